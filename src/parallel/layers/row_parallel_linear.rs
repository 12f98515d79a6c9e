//! `y = x·W + b` with `W` split along its input dimension.

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

use super::weight_matmul;
use crate::comm::Group;
use crate::parallel::mappings::{
    copy_to_region, reduce_from_region, reduce_scatter_to_sequence_region, scatter_to_region,
};
use crate::parallel::sharding::{init_shard, DeclaresHoldings, Holding};
use crate::util::init::Init;

/// Megatron's `RowParallelLinear`: each rank holds `in / N` input rows of the weight and
/// multiplies its part of the input; the partial products are all-reduced and the bias,
/// replicated on every rank, is added after the reduce.
#[derive(Module, Debug)]
pub struct RowParallelLinear {
    /// `[in / N, out]`.
    pub weight: Param<Tensor<2>>,
    /// `[out]`, the same on every rank.
    pub bias: Option<Param<Tensor<1>>>,
    /// The input already arrives split (from a column-parallel layer); otherwise it is
    /// scattered first.
    #[module(skip)]
    pub input_is_parallel: bool,
    /// The output is reduce-scattered over the sequence instead of all-reduced: each rank
    /// keeps its sequence chunk (Megatron's `--sequence-parallel`). The bias, whole on every
    /// rank, then sees only the chunk, so its gradient is summed over the group.
    #[module(skip)]
    pub sequence_parallel: bool,
    /// The tensor-parallel group.
    #[module(skip)]
    pub group: Group,
}

/// The input rows are split; the bias is added after the all-reduce, whole on every rank.
impl DeclaresHoldings for RowParallelLinear {
    const HOLDINGS: &'static [(&'static str, Holding)] =
        &[("weight", Holding::Split(0)), ("bias", Holding::Duplicated)];
}

impl RowParallelLinear {
    /// This rank's rows of an `in → out` layer with Normal(0, `std`) weights and zero bias;
    /// `in` must be divisible by the group size.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        d_in: usize,
        d_out: usize,
        std: f64,
        seed: u64,
        name: &str,
        input_is_parallel: bool,
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
            input_is_parallel,
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

    /// The same layer leaving sequence chunks as output when `on` (`--sequence-parallel`).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// Applies the layer over the last dimension of `x`; the output is whole on every rank (or
    /// this rank's sequence chunk of `[batch, seq, hidden]` under sequence parallelism).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match self.forward_skip_bias(x) {
            (y, Some(bias)) => y + bias.unsqueeze(),
            (y, None) => y,
        }
    }

    /// [`Self::forward`] without the bias added, and the bias (Megatron's `skip_bias_add`:
    /// the caller adds it inside a fused bias-dropout-add).
    pub fn forward_skip_bias<const D: usize>(
        &self,
        x: Tensor<D>,
    ) -> (Tensor<D>, Option<Tensor<1>>) {
        let x = if self.input_is_parallel {
            x
        } else {
            scatter_to_region(x, &self.group)
        };
        let partial = weight_matmul(x, self.weight.val());
        if !self.sequence_parallel {
            let y = reduce_from_region(partial, &self.group);
            return (y, self.bias.as_ref().map(|bias| bias.val()));
        }
        let y = reduce_scatter_to_sequence_region(partial, &self.group);
        let bias = self
            .bias
            .as_ref()
            .map(|bias| copy_to_region(bias.val(), &self.group));
        (y, bias)
    }
}
