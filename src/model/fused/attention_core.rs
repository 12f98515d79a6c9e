//! The attention core between the QKV split and the head merge, forward and backward, for
//! the op from the rows ([`super::attention_from_rows`]): the kernels the composed core runs
//! (scores, causal softmax with the dropout of its output in the same kernel both ways,
//! product) or the fused attention, with the backward written out: the same products burn's
//! autodiff would form, through [`Gemm`] (cuBLAS on CUDA). With rotary embeddings (Llama) the
//! queries and keys are rotated after the split and their gradients rotated back before the
//! merge, by the rotary kernel.
//!
//! Under selective recomputation ([`CoreKernels::Recomputed`]) the core keeps only the
//! queries, keys and values, as the fused attention does (its softmax writes only the dropped
//! probabilities), and its backward forms the scores again, and the probabilities inside
//! the softmax backward's kernel, before the products: Megatron's recomputation of the core
//! attention, without rerunning the split, the `p v` product and the merge, and without the
//! three graphs per layer the model's recomputation of a core builds.

use burn::backend::tensor::FloatTensor;
use ferrotron_kernels::launch::{DropoutDraw, QkvLayout};

use super::bias_gradient::BiasGradKernels;
use super::flash_attention::FlashAttentionKernels;
use super::qkv_rows::QkvKernels;
use super::rotary::RotaryKernels;
use super::softmax::SoftmaxKernels;
use crate::util::matmul::extension::{transposed, Gemm};

/// The kernels the core may run: the split and merge, the softmax, the fused attention, the
/// rotary embedding, and the products.
pub trait AttentionKernels:
    QkvKernels + SoftmaxKernels + FlashAttentionKernels + RotaryKernels + BiasGradKernels + Gemm
{
}

impl<
        B: QkvKernels
            + SoftmaxKernels
            + FlashAttentionKernels
            + RotaryKernels
            + BiasGradKernels
            + Gemm,
    > AttentionKernels for B
{
}

/// Which kernels the core runs between the split and the merge, and so what it keeps for
/// its backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoreKernels {
    /// Scores, causal softmax (writing its dropout), product: keeps the probabilities
    /// `[b, heads, s, s]` (the backward's softmax kernel writes their dropout again, the same
    /// bits, for the `p v` product's gradient).
    Composed,
    /// The same kernels, keeping only the queries, keys and values: the backward forms the
    /// scores and the softmax again, the same bits (selective recomputation).
    Recomputed,
    /// The fused attention (`--use-flash-attn`): keeps its output and a log-sum-exp per row.
    Flash,
}

/// What the backward needs: the per-head queries, keys and values, and either the fused
/// attention's output and log-sum-exp per row, or the probabilities (before dropout), or
/// nothing more (they are formed again).
#[derive(Clone, Debug)]
pub enum Saved<B: AttentionKernels> {
    /// The fused attention ran (`--use-flash-attn`).
    Flash {
        qkv: [FloatTensor<B>; 3],
        output: FloatTensor<B>,
        logsumexp: FloatTensor<B>,
    },
    /// The scores, softmax, dropout and product kernels ran.
    Composed {
        qkv: [FloatTensor<B>; 3],
        probs: FloatTensor<B>,
    },
    /// The scores, softmax and dropout are formed again in the backward.
    Recomputed { qkv: [FloatTensor<B>; 3] },
}

/// The rotary embedding applied to the split queries and keys: the angle tables (f32, `[seq,
/// rotary_dim / 2]`, positions from 0) and the pairing.
#[derive(Clone, Debug)]
pub struct Rotation<B: AttentionKernels> {
    /// `cos` of each position's pair angles.
    pub cos: FloatTensor<B>,
    /// `sin` of each position's pair angles.
    pub sin: FloatTensor<B>,
    /// Pairs `(2i, 2i + 1)` instead of `(i, i + rotary_dim / 2)`.
    pub interleaved: bool,
}

impl<B: AttentionKernels> Rotation<B> {
    /// `x` `[b, heads, s, head_dim]` rotated (or, with `inverse`, rotated back: the backward).
    fn apply(&self, x: FloatTensor<B>, inverse: bool) -> FloatTensor<B> {
        let (cos, sin) = (self.cos.clone(), self.sin.clone());
        B::rotary_apply(x, cos, sin, 0, self.interleaved, inverse)
    }
}

/// The context `[b, s, heads · head_dim]` of the rows `mixed` (the projection's `bias` added
/// by the split), and what the backward needs.
pub fn forward<B: AttentionKernels>(
    mixed: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    layout: QkvLayout,
    scale: f32,
    draw: Option<DropoutDraw>,
    kernels: CoreKernels,
    rotation: Option<&Rotation<B>>,
) -> (FloatTensor<B>, Saved<B>) {
    let [mut q, mut k, v] = B::qkv_split(mixed, bias, layout);
    if let Some(rotation) = rotation {
        q = rotation.apply(q, false);
        k = rotation.apply(k, false);
    }
    let qkv = [q.clone(), k.clone(), v.clone()];
    let (heads, saved) = match kernels {
        CoreKernels::Flash => {
            let (output, logsumexp) = B::flash_attention_forward(q, k, v, scale, draw, None);
            let saved = Saved::Flash {
                qkv,
                output: output.clone(),
                logsumexp,
            };
            (output, saved)
        }
        CoreKernels::Composed => {
            let [probs, dropped] = B::causal_softmax_forward(scores::<B>(q, k), scale, draw);
            (B::gemm(dropped, v), Saved::Composed { qkv, probs })
        }
        CoreKernels::Recomputed => {
            // Neither set of probabilities is kept: the softmax writes only the dropped ones
            // (the bits `probabilities` forms again in the backward).
            let dropped = B::causal_softmax_dropped(scores::<B>(q, k), scale, draw);
            (B::gemm(dropped, v), Saved::Recomputed { qkv })
        }
    };
    (B::merge_heads(heads, layout), saved)
}

/// The attention scores `q kᵀ` (unscaled: the softmax kernels scale them).
fn scores<B: AttentionKernels>(q: FloatTensor<B>, k: FloatTensor<B>) -> FloatTensor<B> {
    B::gemm(q, transposed::<B>(k))
}

/// The rows' gradient from the context's gradient `grad`, and with `with_bias` the QKV
/// projection bias's (the rows' gradient summed over the rows, formed in the same launch as
/// the rows').
pub fn backward<B: AttentionKernels>(
    saved: Saved<B>,
    grad: FloatTensor<B>,
    layout: QkvLayout,
    scale: f32,
    draw: Option<DropoutDraw>,
    rotation: Option<Rotation<B>>,
    with_bias: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let grad = B::split_heads(grad, layout);
    let mut grads = match saved {
        Saved::Flash {
            qkv: [q, k, v],
            output,
            logsumexp,
        } => {
            let (dq, dk, dv) =
                B::flash_attention_backward(q, k, v, output, logsumexp, grad, scale, draw, None);
            [dq, dk, dv]
        }
        Saved::Composed { qkv, probs } => composed_backward::<B>(qkv, probs, grad, scale, draw),
        Saved::Recomputed { qkv: [q, k, v] } => {
            // The scores again (the same product: the same bits) beside the dropped
            // probabilities' gradient, in one ordering window; the softmax backward forms the
            // probabilities from the scores inside its kernel, with the forward's bits.
            let [scores, d_dropped] = B::gemm_independent([
                (q.clone(), transposed::<B>(k.clone())),
                (grad.clone(), transposed::<B>(v)),
            ]);
            let [d_scores, dropped] =
                B::causal_softmax_backward_from_input(scores, d_dropped, scale, draw);
            products_backward::<B>([q, k], grad, d_scores, dropped)
        }
    };
    if let Some(rotation) = rotation {
        let [dq, dk, dv] = grads;
        grads = [rotation.apply(dq, true), rotation.apply(dk, true), dv];
    }
    if with_bias {
        let (rows, bias) = B::qkv_merge_bias_gradient(grads, layout);
        (rows, Some(bias))
    } else {
        (B::qkv_merge(grads, layout), None)
    }
}

/// The per-head `[dq, dk, dv]` of the composed core from the output's gradient `grad` and
/// the probabilities `probs`: the products burn's autodiff would form, and the softmax
/// backward taking the dropout back in the same kernel and writing the dropped probabilities
/// (the forward's bits) that `dv` reads. Two ordering windows of cuBLAS products: `d_dropped`
/// alone, then `dv`, `dq`, `dk` together.
fn composed_backward<B: AttentionKernels>(
    [q, k, v]: [FloatTensor<B>; 3],
    probs: FloatTensor<B>,
    grad: FloatTensor<B>,
    scale: f32,
    draw: Option<DropoutDraw>,
) -> [FloatTensor<B>; 3] {
    let d_dropped = B::gemm(grad.clone(), transposed::<B>(v));
    let (d_scores, dropped) = match draw {
        Some(draw) => {
            let [d_scores, dropped] = B::softmax_backward_redropping(probs, d_dropped, scale, draw);
            (d_scores, dropped)
        }
        None => (
            B::softmax_backward(probs.clone(), d_dropped, scale, None),
            probs,
        ),
    };
    products_backward::<B>([q, k], grad, d_scores, dropped)
}

/// `[dq, dk, dv]` from the scores' gradient `d_scores` and the probabilities the `p v` product
/// read (`dropped`): three independent products, one ordering window.
fn products_backward<B: AttentionKernels>(
    [q, k]: [FloatTensor<B>; 2],
    grad: FloatTensor<B>,
    d_scores: FloatTensor<B>,
    dropped: FloatTensor<B>,
) -> [FloatTensor<B>; 3] {
    let [dv, dq, dk] = B::gemm_independent([
        (transposed::<B>(dropped), grad),
        (d_scores.clone(), k),
        (transposed::<B>(d_scores), q),
    ]);
    [dq, dk, dv]
}
