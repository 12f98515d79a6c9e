//! The two things every launcher of a `ferrotron-kernels` kernel does to burn's CubeCL tensors
//! (GPU builds only): make an input contiguous, and allocate an output.

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;

/// A contiguous row-major tensor (what the kernels index; the handle carries its offset, and
/// the buffer may be padded past the end).
pub fn packed(t: CubeTensor) -> CubeTensor {
    let t = into_contiguous(t);
    assert!(t.is_contiguous(), "fused kernels need a contiguous tensor");
    t
}

/// A new, uninitialized contiguous tensor on `like`'s device with `shape` and `dtype`.
pub fn empty_like(like: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}
