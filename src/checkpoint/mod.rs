//! Megatron-layout checkpoints: `DIR/iter_0000500/mp_rank_00/model_optim_rng.safetensors` and
//! `DIR/latest_checkpointed_iteration.txt`.
//!
//! One file per tensor-parallel rank (`mp_rank_TT`; `mp_rank_TT_PPP` per pipeline stage, as
//! Megatron names them) holds that rank's shard of the model and of the optimizer moments,
//! and the training state (iteration, consumed samples, optimizer steps, model shape, TP and
//! PP sizes). Parameters keep their whole-model names on every stage. Loading joins the shards
//! and re-splits them for the loading run's TP size and takes each layer from the stage that
//! saved it, so a checkpoint saved at one layout loads at any other; the files are mapped
//! and read one tensor at a time (at the saved size each rank reads only its own parts). The iteration directory is written under a
//! temporary name and renamed, and the `latest` file is replaced last, so a kill during a save
//! leaves the previous checkpoint usable.

pub mod convert;
pub mod format;
mod load;
pub mod megatron_args;
pub mod megatron_checkpoint;
pub mod megatron_legacy_names;
pub mod megatron_optimizer;
pub mod megatron_optimizer_save;
pub mod megatron_tensors;
pub mod megatron_torch;
pub mod megatron_torch_save;
pub mod open;
pub mod pickle;
mod save;
pub mod tensor_file;
pub mod torch_dist;
pub mod torch_save;
mod write;

pub use format::CheckpointFormat;
pub use load::{load_checkpoint, read_full_checkpoint, read_full_model, FullCheckpoint};
pub use open::{load_model, load_model_shard, saved_model, Checkpoint};
pub use write::{RunRecord, SaveFormat, SavedModel, SavedRank};

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::model::GptConfig;
use crate::optim::{GradScalerState, NamedMoments};

/// Megatron's tracker file.
pub const TRACKER_FILE: &str = "latest_checkpointed_iteration.txt";
pub(crate) const CHECKPOINT_FILE: &str = "model_optim_rng.safetensors";

/// Where training stands, saved with the weights.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrainState {
    /// Iterations completed.
    pub iteration: u64,
    /// Iterations skipped for overflowing gradients (no update, no learning-rate step).
    pub skipped_iterations: u64,
    /// The learning-rate scheduler's steps: the samples of the iterations that updated the
    /// weights (Megatron's `OptimizerParamScheduler.num_steps`).
    pub scheduler_steps: u64,
    /// Training samples consumed.
    pub consumed_train_samples: u64,
    /// Validation samples consumed (evaluations continue through the validation set).
    pub consumed_valid_samples: u64,
}

/// Where one model-parallel rank's file sits: its tensor-parallel rank, and its pipeline
/// stage when there is more than one (Megatron's `mp_rank_TT` or `mp_rank_TT_PPP`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardPlace {
    /// Tensor-parallel rank.
    pub tp: usize,
    /// Tensor-parallel size.
    pub tp_size: usize,
    /// Pipeline stage.
    pub pp: usize,
    /// Pipeline size.
    pub pp_size: usize,
}

impl ShardPlace {
    /// Tensor-parallel rank `tp` of `tp_size`, of a model without pipeline stages.
    pub fn tensor(tp: usize, tp_size: usize) -> Self {
        Self {
            tp,
            tp_size,
            pp: 0,
            pp_size: 1,
        }
    }

    fn dir_name(&self) -> String {
        if self.pp_size == 1 {
            format!("mp_rank_{:02}", self.tp)
        } else {
            format!("mp_rank_{:02}_{:03}", self.tp, self.pp)
        }
    }
}

/// The directory of one rank's checkpoint at `iteration`.
pub fn checkpoint_dir(root: &Path, iteration: u64, place: ShardPlace) -> PathBuf {
    root.join(format!("iter_{iteration:07}"))
        .join(place.dir_name())
}

/// Where `iteration` is written before it is renamed into place (a kill during a save leaves
/// the previous checkpoint usable).
fn staging_dir(root: &Path, iteration: u64) -> PathBuf {
    root.join(format!(".iter_{iteration:07}.tmp"))
}

/// A fresh, empty staging directory for `iteration` under `root` (one left by a killed save
/// is removed first).
fn begin_iteration(root: &Path, iteration: u64) -> Result<PathBuf> {
    let staging = staging_dir(root, iteration);
    std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    if staging.exists() {
        std::fs::remove_dir_all(&staging)
            .with_context(|| format!("removing a stale {}", staging.display()))?;
    }
    std::fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;
    Ok(staging)
}

/// Renames `iteration`'s complete staging directory to `iter_NNNNNNN` (replacing one saved
/// before at the same iteration), then names it in the tracker file, replaced atomically.
fn publish_iteration(root: &Path, iteration: u64) -> Result<()> {
    use std::io::Write;
    let final_dir = root.join(format!("iter_{iteration:07}"));
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir)
            .with_context(|| format!("replacing {}", final_dir.display()))?;
    }
    std::fs::rename(staging_dir(root, iteration), &final_dir)
        .with_context(|| format!("renaming to {}", final_dir.display()))?;
    let tracker_path = root.join(TRACKER_FILE);
    let mut tracker = crate::util::atomic_file::temp_file_beside(&tracker_path)?;
    writeln!(tracker, "{iteration}")?;
    tracker.persist(tracker_path)?;
    Ok(())
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

/// The optimizer state a checkpoint holds, by parameter name, whatever optimizer (replicated
/// or distributed over data-parallel ranks) kept it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptimizerState {
    /// Steps taken.
    pub steps: u64,
    /// Adam's moments of this tensor-parallel rank's shard of each parameter.
    pub moments: Vec<NamedMoments>,
    /// The loss scaler's state (mixed precision with a scaler only).
    pub grad_scaler: Option<GradScalerState>,
}

/// Each parameter's partition dimension by name (`None`: whole on every rank).
type PartitionDims = HashMap<String, Option<usize>>;

/// What a checkpoint holds besides the weights.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedCheckpoint {
    /// The training state.
    pub state: TrainState,
    /// Optimizer steps taken.
    pub optimizer_steps: u64,
    /// The loss scaler's state, if the run had one.
    pub grad_scaler: Option<GradScalerState>,
    /// The model shape it was saved with.
    pub config: GptConfig,
    /// The tensor-parallel size it was saved with.
    pub tensor_model_parallel_size: usize,
    /// The pipeline-parallel size it was saved with.
    pub pipeline_model_parallel_size: usize,
}

/// Refuses, in one line, to load a checkpoint of one model into another. What must match is
/// the shape (layers, hidden size, heads, positions, FFN width) and the architecture (norm,
/// positions, activation, biases, query groups, head width, epsilon); the padded vocabulary may differ (rows are cut or
/// zero-padded), and dropout, init std and the fusion switches are settings of the run.
pub fn check_same_model(root: &Path, saved: &GptConfig, wanted: &GptConfig) -> Result<()> {
    let shape = |c: &GptConfig| {
        format!(
            "{} layers, hidden size {}, {} heads, {} positions, FFN width {}",
            c.num_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.max_position_embeddings,
            c.ffn_size()
        )
    };
    if shape(saved) != shape(wanted) {
        bail!(
            "--load {}: the checkpoint is a model of {}, this run asks for {}",
            root.display(),
            shape(saved),
            shape(wanted)
        );
    }
    let math = |c: &GptConfig| {
        format!(
            "{}, {} query groups of width {}, norm epsilon {}",
            c.architecture(),
            c.query_groups(),
            c.head_dim(),
            c.layernorm_epsilon
        )
    };
    if math(saved) != math(wanted) {
        bail!(
            "--load {}: the checkpoint's model is {}; this run asks for {}",
            root.display(),
            math(saved),
            math(wanted)
        );
    }
    Ok(())
}
