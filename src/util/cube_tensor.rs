//! What every launcher of a `ferrotron-kernels` kernel does with burn's CubeCL tensors (GPU
//! builds only): make an input contiguous, allocate an output, see it as rows, and pick the
//! kernel for its storage type.

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

/// `t` as a contiguous f32 tensor (no copy when it already is one).
pub fn packed_f32(t: CubeTensor) -> CubeTensor {
    use burn::backend::ops::FloatTensorOps;
    packed(burn_cubecl::CubeBackend::float_cast(
        t,
        burn::tensor::FloatDType::F32,
    ))
}

/// A new, uninitialized contiguous tensor on `like`'s device with `shape` and `dtype`.
pub fn empty_like(like: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

/// `(rows, cols)` of a tensor seen as rows of its last dimension.
pub fn rows_cols(shape: &Shape) -> (usize, usize) {
    let cols = shape[shape.num_dims() - 1];
    (shape.num_elements() / cols.max(1), cols)
}

/// Calls `ferrotron_kernels::launch::$launch::<F>` for the storage type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $launch:ident, $($arg:expr),* $(,)?) => {
        match $dtype {
            burn::tensor::DType::F32 => ferrotron_kernels::launch::$launch::<f32>($($arg),*),
            burn::tensor::DType::F16 => {
                ferrotron_kernels::launch::$launch::<ferrotron_kernels::half::f16>($($arg),*)
            }
            burn::tensor::DType::BF16 => {
                ferrotron_kernels::launch::$launch::<ferrotron_kernels::half::bf16>($($arg),*)
            }
            other => panic!("fused kernels support f32, f16 and bf16, not {other:?}"),
        }
    };
}
pub(crate) use by_dtype;
