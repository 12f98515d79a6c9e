//! `y = x·W + b` with `W` split along its output dimension.

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

use super::weight_matmul;
use crate::comm::Group;
use crate::parallel::mappings::{copy_to_region, gather_from_region, gather_from_sequence_region};
use crate::parallel::sharding::{init_shard, DeclaresHoldings, Holding};
use crate::util::init::Init;

/// Megatron's `ColumnParallelLinear`: each rank holds `out / N` output columns.
///
/// The input is copied into the parallel region (its gradient is all-reduced on the way
/// back); the output stays split unless `gather_output`.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear {
    /// `[in, out / N]`.
    pub weight: Param<Tensor<2>>,
    /// `[out / N]`.
    pub bias: Option<Param<Tensor<1>>>,
    /// All-gather the output columns (otherwise each rank keeps its own).
    #[module(skip)]
    pub gather_output: bool,
    /// The input arrives as this rank's chunk of the sequence and is all-gathered first
    /// (its gradient reduce-scattered back): Megatron's `--sequence-parallel`.
    #[module(skip)]
    pub sequence_parallel: bool,
    /// The tensor-parallel group.
    #[module(skip)]
    pub group: Group,
}

/// The output columns are split: the weight's dimension 1, and the bias.
impl DeclaresHoldings for ColumnParallelLinear {
    const HOLDINGS: &'static [(&'static str, Holding)] =
        &[("weight", Holding::Split(1)), ("bias", Holding::Split(0))];
}

impl ColumnParallelLinear {
    /// This rank's columns of an `in → out` layer with Normal(0, `std`) weights and zero
    /// bias; `name` seeds the master weights. `out` must be divisible by the group size.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        d_in: usize,
        d_out: usize,
        std: f64,
        seed: u64,
        name: &str,
        gather_output: bool,
        group: &Group,
        device: &Device,
    ) -> Self {
        Self {
            weight: Param::from_tensor(init_shard(
                Init::Normal(std),
                [d_in, d_out],
                seed,
                &format!("{name}.weight"),
                Self::holding("weight").partition_dim(),
                group,
                device,
            )),
            bias: Some(Param::from_tensor(init_shard(
                Init::Zeros,
                [d_out],
                seed,
                &format!("{name}.bias"),
                Self::holding("bias").partition_dim(),
                group,
                device,
            ))),
            gather_output,
            sequence_parallel: false,
            group: group.clone(),
        }
    }

    /// The same layer without its bias (`--disable-bias-linear`) when `bias` is false.
    pub fn with_bias(mut self, bias: bool) -> Self {
        if !bias {
            self.bias = None;
        }
        self
    }

    /// The same layer taking sequence chunks as input when `on` (`--sequence-parallel`).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// Applies the layer over the last dimension of `x` (whole on every rank, or this rank's
    /// sequence chunk of `[batch, seq, hidden]` under sequence parallelism).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_in_region(self.enter_region(x))
    }

    /// `x` as the layer's matmul takes it: copied into the parallel region (its gradient
    /// all-reduced on the way back), or all-gathered over the sequence under sequence
    /// parallelism (its gradient reduce-scattered). Layers that read the same input (SwiGLU's
    /// two halves) enter it once and share it.
    pub fn enter_region<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        if self.sequence_parallel {
            gather_from_sequence_region(x, &self.group)
        } else {
            copy_to_region(x, &self.group)
        }
    }

    /// [`Self::forward`] without the bias added, and the bias (Megatron's `skip_bias_add`:
    /// the caller adds it inside a fused activation). A layer that gathers its output adds
    /// its bias before the gather, and returns none.
    pub fn forward_skip_bias<const D: usize>(
        &self,
        x: Tensor<D>,
    ) -> (Tensor<D>, Option<Tensor<1>>) {
        if self.gather_output {
            return (self.forward(x), None);
        }
        let y = weight_matmul(self.enter_region(x), self.weight.val());
        (y, self.bias.as_ref().map(|bias| bias.val()))
    }

    /// The layer on an input already in the region ([`Self::enter_region`]).
    pub fn forward_in_region<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let mut y = weight_matmul(x, self.weight.val());
        if let Some(bias) = &self.bias {
            y = y + bias.val().unsqueeze();
        }
        if self.gather_output {
            gather_from_region(y, &self.group)
        } else {
            y
        }
    }
}
