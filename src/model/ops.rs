//! The operations the fused kernels replace, each behind one function.
//!
//! With `fused` set and a CubeCL device (a GPU build on CUDA or wgpu), they run ferrotron's
//! fused kernels ([`super::fused`]); otherwise the reference implementations composed of
//! plain burn tensor ops, which run on every backend (the CPU default).

use crate::util::device::at_least_f32;
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Bool, Int, Tensor};

/// Megatron's fill value for masked attention scores.
pub const MASKED_SCORE: f32 = -10000.0;

/// `softmax(scale · x)` over the last dimension with key positions after the query masked
/// (Megatron's `ScaledUpperTriangMaskedSoftmax`); `x` is `[batch, heads, sq, sk]`.
pub fn scaled_causal_masked_softmax(x: Tensor<4>, scale: f64, fused: bool) -> Tensor<4> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if fused && crate::util::device::is_cube(&x.device()) {
        return super::fused::causal_softmax(x, scale);
    }
    let _ = fused;
    offset_causal_masked_softmax(x, scale, 0)
}

/// [`scaled_causal_masked_softmax`] for queries at positions `offset..offset + sq` over keys
/// `0..sk` (incremental decoding: query i sees keys up to `offset + i`).
///
/// Computed in fp32 whatever `x`'s dtype (Megatron's `--attention-softmax-in-fp32`), the
/// probabilities returned in `x`'s dtype.
pub fn offset_causal_masked_softmax(x: Tensor<4>, scale: f64, offset: usize) -> Tensor<4> {
    let [_, _, sq, sk] = x.dims();
    let dtype = x.dtype();
    // True strictly above the (shifted) diagonal: key j > query offset + i is hidden.
    let mask = Tensor::<2, Bool>::tril_mask([sq, sk], offset as i64, &x.device());
    softmax(
        at_least_f32(x)
            .mul_scalar(scale)
            .mask_fill(mask.unsqueeze::<4>(), MASKED_SCORE),
        3,
    )
    .cast(dtype)
}

/// [`scaled_causal_masked_softmax`] with each query `i` also blind to the keys before
/// `first_keys[b, i]` (`[batch, sq]`: its document's first token, `--reset-attention-mask`),
/// composed of burn ops in fp32 as [`offset_causal_masked_softmax`], with Megatron's fill value
/// (whose `exp` underflows to 0, so a document's probabilities are those it has alone).
pub fn scaled_document_masked_softmax(
    x: Tensor<4>,
    scale: f64,
    first_keys: Tensor<2, Int>,
) -> Tensor<4> {
    offset_document_masked_softmax(x, scale, 0, first_keys)
}

/// [`scaled_document_masked_softmax`] for queries after `offset` cached keys (query `i` at
/// key position `offset + i`), `first_keys` `[batch or 1, sq]`: a KV cache's step under a
/// sliding window.
pub fn offset_document_masked_softmax(
    x: Tensor<4>,
    scale: f64,
    offset: usize,
    first_keys: Tensor<2, Int>,
) -> Tensor<4> {
    let [b, h, sq, sk] = x.dims();
    let dtype = x.dtype();
    let hidden = super::documents::hidden_keys(first_keys, sk, offset).expand([b, h, sq, sk]);
    softmax(
        at_least_f32(x)
            .mul_scalar(scale)
            .mask_fill(hidden, MASKED_SCORE),
        3,
    )
    .cast(dtype)
}

/// LayerNorm over the last dimension (biased variance, as PyTorch and Megatron), computed in
/// fp32 whatever `x`'s dtype and returned in `x`'s dtype (as Megatron's fused LayerNorm).
pub fn layer_norm(
    x: Tensor<3>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    epsilon: f64,
    fused: bool,
) -> Tensor<3> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if fused && crate::util::device::is_cube(&x.device()) {
        return super::fused::layer_norm(x, gamma, beta, epsilon);
    }
    let _ = fused;
    let dtype = x.dtype();
    let x = at_least_f32(x);
    let compute = x.dtype();
    let mean = x.clone().mean_dim(2);
    let centered = x - mean;
    let var = centered.clone().square().mean_dim(2);
    let normed = centered / var.add_scalar(epsilon).sqrt();
    (normed * gamma.cast(compute).unsqueeze::<3>() + beta.cast(compute).unsqueeze::<3>())
        .cast(dtype)
}

/// RMSNorm over the last dimension, `x / √(mean(x²) + ε) · γ`, computed in fp32 whatever
/// `x`'s dtype and returned in `x`'s dtype (as Megatron's and HF's).
pub fn rms_norm(x: Tensor<3>, gamma: Tensor<1>, epsilon: f64, fused: bool) -> Tensor<3> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if fused && crate::util::device::is_cube(&x.device()) {
        return super::fused::rms_norm(x, gamma, epsilon);
    }
    let _ = fused;
    let dtype = x.dtype();
    let x = at_least_f32(x);
    let compute = x.dtype();
    let inverse_rms = x
        .clone()
        .square()
        .mean_dim(2)
        .add_scalar(epsilon)
        .sqrt()
        .recip();
    (x * inverse_rms * gamma.cast(compute).unsqueeze::<3>()).cast(dtype)
}

/// GELU, exact or (`tanh`, `--openai-gelu`) the tanh approximation: one fused kernel each
/// way (f32 inside) with `fused` on a CubeCL device, else burn's composed ops.
pub fn gelu<const D: usize>(x: Tensor<D>, tanh: bool, fused: bool) -> Tensor<D> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if fused && crate::util::device::is_cube(&x.device()) {
        return super::fused::gelu(x, tanh);
    }
    let _ = fused;
    if tanh {
        burn::tensor::activation::gelu_approximate(x)
    } else {
        burn::tensor::activation::gelu(x)
    }
}

/// GELU of `x + bias` (the column-parallel layer's bias, over the last dimension): one fused
/// kernel with `fused` on a CubeCL device (Megatron's bias-GELU fusion), else the add and
/// [`gelu`] composed.
pub fn bias_gelu<const D: usize>(
    x: Tensor<D>,
    bias: Option<Tensor<1>>,
    tanh: bool,
    fused: bool,
) -> Tensor<D> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if fused && crate::util::device::is_cube(&x.device()) {
        return match bias {
            Some(bias) => super::fused::bias_gelu(x, bias, tanh),
            None => super::fused::gelu(x, tanh),
        };
    }
    let _ = fused;
    let x = match bias {
        Some(bias) => x + bias.unsqueeze(),
        None => x,
    };
    gelu(x, tanh, false)
}

/// SwiGLU's activation `silu(gate) ⊙ up` (Llama's MLP), in `gate`'s dtype: one fused kernel
/// (f32 inside) with `fused` on a CubeCL device, else composed of burn ops.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>, fused: bool) -> Tensor<D> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if fused && crate::util::device::is_cube(&gate.device()) {
        return super::fused::swiglu(gate, up);
    }
    let _ = fused;
    silu(gate) * up
}
