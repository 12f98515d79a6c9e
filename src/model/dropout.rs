//! Dropout whose masks come from ferrotron's seeded streams ([`crate::parallel::random`]),
//! not from the device's generator: reproducible across backends, resumes and
//! tensor-parallel ranks.

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};

use crate::parallel::random::{dropout_mask, RngRegion};

/// Zeroes each element with probability `prob` and scales the rest by `1 / (1 − prob)`, in
/// training only (on an autodiff tensor).
#[derive(Module, Debug)]
pub struct Dropout {
    /// Drop probability.
    pub prob: f64,
    /// The stream it draws from (replicated or model-parallel region).
    #[module(skip)]
    pub region: RngRegion,
}

impl Dropout {
    /// A dropout of probability `prob` drawing from `region`'s stream.
    pub fn new(prob: f64, region: RngRegion) -> Self {
        Self { prob, region }
    }

    /// Applies dropout to `x` when training.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        if self.prob == 0.0 || !x.is_autodiff() {
            return x;
        }
        let shape = x.dims();
        let n = shape.iter().product();
        let mask = Tensor::<D>::from_data(
            TensorData::new(dropout_mask(n, self.prob, self.region), shape),
            &x.device(),
        )
        .cast(x.dtype());
        x * mask
    }
}
