//! The ground floor: what every other module may use and which imports none of them —
//! backend and device choice, the matrix product (cuBLAS on CUDA), host tensors, atomic
//! files, the allocator, command-line helpers, numpy's random generator and the parameter
//! initialisation built on it.

pub mod allocator;
pub mod atomic_file;
pub mod cli;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod cube_tensor;
#[cfg(feature = "cuda")]
pub mod cublas;
pub mod device;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod device_thread;
pub mod exit_signal;
pub mod fixed_order_sum;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod graph;
pub mod host_tensor;
pub mod init;
pub mod masked_mean;
pub mod matmul;
pub mod numpy_pcg64;
pub mod numpy_random;
pub mod product_plan;
