//! The cross-entropy's fused kernels (`ferrotron-kernels`' `cross_entropy`) on burn's CubeCL
//! tensors (GPU builds only): one launch for the loss and log-sum-exp, one for the logits'
//! gradient, instead of the ~30 launches of the composed ops.

use burn::tensor::{DType, FloatDType, IntDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::half::{bf16, f16};
use ferrotron_kernels::launch::{cross_entropy_backward, cross_entropy_forward, RowLaunch};

use crate::util::cube_tensor::{empty_like, packed};
use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::TensorMetadata;

/// The targets as the kernels read them: i32, contiguous.
fn targets(index: IntTensor<CubeBackend>) -> CubeTensor {
    packed(CubeBackend::int_cast(index, IntDType::I32))
}

/// A per-row f32 column, contiguous.
fn column(t: FloatTensor<CubeBackend>) -> CubeTensor {
    packed(CubeBackend::float_cast(t, FloatDType::F32))
}

fn rows_cols(logits: &CubeTensor) -> (usize, usize) {
    let dims = logits.shape().dims::<2>();
    (dims[0], dims[1])
}

/// Loss and log-sum-exp `[tokens, 1]` (f32) of `logits` `[tokens, V]`.
pub fn forward(
    logits: CubeTensor,
    target_index: IntTensor<CubeBackend>,
    target_inside: FloatTensor<CubeBackend>,
) -> (CubeTensor, CubeTensor) {
    let logits = packed(logits);
    let (rows, cols) = rows_cols(&logits);
    let (targets, inside) = (targets(target_index), column(target_inside));
    let loss = empty_like(&logits, Shape::new([rows, 1]), DType::F32);
    let log_sum_exp = empty_like(&logits, Shape::new([rows, 1]), DType::F32);
    let client = &logits.client;
    let launch = RowLaunch::for_client(client);
    let (l, t, i, o, s) = (
        &logits.handle,
        &targets.handle,
        &inside.handle,
        &loss.handle,
        &log_sum_exp.handle,
    );
    match logits.dtype {
        DType::F32 => cross_entropy_forward::<f32>(client, launch, l, t, i, o, s, rows, cols),
        DType::F16 => cross_entropy_forward::<f16>(client, launch, l, t, i, o, s, rows, cols),
        DType::BF16 => cross_entropy_forward::<bf16>(client, launch, l, t, i, o, s, rows, cols),
        other => panic!("cross-entropy of {other:?} logits"),
    }
    (loss, log_sum_exp)
}

/// The gradient of `logits` `[tokens, V]` from the forward's log-sum-exp and `grad_loss`
/// `[tokens, 1]`.
pub fn backward(
    logits: CubeTensor,
    log_sum_exp: CubeTensor,
    target_index: IntTensor<CubeBackend>,
    target_inside: FloatTensor<CubeBackend>,
    grad_loss: CubeTensor,
) -> CubeTensor {
    let logits = packed(logits);
    let (rows, cols) = rows_cols(&logits);
    let (targets, inside) = (targets(target_index), column(target_inside));
    let (log_sum_exp, grad_loss) = (column(log_sum_exp), column(grad_loss));
    let grad = empty_like(&logits, logits.shape(), logits.dtype);
    let client = &logits.client;
    let launch = RowLaunch::for_client(client);
    let (l, t, i, s, g, o) = (
        &logits.handle,
        &targets.handle,
        &inside.handle,
        &log_sum_exp.handle,
        &grad_loss.handle,
        &grad.handle,
    );
    match logits.dtype {
        DType::F32 => cross_entropy_backward::<f32>(client, launch, l, t, i, s, g, o, rows, cols),
        DType::F16 => cross_entropy_backward::<f16>(client, launch, l, t, i, s, g, o, rows, cols),
        DType::BF16 => cross_entropy_backward::<bf16>(client, launch, l, t, i, s, g, o, rows, cols),
        other => panic!("cross-entropy of {other:?} logits"),
    }
    grad
}
