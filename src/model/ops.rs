//! The operations the fused kernels replace, each behind one function.
//!
//! With `fused` set and a CubeCL device (a GPU build on CUDA or wgpu), they run ferrotron's
//! fused kernels ([`super::fused_ops`]); otherwise the reference implementations composed of
//! plain burn tensor ops, which run on every backend (the CPU default).

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor};

/// Megatron's fill value for masked attention scores.
pub const MASKED_SCORE: f32 = -10000.0;

/// `softmax(scale · x)` over the last dimension with key positions after the query masked
/// (Megatron's `ScaledUpperTriangMaskedSoftmax`); `x` is `[batch, heads, sq, sk]`.
pub fn scaled_causal_masked_softmax(x: Tensor<4>, scale: f64, fused: bool) -> Tensor<4> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if fused && crate::train::device::is_cube(&x.device()) {
        return super::fused_ops::causal_softmax(x, scale);
    }
    let _ = fused;
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

/// [`scaled_causal_masked_softmax`] for queries at positions `offset..offset + sq` over keys
/// `0..sk` (incremental decoding: query i sees keys up to `offset + i`).
pub fn offset_causal_masked_softmax(x: Tensor<4>, scale: f64, offset: usize) -> Tensor<4> {
    let [_, _, sq, sk] = x.dims();
    let mask = Tensor::<2, Bool>::tril_mask([sq, sk], offset as i64, &x.device());
    softmax(
        x.mul_scalar(scale)
            .mask_fill(mask.unsqueeze::<4>(), MASKED_SCORE),
        3,
    )
}

/// LayerNorm over the last dimension (biased variance, as PyTorch and Megatron).
pub fn layer_norm(
    x: Tensor<3>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    epsilon: f64,
    fused: bool,
) -> Tensor<3> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if fused && crate::train::device::is_cube(&x.device()) {
        return super::fused_ops::layer_norm(x, gamma, beta, epsilon);
    }
    let _ = fused;
    let mean = x.clone().mean_dim(2);
    let centered = x - mean;
    let var = centered.clone().square().mean_dim(2);
    let normed = centered / var.add_scalar(epsilon).sqrt();
    normed * gamma.unsqueeze::<3>() + beta.unsqueeze::<3>()
}
