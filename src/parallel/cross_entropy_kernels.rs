//! The cross-entropy's fused kernels (`ferrotron-kernels`' `cross_entropy`) on burn's CubeCL
//! tensors (GPU builds only): one launch for the loss and log-sum-exp, one for the logits'
//! gradient, instead of the ~30 launches of the composed ops.

use burn::backend::ops::IntTensorOps;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::TensorMetadata;
use burn::tensor::{DType, IntDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::RowLaunch;

use crate::util::cube_tensor::{by_dtype, empty_like, packed, packed_f32, rows_cols};

/// The targets as the kernels read them: i32, contiguous.
fn targets(index: IntTensor<CubeBackend>) -> CubeTensor {
    packed(CubeBackend::int_cast(index, IntDType::I32))
}

/// The loss `[tokens, 1]` (f32) of `logits` `[tokens, V]`, and what the backward needs: the
/// (contiguous) logits and their log-sum-exp.
pub fn forward(
    logits: CubeTensor,
    target_index: IntTensor<CubeBackend>,
    target_inside: FloatTensor<CubeBackend>,
) -> [CubeTensor; 3] {
    let logits = packed(logits);
    let (rows, cols) = rows_cols(&logits.shape());
    let (targets, inside) = (targets(target_index), packed_f32(target_inside));
    let loss = empty_like(&logits, Shape::new([rows, 1]), DType::F32);
    let log_sum_exp = empty_like(&logits, Shape::new([rows, 1]), DType::F32);
    by_dtype!(
        logits.dtype,
        cross_entropy_forward,
        &logits.client,
        RowLaunch::for_client(&logits.client),
        &logits.handle,
        &targets.handle,
        &inside.handle,
        &loss.handle,
        &log_sum_exp.handle,
        rows,
        cols
    );
    [loss, logits, log_sum_exp]
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
    let (rows, cols) = rows_cols(&logits.shape());
    let (targets, inside) = (targets(target_index), packed_f32(target_inside));
    let (log_sum_exp, grad_loss) = (packed_f32(log_sum_exp), packed_f32(grad_loss));
    let grad = empty_like(&logits, logits.shape(), logits.dtype);
    by_dtype!(
        logits.dtype,
        cross_entropy_backward,
        &logits.client,
        RowLaunch::for_client(&logits.client),
        &logits.handle,
        &targets.handle,
        &inside.handle,
        &log_sum_exp.handle,
        &grad_loss.handle,
        &grad.handle,
        rows,
        cols
    );
    grad
}
