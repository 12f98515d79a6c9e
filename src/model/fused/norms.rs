//! LayerNorm and RMSNorm over the last dimension, fused: one kernel forward (saving the
//! per-row statistics in f32), and a backward of one kernel for dx and one for the
//! parameters' gradients summed over the rows (the column-sum kernel), where burn's composed
//! norms take about a dozen launches each way. The dx kernel also adds the gradient the input
//! has from the residual add that reads it too ([`super::residual_join`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::{DType, Shape, Tensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::RowLaunch;

use super::residual_join::ResidualJoin;
use super::same_dtype;
use crate::util::cube_tensor::{by_dtype, empty_like, packed, rows_cols};

/// The normalisation kernels a backend runs.
pub trait NormKernels: Backend {
    /// LayerNorm over the last dimension: output, and the per-row mean and 1/σ.
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// LayerNorm backward: dx (plus `residual_grad`, the input's gradient from its other use,
    /// when given), dγ, dβ.
    fn layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        residual_grad: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// RMSNorm over the last dimension: output, and the per-row 1/rms (f32).
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// RMSNorm backward: dx (plus `residual_grad` when given), dγ.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        residual_grad: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// The differentiable fused norms (a burn backend extension).
#[backend_extension(Autodiff, Cube)]
pub trait NormOps: Backend {
    /// LayerNorm over the last dimension.
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self>;
    /// RMSNorm over the last dimension.
    fn fused_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self>;
}

impl NormKernels for CubeBackend {
    fn layer_norm_forward(
        x: CubeTensor,
        gamma: CubeTensor,
        beta: CubeTensor,
        epsilon: f32,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let (x, gamma, beta) = (packed(x), packed(gamma), packed(beta));
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let y = empty_like(&x, shape, x.dtype);
        let mean = empty_like(&x, Shape::new([rows]), DType::F32);
        let rstd = empty_like(&x, Shape::new([rows]), DType::F32);
        by_dtype!(
            x.dtype,
            layer_norm_forward,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            &gamma.handle,
            &beta.handle,
            &y.handle,
            &mean.handle,
            &rstd.handle,
            rows,
            cols,
            epsilon
        );
        (y, mean, rstd)
    }

    fn layer_norm_backward(
        x: CubeTensor,
        gamma: CubeTensor,
        dy: CubeTensor,
        mean: CubeTensor,
        rstd: CubeTensor,
        residual_grad: Option<CubeTensor>,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let (x, gamma, dy) = (packed(x), packed(gamma), packed(dy));
        let residual_grad = residual_grad.map(|r| joinable(&x, r));
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let dx = empty_like(&x, shape, x.dtype);
        let dgamma = empty_like(&x, Shape::new([cols]), x.dtype);
        let dbeta = empty_like(&x, Shape::new([cols]), x.dtype);
        by_dtype!(
            x.dtype,
            layer_norm_backward,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            &gamma.handle,
            &dy.handle,
            &mean.handle,
            &rstd.handle,
            residual_grad.as_ref().map(|r| &r.handle),
            &dx.handle,
            &dgamma.handle,
            &dbeta.handle,
            rows,
            cols
        );
        (dx, dgamma, dbeta)
    }

    fn rms_norm_forward(
        x: CubeTensor,
        gamma: CubeTensor,
        epsilon: f32,
    ) -> (CubeTensor, CubeTensor) {
        let (x, gamma) = (packed(x), packed(gamma));
        same_dtype("RMSNorm's γ", &x, &gamma);
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let y = empty_like(&x, shape, x.dtype);
        let rstd = empty_like(&x, Shape::new([rows]), DType::F32);
        by_dtype!(
            x.dtype,
            rms_norm_forward,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            &gamma.handle,
            &y.handle,
            &rstd.handle,
            rows,
            cols,
            epsilon
        );
        (y, rstd)
    }

    fn rms_norm_backward(
        x: CubeTensor,
        gamma: CubeTensor,
        dy: CubeTensor,
        rstd: CubeTensor,
        residual_grad: Option<CubeTensor>,
    ) -> (CubeTensor, CubeTensor) {
        let (x, gamma, dy) = (packed(x), packed(gamma), packed(dy));
        same_dtype("RMSNorm's output gradient", &x, &dy);
        let residual_grad = residual_grad.map(|r| joinable(&x, r));
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let dx = empty_like(&x, shape, x.dtype);
        let dgamma = empty_like(&x, Shape::new([cols]), x.dtype);
        by_dtype!(
            x.dtype,
            rms_norm_backward,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            &gamma.handle,
            &dy.handle,
            &rstd.handle,
            residual_grad.as_ref().map(|r| &r.handle),
            &dx.handle,
            &dgamma.handle,
            rows,
            cols
        );
        (dx, dgamma)
    }
}

/// The residual add's gradient of `x`, as the dx kernel reads it: contiguous, `x`'s shape
/// and dtype.
fn joinable(x: &CubeTensor, residual_grad: CubeTensor) -> CubeTensor {
    let residual_grad = packed(residual_grad);
    same_dtype("the residual's gradient", x, &residual_grad);
    assert_eq!(
        residual_grad.shape(),
        x.shape(),
        "the residual's gradient's shape"
    );
    residual_grad
}

impl NormOps for CubeBackend {
    fn fused_layer_norm(
        x: CubeTensor,
        gamma: CubeTensor,
        beta: CubeTensor,
        epsilon: f32,
    ) -> CubeTensor {
        Self::layer_norm_forward(x, gamma, beta, epsilon).0
    }

    fn fused_rms_norm(x: CubeTensor, gamma: CubeTensor, epsilon: f32) -> CubeTensor {
        Self::rms_norm_forward(x, gamma, epsilon).0
    }
}

#[derive(Debug)]
struct LayerNormBackward;

impl<B: NormKernels> Backward<B, 3> for LayerNormBackward {
    /// x, γ, mean, 1/σ, and the join with x's residual add.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        ResidualJoin<B>,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pgamma, pbeta] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, gamma, mean, rstd, join) = ops.state;
        let residual = join.take();
        let (dx, dgamma, dbeta) = B::layer_norm_backward(x, gamma, grad, mean, rstd, residual);
        if let Some(p) = px {
            grads.register::<B>(p.id, dx);
        }
        if let Some(p) = pgamma {
            grads.register::<B>(p.id, dgamma);
        }
        if let Some(p) = pbeta {
            grads.register::<B>(p.id, dbeta);
        }
    }
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: NormKernels> Backward<B, 2> for RmsNormBackward {
    /// x, γ, 1/rms, and the join with x's residual add.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        ResidualJoin<B>,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pgamma] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, gamma, rstd, join) = ops.state;
        let residual = join.take();
        let (dx, dgamma) = B::rms_norm_backward(x, gamma, grad, rstd, residual);
        if let Some(p) = px {
            grads.register::<B>(p.id, dx);
        }
        if let Some(p) = pgamma {
            grads.register::<B>(p.id, dgamma);
        }
    }
}

impl<B: NormKernels + NormOps, C: CheckpointStrategy> NormOps for Autodiff<B, C> {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self> {
        let (x, nx) = x.into_parts();
        let input = nx.id();
        let (gamma, ngamma) = gamma.into_parts();
        let (beta, nbeta) = beta.into_parts();
        match LayerNormBackward
            .prepare::<C>([nx, ngamma, nbeta])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, mean, rstd) =
                    B::layer_norm_forward(x.clone(), gamma.clone(), beta, epsilon);
                let join = ResidualJoin::offer(input);
                prep.finish((x, gamma, mean, rstd, join), y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::layer_norm_forward(x, gamma, beta, epsilon).0)
            }
        }
    }

    fn fused_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self> {
        let (x, nx) = x.into_parts();
        let input = nx.id();
        let (gamma, ngamma) = gamma.into_parts();
        match RmsNormBackward
            .prepare::<C>([nx, ngamma])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, rstd) = B::rms_norm_forward(x.clone(), gamma.clone(), epsilon);
                prep.finish((x, gamma, rstd, ResidualJoin::offer(input)), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rms_norm_forward(x, gamma, epsilon).0),
        }
    }
}

/// The fused LayerNorm of `x` over its last dimension.
pub fn layer_norm(x: Tensor<3>, gamma: Tensor<1>, beta: Tensor<1>, epsilon: f64) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as NormOps>::fused_layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon as f32,
    ))
}

/// The fused RMSNorm of `x` over its last dimension (γ stored as `x` is).
pub fn rms_norm(x: Tensor<3>, gamma: Tensor<1>, epsilon: f64) -> Tensor<3> {
    let gamma = gamma.cast(x.dtype());
    Tensor::from_dispatch(<Dispatch as NormOps>::fused_rms_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        epsilon as f32,
    ))
}
