//! The gradient of a bias added to every row: the rows' gradient summed per column, one
//! launch of the column-sum kernel ([`ferrotron_kernels::columns`]).
//!
//! Why not burn's `sum_dim` over the rows: on a GPU it took many times what the bytes need for
//! each of GPT-2 345M's 96 biases a step (measured:
//! benchmarks/results/2026-11-30-h200-gpu-history.md), giving each column to one unit that
//! walks every row; the column-sum kernel spreads the rows of a column over a cube's units and
//! adds their sums in a fixed order.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::Shape;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::ColumnLaunch;

use crate::util::cube_tensor::{by_dtype, empty_like, packed, rows_cols};

/// The column sums a backend runs for a bias's gradient.
pub trait BiasGradKernels: Backend {
    /// `grad` (`[.., hidden]`) summed over all its rows: `[hidden]`, in `grad`'s type.
    fn bias_gradient(grad: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl BiasGradKernels for CubeBackend {
    fn bias_gradient(grad: CubeTensor) -> CubeTensor {
        let grad = packed(grad);
        let (rows, cols) = rows_cols(&grad.shape());
        if rows == 0 {
            return <Self as burn::backend::ops::FloatTensorOps<Self>>::float_zeros(
                Shape::new([cols]),
                &grad.device,
                grad.dtype.into(),
            );
        }
        let sums = empty_like(&grad, Shape::new([cols]), grad.dtype);
        by_dtype!(
            grad.dtype,
            bias_gradient,
            &grad.client,
            ColumnLaunch::for_client(&grad.client),
            &grad.handle,
            &sums.handle,
            rows,
            cols
        );
        sums
    }
}
