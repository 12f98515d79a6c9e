//! The MLP's activations, fused: GELU (exact or tanh, with the first MLP layer's bias added
//! inside: Megatron's bias-GELU fusion) and SwiGLU's `silu(gate) ⊙ up`, one element-wise
//! kernel each way. burn's composed GELU is about five launches forward and a dozen backward,
//! and on CubeCL devices differentiates the exact form as the tanh one; the kernel's
//! derivative is exact. Bias-GELU's backward with the bias's gradient is one launch of the
//! column-sum kernel (the slope applied as it reads `dy`), where it was the GELU backward
//! kernel and the column sums.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::{Shape, Tensor};
use burn_cubecl::cubecl::server::Handle;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::ColumnLaunch;

use super::bias_gradient::BiasGradKernels;
use super::same_dtype;
use crate::util::cube_tensor::{by_dtype, empty_like, packed, rows_cols};

/// The activation kernels a backend runs.
pub trait ActivationKernels: BiasGradKernels {
    /// GELU, element-wise (the tanh approximation with `tanh`).
    fn fused_gelu_forward(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        tanh: bool,
    ) -> FloatTensor<Self>;
    /// GELU backward: dx from the forward's input and dy (the exact derivative of the form
    /// computed; burn's default `gelu_backward` is the tanh form's for both).
    fn fused_gelu_backward(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        tanh: bool,
    ) -> FloatTensor<Self>;
    /// Bias-GELU backward with the bias's gradient: dx as [`Self::fused_gelu_backward`]
    /// gives it, and dx summed over its rows (`[hidden]`), as
    /// [`BiasGradKernels::bias_gradient`] gives it.
    fn gelu_bias_gradient(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        tanh: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// `silu(gate) ⊙ up`, element-wise.
    fn swiglu_forward(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
    /// SwiGLU backward: d_gate, d_up.
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// The differentiable fused activations (a burn backend extension).
#[backend_extension(Autodiff, Cube)]
pub trait ActivationOps: Backend {
    /// GELU: exact, or the tanh approximation with `tanh` (`--openai-gelu`).
    fn fused_gelu(x: FloatTensor<Self>, tanh: bool) -> FloatTensor<Self>;
    /// GELU of `x + bias`, the bias over the last dimension (Megatron's bias-GELU fusion).
    fn fused_bias_gelu(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        tanh: bool,
    ) -> FloatTensor<Self>;
    /// SwiGLU's `silu(gate) ⊙ up`.
    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// A kernel's bias over the rows of `x` (its last dimension), when there is one.
fn row_bias<'a>(x: &CubeTensor, bias: Option<&'a CubeTensor>) -> Option<(&'a Handle, usize)> {
    bias.map(|b| {
        same_dtype("the bias", x, b);
        let shape = x.shape();
        (&b.handle, shape[shape.num_dims() - 1])
    })
}

impl ActivationKernels for CubeBackend {
    fn fused_gelu_forward(x: CubeTensor, bias: Option<CubeTensor>, tanh: bool) -> CubeTensor {
        let (x, bias) = (packed(x), bias.map(packed));
        let shape = x.shape();
        let len = shape.num_elements();
        let row_bias = row_bias(&x, bias.as_ref());
        let y = empty_like(&x, shape, x.dtype);
        by_dtype!(
            x.dtype,
            gelu_forward,
            &x.client,
            &x.handle,
            row_bias,
            &y.handle,
            len,
            tanh
        );
        y
    }

    fn fused_gelu_backward(
        x: CubeTensor,
        bias: Option<CubeTensor>,
        dy: CubeTensor,
        tanh: bool,
    ) -> CubeTensor {
        let (x, dy, bias) = (packed(x), packed(dy), bias.map(packed));
        same_dtype("GELU's output gradient", &x, &dy);
        let shape = x.shape();
        assert_eq!(shape, dy.shape(), "GELU's input and output gradient");
        let len = shape.num_elements();
        let row_bias = row_bias(&x, bias.as_ref());
        let dx = empty_like(&x, shape, x.dtype);
        by_dtype!(
            x.dtype,
            gelu_backward,
            &x.client,
            &x.handle,
            row_bias,
            &dy.handle,
            &dx.handle,
            len,
            tanh
        );
        dx
    }

    fn gelu_bias_gradient(
        x: CubeTensor,
        bias: CubeTensor,
        dy: CubeTensor,
        tanh: bool,
    ) -> (CubeTensor, CubeTensor) {
        let (x, dy, bias) = (packed(x), packed(dy), packed(bias));
        same_dtype("GELU's output gradient", &x, &dy);
        same_dtype("the bias", &x, &bias);
        let shape = x.shape();
        assert_eq!(shape, dy.shape(), "GELU's input and output gradient");
        let (rows, cols) = rows_cols(&shape);
        if rows == 0 {
            let dx = Self::fused_gelu_backward(x, Some(bias), dy, tanh);
            return (dx.clone(), Self::bias_gradient(dx));
        }
        let dx = empty_like(&x, shape, x.dtype);
        let sums = empty_like(&x, Shape::new([cols]), x.dtype);
        by_dtype!(
            x.dtype,
            gelu_bias_gradient,
            &x.client,
            ColumnLaunch::for_client(&x.client),
            &x.handle,
            &bias.handle,
            &dy.handle,
            &dx.handle,
            &sums.handle,
            rows,
            cols,
            tanh
        );
        (dx, sums)
    }

    fn swiglu_forward(gate: CubeTensor, up: CubeTensor) -> CubeTensor {
        let (gate, up) = (packed(gate), packed(up));
        same_dtype("SwiGLU's up", &gate, &up);
        let shape = gate.shape();
        assert_eq!(shape, up.shape(), "SwiGLU's gate and up");
        let len = shape.num_elements();
        let y = empty_like(&gate, shape, gate.dtype);
        by_dtype!(
            gate.dtype,
            swiglu_forward,
            &gate.client,
            &gate.handle,
            &up.handle,
            &y.handle,
            len
        );
        y
    }

    fn swiglu_backward(
        gate: CubeTensor,
        up: CubeTensor,
        dy: CubeTensor,
    ) -> (CubeTensor, CubeTensor) {
        let (gate, up, dy) = (packed(gate), packed(up), packed(dy));
        same_dtype("SwiGLU's output gradient", &gate, &dy);
        let shape = gate.shape();
        let len = shape.num_elements();
        let [dgate, dup] = [0; 2].map(|_| empty_like(&gate, shape.clone(), gate.dtype));
        by_dtype!(
            gate.dtype,
            swiglu_backward,
            &gate.client,
            &gate.handle,
            &up.handle,
            &dy.handle,
            [&dgate.handle, &dup.handle],
            len
        );
        (dgate, dup)
    }
}

impl ActivationOps for CubeBackend {
    fn fused_gelu(x: CubeTensor, tanh: bool) -> CubeTensor {
        Self::fused_gelu_forward(x, None, tanh)
    }

    fn fused_bias_gelu(x: CubeTensor, bias: CubeTensor, tanh: bool) -> CubeTensor {
        Self::fused_gelu_forward(x, Some(bias), tanh)
    }

    fn fused_swiglu(gate: CubeTensor, up: CubeTensor) -> CubeTensor {
        Self::swiglu_forward(gate, up)
    }
}

#[derive(Debug)]
struct GeluBackward;

impl<B: ActivationKernels> Backward<B, 1> for GeluBackward {
    /// The input, and whether the tanh approximation ran.
    type State = (FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, tanh) = ops.state;
        if let Some(p) = px {
            grads.register::<B>(p.id, B::fused_gelu_backward(x, None, grad, tanh));
        }
    }
}

#[derive(Debug)]
struct BiasGeluBackward;

impl<B: ActivationKernels> Backward<B, 2> for BiasGeluBackward {
    /// The input, the bias, and whether the tanh approximation ran.
    type State = (FloatTensor<B>, FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pb] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, bias, tanh) = ops.state;
        let dx = match pb {
            Some(p) => {
                let (dx, dbias) = B::gelu_bias_gradient(x, bias, grad, tanh);
                grads.register::<B>(p.id, dbias);
                dx
            }
            None => B::fused_gelu_backward(x, Some(bias), grad, tanh),
        };
        if let Some(p) = px {
            grads.register::<B>(p.id, dx);
        }
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl<B: ActivationKernels> Backward<B, 2> for SwigluBackward {
    /// gate, up.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [pgate, pup] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (dgate, dup) = B::swiglu_backward(gate, up, grad);
        if let Some(p) = pgate {
            grads.register::<B>(p.id, dgate);
        }
        if let Some(p) = pup {
            grads.register::<B>(p.id, dup);
        }
    }
}

impl<B: ActivationKernels + ActivationOps, C: CheckpointStrategy> ActivationOps for Autodiff<B, C> {
    fn fused_gelu(x: FloatTensor<Self>, tanh: bool) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        match GeluBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = B::fused_gelu_forward(x.clone(), None, tanh);
                prep.finish((x, tanh), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_gelu_forward(x, None, tanh)),
        }
    }

    fn fused_bias_gelu(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        tanh: bool,
    ) -> FloatTensor<Self> {
        let (x, nx) = x.into_parts();
        let (bias, nb) = bias.into_parts();
        match BiasGeluBackward
            .prepare::<C>([nx, nb])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::fused_gelu_forward(x.clone(), Some(bias.clone()), tanh);
                prep.finish((x, bias, tanh), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_gelu_forward(x, Some(bias), tanh)),
        }
    }

    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let (gate, ngate) = gate.into_parts();
        let (up, nup) = up.into_parts();
        match SwigluBackward
            .prepare::<C>([ngate, nup])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::swiglu_forward(gate.clone(), up.clone());
                prep.finish((gate, up), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu_forward(gate, up)),
        }
    }
}

/// The fused GELU of `x + bias` (the bias over the last dimension, cast to `x`'s dtype):
/// exact, or the tanh approximation with `tanh`.
pub fn bias_gelu<const D: usize>(x: Tensor<D>, bias: Tensor<1>, tanh: bool) -> Tensor<D> {
    let bias = bias.cast(x.dtype());
    Tensor::from_dispatch(<Dispatch as ActivationOps>::fused_bias_gelu(
        x.into_dispatch(),
        bias.into_dispatch(),
        tanh,
    ))
}

/// The fused GELU of `x`: exact, or the tanh approximation with `tanh`.
pub fn gelu<const D: usize>(x: Tensor<D>, tanh: bool) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as ActivationOps>::fused_gelu(
        x.into_dispatch(),
        tanh,
    ))
}

/// The fused SwiGLU activation `silu(gate) ⊙ up` (both of one shape and dtype).
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    assert_eq!(gate.dims(), up.dims(), "SwiGLU's gate and up");
    let up = up.cast(gate.dtype());
    Tensor::from_dispatch(<Dispatch as ActivationOps>::fused_swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
}
