//! Which part of each parameter a rank holds.
//!
//! Every parameter is first built whole (the *master* tensor, the same for every
//! tensor-parallel size) and each rank keeps one equal chunk of it along its partition
//! dimension, as Megatron's CPU initialization does. The parallel layers declare how they hold
//! each parameter ([`DeclaresHoldings`], Megatron's `tensor_model_parallel` / `partition_dim`
//! attributes) and build their shards from that declaration; [`super::holdings`] reads the
//! declarations off a built model for checkpoints (which store the chunks, one file per rank),
//! the gradient norm and the optimizers. Every other parameter is whole on every rank.

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::comm::Group;
use crate::util::host_tensor::HostTensor;
use crate::util::init::{master_values, Init};

/// How this rank holds a parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Holding {
    /// Split over the tensor-parallel ranks along this dimension (weights are stored
    /// `[in, out]`): each rank holds one equal chunk.
    Split(usize),
    /// Whole on every tensor-parallel rank (LayerNorms, position embedding, row-parallel
    /// biases): its gradient is the same on every rank, so the norm counts it once.
    Duplicated,
}

impl Holding {
    /// The partition dimension, `None` when duplicated.
    pub fn partition_dim(self) -> Option<usize> {
        match self {
            Self::Split(dim) => Some(dim),
            Self::Duplicated => None,
        }
    }
}

/// A layer that splits parameters over the tensor-parallel ranks: how it holds each of its
/// parameter fields. Its constructor builds the shards from this table.
pub trait DeclaresHoldings {
    /// `(field, holding)` for every parameter field.
    const HOLDINGS: &'static [(&'static str, Holding)];

    /// The holding of parameter field `field` (duplicated if undeclared).
    fn holding(field: &str) -> Holding {
        Self::HOLDINGS
            .iter()
            .find(|(f, _)| *f == field)
            .map_or(Holding::Duplicated, |(_, h)| *h)
    }
}

/// Rank `rank`'s chunk of `full` along `dim` (all of it when `dim` is `None`).
pub fn shard_of(
    full: &HostTensor,
    dim: Option<usize>,
    rank: usize,
    size: usize,
) -> Result<HostTensor, String> {
    match dim {
        Some(d) => full.chunk(d, size, rank),
        None => Ok(full.clone()),
    }
}

/// This rank's shard of parameter `name`, initialized as the master tensor of `shape`
/// would be, on `device`.
pub fn init_shard<const D: usize>(
    init: Init,
    shape: [usize; D],
    seed: u64,
    name: &str,
    dim: Option<usize>,
    group: &Group,
    device: &Device,
) -> Tensor<D> {
    let full = HostTensor::new(shape.to_vec(), master_values(init, &shape, seed, name));
    let part = shard_of(&full, dim, group.rank(), group.size())
        .unwrap_or_else(|e| panic!("{name}: {e} (validated before building the model)"));
    let local: [usize; D] = part.shape.clone().try_into().expect("same rank");
    Tensor::from_data(TensorData::new(part.values, local), device)
}

/// Global vocabulary ids as columns of the shard `[start, start + len)`: the local index
/// (0 where the id lies outside the shard, so it is always a valid index) and the mask of ids
/// outside. Used by the vocab-parallel embedding and cross-entropy.
pub fn vocab_shard_index<const D: usize>(
    ids: Tensor<D, Int>,
    start: usize,
    len: usize,
) -> (Tensor<D, Int>, Tensor<D, Bool>) {
    let local = ids.sub_scalar(start as i64);
    let outside = local
        .clone()
        .lower_elem(0)
        .bool_or(local.clone().greater_equal_elem(len as i64));
    (local.mask_fill(outside.clone(), 0), outside)
}
