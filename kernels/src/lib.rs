//! ferrotron's fused CubeCL kernels, the counterparts of Megatron's fused CUDA kernels:
//!
//! - [`softmax`]: scaled upper-triangular (causal) masked softmax
//!   (`ScaledUpperTriangMaskedSoftmax`), scaled softmax with a padding mask
//!   (`ScaledMaskedSoftmax`), and their shared backward;
//! - [`cross_entropy`]: cross-entropy of rows of logits against a target column (loss and
//!   log-sum-exp forward; `(softmax − one-hot) · dloss` backward);
//! - [`masked_mean`]: the loss's masked mean `Σ value · mask / Σ mask` (one cube, a fixed
//!   order) and its backward;
//! - [`layer_norm`]: LayerNorm forward (saving mean and 1/σ) and backward (dx, dγ, dβ);
//! - [`rms_norm`]: RMSNorm forward (saving 1/rms) and backward (dx, dγ);
//! - [`swiglu`]: SwiGLU's `silu(gate) ⊙ up`, forward and backward (both gradients at once);
//! - [`rotary`]: rotary position embedding of queries or keys (interleaved or half-split
//!   pairs, part of each head rotated), whose backward is the rotation by the negative angle;
//! - [`heads`]: the fused QKV projection's rows split into per-head queries, keys and values
//!   (keys and values repeated per query head), and the gradients merged back; the core's
//!   output moved from heads to rows and back;
//! - [`gelu`]: GELU, exact or tanh, with an optional bias added first (bias-GELU), forward
//!   and backward;
//! - [`dropout`]: dropout with masks derived on the device from a key and the element index,
//!   and the bias-dropout-add after a row-parallel layer (`residual + dropout(y + bias)`);
//! - [`attention`]: causal attention fused FlashAttention-2-style (tiles of keys and queries
//!   in shared memory, products in 4-row micro-tiles, online softmax, dropout inside, no
//!   `seq × seq` tensor), forward and backward;
//! - [`attention_mma`]: the same attention's forward with its products on matrix units
//!   (tensor cores; CubeCL's `cmma`) where the device has them for the storage type;
//! - [`attention_planes`]: the same attention for CPU Vulkan devices (lavapipe), one plane per
//!   cube with rows in registers and plane broadcasts in place of shared-memory tiles;
//! - [`attention_common`]: what the three attention families share: the kernels' prologue,
//!   the causal mask (one rule, for whole tiles and for elements), the dropout draw and the
//!   head rows' loads with their bounds checks;
//! - [`columns`]: sums over the rows per column in one launch (a bias's gradient, the norms'
//!   dγ and dβ);
//! - [`embedding`]: the word embedding's gradient, each token's rows summed in position
//!   order by one cube (no sort, no atomics);
//! - [`grad_norm`]: the global norm of a flat gradient buffer and the clipping coefficient
//!   (two launches, a fixed order);
//! - [`adam`]: one Adam step of a parameter (both moments and the update) in one kernel;
//! - [`vectors`]: folding a unit's vector of partial values, element positions in a vector;
//! - [`stream_order`]: device-side counters that order CubeCL's stream against another
//!   stream's work (cuBLAS's products) without a host wait.
//!
//! The row kernels (softmax, LayerNorm, RMSNorm, cross-entropy) give each row a warp-sized
//! group of units ([`rows`]) and loop over rows of any length in strides of that group, loading
//! the widest vector that divides the row ([`rows::RowLaunch::vectorized`], [`vectors`]; the
//! element-wise kernels, the QKV split and merge and attention's head rows too); attention gives a cube a block of rows
//! ([`launch::AttentionLaunch`]); the element-wise kernels give each element (each vector
//! where they load vectors) one unit. The row, attention, SwiGLU and rotary
//! kernels compute in a separate float type `A` (launch with `A = f32`) whatever the storage
//! type `F` (f32, f16, bf16). The softmax, LayerNorm, RMSNorm, SwiGLU, rotary and dropout
//! kernels read and write each tensor once; attention reads the keys and values of a head
//! once per block of queries (shared-memory tiles). They are written against CubeCL's
//! runtime-generic frontend, so the same source compiles for CUDA, wgpu (Vulkan, Metal,
//! lavapipe on CPU) and the other CubeCL runtimes. Buffers are contiguous row-major slices.

pub mod adam;
pub mod attention;
pub mod attention_common;
pub mod attention_mma;
pub mod attention_planes;
pub mod columns;
#[cfg(feature = "cpu")]
pub mod cpu_runtime;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod gelu;
pub mod grad_norm;
pub mod heads;
pub mod launch;
pub mod layer_norm;
pub mod masked_mean;
pub mod reduce;
pub mod rms_norm;
pub mod rotary;
pub mod rows;
pub mod softmax;
pub mod stream_order;
pub mod swiglu;
pub mod vectors;

/// The half-precision storage types, for launching the kernels in f16 / bf16.
pub use half;
