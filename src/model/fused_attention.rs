//! The attention core as one differentiable op from the fused QKV projection's rows to the
//! merged context (GPU builds only).
//!
//! Why one op: burn's autodiff has no op with several outputs, so splitting the projection's
//! rows into queries, keys and values is three slices, and the backward of each slice is a
//! zeroed tensor of the rows' size and a slice-assignment, summed with two additions: eight
//! launches per layer, plus the copies that turn the slices into per-head tensors. Here the
//! split is one kernel forward and the merge one kernel backward, and the core between them
//! runs the kernels the composed core runs (scores, causal softmax with the dropout of its
//! output in the same kernel both ways, product) or the fused attention, with its backward written out: the same products burn's autodiff would
//! form, through [`Gemm`] (cuBLAS on CUDA). With rotary embeddings (Llama) the queries and
//! keys are rotated inside the op after the split and their gradients rotated back before the
//! merge, by the rotary kernel.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::tensor::FloatTensor;
use burn::tensor::Shape;
use ferrotron_kernels::launch::{DropoutDraw, QkvLayout};

use super::fused_ops::FusedKernels;
use crate::util::matmul::extension::{transposed, Gemm};

/// What the backward needs: the per-head queries, keys and values, and either the fused
/// attention's output and log-sum-exp per row, or the probabilities before and after dropout.
#[derive(Clone, Debug)]
pub enum Saved<B: FusedKernels> {
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
        dropped: FloatTensor<B>,
    },
}

/// The rotary embedding applied to the split queries and keys: the angle tables (f32, `[seq,
/// rotary_dim / 2]`, positions from 0) and the pairing.
#[derive(Clone, Debug)]
pub struct Rotation<B: FusedKernels> {
    /// `cos` of each position's pair angles.
    pub cos: FloatTensor<B>,
    /// `sin` of each position's pair angles.
    pub sin: FloatTensor<B>,
    /// Pairs `(2i, 2i + 1)` instead of `(i, i + rotary_dim / 2)`.
    pub interleaved: bool,
}

impl<B: FusedKernels> Rotation<B> {
    /// `x` `[b, heads, s, head_dim]` rotated (or, with `inverse`, rotated back: the backward).
    fn apply(&self, x: FloatTensor<B>, inverse: bool) -> FloatTensor<B> {
        let (cos, sin) = (self.cos.clone(), self.sin.clone());
        B::rotary_apply(x, cos, sin, 0, self.interleaved, inverse)
    }
}

/// The layout of rows of shape `[b, s, groups · (per_group + 2) · head_dim]`.
pub fn layout(shape: &Shape, groups: u32, per_group: u32) -> QkvLayout {
    let [batch, seq, width] = shape.dims::<3>();
    let (groups, per_group) = (groups as usize, per_group as usize);
    assert!(
        groups * per_group > 0 && width.is_multiple_of(groups * (per_group + 2)),
        "QKV rows {width} wide for {groups} groups of {per_group} query heads"
    );
    QkvLayout {
        batch,
        seq,
        groups,
        per_group,
        head_dim: width / (groups * (per_group + 2)),
    }
}

/// The context `[b, s, heads · head_dim]` of the rows `mixed`, and what the backward needs.
pub fn forward<B: FusedKernels + Gemm>(
    mixed: FloatTensor<B>,
    layout: QkvLayout,
    scale: f32,
    draw: Option<DropoutDraw>,
    flash: bool,
    rotation: Option<&Rotation<B>>,
) -> (FloatTensor<B>, Saved<B>) {
    let [mut q, mut k, v] = B::qkv_split(mixed, layout);
    if let Some(rotation) = rotation {
        q = rotation.apply(q, false);
        k = rotation.apply(k, false);
    }
    let (heads, saved) = if flash {
        let (output, logsumexp) =
            B::flash_attention_forward(q.clone(), k.clone(), v.clone(), scale, draw);
        let saved = Saved::Flash {
            qkv: [q, k, v],
            output: output.clone(),
            logsumexp,
        };
        (output, saved)
    } else {
        let scores = B::gemm(q.clone(), transposed::<B>(k.clone()));
        let [probs, dropped] = B::causal_softmax_forward(scores, scale, draw);
        let output = B::gemm(dropped.clone(), v.clone());
        let saved = Saved::Composed {
            qkv: [q, k, v],
            probs,
            dropped,
        };
        (output, saved)
    };
    (merge_heads::<B>(heads, layout), saved)
}

/// The rows' gradient from the context's gradient `grad`.
fn backward<B: FusedKernels + Gemm>(
    saved: Saved<B>,
    grad: FloatTensor<B>,
    layout: QkvLayout,
    scale: f32,
    draw: Option<DropoutDraw>,
    rotation: Option<Rotation<B>>,
) -> FloatTensor<B> {
    let grad = split_heads::<B>(grad, layout);
    let mut grads = match saved {
        Saved::Flash {
            qkv: [q, k, v],
            output,
            logsumexp,
        } => {
            let (dq, dk, dv) =
                B::flash_attention_backward(q, k, v, output, logsumexp, grad, scale, draw);
            [dq, dk, dv]
        }
        Saved::Composed {
            qkv: [q, k, v],
            probs,
            dropped,
        } => {
            let d_dropped = B::gemm(grad.clone(), transposed::<B>(v));
            let dv = B::gemm(transposed::<B>(dropped), grad);
            let d_scores = B::softmax_backward(probs, d_dropped, scale, draw);
            let dq = B::gemm(d_scores.clone(), k);
            let dk = B::gemm(transposed::<B>(d_scores), q);
            [dq, dk, dv]
        }
    };
    if let Some(rotation) = rotation {
        let [dq, dk, dv] = grads;
        grads = [rotation.apply(dq, true), rotation.apply(dk, true), dv];
    }
    B::qkv_merge(grads, layout)
}

/// `[b, heads, s, head_dim]` → `[b, s, heads · head_dim]` (one copy).
fn merge_heads<B: FusedKernels>(heads: FloatTensor<B>, l: QkvLayout) -> FloatTensor<B> {
    let rows = B::contiguous(B::float_swap_dims(heads, 1, 2));
    B::float_reshape(rows, Shape::new([l.batch, l.seq, l.heads() * l.head_dim]))
}

/// `[b, s, heads · head_dim]` → `[b, heads, s, head_dim]` (one copy).
fn split_heads<B: FusedKernels>(rows: FloatTensor<B>, l: QkvLayout) -> FloatTensor<B> {
    let rows = B::float_reshape(
        B::contiguous(rows),
        Shape::new([l.batch, l.seq, l.heads(), l.head_dim]),
    );
    B::contiguous(B::float_swap_dims(rows, 1, 2))
}

/// The backward of [`super::fused_ops::FusedOps::fused_attention_from_qkv`].
#[derive(Debug)]
pub struct MixedAttentionBackward;

impl<B: FusedKernels + Gemm> Backward<B, 1> for MixedAttentionBackward {
    /// What the forward saved, the layout, the scale, the dropout draw and the rotation.
    type State = (
        Saved<B>,
        QkvLayout,
        f32,
        Option<DropoutDraw>,
        Option<Rotation<B>>,
    );

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            let (saved, layout, scale, draw, rotation) = ops.state;
            let grad = backward::<B>(saved, grad, layout, scale, draw, rotation);
            grads.register::<B>(parent.id, grad);
        }
    }
}
