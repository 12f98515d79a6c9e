//! Reading ferrotron's checkpoints at any layout: the shards joined along each parameter's
//! partition dimension and re-split for the loading run, each layer taken from the stage
//! that saved it. Megatron's formats have readers of their own; [`super::open`] picks.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use burn::tensor::Device;

use super::tensor_file::{HostTensor, TensorFile};
use super::{
    check_same_model, checkpoint_dir, latest_iteration, LoadedCheckpoint, OptimizerState,
    PartitionDims, ShardPlace, TrainState, CHECKPOINT_FILE, TRACKER_FILE,
};
use crate::comm::Group;
use crate::model::named_parameters::load_named_parameters;
use crate::model::{Gpt, GptConfig, StageLayers};
use crate::optim::NamedMoments;
use crate::parallel::{holdings::parameter_holdings, sharding::shard_of};

/// First and second moments of one parameter as found in a file (either may be missing).
type SavedMoments = (Option<Vec<f32>>, Option<Vec<f32>>);

/// The parameter a checkpoint key belongs to (`model.X`, `optimizer.exp_avg.X`,
/// `optimizer.exp_avg_sq.X` → `X`).
fn parameter_of(key: &str) -> &str {
    ["model.", "optimizer.exp_avg.", "optimizer.exp_avg_sq."]
        .iter()
        .find_map(|p| key.strip_prefix(p))
        .unwrap_or(key)
}

/// The shard files of a saved checkpoint, mapped, read a tensor at a time: a rank joins (or
/// takes) one parameter at a time, so loading holds one whole tensor beyond its own shards,
/// never the whole checkpoint (which, per rank of a 4-thread run of a 345M model, would be
/// 4 × 4 GB).
struct SavedCheckpoint {
    iter_dir: PathBuf,
    /// The files, `[pipeline stage][tensor-parallel rank]`.
    shards: Vec<Vec<TensorFile>>,
    /// Each tensor's stage (the first that holds it: the tied word embedding is on the first
    /// and the last, equal).
    stage_of: HashMap<String, usize>,
    info: LoadedCheckpoint,
}

/// Opens every `mp_rank_*` shard of the latest checkpoint under `root`. `None` when there is
/// no checkpoint.
fn open_checkpoint(root: &Path) -> Result<Option<SavedCheckpoint>> {
    let Some(iteration) = latest_iteration(root)? else {
        return Ok(None);
    };
    let iter_dir = root.join(format!("iter_{iteration:07}"));
    let shards = open_shard_files(root, iteration)?;
    let mut stage_of = HashMap::new();
    for (pp, stage) in shards.iter().enumerate() {
        for name in stage[0].names()? {
            stage_of.entry(name).or_insert(pp);
        }
    }
    let info = read_info(&shards, &iter_dir)?;
    Ok(Some(SavedCheckpoint {
        iter_dir,
        shards,
        stage_of,
        info,
    }))
}

/// The model ferrotron's latest checkpoint under `root` was saved with. `None` without a
/// checkpoint.
pub(super) fn saved_config(root: &Path) -> Result<Option<GptConfig>> {
    Ok(open_checkpoint(root)?.map(|saved| saved.info.config))
}

/// The shard files of checkpoint `iteration` under `root`, `[pipeline stage][tensor-parallel
/// rank]`, found by their names.
fn open_shard_files(root: &Path, iteration: u64) -> Result<Vec<Vec<TensorFile>>> {
    // Stages are `mp_rank_TT_PPP` when the run had pipeline stages, `mp_rank_TT` otherwise.
    let pipelined = checkpoint_dir(
        root,
        iteration,
        ShardPlace {
            tp: 0,
            tp_size: 1,
            pp: 0,
            pp_size: 2,
        },
    )
    .exists();
    // Only the naming depends on the size here; the metadata says the real one.
    let pp_size = if pipelined { 2 } else { 1 };
    let mut shards: Vec<Vec<TensorFile>> = Vec::new();
    for pp in 0.. {
        let file = |tp| {
            checkpoint_dir(
                root,
                iteration,
                ShardPlace {
                    tp,
                    tp_size: 1,
                    pp,
                    pp_size,
                },
            )
            .join(CHECKPOINT_FILE)
        };
        if pp > 0 && !file(0).exists() {
            break;
        }
        let mut stage = Vec::new();
        for tp in 0.. {
            let path = file(tp);
            if tp > 0 && !path.exists() {
                break;
            }
            stage.push(TensorFile::open(&path)?);
        }
        shards.push(stage);
        if !pipelined {
            break;
        }
    }
    Ok(shards)
}

/// What the shard files' metadata says (the first file's), checked against the files found.
fn read_info(shards: &[Vec<TensorFile>], iter_dir: &Path) -> Result<LoadedCheckpoint> {
    let shards0 = &shards[0];
    let metadata = shards0[0].metadata()?;
    let path0 = shards0[0].path().to_path_buf();
    let get = |key: &str| -> Result<String> {
        metadata
            .get(key)
            .cloned()
            .with_context(|| format!("{}: metadata has no {key}", path0.display()))
    };
    let parse = |key: &str| -> Result<u64> {
        get(key)?
            .parse::<u64>()
            .with_context(|| format!("{}: bad {key}", path0.display()))
    };
    let saved_size = metadata
        .get("tensor_model_parallel_size")
        .map_or(Ok(1), |v| v.parse::<usize>())
        .with_context(|| format!("{}: bad tensor_model_parallel_size", path0.display()))?;
    let saved_stages = metadata
        .get("pipeline_model_parallel_size")
        .map_or(Ok(1), |v| v.parse::<usize>())
        .with_context(|| format!("{}: bad pipeline_model_parallel_size", path0.display()))?;
    if saved_stages != shards.len() || shards.iter().any(|s| s.len() != saved_size) {
        bail!(
            "{}: saved with {saved_size} tensor-parallel ranks × {saved_stages} pipeline stages \
             but the mp_rank_* files there are {:?} per stage",
            iter_dir.display(),
            shards.iter().map(Vec::len).collect::<Vec<_>>()
        );
    }
    let config = GptConfig::from_json(&get("model_config")?)
        .with_context(|| format!("{}: bad model_config", path0.display()))?;
    let optional = |key: &str| match metadata.get(key) {
        Some(_) => parse(key).map(Some),
        None => Ok(None),
    };
    let iteration = parse("iteration")?;
    let skipped_iterations = optional("skipped_iterations")?.unwrap_or(0);
    let consumed_train_samples = parse("consumed_train_samples")?;
    // Checkpoints from before the scheduler's steps were saved trained at one batch size.
    let scheduler_steps = optional("scheduler_steps")?.unwrap_or(
        consumed_train_samples / iteration.max(1) * (iteration - skipped_iterations.min(iteration)),
    );
    Ok(LoadedCheckpoint {
        state: TrainState {
            iteration,
            skipped_iterations,
            scheduler_steps,
            consumed_train_samples,
            consumed_valid_samples: parse("consumed_valid_samples")?,
        },
        optimizer_steps: parse("optimizer_steps")?,
        grad_scaler: metadata
            .get("grad_scaler")
            .map(|json| serde_json::from_str(json))
            .transpose()
            .with_context(|| format!("{}: bad grad_scaler", path0.display()))?,
        config,
        tensor_model_parallel_size: saved_size,
        pipeline_model_parallel_size: saved_stages,
    })
}

impl SavedCheckpoint {
    /// How the saving run's layers split each parameter: from the metadata, or, for a
    /// checkpoint written before it was recorded there, read off a whole model of the saved
    /// shape built on the CPU (a model's holdings do not depend on the tensor-parallel size).
    fn partition_dims(&self) -> Result<PartitionDims> {
        let file = &self.shards[0][0];
        if let Some(json) = file.metadata()?.get("partition_dims") {
            return serde_json::from_str(json)
                .with_context(|| format!("{}: bad partition_dims", file.path().display()));
        }
        let config = &self.info.config;
        let model = config
            .init_stage(
                0,
                &Group::single(),
                &StageLayers::whole(config.num_layers),
                &Device::flex(),
            )
            .map_err(anyhow::Error::msg)?;
        Ok(parameter_holdings(&model)
            .into_iter()
            .map(|p| (p.name, p.holding.partition_dim()))
            .collect())
    }

    /// The tensor names (of every stage), sorted.
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.stage_of.keys().cloned().collect();
        names.sort();
        names
    }

    /// The files of the stage that holds `key`.
    fn stage(&self, key: &str) -> &[TensorFile] {
        &self.shards[self.stage_of.get(key).copied().unwrap_or(0)]
    }

    /// Shard `rank`'s part of tensor `key`. Moments were once saved flat: they get their
    /// parameter's shape.
    fn part(&self, key: &str, rank: usize) -> Result<HostTensor> {
        let file = &self.stage(key)[rank];
        let mut t = file
            .read(key)?
            .with_context(|| format!("{}: no {key}", file.path().display()))?;
        if !key.starts_with("model.") {
            if let Some(shape) = file.shape(&format!("model.{}", parameter_of(key)))? {
                if shape.iter().product::<usize>() == t.values.len() {
                    t.shape = shape;
                }
            }
        }
        Ok(t)
    }

    /// Tensor `key` whole: the shards' parts joined along the parameter's partition
    /// dimension (from `dims`).
    fn whole(&self, key: &str, dims: &PartitionDims) -> Result<HostTensor> {
        let dim = dims.get(parameter_of(key)).copied().flatten();
        let tp = self.info.tensor_model_parallel_size;
        if dim.is_none() || tp == 1 {
            return self.part(key, 0);
        }
        let parts = (0..tp)
            .map(|rank| self.part(key, rank))
            .collect::<Result<Vec<_>>>()?;
        HostTensor::concat(&parts, dim.unwrap())
            .map_err(|e| anyhow::anyhow!("{}: {key}: {e}", self.iter_dir.display()))
    }
}

/// A whole checkpoint with every tensor joined from its rank shards.
pub struct FullCheckpoint {
    /// State, shape, saved TP size.
    pub info: LoadedCheckpoint,
    /// `model.*`, `optimizer.exp_avg.*`, `optimizer.exp_avg_sq.*`, whole.
    pub tensors: HashMap<String, HostTensor>,
}

/// Reads every `mp_rank_*` shard of the latest checkpoint under `root` and joins them along
/// each parameter's partition dimension. `None` when there is no checkpoint.
pub fn read_full_checkpoint(root: &Path) -> Result<Option<FullCheckpoint>> {
    read_full(root, |_| true)
}

/// [`read_full_checkpoint`] without the optimizer state: only the `model.*` tensors are
/// joined (and read), for conversions that write weights alone.
pub fn read_full_model(root: &Path) -> Result<Option<FullCheckpoint>> {
    read_full(root, |key| key.starts_with("model."))
}

/// The latest checkpoint's tensors whose keys `wanted` accepts, each joined whole.
fn read_full(root: &Path, wanted: impl Fn(&str) -> bool) -> Result<Option<FullCheckpoint>> {
    let Some(saved) = open_checkpoint(root)? else {
        return Ok(None);
    };
    let dims = saved.partition_dims()?;
    let mut tensors = HashMap::new();
    for key in saved.names().into_iter().filter(|k| wanted(k)) {
        let whole = saved.whole(&key, &dims)?;
        tensors.insert(key, whole);
    }
    Ok(Some(FullCheckpoint {
        info: saved.info,
        tensors,
    }))
}

/// Reads the latest checkpoint under `root` and builds `group`'s rank of pipeline stage
/// `stage` of the model from it (`None`: the whole model), on `device`, resharding when it was
/// saved with another tensor-parallel size and taking each layer from whichever stage saved
/// it. The model has the shape of `config` (default: the saved one); a different padded
/// vocabulary cuts or zero-pads the embedding rows. Also returns the optimizer state of this
/// rank's shards. `None` when there is no checkpoint.
pub fn load_checkpoint(
    root: &Path,
    config: Option<&GptConfig>,
    device: &Device,
    group: &Group,
    stage: Option<&StageLayers>,
) -> Result<Option<(Gpt, LoadedCheckpoint, OptimizerState)>> {
    load_parts(root, config, device, group, stage, true)
}

/// This rank's shard of the whole model of ferrotron's latest checkpoint under `root`, for
/// inference (any saved layout, resharded to `group`), without reading the optimizer's
/// moments (twice the model's size); an error when there is none.
pub(super) fn load_model_shard(
    root: &Path,
    device: &Device,
    group: &Group,
) -> Result<(Gpt, LoadedCheckpoint)> {
    load_parts(root, None, device, group, None, false)?
        .map(|(model, info, _)| (model, info))
        .with_context(|| format!("no checkpoint in {} (no {TRACKER_FILE})", root.display()))
}

/// [`load_checkpoint`], the optimizer's moments read only `with_optimizer` (they are twice
/// the model's size).
pub(super) fn load_parts(
    root: &Path,
    config: Option<&GptConfig>,
    device: &Device,
    group: &Group,
    stage: Option<&StageLayers>,
    with_optimizer: bool,
) -> Result<Option<(Gpt, LoadedCheckpoint, OptimizerState)>> {
    let Some(saved) = open_checkpoint(root)? else {
        return Ok(None);
    };
    if let Some(wanted) = config {
        check_same_model(root, &saved.info.config, wanted)?;
    }
    let config = config.unwrap_or(&saved.info.config).clone();
    // Saved at this layout: each rank reads its own shard's parts as they are.
    let same_layout = saved.info.tensor_model_parallel_size == group.size()
        && saved.info.config.padded_vocab_size == config.padded_vocab_size;
    let whole_model = StageLayers::whole(config.num_layers);
    let model = config
        .init_stage(0, group, stage.unwrap_or(&whole_model), device)
        .map_err(anyhow::Error::msg)?;
    let dims: PartitionDims = parameter_holdings(&model)
        .into_iter()
        .map(|p| (p.name, p.holding.partition_dim()))
        .collect();
    let mut values = HashMap::new();
    let mut moments: HashMap<String, SavedMoments> = HashMap::new();
    for key in saved.names() {
        let param = parameter_of(&key).to_owned();
        if !dims.contains_key(&param) || !(with_optimizer || key.starts_with("model.")) {
            // Another pipeline stage's part, or optimizer state inference does not need.
            continue;
        }
        let t = if same_layout {
            saved.part(&key, group.rank())?
        } else {
            let mut t = saved.whole(&key, &dims)?;
            // The vocabulary dimension follows this run's padding (rows cut or zero-padded).
            let vocab_dim = match param.as_str() {
                "word_embeddings.weight" => Some(0),
                "output_layer.weight" => Some(1),
                _ => None,
            };
            if let Some(dim) = vocab_dim {
                if t.shape[dim] != config.padded_vocab_size {
                    t = t.resized(dim, config.padded_vocab_size);
                }
            }
            shard_of(&t, dims[&param], group.rank(), group.size())
                .map_err(|e| anyhow::anyhow!("{}: {key}: {e}", root.display()))?
        };
        if key.starts_with("model.") {
            values.insert(param, (t.shape, t.values));
        } else if key.starts_with("optimizer.exp_avg.") {
            moments.entry(param).or_default().0 = Some(t.values);
        } else if key.starts_with("optimizer.exp_avg_sq.") {
            moments.entry(param).or_default().1 = Some(t.values);
        }
    }
    let (model, missing) = load_named_parameters(model, &values);
    if !missing.is_empty() {
        bail!(
            "{}: no weights for {} (and {} more)",
            root.display(),
            missing[0],
            missing.len() - 1
        );
    }
    let optimizer = OptimizerState {
        steps: saved.info.optimizer_steps,
        grad_scaler: saved.info.grad_scaler.clone(),
        moments: moments
            .into_iter()
            .filter_map(|(name, (m, v))| Some(NamedMoments { name, m: m?, v: v? }))
            .collect(),
    };
    Ok(Some((model, saved.info, optimizer)))
}
