//! The masked mean `Σ value · mask / Σ mask` (Megatron's LM-loss reduction), its sums in an
//! order that does not change from run to run.
//!
//! On the CPU backend it is composed of tensor ops ([`fixed_order_sum`], whose numbers the
//! Megatron-made fixtures were checked with). On CubeCL devices it is a differentiable op of
//! one kernel each way (`ferrotron-kernels`' `masked_mean`), where the composed form is ten
//! launches a step.

use burn::tensor::Tensor;

use super::fixed_order_sum::fixed_order_sum;

/// `Σ value · mask / Σ mask` over all elements, a one-element tensor (differentiable in
/// `values`; `mask` is data).
pub fn masked_mean<const D: usize>(values: Tensor<D>, mask: Tensor<D>) -> Tensor<1> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if super::device::is_cube(&values.device()) {
        return fused::masked_mean(values, mask);
    }
    fixed_order_sum(values * mask.clone()) / fixed_order_sum(mask)
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod fused {
    //! [`MaskedMeanOps`], the masked mean as a burn backend extension with its own backward.

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
    use ferrotron_kernels::launch::{self as kernels, RowLaunch};

    use crate::util::cube_tensor::{empty_like, packed_f32};

    /// The kernels a backend runs (forward and backward).
    pub trait MaskedMeanKernels: Backend {
        /// The mean and `Σ mask` (one-element f32 tensors) of `values` and `mask`.
        fn masked_mean_stats(
            values: FloatTensor<Self>,
            mask: FloatTensor<Self>,
        ) -> [FloatTensor<Self>; 2];
        /// `mask · grad / Σ mask` (f32, shaped as `mask`), `grad` one element, `count` the
        /// forward's `Σ mask`.
        fn masked_mean_grad(
            mask: FloatTensor<Self>,
            count: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
    }

    /// The differentiable masked mean (a burn backend extension).
    #[backend_extension(Autodiff, Cube)]
    pub trait MaskedMeanOps: Backend {
        /// `Σ values · mask / Σ mask` of two flat tensors, a one-element tensor.
        fn masked_mean(values: FloatTensor<Self>, mask: FloatTensor<Self>) -> FloatTensor<Self>;
    }

    impl MaskedMeanKernels for CubeBackend {
        fn masked_mean_stats(values: CubeTensor, mask: CubeTensor) -> [CubeTensor; 2] {
            let (values, mask) = (packed_f32(values), packed_f32(mask));
            let len = values.shape().num_elements();
            assert_eq!(len, mask.shape().num_elements(), "a mask per value");
            let [mean, count] = [0; 2].map(|_| empty_like(&values, Shape::new([1]), DType::F32));
            kernels::masked_mean_forward(
                &values.client,
                RowLaunch::for_client(&values.client),
                &values.handle,
                &mask.handle,
                [&mean.handle, &count.handle],
                len,
            );
            [mean, count]
        }

        fn masked_mean_grad(mask: CubeTensor, count: CubeTensor, grad: CubeTensor) -> CubeTensor {
            let (mask, grad) = (packed_f32(mask), packed_f32(grad));
            let len = mask.shape().num_elements();
            let grad_values = empty_like(&mask, mask.shape(), DType::F32);
            kernels::masked_mean_backward(
                &mask.client,
                &mask.handle,
                &count.handle,
                &grad.handle,
                &grad_values.handle,
                len,
            );
            grad_values
        }
    }

    impl MaskedMeanOps for CubeBackend {
        fn masked_mean(values: CubeTensor, mask: CubeTensor) -> CubeTensor {
            let [mean, _] = Self::masked_mean_stats(values, mask);
            mean
        }
    }

    #[derive(Debug)]
    struct MaskedMeanBackward;

    impl<B: MaskedMeanKernels> Backward<B, 1> for MaskedMeanBackward {
        /// The mask (shaped as the values), its sum, and the values' dtype.
        type State = (FloatTensor<B>, FloatTensor<B>, DType);

        fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [parent] = ops.parents;
            let grad = grads.consume::<B>(&ops.node);
            if let Some(parent) = parent {
                let (mask, count, dtype) = ops.state;
                let grad_values = B::masked_mean_grad(mask, count, grad);
                let grad_values = match dtype {
                    DType::F32 => grad_values,
                    other => B::float_cast(grad_values, other.into()),
                };
                grads.register::<B>(parent.id, grad_values);
            }
        }
    }

    impl<B: MaskedMeanKernels + MaskedMeanOps, C: CheckpointStrategy> MaskedMeanOps for Autodiff<B, C> {
        fn masked_mean(values: FloatTensor<Self>, mask: FloatTensor<Self>) -> FloatTensor<Self> {
            let (values, node) = values.into_parts();
            let mask = mask.into_primitive();
            match MaskedMeanBackward
                .prepare::<C>([node])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let dtype = values.dtype();
                    let [mean, count] = B::masked_mean_stats(values, mask.clone());
                    prep.finish((mask, count, dtype), mean)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::masked_mean(values, mask)),
            }
        }
    }

    /// [`super::masked_mean`] on a CubeCL device.
    pub fn masked_mean<const D: usize>(values: Tensor<D>, mask: Tensor<D>) -> Tensor<1> {
        Tensor::from_dispatch(<Dispatch as MaskedMeanOps>::masked_mean(
            values.into_dispatch(),
            mask.into_dispatch(),
        ))
    }
}
