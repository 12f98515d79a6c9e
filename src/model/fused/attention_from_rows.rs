//! The attention core as one differentiable op from the fused QKV projection's rows to the
//! merged context: the split kernel ([`super::qkv_rows`]), the core
//! ([`super::attention_core`]), the head merge, and a backward written out down to the merge
//! kernel into the rows' gradient.
//!
//! Why one op: burn's autodiff has no op with several outputs, so splitting the projection's
//! rows into queries, keys and values is three slices, and the backward of each slice is a
//! zeroed tensor of the rows' size and a slice-assignment, summed with two additions: eight
//! launches per layer, plus the copies that turn the slices into per-head tensors. Here the
//! split is one kernel forward and the merge one kernel backward.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::{FloatDType, Tensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::{DropoutDraw, QkvLayout};

use super::attention_core::{self, AttentionKernels, CoreKernels, Rotation, Saved};
use super::dropout_draw;
use super::qkv_rows::layout;

/// The differentiable attention core from the rows (a burn backend extension).
#[backend_extension(Autodiff, Cube)]
pub trait RowsAttentionOps: Backend {
    /// The attention core from the fused QKV projection's rows `[b, s, groups · (per_group
    /// + 2) · head_dim]` to the context `[b, s, groups · per_group · head_dim]`: split,
    /// causal attention by `kernels`, heads merged; dropout as
    /// [`Self::fused_causal_attention`]'s.
    fn fused_attention_from_qkv(
        mixed: FloatTensor<Self>,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> FloatTensor<Self>;
    /// [`Self::fused_attention_from_qkv`] with the queries and keys rotated after the split
    /// by the angle tables `cos`, `sin` (f32, `[seq, rotary_dim / 2]`, positions from 0), as
    /// [`Self::fused_rotary`] with `interleaved`.
    #[allow(clippy::too_many_arguments)]
    fn fused_rotary_attention_from_qkv(
        mixed: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        interleaved: bool,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> FloatTensor<Self>;
}

impl RowsAttentionOps for CubeBackend {
    fn fused_attention_from_qkv(
        mixed: CubeTensor,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> CubeTensor {
        let layout = layout(&mixed.shape(), groups, per_group);
        attention_core::forward::<Self>(mixed, layout, scale, draw, kernels, None).0
    }

    fn fused_rotary_attention_from_qkv(
        mixed: CubeTensor,
        cos: CubeTensor,
        sin: CubeTensor,
        interleaved: bool,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> CubeTensor {
        let layout = layout(&mixed.shape(), groups, per_group);
        let rotation = Rotation {
            cos,
            sin,
            interleaved,
        };
        attention_core::forward::<Self>(mixed, layout, scale, draw, kernels, Some(&rotation)).0
    }
}

/// The attention core from the QKV rows as an autodiff op: its arguments but the rows.
struct MixedAttention<B: AttentionKernels> {
    layout: QkvLayout,
    scale: f32,
    draw: Option<DropoutDraw>,
    kernels: CoreKernels,
    rotation: Option<Rotation<B>>,
}

impl<B: AttentionKernels> MixedAttention<B> {
    /// The context of the rows `mixed`, its backward recorded when they are tracked.
    fn tracked<C: CheckpointStrategy>(
        self,
        mixed: FloatTensor<Autodiff<B, C>>,
    ) -> FloatTensor<Autodiff<B, C>> {
        let (mixed, node) = mixed.into_parts();
        let Self {
            layout,
            scale,
            draw,
            kernels,
            rotation,
        } = self;
        let run = |mixed| {
            attention_core::forward::<B>(mixed, layout, scale, draw, kernels, rotation.as_ref())
        };
        match MixedAttentionBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (context, saved) = run(mixed);
                prep.finish((saved, layout, scale, draw, rotation), context)
            }
            OpsKind::UnTracked(prep) => prep.finish(run(mixed).0),
        }
    }
}

/// The backward of [`RowsAttentionOps::fused_attention_from_qkv`].
#[derive(Debug)]
pub struct MixedAttentionBackward;

impl<B: AttentionKernels> Backward<B, 1> for MixedAttentionBackward {
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
            let grad = attention_core::backward::<B>(saved, grad, layout, scale, draw, rotation);
            grads.register::<B>(parent.id, grad);
        }
    }
}

impl<B: AttentionKernels + RowsAttentionOps, C: CheckpointStrategy> RowsAttentionOps
    for Autodiff<B, C>
{
    fn fused_attention_from_qkv(
        mixed: FloatTensor<Self>,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> FloatTensor<Self> {
        let layout = layout(&mixed.shape(), groups, per_group);
        let op = MixedAttention::<B> {
            layout,
            scale,
            draw,
            kernels,
            rotation: None,
        };
        op.tracked::<C>(mixed)
    }

    fn fused_rotary_attention_from_qkv(
        mixed: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        interleaved: bool,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> FloatTensor<Self> {
        let layout = layout(&mixed.shape(), groups, per_group);
        // The tables are constants of the op: no gradient flows to them.
        let rotation = Rotation {
            cos: cos.into_primitive(),
            sin: sin.into_primitive(),
            interleaved,
        };
        let op = MixedAttention::<B> {
            layout,
            scale,
            draw,
            kernels,
            rotation: Some(rotation),
        };
        op.tracked::<C>(mixed)
    }
}

/// The attention core from the fused QKV projection's rows `qkv` `[b, s, groups ·
/// (per_group + 2) · head_dim]` (Megatron's per-group layout) to the context `[b, s, heads ·
/// head_dim]`, as one differentiable op: its backward is one kernel into the rows' gradient,
/// where the composed split's is eight launches. `kernels` says which attention runs inside
/// ([`CoreKernels::Flash`]: [`causal_attention`]'s kernel) and so what it keeps; `dropout` as
/// [`causal_attention`]'s. With `rotary` the queries and keys are
/// rotated after the split inside the op.
pub fn attention_from_qkv(
    qkv: Tensor<3>,
    groups: usize,
    per_group: usize,
    scale: f64,
    dropout: Option<(u64, f64)>,
    kernels: CoreKernels,
    rotary: Option<RowRotation>,
) -> Tensor<3> {
    let (groups, per_group, scale) = (groups as u32, per_group as u32, scale as f32);
    let (qkv, draw) = (qkv.into_dispatch(), dropout_draw(dropout));
    Tensor::from_dispatch(match rotary {
        None => <Dispatch as RowsAttentionOps>::fused_attention_from_qkv(
            qkv, groups, per_group, scale, draw, kernels,
        ),
        Some(RowRotation {
            cos,
            sin,
            interleaved,
        }) => <Dispatch as RowsAttentionOps>::fused_rotary_attention_from_qkv(
            qkv,
            cos.cast(FloatDType::F32).into_dispatch(),
            sin.cast(FloatDType::F32).into_dispatch(),
            interleaved,
            groups,
            per_group,
            scale,
            draw,
            kernels,
        ),
    })
}

/// The rotary embedding [`attention_from_qkv`] applies to its queries and keys: the angle
/// tables `[seq, rotary_dim / 2]` of positions `0..seq` and the pairing.
pub struct RowRotation {
    /// `cos` of each position's pair angles.
    pub cos: Tensor<2>,
    /// `sin` of each position's pair angles.
    pub sin: Tensor<2>,
    /// Pairs `(2i, 2i + 1)` instead of `(i, i + rotary_dim / 2)`.
    pub interleaved: bool,
}
