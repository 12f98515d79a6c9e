//! Dropout whose masks come from ferrotron's seeded streams ([`crate::parallel::random`]),
//! not from the device's generator: reproducible across backends, resumes and
//! tensor-parallel ranks. On CubeCL devices (CUDA, wgpu) the mask is derived in the kernel
//! from the draw's key and the element index, with the bits the host draws on the CPU. A
//! tensor split over ranks along dimension 1 (the sequence under sequence parallelism, the
//! heads of the attention probabilities, a context-parallel rank's two chunks of the
//! sequence) takes its part of the whole tensor's mask.

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};

use crate::comm::Group;
use crate::parallel::context::{context_rows, ContextSplit};
use crate::parallel::random::{dropout_mask_of, dropout_mask_picked, next_dropout_key, RngRegion};

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
    /// The tensor's dimension 1 is a context-parallel rank's two chunks of the sequence
    /// (before any [`Self::chunk_of`] split): the mask is the whole sequence's at their rows.
    #[module(skip)]
    pub context: Option<ContextSplit>,
}

impl Dropout {
    /// A dropout of probability `prob` drawing from `region`'s stream.
    pub fn new(prob: f64, region: RngRegion) -> Self {
        Self {
            prob,
            region,
            chunk_of: None,
            context: None,
        }
    }

    /// The same dropout for a tensor whose sequence (dimension 1) is `split`'s part of the
    /// whole (context parallelism; `None`: the whole sequence).
    pub fn with_context(mut self, split: Option<ContextSplit>) -> Self {
        self.context = split;
        self
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
        if self.context.is_some() {
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            if crate::util::device::is_cube(&x.device()) {
                return self.context_runs_on_device(x, key);
            }
            let dims = x.dims();
            return self.forward_drawn(x, key, self.whole_of(&dims), self.picks_of(&dims));
        }
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if crate::util::device::is_cube(&x.device()) {
            // Generated on the device from the key (this rank's chunk of it), never stored;
            // the backward re-derives it.
            let slice = self.slice_of(&x.dims());
            return super::fused::dropout_slice(x, key, self.prob, slice);
        }
        if self.chunk_of.is_some() {
            let dims = x.dims();
            return self.forward_drawn(x, key, self.whole_of(&dims), self.picks_of(&dims));
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
        if fused && self.context.is_none() && crate::util::device::is_cube(&y.device()) {
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

    /// `x` times the part of draw `key`'s mask over a tensor of shape `whole` that `picks`
    /// says `x` holds (see [`dropout_mask_picked`]): for a tensor of which this rank holds
    /// part, and for the attention core under context parallelism, which takes one draw for
    /// the probabilities of both its chunks.
    pub fn forward_drawn<const D: usize>(
        &self,
        x: Tensor<D>,
        key: u64,
        whole: [usize; D],
        picks: [Vec<usize>; D],
    ) -> Tensor<D> {
        let mask = dropout_mask_picked(key, self.prob, &whole, &picks);
        let mask = Tensor::<D>::from_data(TensorData::new(mask, x.dims()), &x.device());
        let dtype = x.dtype();
        x * mask.cast(dtype)
    }

    /// [`Self::forward`] of a context-parallel rank's rows on a CubeCL device: one fused
    /// dropout per run of consecutive whole-sequence rows (a rank's two chunks, or the parts
    /// of them a sequence-parallel rank holds), each a slice of the whole tensor's draw, so
    /// the mask is derived on the device as without context parallelism.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn context_runs_on_device<const D: usize>(&self, x: Tensor<D>, key: u64) -> Tensor<D> {
        use ferrotron_kernels::launch::DrawSlice;
        let dims = x.dims();
        let (whole, rows) = (self.whole_of(&dims)[1], self.rows_of(dims[1]));
        let rest: usize = dims[2..].iter().product();
        let mut runs: Vec<(usize, usize)> = vec![]; // (first local row, first whole row)
        for (i, &row) in rows.iter().enumerate() {
            if i == 0 || rows[i - 1] + 1 != row {
                runs.push((i, row));
            }
        }
        let ends: Vec<usize> = runs.iter().skip(1).map(|r| r.0).chain([dims[1]]).collect();
        let parts = runs.iter().zip(ends).map(|(&(from, row), end)| {
            let slice = DrawSlice {
                own: ((end - from) * rest) as u32,
                row: (whole * rest) as u32,
                first: (row * rest) as u32,
            };
            let part = x.clone().narrow(1, from, end - from);
            super::fused::dropout_slice(part, key, self.prob, slice)
        });
        Tensor::cat(parts.collect(), 1)
    }

    /// The whole tensor's indices along dimension 1 of the `local` this rank holds: its chunk
    /// under [`Self::chunk_of`], mapped to the whole sequence's rows under [`Self::context`].
    pub fn rows_of(&self, local: usize) -> Vec<usize> {
        let (parts, rank) = self
            .chunk_of
            .as_ref()
            .map_or((1, 0), |g| (g.size(), g.rank()));
        let own = rank * local..(rank + 1) * local;
        match &self.context {
            Some(split) => {
                let whole = local * parts * split.size();
                let rows = context_rows(split.size(), split.group.rank(), whole);
                rows[own].to_vec()
            }
            None => own.collect(),
        }
    }

    /// The shape of the whole tensor of which this rank holds one of shape `dims`.
    fn whole_of<const D: usize>(&self, dims: &[usize; D]) -> [usize; D] {
        let mut whole = *dims;
        whole[1] *= self.chunk_of.as_ref().map_or(1, Group::size);
        whole[1] *= self.context.as_ref().map_or(1, ContextSplit::size);
        whole
    }

    /// Which whole-tensor indices a tensor of shape `dims` holds along each dimension.
    fn picks_of<const D: usize>(&self, dims: &[usize; D]) -> [Vec<usize>; D] {
        std::array::from_fn(|d| match d {
            1 => self.rows_of(dims[1]),
            _ => (0..dims[d]).collect(),
        })
    }
}
