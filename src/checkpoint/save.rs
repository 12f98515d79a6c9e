//! Writing a checkpoint: each rank's shard of the model and the optimizer state, in a staging
//! directory renamed into place, then the tracker file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Result;

use super::tensor_file::{write_tensor_refs, TensorRef};
use super::{
    begin_iteration, checkpoint_dir, publish_iteration, staging_dir, OptimizerState, PartitionDims,
    ShardPlace, TrainState, CHECKPOINT_FILE,
};
use crate::comm::Group;
use crate::model::named_parameters::named_parameters;
use crate::model::{Gpt, GptConfig};
use crate::parallel::holdings::parameter_holdings;

/// Saves this rank's shard of the model and optimizer, and the training state, under `root`
/// (`iter_XXXXXXX/mp_rank_TT[_PPP]/`, at `place`). Every
/// rank of `group` (the ranks of one model replica) calls it; its rank 0 publishes the
/// iteration directory (a rename) and then the tracker once all shards are written.
pub fn save_checkpoint(
    root: &Path,
    model: &Gpt,
    config: &GptConfig,
    optimizer: &OptimizerState,
    state: &TrainState,
    group: &Group,
    place: ShardPlace,
) -> Result<PathBuf> {
    let leader = group.rank() == 0;
    if leader {
        begin_iteration(root, state.iteration)?;
    }
    group.barrier()?;
    let staging = staging_dir(root, state.iteration);
    let params = named_parameters(model);
    let shapes: HashMap<&str, &Vec<usize>> =
        params.iter().map(|p| (p.name.as_str(), &p.shape)).collect();
    // Borrowed, not copied: the file is streamed from the optimizer's and the weights' own
    // buffers (a 345M model's state is 4 GB).
    let mut tensors: Vec<TensorRef<'_>> = Vec::new();
    for m in &optimizer.moments {
        let shape = shapes
            .get(m.name.as_str())
            .map_or_else(|| vec![m.m.len()], |s| s.to_vec());
        tensors.push(TensorRef {
            name: format!("optimizer.exp_avg.{}", m.name),
            shape: shape.clone(),
            values: &m.m,
        });
        tensors.push(TensorRef {
            name: format!("optimizer.exp_avg_sq.{}", m.name),
            shape,
            values: &m.v,
        });
    }
    for p in &params {
        tensors.push(TensorRef {
            name: format!("model.{}", p.name),
            shape: p.shape.clone(),
            values: &p.values,
        });
    }
    let metadata = metadata(model, config, optimizer, state, place)?;
    let rank_dir = staging.join(place.dir_name());
    std::fs::create_dir_all(&rank_dir)?;
    write_tensor_refs(&rank_dir.join(CHECKPOINT_FILE), &tensors, metadata)?;
    group.barrier()?;
    if leader {
        publish_iteration(root, state.iteration)?;
    }
    group.barrier()?;
    Ok(checkpoint_dir(root, state.iteration, place))
}

/// What a shard file says besides its tensors: the training state, the model's shape, the
/// layout it was saved at, and how each parameter is split.
fn metadata(
    model: &Gpt,
    config: &GptConfig,
    optimizer: &OptimizerState,
    state: &TrainState,
    place: ShardPlace,
) -> Result<HashMap<String, String>> {
    let mut metadata = HashMap::from([
        ("format".to_owned(), "ferrotron-checkpoint-1".to_owned()),
        ("iteration".to_owned(), state.iteration.to_string()),
        (
            "consumed_train_samples".to_owned(),
            state.consumed_train_samples.to_string(),
        ),
        (
            "consumed_valid_samples".to_owned(),
            state.consumed_valid_samples.to_string(),
        ),
        ("optimizer_steps".to_owned(), optimizer.steps.to_string()),
        (
            "skipped_iterations".to_owned(),
            state.skipped_iterations.to_string(),
        ),
        (
            "scheduler_steps".to_owned(),
            state.scheduler_steps.to_string(),
        ),
        ("model_config".to_owned(), serde_json::to_string(config)?),
        (
            "tensor_model_parallel_size".to_owned(),
            place.tp_size.to_string(),
        ),
        (
            "tensor_model_parallel_rank".to_owned(),
            place.tp.to_string(),
        ),
        (
            "pipeline_model_parallel_size".to_owned(),
            place.pp_size.to_string(),
        ),
        (
            "pipeline_model_parallel_rank".to_owned(),
            place.pp.to_string(),
        ),
    ]);
    if let Some(scaler) = &optimizer.grad_scaler {
        metadata.insert("grad_scaler".to_owned(), serde_json::to_string(scaler)?);
    }
    // How the ranks split each parameter, as the model's layers declare it: what joins the
    // shards again without building a model.
    let dims: PartitionDims = parameter_holdings(model)
        .into_iter()
        .map(|p| (p.name, p.holding.partition_dim()))
        .collect();
    metadata.insert("partition_dims".to_owned(), serde_json::to_string(&dims)?);
    Ok(metadata)
}
