//! Megatron's fused bias-dropout-add, `residual + dropout(y + bias)`, as a differentiable op
//! on CubeCL devices (GPU builds only).
//!
//! Why: after each row-parallel layer (attention output, MLP output) the bias add, dropout
//! and residual add are three launches and two intermediate tensors composed; fused they are
//! one launch forward. The backward is what autodiff does for the composed ops: the residual
//! gets the output's gradient as is, `y` the gradient dropped with the same mask (one
//! launch), the bias its sum over rows (one reduction).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Dispatch, TensorMetadata};
use burn::tensor::Tensor;
use ferrotron_kernels::launch::{DrawSlice, DropoutDraw};

use super::fused_ops::{bias_grad, dropout_draw, FusedKernels, FusedOps};

/// The backward of [`FusedOps::fused_bias_dropout_add`] (3 parents: residual, y, bias) and
/// [`FusedOps::fused_dropout_add`] (2 parents: residual, y).
#[derive(Debug)]
pub struct BiasDropoutAddBackward;

/// The draw and the slice of it `y` holds.
type State = (Option<DropoutDraw>, DrawSlice);

/// `y`'s gradient from the output's: dropped with the forward's mask.
fn y_grad<B: FusedKernels>(
    grad: &FloatTensor<B>,
    draw: Option<DropoutDraw>,
    slice: DrawSlice,
) -> FloatTensor<B> {
    match draw {
        Some(draw) => B::dropout_apply(grad.clone(), draw, slice),
        None => grad.clone(),
    }
}

impl<B: FusedKernels> Backward<B, 3> for BiasDropoutAddBackward {
    type State = State;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [residual, y, bias] = ops.parents;
        let (draw, slice) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let grad_y = y_grad::<B>(&grad, draw, slice);
        if let Some(bias) = bias {
            let shape = grad_y.shape();
            grads.register::<B>(bias.id, bias_grad::<B>(grad_y.clone(), &shape));
        }
        if let Some(y) = y {
            grads.register::<B>(y.id, grad_y);
        }
        if let Some(residual) = residual {
            grads.register::<B>(residual.id, grad);
        }
    }
}

impl<B: FusedKernels> Backward<B, 2> for BiasDropoutAddBackward {
    type State = State;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [residual, y] = ops.parents;
        let (draw, slice) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let grad_y = y_grad::<B>(&grad, draw, slice);
        if let Some(y) = y {
            grads.register::<B>(y.id, grad_y);
        }
        if let Some(residual) = residual {
            grads.register::<B>(residual.id, grad);
        }
    }
}

/// The autodiff forward of both ops from `[residual, y]` or `[residual, y, bias]`: the
/// kernel, and the state when tracked.
pub fn tracked<B: FusedKernels, C: CheckpointStrategy, const N: usize>(
    inputs: [FloatTensor<Autodiff<B, C>>; N],
    draw: Option<DropoutDraw>,
    slice: DrawSlice,
) -> FloatTensor<Autodiff<B, C>>
where
    BiasDropoutAddBackward: Backward<B, N, State = State>,
{
    let mut primitives = Vec::with_capacity(N);
    let nodes = inputs.map(|t| {
        let (primitive, node) = t.into_parts();
        primitives.push(primitive);
        node
    });
    let mut primitives = primitives.into_iter();
    let (residual, y) = (primitives.next().unwrap(), primitives.next().unwrap());
    let bias = primitives.next();
    match BiasDropoutAddBackward
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let output = B::bias_dropout_add_apply(residual, y, bias, draw, slice);
            prep.finish((draw, slice), output)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(B::bias_dropout_add_apply(residual, y, bias, draw, slice))
        }
    }
}

/// `residual + dropout(y + bias)` fused, the bias (if any) cast to `y`'s dtype and
/// broadcast over `y`'s rows, `y` holding `slice` of the draw `dropout` (key, probability;
/// none: nothing dropped).
pub fn bias_dropout_add(
    residual: Tensor<3>,
    y: Tensor<3>,
    bias: Option<Tensor<1>>,
    dropout: Option<(u64, f64)>,
    slice: DrawSlice,
) -> Tensor<3> {
    let draw = dropout_draw(dropout);
    let residual = residual.cast(y.dtype());
    Tensor::from_dispatch(match bias {
        Some(bias) => <Dispatch as FusedOps>::fused_bias_dropout_add(
            residual.into_dispatch(),
            y.clone().into_dispatch(),
            bias.cast(y.dtype()).into_dispatch(),
            draw,
            slice,
        ),
        None => <Dispatch as FusedOps>::fused_dropout_add(
            residual.into_dispatch(),
            y.into_dispatch(),
            draw,
            slice,
        ),
    })
}
