//! Which part of each parameter a rank holds.
//!
//! Every parameter is first built whole (the *master* tensor, the same for every
//! tensor-parallel size) and each rank keeps one equal chunk of it along its partition
//! dimension, as Megatron's CPU initialization does. Checkpoints store these chunks, one file
//! per rank, and [`partition_dim`] says how to join or re-split them.

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

use crate::comm::Group;
use crate::host_tensor::HostTensor;
use crate::model::init::{master_values, Init};

/// The dimension along which parameter `name` is split across ranks, `None` when every rank
/// holds all of it (LayerNorms, position embedding, row-parallel biases).
///
/// Weights are stored `[in, out]`: column-parallel layers split dimension 1 (and their bias),
/// row-parallel layers dimension 0, the word embedding its vocabulary rows.
pub fn partition_dim(name: &str) -> Option<usize> {
    const COLUMN: [&str; 2] = [".self_attention.query_key_value.", ".mlp.dense_h_to_4h."];
    const ROW: [&str; 2] = [".self_attention.dense.weight", ".mlp.dense_4h_to_h.weight"];
    if name == "word_embeddings.weight" {
        Some(0)
    } else if COLUMN.iter().any(|c| name.contains(c)) {
        Some(if name.ends_with(".weight") { 1 } else { 0 })
    } else if ROW.iter().any(|r| name.ends_with(r)) {
        Some(0)
    } else {
        None
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
