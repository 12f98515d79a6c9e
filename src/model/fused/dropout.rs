//! Dropout on the device, and Megatron's bias-dropout-add, fused.
//!
//! Dropout: the mask is a pure function of the draw's key and the element index (32-bit
//! integer hashing, derived again by the kernel for the backward), so no mask is uploaded or
//! stored and device and host draw the same bits.
//!
//! Bias-dropout-add, `residual + dropout(y + bias)`: after each row-parallel layer (attention
//! output, MLP output) the bias add, dropout and residual add are three launches and two
//! intermediate tensors composed; fused they are one launch forward. The backward is what
//! autodiff does for the composed ops: the residual gets the output's gradient as is, `y` the
//! gradient dropped with the same mask, the bias its sum over rows: one launch of the
//! column-sum kernel dropping the gradient on the way (the dropout kernel and the column sums
//! were two launches and two reads of the gradient per layer: benchmarks/results/
//! 2026-12-03-figures-from-comments.md counts them). The
//! residual's gradient goes to the norm that also reads the residual, whose backward kernel
//! adds it ([`super::residual_join`]), where autodiff would add the two in a launch of its own.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::Shape;
use burn::tensor::Tensor;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::{ColumnLaunch, DrawSlice, DropoutDraw};

use super::bias_gradient::BiasGradKernels;
use super::residual_join::ResidualJoin;
use super::{dropout_draw, same_dtype};
use crate::util::cube_tensor::{by_dtype, empty_like, packed, rows_cols};

/// The dropout kernels a backend runs.
pub trait DropoutKernels: BiasGradKernels {
    /// `x ⊙ mask` of the dropout draw `draw`, `x` holding its slice (forward; backward
    /// on the gradient).
    fn dropout_apply(x: FloatTensor<Self>, draw: DropoutDraw) -> FloatTensor<Self>;
    /// `grad` (`[.., hidden]`, holding the draw's slice) dropped with `draw`'s mask, and
    /// that summed over its rows (`[hidden]`): bias-dropout-add's gradients of `y` and of the
    /// bias, as [`DropoutKernels::dropout_apply`] and [`BiasGradKernels::bias_gradient`] give
    /// them.
    fn dropped_bias_gradient(
        grad: FloatTensor<Self>,
        draw: DropoutDraw,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// `residual + dropout(y + bias)` (Megatron's bias-dropout-add), the bias broadcast over
    /// the rows of the last dimension; `y` holds the draw's slice.
    fn bias_dropout_add_apply(
        residual: FloatTensor<Self>,
        y: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self>;
}

/// The differentiable fused dropout and bias-dropout-add (a burn backend extension).
#[backend_extension(Autodiff, Cube)]
pub trait DropoutOps: Backend {
    /// Dropout with the mask of `draw`, `x` holding its slice.
    fn fused_dropout(x: FloatTensor<Self>, draw: DropoutDraw) -> FloatTensor<Self>;
    /// `residual + dropout(y + bias)`, the bias over the last dimension, `y` holding the
    /// draw's slice (none: nothing dropped).
    fn fused_bias_dropout_add(
        residual: FloatTensor<Self>,
        y: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self>;
    /// `residual + dropout(y)` (a layer without biases).
    fn fused_dropout_add(
        residual: FloatTensor<Self>,
        y: FloatTensor<Self>,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self>;
}

impl DropoutKernels for CubeBackend {
    fn dropout_apply(x: CubeTensor, draw: DropoutDraw) -> CubeTensor {
        let x = packed(x);
        let shape = x.shape();
        let len = shape.num_elements();
        let y = empty_like(&x, shape, x.dtype);
        by_dtype!(x.dtype, dropout, &x.client, &x.handle, &y.handle, len, draw);
        y
    }

    fn dropped_bias_gradient(grad: CubeTensor, draw: DropoutDraw) -> (CubeTensor, CubeTensor) {
        let grad = packed(grad);
        let shape = grad.shape();
        let (rows, cols) = rows_cols(&shape);
        if rows == 0 {
            let dropped = Self::dropout_apply(grad.clone(), draw);
            return (dropped, Self::bias_gradient(grad));
        }
        let dropped = empty_like(&grad, shape, grad.dtype);
        let sums = empty_like(&grad, Shape::new([cols]), grad.dtype);
        by_dtype!(
            grad.dtype,
            dropped_bias_gradient,
            &grad.client,
            ColumnLaunch::for_client(&grad.client),
            &grad.handle,
            &dropped.handle,
            &sums.handle,
            rows,
            cols,
            draw
        );
        (dropped, sums)
    }

    fn bias_dropout_add_apply(
        residual: CubeTensor,
        y: CubeTensor,
        bias: Option<CubeTensor>,
        draw: Option<DropoutDraw>,
    ) -> CubeTensor {
        let (residual, y, bias) = (packed(residual), packed(y), bias.map(packed));
        same_dtype("the residual", &y, &residual);
        if let Some(bias) = &bias {
            same_dtype("the bias", &y, bias);
        }
        let shape = y.shape();
        let (len, hidden) = (shape.num_elements(), shape[shape.num_dims() - 1]);
        let output = empty_like(&y, shape, y.dtype);
        by_dtype!(
            y.dtype,
            bias_dropout_add,
            &y.client,
            [&residual.handle, &y.handle],
            bias.as_ref().map(|b| &b.handle),
            &output.handle,
            len,
            hidden,
            draw
        );
        output
    }
}

impl DropoutOps for CubeBackend {
    fn fused_dropout(x: CubeTensor, draw: DropoutDraw) -> CubeTensor {
        Self::dropout_apply(x, draw)
    }

    fn fused_bias_dropout_add(
        residual: CubeTensor,
        y: CubeTensor,
        bias: CubeTensor,
        draw: Option<DropoutDraw>,
    ) -> CubeTensor {
        Self::bias_dropout_add_apply(residual, y, Some(bias), draw)
    }

    fn fused_dropout_add(
        residual: CubeTensor,
        y: CubeTensor,
        draw: Option<DropoutDraw>,
    ) -> CubeTensor {
        Self::bias_dropout_add_apply(residual, y, None, draw)
    }
}

#[derive(Debug)]
struct DropoutBackward;

impl<B: DropoutKernels> Backward<B, 1> for DropoutBackward {
    /// The draw (with the tensor's slice of it): the backward derives the same mask.
    type State = DropoutDraw;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            grads.register::<B>(parent.id, B::dropout_apply(grad, ops.state));
        }
    }
}

/// The backward of [`DropoutOps::fused_bias_dropout_add`] (3 parents: residual, y, bias) and
/// [`DropoutOps::fused_dropout_add`] (2 parents: residual, y).
#[derive(Debug)]
struct BiasDropoutAddBackward;

/// The draw (with the slice of it `y` holds) and the join with the norm reading the residual.
type State<B> = (Option<DropoutDraw>, Option<ResidualJoin<B>>);

/// The residual's gradient (the output's, as is): to the norm that also reads the residual if
/// it joins them, otherwise registered.
fn register_residual<B: Backend>(
    grads: &mut Gradients,
    residual: Option<NodeId>,
    grad: FloatTensor<B>,
    join: Option<ResidualJoin<B>>,
) {
    let Some(residual) = residual else { return };
    let unjoined = match join {
        Some(join) => join.hand_over(grad),
        None => Some(grad),
    };
    if let Some(grad) = unjoined {
        grads.register::<B>(residual, grad);
    }
}

/// `y`'s gradient from the output's: dropped with the forward's mask.
fn y_grad<B: DropoutKernels>(grad: &FloatTensor<B>, draw: Option<DropoutDraw>) -> FloatTensor<B> {
    match draw {
        Some(draw) => B::dropout_apply(grad.clone(), draw),
        None => grad.clone(),
    }
}

impl<B: DropoutKernels> Backward<B, 3> for BiasDropoutAddBackward {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [residual, y, bias] = ops.parents;
        let (draw, join) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let grad_y = match (&bias, draw) {
            (Some(bias), Some(draw)) => {
                let (grad_y, grad_bias) = B::dropped_bias_gradient(grad.clone(), draw);
                grads.register::<B>(bias.id, grad_bias);
                grad_y
            }
            _ => {
                let grad_y = y_grad::<B>(&grad, draw);
                if let Some(bias) = &bias {
                    grads.register::<B>(bias.id, B::bias_gradient(grad_y.clone()));
                }
                grad_y
            }
        };
        if let Some(y) = y {
            grads.register::<B>(y.id, grad_y);
        }
        register_residual::<B>(grads, residual.map(|r| r.id), grad, join);
    }
}

impl<B: DropoutKernels> Backward<B, 2> for BiasDropoutAddBackward {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [residual, y] = ops.parents;
        let (draw, join) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let grad_y = y_grad::<B>(&grad, draw);
        if let Some(y) = y {
            grads.register::<B>(y.id, grad_y);
        }
        register_residual::<B>(grads, residual.map(|r| r.id), grad, join);
    }
}

/// The autodiff forward of both ops from `[residual, y]` or `[residual, y, bias]`: the
/// kernel, and the state when tracked.
fn tracked<B: DropoutKernels, C: CheckpointStrategy, const N: usize>(
    inputs: [FloatTensor<Autodiff<B, C>>; N],
    draw: Option<DropoutDraw>,
) -> FloatTensor<Autodiff<B, C>>
where
    BiasDropoutAddBackward: Backward<B, N, State = State<B>>,
{
    let mut primitives = Vec::with_capacity(N);
    let nodes = inputs.map(|t| {
        let (primitive, node) = t.into_parts();
        primitives.push(primitive);
        node
    });
    let residual_node = nodes[0].id();
    let mut primitives = primitives.into_iter();
    let (residual, y) = (primitives.next().unwrap(), primitives.next().unwrap());
    let bias = primitives.next();
    match BiasDropoutAddBackward
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let output = B::bias_dropout_add_apply(residual, y, bias, draw);
            let join = ResidualJoin::claim(residual_node);
            prep.finish((draw, join), output)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::bias_dropout_add_apply(residual, y, bias, draw)),
    }
}

impl<B: DropoutKernels + DropoutOps, C: CheckpointStrategy> DropoutOps for Autodiff<B, C> {
    fn fused_dropout(x: FloatTensor<Self>, draw: DropoutDraw) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        match DropoutBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(draw, B::dropout_apply(x, draw)),
            OpsKind::UnTracked(prep) => prep.finish(B::dropout_apply(x, draw)),
        }
    }

    fn fused_bias_dropout_add(
        residual: FloatTensor<Self>,
        y: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self> {
        tracked::<B, C, 3>([residual, y, bias], draw)
    }

    fn fused_dropout_add(
        residual: FloatTensor<Self>,
        y: FloatTensor<Self>,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self> {
        tracked::<B, C, 2>([residual, y], draw)
    }
}

/// Dropout of `x` with probability `p`, `x` holding `slice` of the draw keyed `key` (all of
/// it, or a rank's chunk as [`DrawSlice::chunk`] cuts it), the mask derived on the device:
/// the host's mask ([`crate::parallel::random::dropout_mask_of`]) for the same elements.
pub fn dropout_slice<const D: usize>(
    x: Tensor<D>,
    key: u64,
    p: f64,
    slice: DrawSlice,
) -> Tensor<D> {
    let draw = dropout_draw(Some((key, p)), slice).expect("a draw");
    let x = x.into_dispatch();
    Tensor::from_dispatch(<Dispatch as DropoutOps>::fused_dropout(x, draw))
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
    let draw = dropout_draw(dropout, slice);
    let residual = residual.cast(y.dtype());
    Tensor::from_dispatch(match bias {
        Some(bias) => <Dispatch as DropoutOps>::fused_bias_dropout_add(
            residual.into_dispatch(),
            y.clone().into_dispatch(),
            bias.cast(y.dtype()).into_dispatch(),
            draw,
        ),
        None => <Dispatch as DropoutOps>::fused_dropout_add(
            residual.into_dispatch(),
            y.into_dispatch(),
            draw,
        ),
    })
}
