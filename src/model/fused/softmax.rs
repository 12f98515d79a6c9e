//! Megatron's scaled upper-triangular (causal) masked softmax, fused: one kernel forward, one
//! backward, where burn's composed softmax takes a mask, a max, an exp, a sum and a division
//! each way. The attention core from the QKV rows also calls its kernels with the attention
//! dropout inside (both ways).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::{Shape, Tensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::{DropoutDraw, RowLaunch, ScoresShape, SoftmaxMask};

use super::same_dtype;
use crate::util::cube_tensor::{by_dtype, empty_like, packed};

/// The softmax kernels a backend runs.
pub trait SoftmaxKernels: Backend {
    /// `[y, dropout(y)]` for `y = softmax(scale · x)` over the last dimension of `[b, heads,
    /// sq, sk]`, keys after the query masked, from one kernel: the dropout by `draw` over the
    /// whole tensor (what [`super::dropout::DropoutKernels::dropout_apply`] makes of `y`); without a draw both are `y`.
    fn causal_softmax_forward(
        x: FloatTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> [FloatTensor<Self>; 2];
    /// `dropout(softmax(scale · x))` alone, causal, as [`Self::causal_softmax_forward`]
    /// computes its second output (the same bits), without writing the probabilities; without
    /// a draw, the probabilities.
    fn causal_softmax_dropped(
        x: FloatTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self>;
    /// The backward of [`Self::causal_softmax_forward`] from its output `y` `[b, heads, sq,
    /// sk]`: `scale · y ⊙ (dy − Σ dy ⊙ y)` per row, the keys after each query neither read
    /// nor summed (their gradient is 0); with a draw, `dy` is the gradient of the dropped
    /// output, taken back through the dropout in the same kernel.
    fn softmax_backward(
        y: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self>;
    /// `[dx, dropout(y)]`: [`Self::softmax_backward`] of a causal softmax through its
    /// dropout by `draw`, and the forward's dropped probabilities again (the same bits as
    /// [`Self::causal_softmax_forward`]'s second output) from the same kernel, so that an
    /// attention core keeps only `y` for the `p v` product's gradient.
    fn softmax_backward_redropping(
        y: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f32,
        draw: DropoutDraw,
    ) -> [FloatTensor<Self>; 2];
    /// `[dx, p]` of a causal softmax from its input `x` rather than its output: the
    /// probabilities `y` formed again in the kernel (the bits of
    /// [`Self::causal_softmax_forward`]'s), `dx` as [`Self::softmax_backward_redropping`]
    /// (or, without a draw, [`Self::softmax_backward`]) gives it from `y`, and `p` what the
    /// `p v` product's gradient reads: `dropout(y)` by `draw`, or `y` without one. One launch
    /// and no stored `y` where the forward kernel then the backward kernel take two launches
    /// and a pass writing `y` and one reading it back (a recomputed attention core's
    /// backward).
    fn causal_softmax_backward_from_input(
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> [FloatTensor<Self>; 2];
}

/// The differentiable fused softmax (a burn backend extension).
#[backend_extension(Autodiff, Cube)]
pub trait SoftmaxOps: Backend {
    /// Megatron's scaled upper-triangular masked softmax.
    fn fused_causal_softmax(x: FloatTensor<Self>, scale: f32) -> FloatTensor<Self>;
}

/// The scores shape of a `[b, heads, sq, sk]` tensor.
fn scores_shape(shape: &Shape) -> ScoresShape {
    let [batch, heads, sq, sk] = shape.dims::<4>();
    ScoresShape {
        batch,
        heads,
        sq,
        sk,
    }
}

impl SoftmaxKernels for CubeBackend {
    fn causal_softmax_forward(
        x: CubeTensor,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> [CubeTensor; 2] {
        let x = packed(x);
        let shape = x.shape();
        let scores = scores_shape(&shape);
        let y = empty_like(&x, shape.clone(), x.dtype);
        let dropped = draw.map(|draw| (draw, empty_like(&x, shape, x.dtype)));
        by_dtype!(
            x.dtype,
            softmax_forward,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            SoftmaxMask::Causal,
            &y.handle,
            dropped.as_ref().map(|(draw, d)| (*draw, &d.handle)),
            scores,
            scale
        );
        let dropped = dropped.map_or_else(|| y.clone(), |(_, d)| d);
        [y, dropped]
    }

    fn causal_softmax_dropped(x: CubeTensor, scale: f32, draw: Option<DropoutDraw>) -> CubeTensor {
        let Some(draw) = draw else {
            let [y, _] = Self::causal_softmax_forward(x, scale, None);
            return y;
        };
        let x = packed(x);
        let shape = x.shape();
        let scores = scores_shape(&shape);
        let dropped = empty_like(&x, shape, x.dtype);
        by_dtype!(
            x.dtype,
            causal_softmax_dropped,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            &dropped.handle,
            draw,
            scores,
            scale
        );
        dropped
    }

    fn softmax_backward(
        y: CubeTensor,
        dy: CubeTensor,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> CubeTensor {
        causal_backward(y, dy, scale, draw, false).0
    }

    fn softmax_backward_redropping(
        y: CubeTensor,
        dy: CubeTensor,
        scale: f32,
        draw: DropoutDraw,
    ) -> [CubeTensor; 2] {
        let (dx, dropped) = causal_backward(y, dy, scale, Some(draw), true);
        [dx, dropped.expect("written with the draw")]
    }
    fn causal_softmax_backward_from_input(
        x: CubeTensor,
        dy: CubeTensor,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> [CubeTensor; 2] {
        let (x, dy) = (packed(x), packed(dy));
        same_dtype("the softmax output's gradient", &x, &dy);
        let shape = x.shape();
        let scores = scores_shape(&shape);
        let dx = empty_like(&x, shape.clone(), x.dtype);
        let probabilities = empty_like(&x, shape, x.dtype);
        by_dtype!(
            x.dtype,
            softmax_backward_from_scores,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            &dy.handle,
            &dx.handle,
            &probabilities.handle,
            scores,
            scale,
            draw
        );
        [dx, probabilities]
    }
}

/// The causal softmax backward (through the dropout by `draw`, if any) and, with
/// `redropping`, the dropout of `y` by the draw from the same kernel.
fn causal_backward(
    y: CubeTensor,
    dy: CubeTensor,
    scale: f32,
    draw: Option<DropoutDraw>,
    redropping: bool,
) -> (CubeTensor, Option<CubeTensor>) {
    let (y, dy) = (packed(y), packed(dy));
    same_dtype("the softmax output's gradient", &y, &dy);
    let shape = y.shape();
    let scores = scores_shape(&shape);
    let dx = empty_like(&y, shape.clone(), y.dtype);
    let dropped = (redropping && draw.is_some()).then(|| empty_like(&y, shape, y.dtype));
    by_dtype!(
        y.dtype,
        softmax_backward,
        &y.client,
        RowLaunch::for_client(&y.client),
        &y.handle,
        &dy.handle,
        &dx.handle,
        scores,
        true,
        scale,
        draw,
        dropped.as_ref().map(|d| &d.handle)
    );
    (dx, dropped)
}

impl SoftmaxOps for CubeBackend {
    fn fused_causal_softmax(x: CubeTensor, scale: f32) -> CubeTensor {
        let [y, _] = Self::causal_softmax_forward(x, scale, None);
        y
    }
}

#[derive(Debug)]
struct SoftmaxBackward;

impl<B: SoftmaxKernels> Backward<B, 1> for SoftmaxBackward {
    /// The softmax output and the scale.
    type State = (FloatTensor<B>, f32);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            let (y, scale) = ops.state;
            grads.register::<B>(parent.id, B::softmax_backward(y, grad, scale, None));
        }
    }
}

impl<B: SoftmaxKernels + SoftmaxOps, C: CheckpointStrategy> SoftmaxOps for Autodiff<B, C> {
    fn fused_causal_softmax(x: FloatTensor<Self>, scale: f32) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        match SoftmaxBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let [y, _] = B::causal_softmax_forward(x, scale, None);
                prep.finish((y.clone(), scale), y)
            }
            OpsKind::UnTracked(prep) => {
                let [y, _] = B::causal_softmax_forward(x, scale, None);
                prep.finish(y)
            }
        }
    }
}

/// The fused causal softmax of `[b, heads, s, s]` scores (square, as Megatron's kernel: query
/// i sees keys 0..=i, the same mask as the composed reference).
pub fn causal_softmax(x: Tensor<4>, scale: f64) -> Tensor<4> {
    let [_, _, sq, sk] = x.dims();
    assert_eq!(sq, sk, "the fused causal softmax takes square scores");
    Tensor::from_dispatch(<Dispatch as SoftmaxOps>::fused_causal_softmax(
        x.into_dispatch(),
        scale as f32,
    ))
}
