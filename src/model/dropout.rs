//! Dropout whose masks come from ferrotron's seeded streams ([`crate::parallel::random`]),
//! not from the device's generator: reproducible across backends, resumes and
//! tensor-parallel ranks. On CubeCL devices (CUDA, wgpu) the mask is derived in the kernel
//! from the draw's key and the element index, with the bits the host draws on the CPU. A
//! tensor split over ranks along dimension 1 (the sequence under sequence parallelism, the
//! heads of the attention probabilities) takes its chunk of the whole tensor's mask.

use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};

use crate::comm::Group;
use crate::parallel::random::{dropout_mask_of, next_dropout_key, RngRegion};

/// Zeroes each element with probability `prob` and scales the rest by `1 / (1 − prob)`, in
/// training only (on an autodiff tensor).
#[derive(Module, Debug)]
pub struct Dropout {
    /// Drop probability.
    pub prob: f64,
    /// The stream it draws from.
    #[module(skip)]
    pub region: RngRegion,
    /// The group whose ranks each hold one equal chunk along dimension 1 of the tensor the
    /// mask is for (the sequence under sequence parallelism; the attention probabilities'
    /// heads under tensor parallelism). The mask is drawn for the whole tensor and each rank
    /// keeps its chunk's, so the run drops what the one-process run drops.
    #[module(skip)]
    pub chunk_of: Option<Group>,
}

impl Dropout {
    /// A dropout of probability `prob` drawing from `region`'s stream.
    pub fn new(prob: f64, region: RngRegion) -> Self {
        Self {
            prob,
            region,
            chunk_of: None,
        }
    }

    /// The same dropout for a tensor of which this rank holds its chunk of `group` along
    /// dimension 1.
    pub fn with_chunk_of(mut self, group: &Group) -> Self {
        self.chunk_of = (group.size() > 1).then(|| group.clone());
        self
    }

    /// Which part of the draw a tensor of shape `dims` holds: its chunk along dimension 1
    /// ([`Self::with_chunk_of`]), or all of it. For ops that drop inside a fused kernel.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    pub fn slice_of(&self, dims: &[usize]) -> ferrotron_kernels::launch::DrawSlice {
        use ferrotron_kernels::launch::DrawSlice;
        match &self.chunk_of {
            Some(group) => DrawSlice::chunk(dims[1..].iter().product(), group.size(), group.rank()),
            None => DrawSlice::WHOLE,
        }
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
            // Generated on the device from the key (this rank's chunk of it), never stored;
            // the backward re-derives it.
            let slice = self.slice_of(&x.dims());
            return super::fused::dropout_slice(x, key, self.prob, slice);
        }
        if let Some(group) = &self.chunk_of {
            let mask = self.chunk_mask(key, x.dims(), group, &x.device());
            return x.clone() * mask.cast(x.dtype());
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

    /// `residual + dropout(y + bias)` when training (Megatron's bias-dropout-add, after each
    /// row-parallel layer): one fused kernel on CubeCL devices when `fused`, otherwise the
    /// bias add, [`Self::forward`] and the residual add. Takes the same draw either way.
    pub fn bias_dropout_add(
        &self,
        residual: Tensor<3>,
        y: Tensor<3>,
        bias: Option<Tensor<1>>,
        fused: bool,
    ) -> Tensor<3> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if fused && crate::util::device::is_cube(&y.device()) {
            let slice = self.slice_of(&y.dims());
            let draw = self.draw(y.is_autodiff());
            return super::fused::bias_dropout_add(residual, y, bias, draw, slice);
        }
        let _ = fused;
        let y = match bias {
            Some(bias) => y + bias.unsqueeze(),
            None => y,
        };
        residual + self.forward(y)
    }

    /// This rank's chunk (along dimension 1) of the mask of draw `key` over the whole
    /// tensor, for a chunk of shape `chunk`.
    fn chunk_mask<const D: usize>(
        &self,
        key: u64,
        chunk: [usize; D],
        group: &Group,
        device: &Device,
    ) -> Tensor<D> {
        let (parts, rank) = (group.size(), group.rank());
        let mut whole = chunk;
        whole[1] *= parts;
        let values = dropout_mask_of(key, whole.iter().product(), self.prob);
        // Rows of the whole mask before dimension 1, each [seq · rest] long.
        let rest: usize = chunk[2..].iter().product();
        let (row, own) = (whole[1] * rest, chunk[1] * rest);
        let mut mine = Vec::with_capacity(chunk.iter().product());
        for outer in values.chunks(row) {
            mine.extend_from_slice(&outer[rank * own..(rank + 1) * own]);
        }
        Tensor::<D>::from_data(TensorData::new(mine, chunk), device)
    }
}
