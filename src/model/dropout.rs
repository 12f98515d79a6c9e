//! Dropout whose masks come from ferrotron's seeded streams ([`crate::parallel::random`]),
//! not from the device's generator: reproducible across backends, resumes and
//! tensor-parallel ranks. On CubeCL devices (CUDA, wgpu) the mask is derived in the kernel
//! from the draw's key and the element index, with the bits the host draws on the CPU.

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};

use crate::parallel::random::{dropout_mask_of, next_dropout_key, RngRegion};

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

    /// The key and probability of the draw that applying this dropout to a tensor now would
    /// make (none when it would not drop: not training, or probability 0), for ops that
    /// drop inside a fused kernel. Takes the draw from the stream as [`Self::forward`] does,
    /// so fused and unfused paths keep the streams in step.
    pub fn draw(&self, training: bool) -> Option<(u64, f64)> {
        (self.prob > 0.0 && training).then(|| (next_dropout_key(self.region), self.prob))
    }

    /// Applies dropout to `x` when training.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        if self.prob == 0.0 || !x.is_autodiff() {
            return x;
        }
        let key = next_dropout_key(self.region);
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if crate::util::device::is_cube(&x.device()) {
            // Generated on the device from the key, never stored; the backward re-derives it.
            return super::fused_ops::dropout(x, key, self.prob);
        }
        let shape = x.dims();
        let n = shape.iter().product();
        let mask = Tensor::<D>::from_data(
            TensorData::new(dropout_mask_of(key, n, self.prob), shape),
            &x.device(),
        )
        .cast(x.dtype());
        x * mask
    }
}
