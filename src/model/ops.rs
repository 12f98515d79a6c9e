//! The operations the fused kernels replace, each behind one function.
//!
//! These are the reference implementations composed of plain burn tensor ops; they run on
//! every backend. The CubeCL kernels (in `ferrotron-kernels`) will take over on the backends
//! that have them, through these same functions.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor};

/// Megatron's fill value for masked attention scores.
pub const MASKED_SCORE: f32 = -10000.0;

/// `softmax(scale · x)` over the last dimension with key positions after the query masked
/// (Megatron's `ScaledUpperTriangMaskedSoftmax`); `x` is `[batch, heads, sq, sk]`.
pub fn scaled_causal_masked_softmax(x: Tensor<4>, scale: f64) -> Tensor<4> {
    let [_, _, sq, sk] = x.dims();
    let device = x.device();
    // True strictly above the diagonal: key j > query i is hidden.
    let mask = Tensor::<2, Bool>::tril_mask([sq, sk], 0, &device);
    softmax(
        x.mul_scalar(scale)
            .mask_fill(mask.unsqueeze::<4>(), MASKED_SCORE),
        3,
    )
}

/// LayerNorm over the last dimension (biased variance, as PyTorch and Megatron).
pub fn layer_norm(x: Tensor<3>, gamma: Tensor<1>, beta: Tensor<1>, epsilon: f64) -> Tensor<3> {
    let mean = x.clone().mean_dim(2);
    let centered = x - mean;
    let var = centered.clone().square().mean_dim(2);
    let normed = centered / var.add_scalar(epsilon).sqrt();
    normed * gamma.unsqueeze::<3>() + beta.unsqueeze::<3>()
}
