//! Megatron-layout checkpoints: `DIR/iter_0000500/mp_rank_00/model_optim_rng.safetensors` and
//! `DIR/latest_checkpointed_iteration.txt`.
//!
//! One file holds the model, the optimizer moments and the training state (iteration,
//! consumed samples, optimizer steps, model shape). The iteration directory is written under a
//! temporary name and renamed, and the `latest` file is replaced last, so a kill during a save
//! leaves the previous checkpoint usable.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use burn::tensor::Device;

use super::optimizer::NamedMoments;
use super::tensor_file::{read_tensors, write_tensors, HostTensor};
use super::AdamW;
use crate::model::named_parameters::{load_named_parameters, named_parameters, parameter_names};
use crate::model::{Gpt, GptConfig};

/// Megatron's tracker file.
pub const TRACKER_FILE: &str = "latest_checkpointed_iteration.txt";
const CHECKPOINT_FILE: &str = "model_optim_rng.safetensors";

/// Where training stands, saved with the weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrainState {
    /// Iterations completed.
    pub iteration: u64,
    /// Training samples consumed.
    pub consumed_train_samples: u64,
    /// Validation samples consumed (evaluations continue through the validation set).
    pub consumed_valid_samples: u64,
}

/// The directory of one rank's checkpoint at `iteration`.
pub fn checkpoint_dir(root: &Path, iteration: u64, rank: usize) -> PathBuf {
    root.join(format!("iter_{iteration:07}"))
        .join(format!("mp_rank_{rank:02}"))
}

/// The iteration named by `root/latest_checkpointed_iteration.txt`, if there is one.
pub fn latest_iteration(root: &Path) -> Result<Option<u64>> {
    let tracker = root.join(TRACKER_FILE);
    match std::fs::read_to_string(&tracker) {
        Ok(text) => {
            let text = text.trim();
            let iteration = text.parse().with_context(|| {
                format!(
                    "{}: expected an iteration number, found {text:?}",
                    tracker.display()
                )
            })?;
            Ok(Some(iteration))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", tracker.display())),
    }
}

fn name_table(model: &Gpt) -> Vec<(burn::module::ParamId, String)> {
    parameter_names(model)
        .into_iter()
        .map(|p| (p.id, p.name))
        .collect()
}

/// Saves model, optimizer and state under `root` (rank 0 of a single-rank run).
pub fn save_checkpoint(
    root: &Path,
    model: &Gpt,
    config: &GptConfig,
    optimizer: &AdamW,
    state: &TrainState,
) -> Result<PathBuf> {
    std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    let mut tensors: Vec<(String, HostTensor)> = named_parameters(model)
        .into_iter()
        .map(|p| {
            (
                format!("model.{}", p.name),
                HostTensor {
                    shape: p.shape,
                    values: p.values,
                },
            )
        })
        .collect();
    for m in optimizer.export(&name_table(model)) {
        let n = m.m.len();
        tensors.push((
            format!("optimizer.exp_avg.{}", m.name),
            HostTensor {
                shape: vec![n],
                values: m.m,
            },
        ));
        tensors.push((
            format!("optimizer.exp_avg_sq.{}", m.name),
            HostTensor {
                shape: vec![n],
                values: m.v,
            },
        ));
    }
    let metadata = HashMap::from([
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
        ("optimizer_steps".to_owned(), optimizer.steps().to_string()),
        ("model_config".to_owned(), serde_json::to_string(config)?),
    ]);
    let final_iter_dir = root.join(format!("iter_{:07}", state.iteration));
    let staging = tempfile::Builder::new()
        .prefix(".iter_")
        .suffix(".tmp")
        .tempdir_in(root)?;
    let rank_dir = staging.path().join("mp_rank_00");
    std::fs::create_dir_all(&rank_dir)?;
    write_tensors(&rank_dir.join(CHECKPOINT_FILE), &tensors, metadata)?;
    if final_iter_dir.exists() {
        std::fs::remove_dir_all(&final_iter_dir)
            .with_context(|| format!("replacing {}", final_iter_dir.display()))?;
    }
    let staged = staging.keep();
    std::fs::rename(&staged, &final_iter_dir)
        .with_context(|| format!("renaming to {}", final_iter_dir.display()))?;
    let tracker_path = root.join(TRACKER_FILE);
    let mut tracker = crate::atomic_file::temp_file_beside(&tracker_path)?;
    writeln!(tracker, "{}", state.iteration)?;
    tracker.persist(tracker_path)?;
    Ok(checkpoint_dir(root, state.iteration, 0))
}

/// First and second moments of one parameter as found in a file (either may be missing).
type SavedMoments = (Option<Vec<f32>>, Option<Vec<f32>>);

/// What a checkpoint holds besides the weights.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedCheckpoint {
    /// The training state.
    pub state: TrainState,
    /// Optimizer steps taken.
    pub optimizer_steps: u64,
    /// The model shape it was saved with.
    pub config: GptConfig,
}

/// Reads the latest checkpoint under `root`: the model (built on `device` from the saved
/// shape), and, when `optimizer` is given, its state. `None` when there is no checkpoint.
pub fn load_checkpoint(
    root: &Path,
    seed: u64,
    device: &Device,
    optimizer: Option<&mut AdamW>,
) -> Result<Option<(Gpt, LoadedCheckpoint)>> {
    let Some(iteration) = latest_iteration(root)? else {
        return Ok(None);
    };
    let path = checkpoint_dir(root, iteration, 0).join(CHECKPOINT_FILE);
    let (mut tensors, metadata) = read_tensors(&path)?;
    let get = |key: &str| -> Result<String> {
        metadata
            .get(key)
            .cloned()
            .with_context(|| format!("{}: metadata has no {key}", path.display()))
    };
    let parse = |key: &str| -> Result<u64> {
        get(key)?
            .parse::<u64>()
            .with_context(|| format!("{}: bad {key}", path.display()))
    };
    let config: GptConfig = serde_json::from_str(&get("model_config")?)
        .with_context(|| format!("{}: bad model_config", path.display()))?;
    let loaded = LoadedCheckpoint {
        state: TrainState {
            iteration: parse("iteration")?,
            consumed_train_samples: parse("consumed_train_samples")?,
            consumed_valid_samples: parse("consumed_valid_samples")?,
        },
        optimizer_steps: parse("optimizer_steps")?,
        config: config.clone(),
    };
    let model = config.init(seed, device).map_err(anyhow::Error::msg)?;
    let mut values = HashMap::new();
    let mut moments: HashMap<String, SavedMoments> = HashMap::new();
    for (name, t) in tensors.drain() {
        if let Some(p) = name.strip_prefix("model.") {
            values.insert(p.to_owned(), (t.shape, t.values));
        } else if let Some(p) = name.strip_prefix("optimizer.exp_avg.") {
            moments.entry(p.to_owned()).or_default().0 = Some(t.values);
        } else if let Some(p) = name.strip_prefix("optimizer.exp_avg_sq.") {
            moments.entry(p.to_owned()).or_default().1 = Some(t.values);
        }
    }
    let (model, missing) = load_named_parameters(model, &values);
    if !missing.is_empty() {
        bail!(
            "{}: no weights for {} (and {} more)",
            path.display(),
            missing[0],
            missing.len() - 1
        );
    }
    if let Some(optimizer) = optimizer {
        let state = moments
            .into_iter()
            .filter_map(|(name, (m, v))| Some(NamedMoments { name, m: m?, v: v? }))
            .collect();
        optimizer.import(
            loaded.optimizer_steps,
            state,
            &name_table(&model),
            &device.clone().inner(),
        );
    }
    Ok(Some((model, loaded)))
}

/// The model of the latest checkpoint under `root`, for inference on `device` (no optimizer);
/// an error when there is none.
pub fn load_model(root: &Path, device: &Device) -> Result<(Gpt, LoadedCheckpoint)> {
    load_checkpoint(root, 0, device, None)?
        .with_context(|| format!("no checkpoint in {} (no {TRACKER_FILE})", root.display()))
}
