//! The matrix product every layer calls: cuBLAS on CUDA devices, burn's `matmul` elsewhere.
//!
//! burn's autodiff would differentiate a product through burn's own matmul, so on CUDA the
//! product is a backend extension ([`GemmOps`]) whose backward pass is two more products of
//! the same kind: `da = dc · bᵀ`, `db = aᵀ · dc` (transposes are strides, never copies), given
//! to cuBLAS together ([`extension::Gemm::gemm_independent`]: one ordering window for both).
//! cuBLAS itself is in [`super::cublas`]; without the `cuda` feature, on other devices, for
//! f32 (cuBLAS without TF32 lost to CubeCL's f32 kernels: docs/gpu.md, "Matrix products on
//! cuBLAS"; benchmarks/results/2026-12-03-figures-from-comments.md), or with `--cuda-matmul cubecl`, [`matmul`] is exactly
//! `a.matmul(b)`.
//!
//! Which kernels a CUDA run's products use is chosen once per process
//! ([`super::product_plan`]).

use burn::tensor::Tensor;

pub use super::product_plan::{
    choose_products, product_plan, CublasOrdering, ProductKernels, ProductPlan,
};

/// `a · b` over the last two dimensions (`[..., m, k] · [..., k, n]`, the same leading
/// dimensions).
pub fn matmul<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "cuda")]
    if uses_extension(&a) {
        return extension::matmul(a, b);
    }
    a.matmul(b)
}

/// Whether some products on `device` go to cuBLAS (a CUDA device, unless `--cuda-matmul
/// cubecl` or cuBLAS is missing): they run on a stream of their own.
pub fn uses_cublas(device: &burn::tensor::Device) -> bool {
    #[cfg(feature = "cuda")]
    {
        use burn::tensor::DType;
        on_cuda(device)
            && [DType::F32, DType::F16, DType::BF16]
                .into_iter()
                .any(super::cublas::takes)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

/// The log's line on the products of a run on `device` (once [`choose_products`] fixed
/// them): `None` off CUDA, where they have no choice.
pub fn products_log_line(device: &burn::tensor::Device) -> Option<&'static str> {
    #[cfg(feature = "cuda")]
    if on_cuda(device) {
        return Some(if uses_cublas(device) {
            product_plan().describe()
        } else {
            "matrix products: CubeCL's kernels"
        });
    }
    let _ = device;
    None
}

/// Whether [`matmul`] takes the extension: a CUDA tensor of a dtype cuBLAS takes.
#[cfg(feature = "cuda")]
fn uses_extension<const D: usize>(a: &Tensor<D>) -> bool {
    on_cuda(&a.device()) && super::cublas::takes(a.dtype())
}

/// Whether `device` (autodiff or not) is a CUDA device.
#[cfg(feature = "cuda")]
fn on_cuda(device: &burn::tensor::Device) -> bool {
    cuda_index(device).is_some()
}

/// The GPU index of `device` (autodiff or not), if it is a CUDA device.
#[cfg(feature = "cuda")]
pub fn cuda_index(device: &burn::tensor::Device) -> Option<usize> {
    match device.clone().inner().as_dispatch() {
        burn::backend::DispatchDevice::Cube(burn_cubecl::cubecl::device::Device::Cuda(d)) => {
            Some(d.index)
        }
        _ => None,
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod extension {
    //! [`GemmOps`], the product as a burn backend extension with its own backward pass.

    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
    use burn::backend::autodiff::Autodiff;
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
    use burn::tensor::Tensor;
    use burn_cubecl::tensor::CubeTensor;
    use burn_cubecl::CubeBackend;

    /// An operand pair `(a, b)` of a product `a · b`.
    pub type Operands<B> = (FloatTensor<B>, FloatTensor<B>);

    /// The kernel-level product a backend runs (forward and backward).
    pub trait Gemm: Backend {
        /// `a · b` over the last two dimensions; either operand may be a transposed view.
        fn gemm(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;

        /// `[a₁ · b₁, …, a_N · b_N]`, none reading another's result (a backward pass's
        /// gradient products), which cuBLAS runs in one ordering window: one wait each way
        /// for all of them instead of one per product.
        fn gemm_independent<const N: usize>(
            products: [Operands<Self>; N],
        ) -> [FloatTensor<Self>; N] {
            products.map(|(a, b)| Self::gemm(a, b))
        }
    }

    impl Gemm for CubeBackend {
        fn gemm(a: CubeTensor, b: CubeTensor) -> CubeTensor {
            #[cfg(feature = "cuda")]
            if let Some(c) = crate::util::cublas::matmul(&a, &b) {
                return c;
            }
            <CubeBackend as FloatTensorOps<CubeBackend>>::float_matmul(a, b)
        }

        fn gemm_independent<const N: usize>(products: [Operands<Self>; N]) -> [CubeTensor; N] {
            #[cfg(feature = "cuda")]
            if let Some(all) =
                crate::util::cublas::matmul_independent(products.each_ref().map(|(a, b)| (a, b)))
            {
                return all;
            }
            products.map(|(a, b)| Self::gemm(a, b))
        }
    }

    /// The differentiable product (a burn backend extension).
    #[backend_extension(Autodiff, Cube)]
    pub trait GemmOps: Backend {
        /// `a · b` over the last two dimensions.
        fn gemm_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
    }

    impl GemmOps for CubeBackend {
        fn gemm_matmul(a: CubeTensor, b: CubeTensor) -> CubeTensor {
            Self::gemm(a, b)
        }
    }

    /// `x` with its last two dimensions swapped (a view).
    pub fn transposed<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
        let d = x.shape().num_dims();
        B::float_swap_dims(x, d - 2, d - 1)
    }

    #[derive(Debug)]
    struct GemmBackward;

    impl<B: Gemm> Backward<B, 2> for GemmBackward {
        /// a, b.
        type State = (FloatTensor<B>, FloatTensor<B>);

        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [pa, pb] = ops.parents;
            let grad = grads.consume::<B>(&ops.node);
            let (a, b) = ops.state;
            match (pa, pb) {
                (Some(pa), Some(pb)) => {
                    let [da, db] = B::gemm_independent([
                        (grad.clone(), transposed::<B>(b)),
                        (transposed::<B>(a), grad),
                    ]);
                    grads.register::<B>(pa.id, da);
                    grads.register::<B>(pb.id, db);
                }
                (Some(p), None) => {
                    grads.register::<B>(p.id, B::gemm(grad, transposed::<B>(b)));
                }
                (None, Some(p)) => {
                    grads.register::<B>(p.id, B::gemm(transposed::<B>(a), grad));
                }
                (None, None) => {}
            }
        }
    }

    impl<B: Gemm + GemmOps, C: CheckpointStrategy> GemmOps for Autodiff<B, C> {
        fn gemm_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
            let (a, na) = a.into_parts();
            let (b, nb) = b.into_parts();
            match GemmBackward
                .prepare::<C>([na, nb])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let c = B::gemm(a.clone(), b.clone());
                    prep.finish((a, b), c)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::gemm(a, b)),
            }
        }
    }

    /// `a · b` through the extension, on any CubeCL device (cuBLAS on CUDA, burn-cubecl's
    /// matmul elsewhere): what [`super::matmul`] runs on CUDA, callable on every CubeCL device
    /// so that its backward pass is tested where there is no GPU.
    pub fn matmul<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
        Tensor::from_dispatch(<Dispatch as GemmOps>::gemm_matmul(
            a.into_dispatch(),
            b.into_dispatch(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two flags' spellings give their plans, and any other value is refused with the
    /// flag's name and what it takes (a typo must not fall back on the default silently).
    #[test]
    fn the_flags_spell_the_plan_and_refuse_other_values() {
        let plan = ProductPlan::from_flags("cubecl", "host").unwrap();
        assert_eq!(plan.kernels, ProductKernels::Cubecl);
        assert_eq!(plan.ordering, CublasOrdering::Host);
        assert_eq!(
            ProductPlan::from_flags("cublas", "device").unwrap(),
            ProductPlan::default()
        );
        let err = ProductPlan::from_flags("cuBLAS", "device").unwrap_err();
        assert!(
            err.contains("--cuda-matmul cuBLAS: expected cublas or cubecl"),
            "{err}"
        );
        let err = ProductPlan::from_flags("cublas", "device-caller").unwrap_err();
        assert!(err.contains("--cublas-ordering device-caller"), "{err}");
    }

    /// The process's plan, once fixed, is what every later run must ask for: the default run
    /// (every test's) is accepted again; its words name the plan.
    #[test]
    fn a_fixed_plan_accepts_itself() {
        choose_products(ProductPlan::default()).unwrap();
        choose_products(ProductPlan::default()).unwrap();
        assert_eq!(product_plan(), ProductPlan::default());
        assert!(product_plan().describe().contains("on the device"));
    }
}
