//! The embedding lookup `weight[tokens]` with its own backward: on a GPU the gradient is
//! `ferrotron-kernels`' `embedding_gradient` (each token's rows summed in f32, in position
//! order, by one cube) instead of burn's `select_assign` (one unit per column walking every
//! position, adding in the storage type: too few units to fill a GPU, each on a serial chain
//! (measured: benchmarks/results/2026-11-30-h200-gpu-history.md), and in bf16 a frequent
//! token's row rounded at every addition). On the CPU backend, and on CubeCL's CPU devices
//! (where the kernel's barriers make it slower than burn's loop), it is what burn's autodiff
//! does for `select`; in f32 the kernel gives the same bits.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::{FloatTensor, IndexingUpdateOp, IntTensor};
use burn::backend::{backend_extension, Backend, Dispatch, Flex, TensorMetadata};
use burn::tensor::{Int, Shape, Tensor};

/// How the lookup's backward forms the weight's gradient on a CubeCL device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmbeddingGradient {
    /// The kernel on a GPU; burn's `select` backward on a CPU device (lavapipe, cubecl-cpu).
    Auto,
    /// The kernel with a GPU's launch shape on any CubeCL device (how the tests run it on
    /// lavapipe).
    Kernel,
}

/// The backend extension carrying the lookup.
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait EmbeddingOps: Backend {
    /// Rows `[positions, hidden]` of `weight` `[rows, hidden]` at `tokens` `[positions]`.
    fn embedding_lookup(
        weight: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        gradient: EmbeddingGradient,
    ) -> FloatTensor<Self>;
}

/// How a backend forms the lookup's gradient.
pub trait EmbeddingKernels: Backend {
    /// The gradient `[rows, hidden]` of the weight from the rows' gradient `grad`
    /// `[positions, hidden]`: row `r` the sum of `grad`'s rows where `tokens` is `r`.
    fn lookup_gradient(
        grad: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        rows: usize,
        gradient: EmbeddingGradient,
    ) -> FloatTensor<Self>;
}

/// burn's `select` backward: a zeroed table, the rows added at the tokens.
fn composed_backward<B: Backend>(
    grad: FloatTensor<B>,
    tokens: IntTensor<B>,
    rows: usize,
) -> FloatTensor<B> {
    let hidden = grad.shape()[1];
    let zeros = B::float_zeros(
        Shape::new([rows, hidden]),
        &grad.device(),
        grad.dtype().into(),
    );
    B::float_select_assign(zeros, 0, tokens, grad, IndexingUpdateOp::Add)
}

impl EmbeddingKernels for Flex {
    fn lookup_gradient(
        grad: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        rows: usize,
        _: EmbeddingGradient,
    ) -> FloatTensor<Self> {
        composed_backward::<Self>(grad, tokens, rows)
    }
}

impl EmbeddingOps for Flex {
    fn embedding_lookup(
        weight: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        _: EmbeddingGradient,
    ) -> FloatTensor<Self> {
        Self::float_select(weight, 0, tokens)
    }
}

/// The CubeCL backend (CUDA, wgpu): a zeroed table and one kernel (burn's `select` backward
/// on CPU devices, unless told otherwise).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl EmbeddingKernels for burn_cubecl::CubeBackend {
    fn lookup_gradient(
        grad: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        rows: usize,
        gradient: EmbeddingGradient,
    ) -> FloatTensor<Self> {
        use crate::util::cube_tensor::{by_dtype, packed};
        use burn::backend::ops::IntTensorOps;
        use ferrotron_kernels::launch::EmbeddingLaunch;

        let launch = match gradient {
            EmbeddingGradient::Auto => EmbeddingLaunch::for_client(&grad.client),
            EmbeddingGradient::Kernel => Some(EmbeddingLaunch::gpu(&grad.client)),
        };
        let Some(launch) = launch else {
            return composed_backward::<Self>(grad, tokens, rows);
        };
        let grad = packed(grad);
        let tokens = packed(Self::int_cast(tokens, burn::tensor::IntDType::I32));
        let [positions, hidden] = grad.shape().dims::<2>();
        let table = packed(Self::float_zeros(
            Shape::new([rows, hidden]),
            &grad.device,
            grad.dtype.into(),
        ));
        by_dtype!(
            grad.dtype,
            embedding_gradient,
            &grad.client,
            launch,
            &tokens.handle,
            &grad.handle,
            &table.handle,
            positions,
            rows,
            hidden
        );
        table
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl EmbeddingOps for burn_cubecl::CubeBackend {
    fn embedding_lookup(
        weight: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        _: EmbeddingGradient,
    ) -> FloatTensor<Self> {
        Self::float_select(weight, 0, tokens)
    }
}

#[derive(Debug)]
struct EmbeddingBackward;

impl<B: EmbeddingKernels> Backward<B, 1> for EmbeddingBackward {
    /// The tokens, the table's rows, and how to form the gradient.
    type State = (IntTensor<B>, usize, EmbeddingGradient);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(parent) = parent else { return };
        let (tokens, rows, gradient) = ops.state;
        let weight_grad = B::lookup_gradient(grad, tokens, rows, gradient);
        grads.register::<B>(parent.id, weight_grad);
    }
}

impl<B: EmbeddingOps + EmbeddingKernels, C: CheckpointStrategy> EmbeddingOps for Autodiff<B, C> {
    fn embedding_lookup(
        weight: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        gradient: EmbeddingGradient,
    ) -> FloatTensor<Self> {
        let (weight, node) = weight.into_parts();
        let rows = weight.shape()[0];
        match EmbeddingBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let rows_out = B::embedding_lookup(weight, tokens.clone(), gradient);
                prep.finish((tokens, rows, gradient), rows_out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::embedding_lookup(weight, tokens, gradient)),
        }
    }
}

/// Rows `[positions, hidden]` of `weight` at `tokens` (ids below its rows), differentiable
/// in `weight`.
pub fn embedding_lookup(weight: Tensor<2>, tokens: Tensor<1, Int>) -> Tensor<2> {
    embedding_lookup_with(weight, tokens, EmbeddingGradient::Auto)
}

/// [`embedding_lookup`], its gradient formed as `gradient` says.
pub fn embedding_lookup_with(
    weight: Tensor<2>,
    tokens: Tensor<1, Int>,
    gradient: EmbeddingGradient,
) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as EmbeddingOps>::embedding_lookup(
        weight.into_dispatch(),
        tokens.into_dispatch(),
        gradient,
    ))
}
