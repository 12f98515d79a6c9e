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
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::{FloatDType, Shape, Tensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::{DrawSlice, DropoutDraw, QkvLayout};

use super::attention_core::{self, AttentionKernels, CoreKernels, Rotation, Saved};
use super::dropout_draw;
use super::qkv_rows::layout;

/// The settings of the core from the rows besides its tensors: the layout's groups, the
/// scale, the dropout draw and which kernels run.
#[derive(Clone, Copy, Debug)]
pub struct RowsCore {
    /// Key/value heads (query groups) on this rank.
    pub groups: u32,
    /// Query heads per group.
    pub per_group: u32,
    /// The scores' scale, `1/√head_dim`.
    pub scale: f32,
    /// The attention dropout's draw, if any.
    pub draw: Option<DropoutDraw>,
    /// Which kernels run between the split and the merge.
    pub kernels: CoreKernels,
}

/// The differentiable attention core from the rows (a burn backend extension). burn's
/// extensions take no optional tensors, so the projection's bias and the rotary tables make
/// four spellings of the one op.
#[backend_extension(Autodiff, Cube)]
pub trait RowsAttentionOps: Backend {
    /// The attention core from the fused QKV projection's rows `[b, s, groups · (per_group
    /// + 2) · head_dim]` to the context `[b, s, groups · per_group · head_dim]`: split,
    /// causal attention by `core.kernels`, heads merged; dropout as
    /// [`Self::fused_causal_attention`]'s.
    fn fused_attention_from_qkv(mixed: FloatTensor<Self>, core: RowsCore) -> FloatTensor<Self>;
    /// [`Self::fused_attention_from_qkv`] of the projection's product `mixed` without its
    /// `bias` `[width]`, which the split adds.
    fn fused_biased_attention_from_qkv(
        mixed: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        core: RowsCore,
    ) -> FloatTensor<Self>;
    /// [`Self::fused_attention_from_qkv`] with the queries and keys rotated after the split
    /// by the angle tables `cos`, `sin` (f32, `[seq, rotary_dim / 2]`, positions from 0), as
    /// [`Self::fused_rotary`] with `interleaved`.
    fn fused_rotary_attention_from_qkv(
        mixed: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        interleaved: bool,
        core: RowsCore,
    ) -> FloatTensor<Self>;
    /// [`Self::fused_rotary_attention_from_qkv`] with the projection's bias added by the
    /// split, as [`Self::fused_biased_attention_from_qkv`].
    fn fused_biased_rotary_attention_from_qkv(
        mixed: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        interleaved: bool,
        core: RowsCore,
    ) -> FloatTensor<Self>;
}

/// The core on the inner backend (no graph): the context.
fn cube_core(
    mixed: CubeTensor,
    bias: Option<CubeTensor>,
    rotation: Option<Rotation<CubeBackend>>,
    core: RowsCore,
) -> CubeTensor {
    MixedAttention::new(&mixed.shape(), core, rotation)
        .run(mixed, bias)
        .0
}

impl RowsAttentionOps for CubeBackend {
    fn fused_attention_from_qkv(mixed: CubeTensor, core: RowsCore) -> CubeTensor {
        cube_core(mixed, None, None, core)
    }

    fn fused_biased_attention_from_qkv(
        mixed: CubeTensor,
        bias: CubeTensor,
        core: RowsCore,
    ) -> CubeTensor {
        cube_core(mixed, Some(bias), None, core)
    }

    fn fused_rotary_attention_from_qkv(
        mixed: CubeTensor,
        cos: CubeTensor,
        sin: CubeTensor,
        interleaved: bool,
        core: RowsCore,
    ) -> CubeTensor {
        let rotation = Rotation {
            cos,
            sin,
            interleaved,
        };
        cube_core(mixed, None, Some(rotation), core)
    }

    fn fused_biased_rotary_attention_from_qkv(
        mixed: CubeTensor,
        bias: CubeTensor,
        cos: CubeTensor,
        sin: CubeTensor,
        interleaved: bool,
        core: RowsCore,
    ) -> CubeTensor {
        let rotation = Rotation {
            cos,
            sin,
            interleaved,
        };
        cube_core(mixed, Some(bias), Some(rotation), core)
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
    /// The op on rows of `shape`.
    fn new(shape: &Shape, core: RowsCore, rotation: Option<Rotation<B>>) -> Self {
        Self {
            layout: layout(shape, core.groups, core.per_group),
            scale: core.scale,
            draw: core.draw,
            kernels: core.kernels,
            rotation,
        }
    }

    /// The context of the rows `mixed` (and the projection's `bias`), its backward recorded
    /// when they are tracked.
    fn tracked<C: CheckpointStrategy>(
        self,
        mixed: FloatTensor<Autodiff<B, C>>,
        bias: Option<FloatTensor<Autodiff<B, C>>>,
    ) -> FloatTensor<Autodiff<B, C>> {
        let (mixed, node) = mixed.into_parts();
        match bias.map(|bias| bias.into_parts()) {
            None => self.record::<C, 1>([node], mixed, None),
            Some((bias, bias_node)) => self.record::<C, 2>([node, bias_node], mixed, Some(bias)),
        }
    }

    /// [`Self::run`] with the backward recorded on `nodes` (the rows', and the bias's) when
    /// one of them is tracked.
    fn record<C: CheckpointStrategy, const N: usize>(
        self,
        nodes: [NodeGuard; N],
        mixed: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
    ) -> FloatTensor<Autodiff<B, C>>
    where
        MixedAttentionBackward: Backward<B, N, State = RowsState<B>>,
    {
        match MixedAttentionBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (context, state) = self.run(mixed, bias);
                prep.finish(state, context)
            }
            OpsKind::UnTracked(prep) => prep.finish(self.run(mixed, bias).0),
        }
    }

    /// The forward on the inner backend: the context, and what the backward needs.
    fn run(
        self,
        mixed: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
    ) -> (FloatTensor<B>, RowsState<B>) {
        let Self {
            layout,
            scale,
            draw,
            kernels,
            rotation,
        } = self;
        let forward = attention_core::forward::<B>;
        let (context, saved) =
            forward(mixed, bias, layout, scale, draw, kernels, rotation.as_ref());
        (context, (saved, layout, scale, draw, rotation))
    }
}

/// What the forward saved, the layout, the scale, the dropout draw and the rotation.
type RowsState<B> = (
    Saved<B>,
    QkvLayout,
    f32,
    Option<DropoutDraw>,
    Option<Rotation<B>>,
);

/// The rows' gradient from the context's gradient `grad`.
fn rows_grad<B: AttentionKernels>(
    state: RowsState<B>,
    grad: FloatTensor<B>,
    with_bias: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let (saved, layout, scale, draw, rotation) = state;
    attention_core::backward::<B>(saved, grad, layout, scale, draw, rotation, with_bias)
}

/// The backward of [`RowsAttentionOps::fused_attention_from_qkv`]: into the rows, and (with
/// a bias) into the bias, the rows' gradient summed over the rows as the bias add's backward
/// sums it.
#[derive(Debug)]
pub struct MixedAttentionBackward;

impl<B: AttentionKernels> Backward<B, 1> for MixedAttentionBackward {
    type State = RowsState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            grads.register::<B>(parent.id, rows_grad::<B>(ops.state, grad, false).0);
        }
    }
}

impl<B: AttentionKernels> Backward<B, 2> for MixedAttentionBackward {
    type State = RowsState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [rows, bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if rows.is_none() && bias.is_none() {
            return;
        }
        let (grad, bias_grad) = rows_grad::<B>(ops.state, grad, bias.is_some());
        if let (Some(bias), Some(bias_grad)) = (bias, bias_grad) {
            grads.register::<B>(bias.id, bias_grad);
        }
        if let Some(rows) = rows {
            grads.register::<B>(rows.id, grad);
        }
    }
}

impl<B: AttentionKernels + RowsAttentionOps, C: CheckpointStrategy> RowsAttentionOps
    for Autodiff<B, C>
{
    fn fused_attention_from_qkv(mixed: FloatTensor<Self>, core: RowsCore) -> FloatTensor<Self> {
        MixedAttention::<B>::new(&mixed.shape(), core, None).tracked::<C>(mixed, None)
    }

    fn fused_biased_attention_from_qkv(
        mixed: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        core: RowsCore,
    ) -> FloatTensor<Self> {
        MixedAttention::<B>::new(&mixed.shape(), core, None).tracked::<C>(mixed, Some(bias))
    }

    fn fused_rotary_attention_from_qkv(
        mixed: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        interleaved: bool,
        core: RowsCore,
    ) -> FloatTensor<Self> {
        let rotation = Rotation::<B>::constant::<C>(cos, sin, interleaved);
        MixedAttention::<B>::new(&mixed.shape(), core, Some(rotation)).tracked::<C>(mixed, None)
    }

    fn fused_biased_rotary_attention_from_qkv(
        mixed: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        interleaved: bool,
        core: RowsCore,
    ) -> FloatTensor<Self> {
        let rotation = Rotation::<B>::constant::<C>(cos, sin, interleaved);
        MixedAttention::<B>::new(&mixed.shape(), core, Some(rotation))
            .tracked::<C>(mixed, Some(bias))
    }
}

impl<B: AttentionKernels> Rotation<B> {
    /// The rotation by angle tables of the autodiff backend: constants of the op, no gradient
    /// flows to them.
    fn constant<C: CheckpointStrategy>(
        cos: FloatTensor<Autodiff<B, C>>,
        sin: FloatTensor<Autodiff<B, C>>,
        interleaved: bool,
    ) -> Self {
        Rotation {
            cos: cos.into_primitive(),
            sin: sin.into_primitive(),
            interleaved,
        }
    }
}

/// The attention core from the fused QKV projection's rows `qkv` `[b, s, groups ·
/// (per_group + 2) · head_dim]` (Megatron's per-group layout) to the context `[b, s, heads ·
/// head_dim]`, as one differentiable op: its backward is one kernel into the rows' gradient,
/// where the composed split's is eight launches. `kernels` says which attention runs inside
/// ([`CoreKernels::Flash`]: [`causal_attention`]'s kernel) and so what it keeps; `dropout` and
/// the `slice` of it the probabilities hold as [`causal_attention`]'s. With `rotary` the queries and keys are rotated after the split
/// inside the op. The projection's `bias` (if any, `[width]`) is added by the split: `qkv` is
/// the projection's product without it.
#[allow(clippy::too_many_arguments)]
pub fn attention_from_qkv(
    qkv: Tensor<3>,
    bias: Option<Tensor<1>>,
    groups: usize,
    per_group: usize,
    scale: f64,
    dropout: Option<(u64, f64)>,
    slice: DrawSlice,
    kernels: CoreKernels,
    rotary: Option<RowRotation>,
) -> Tensor<3> {
    let core = RowsCore {
        groups: groups as u32,
        per_group: per_group as u32,
        scale: scale as f32,
        draw: dropout_draw(dropout, slice),
        kernels,
    };
    let bias = bias.map(|b| b.cast(qkv.dtype()).into_dispatch());
    let qkv = qkv.into_dispatch();
    type D = Dispatch;
    Tensor::from_dispatch(match (rotary, bias) {
        (None, None) => <D as RowsAttentionOps>::fused_attention_from_qkv(qkv, core),
        (None, Some(bias)) => {
            <D as RowsAttentionOps>::fused_biased_attention_from_qkv(qkv, bias, core)
        }
        (Some(rotation), bias) => {
            let cos = rotation.cos.cast(FloatDType::F32).into_dispatch();
            let sin = rotation.sin.cast(FloatDType::F32).into_dispatch();
            let interleaved = rotation.interleaved;
            match bias {
                None => <D as RowsAttentionOps>::fused_rotary_attention_from_qkv(
                    qkv,
                    cos,
                    sin,
                    interleaved,
                    core,
                ),
                Some(bias) => <D as RowsAttentionOps>::fused_biased_rotary_attention_from_qkv(
                    qkv,
                    bias,
                    cos,
                    sin,
                    interleaved,
                    core,
                ),
            }
        }
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
