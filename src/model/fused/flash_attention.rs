//! Causal attention as one FlashAttention-style kernel (`--use-flash-attn`): online softmax,
//! dropout inside with the composed path's masks, and a backward that forms the probabilities
//! again from a log-sum-exp saved per row, so no `[batch, heads, s, s]` tensor is stored. With
//! packed documents the kernels take each position's first visible key (`[batch, seq]`) and
//! skip the tiles no query of a block sees, so neither a mask nor the other documents' scores
//! are formed.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::ops::IntTensorOps;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::{DType, Device, Int, IntDType, Shape, Tensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::{
    AttentionInputs, AttentionLaunch, DrawSlice, DropoutDraw, FirstKeys,
};

use super::{attention_shape, dropout_draw};
use crate::util::cube_tensor::{by_dtype, empty_like, packed};

/// Where a context-parallel chunk's attention sits in the whole sequence's: its queries are
/// the heads' positions from `queries_from` on (those before are padding, which sees nothing),
/// its probabilities part of the dropout draw over a `draw_seq`-long sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkRows {
    /// The first position that is a query.
    pub queries_from: usize,
    /// The whole sequence's length.
    pub draw_seq: usize,
}

/// The fused attention kernels a backend runs.
pub trait FlashAttentionKernels: Backend {
    /// Causal attention of `[b, heads, s, head_dim]` queries, keys and values, dropout
    /// inside, each query seeing from its entry of `first_keys` (`[b, s]`) on if given: the
    /// output, and the per-row log-sum-exp of the scores (f32, `[b · heads · s]`).
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
        dropout: Option<DropoutDraw>,
        first_keys: Option<(IntTensor<Self>, Option<ChunkRows>)>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// The attention's backward: dq, dk, dv from the forward's inputs, output and
    /// log-sum-exp, the output's gradient, the same dropout draw and first keys.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        output: FloatTensor<Self>,
        logsumexp: FloatTensor<Self>,
        grad_output: FloatTensor<Self>,
        scale: f32,
        dropout: Option<DropoutDraw>,
        first_keys: Option<(IntTensor<Self>, Option<ChunkRows>)>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// The differentiable fused attention (a burn backend extension).
#[backend_extension(Autodiff, Cube)]
pub trait FlashAttentionOps: Backend {
    /// Causal attention `dropout(softmax(scale · q kᵀ)) v` without the `[s, s]` scores
    /// (FlashAttention), the probabilities dropped by `draw` (none: nothing dropped).
    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self>;
    /// [`Self::fused_causal_attention`] with each query seeing from its entry of `first_keys`
    /// (`[b, s]`) on: packed documents, or with `rows` a context-parallel chunk. (An op of
    /// its own: an extension's tensor arguments cannot be optional.)
    fn fused_document_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        first_keys: IntTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
        rows: Option<ChunkRows>,
    ) -> FloatTensor<Self>;
}

/// The first keys as the kernels read them (i32, contiguous: the same bytes as the `u32`
/// they take, the keys being positions).
fn kernel_first_keys(
    first_keys: Option<(CubeTensor, Option<ChunkRows>)>,
) -> Option<(CubeTensor, Option<ChunkRows>)> {
    first_keys.map(|(keys, rows)| (packed(CubeBackend::int_cast(keys, IntDType::I32)), rows))
}

/// The kernels' inputs: the heads `q`, `k`, `v` and the first keys `keys` (`[batch, seq]`,
/// [`kernel_first_keys`]) where there are.
fn kernel_inputs<'a>(
    [q, k, v]: [&'a CubeTensor; 3],
    keys: &'a Option<(CubeTensor, Option<ChunkRows>)>,
) -> AttentionInputs<'a> {
    let seq = q.shape()[2];
    AttentionInputs {
        first_keys: keys.as_ref().map(|(keys, rows)| FirstKeys {
            handle: &keys.handle,
            batch: keys.shape()[0],
            queries_from: rows.map_or(0, |r| r.queries_from),
            draw_seq: rows.map_or(seq, |r| r.draw_seq),
        }),
        ..AttentionInputs::causal(&q.handle, &k.handle, &v.handle)
    }
}

impl FlashAttentionKernels for CubeBackend {
    fn flash_attention_forward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        scale: f32,
        dropout: Option<DropoutDraw>,
        first_keys: Option<(CubeTensor, Option<ChunkRows>)>,
    ) -> (CubeTensor, CubeTensor) {
        let (q, k, v) = (packed(q), packed(k), packed(v));
        let shape = q.shape();
        let attention = attention_shape(&shape);
        let output = empty_like(&q, shape, q.dtype);
        let logsumexp = empty_like(&q, Shape::new([attention.rows()]), DType::F32);
        let keys = kernel_first_keys(first_keys);
        let inputs = kernel_inputs([&q, &k, &v], &keys);
        by_dtype!(
            q.dtype,
            flash_attention_forward,
            &q.client,
            AttentionLaunch::for_client(&q.client, attention.head_dim),
            inputs,
            &output.handle,
            &logsumexp.handle,
            attention,
            scale,
            dropout
        );
        (output, logsumexp)
    }

    fn flash_attention_backward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        output: CubeTensor,
        logsumexp: CubeTensor,
        grad_output: CubeTensor,
        scale: f32,
        dropout: Option<DropoutDraw>,
        first_keys: Option<(CubeTensor, Option<ChunkRows>)>,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let (q, k, v) = (packed(q), packed(k), packed(v));
        let (output, grad_output) = (packed(output), packed(grad_output));
        let shape = q.shape();
        let attention = attention_shape(&shape);
        let [dq, dk, dv] = [0; 3].map(|_| empty_like(&q, shape.clone(), q.dtype));
        let delta = empty_like(&q, Shape::new([attention.rows()]), DType::F32);
        let keys = kernel_first_keys(first_keys);
        let inputs = kernel_inputs([&q, &k, &v], &keys);
        by_dtype!(
            q.dtype,
            flash_attention_backward,
            &q.client,
            AttentionLaunch::for_client(&q.client, attention.head_dim),
            inputs,
            &output.handle,
            &grad_output.handle,
            &logsumexp.handle,
            [&dq.handle, &dk.handle, &dv.handle],
            &delta.handle,
            attention,
            scale,
            dropout
        );
        (dq, dk, dv)
    }
}

impl FlashAttentionOps for CubeBackend {
    fn fused_causal_attention(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> CubeTensor {
        Self::flash_attention_forward(q, k, v, scale, draw, None).0
    }

    fn fused_document_attention(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        first_keys: CubeTensor,
        scale: f32,
        draw: Option<DropoutDraw>,
        rows: Option<ChunkRows>,
    ) -> CubeTensor {
        Self::flash_attention_forward(q, k, v, scale, draw, Some((first_keys, rows))).0
    }
}

#[derive(Debug)]
struct AttentionBackward;

impl<B: FlashAttentionKernels> Backward<B, 3> for AttentionBackward {
    /// q, k, v, the output and its log-sum-exp per row, the scale, the dropout draw and the
    /// first keys: `O(s · head_dim)` per head, no `[s, s]` tensor.
    type State = (
        [FloatTensor<B>; 5],
        f32,
        Option<DropoutDraw>,
        Option<(IntTensor<B>, Option<ChunkRows>)>,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [pq, pk, pv] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let ([q, k, v, output, logsumexp], scale, draw, keys) = ops.state;
        let (dq, dk, dv) =
            B::flash_attention_backward(q, k, v, output, logsumexp, grad, scale, draw, keys);
        for (parent, g) in [(pq, dq), (pk, dk), (pv, dv)] {
            if let Some(p) = parent {
                grads.register::<B>(p.id, g);
            }
        }
    }
}

impl<B: FlashAttentionKernels + FlashAttentionOps, C: CheckpointStrategy> FlashAttentionOps
    for Autodiff<B, C>
{
    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self> {
        tracked_attention::<B, C>([q, k, v], scale, draw, None)
    }

    fn fused_document_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        first_keys: IntTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
        rows: Option<ChunkRows>,
    ) -> FloatTensor<Self> {
        tracked_attention::<B, C>([q, k, v], scale, draw, Some((first_keys, rows)))
    }
}

/// The fused attention as a node of the autodiff graph: the forward's kernels, and what the
/// backward's need kept (see [`AttentionBackward`]).
fn tracked_attention<B: FlashAttentionKernels, C: CheckpointStrategy>(
    [q, k, v]: [FloatTensor<Autodiff<B, C>>; 3],
    scale: f32,
    draw: Option<DropoutDraw>,
    first_keys: Option<(IntTensor<B>, Option<ChunkRows>)>,
) -> FloatTensor<Autodiff<B, C>> {
    let (q, nq) = q.into_parts();
    let (k, nk) = k.into_parts();
    let (v, nv) = v.into_parts();
    match AttentionBackward
        .prepare::<C>([nq, nk, nv])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (heads, keys) = ((q.clone(), k.clone(), v.clone()), first_keys.clone());
            let (output, logsumexp) =
                B::flash_attention_forward(heads.0, heads.1, heads.2, scale, draw, keys);
            let saved = [q, k, v, output.clone(), logsumexp];
            prep.finish((saved, scale, draw, first_keys), output)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(B::flash_attention_forward(q, k, v, scale, draw, first_keys).0)
        }
    }
}

/// Causal attention of `[b, heads, s, head_dim]` queries, keys and values fused
/// (FlashAttention-style): `dropout(softmax(scale · q kᵀ)) v` with the `[s, s]` scores never
/// stored. `dropout` is the draw's key and probability, of which the `[b, heads, s, s]`
/// probabilities hold `slice` (a tensor-parallel rank's heads); it drops the same probabilities
/// as [`dropout`] of that key and slice on the materialised probabilities. With `first_keys`
/// (`[b, s]`, packed documents: not decreasing along a row, each at most its position) query
/// `i` sees keys `first_keys[i] ..= i` only; with `rows` too, only the positions from
/// `rows.queries_from` on are queries (a context-parallel chunk, [`ChunkRows`]).
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    dropout: Option<(u64, f64)>,
    slice: DrawSlice,
    first_keys: Option<Tensor<2, Int>>,
    rows: Option<ChunkRows>,
) -> Tensor<4> {
    let (q, k, v) = (q.into_dispatch(), k.into_dispatch(), v.into_dispatch());
    let (scale, draw) = (scale as f32, dropout_draw(dropout, slice));
    Tensor::from_dispatch(match first_keys {
        None => <Dispatch as FlashAttentionOps>::fused_causal_attention(q, k, v, scale, draw),
        Some(keys) => <Dispatch as FlashAttentionOps>::fused_document_attention(
            q,
            k,
            v,
            keys.into_dispatch(),
            scale,
            draw,
            rows,
        ),
    })
}

/// The kernels [`causal_attention`] runs for heads of `head_dim` stored as `dtype` on
/// `device`, in words (`ferrotron_kernels::launch::attention_kernels_in_words`); `None` off
/// CubeCL devices.
pub fn attention_kernels_in_words(
    device: &Device,
    dtype: DType,
    head_dim: usize,
) -> Option<String> {
    let client = crate::util::device::cube_client(device)?;
    let launch = AttentionLaunch::for_client(&client, head_dim);
    Some(by_dtype!(
        dtype,
        attention_kernels_in_words,
        &client,
        launch,
        head_dim
    ))
}
