//! Checkpoints written in a chosen format (`--ckpt-format`): the trainer hands every format the
//! same [`SavedRank`] and calls [`SaveFormat::save_rank`]; the converter and the importers hand
//! a whole model ([`SavedModel`]) to [`SaveFormat::save_model`]. A format added later
//! (Megatron's `torch_dist`) is a variant here, not a branch in each tool.

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Result};

use super::megatron_optimizer_save::MegatronAdamSettings;
use super::megatron_tensors::ParameterValues;
use super::megatron_torch_save::{
    save_megatron_torch, save_megatron_torch_rank, MegatronRun, MegatronSaveOptions, RankPart,
};
use super::save::save_checkpoint;
use super::{OptimizerState, ShardPlace, TrainState};
use crate::comm::Group;
use crate::model::named_parameters::load_named_parameters;
use crate::model::{Gpt, GptConfig};

/// The format `--save` writes, with what that format needs to know of the run.
#[derive(Clone, Debug, Default)]
pub enum SaveFormat {
    /// ferrotron's safetensors shards, the optimizer state in them.
    #[default]
    Ferrotron,
    /// `--ckpt-format torch`: Megatron-LM's `torch.save` files, with Adam's state.
    MegatronTorch(MegatronSaveOptions),
}

/// What one training rank saves, whatever the format.
pub struct SavedRank<'a> {
    /// This rank's shard of the fp32 main weights.
    pub weights: &'a Gpt,
    /// The model's shape.
    pub config: &'a GptConfig,
    /// This rank's optimizer state (gathered by name under the distributed optimizer).
    pub optimizer: &'a OptimizerState,
    /// Where training stands.
    pub state: &'a TrainState,
    /// Where this rank's file sits, and the layers its stage holds.
    pub part: RankPart<'a>,
    /// What the run was beyond the model (Megatron's `args` record it; ferrotron's format
    /// records the model and the training state only).
    pub run: RunRecord,
}

/// A whole model to write at a chosen layout, without optimizer state (a converted or imported
/// checkpoint).
pub struct SavedModel<'a> {
    /// Every parameter, whole, by ferrotron's name.
    pub values: &'a ParameterValues,
    /// The model's shape.
    pub config: &'a GptConfig,
    /// Where training stands.
    pub state: &'a TrainState,
    /// Tensor-parallel ranks and pipeline stages to write.
    pub layout: (usize, usize),
}

/// The run's settings a checkpoint may record besides the model's shape.
#[derive(Clone, Debug)]
pub struct RunRecord {
    /// `--seq-length`.
    pub seq_length: usize,
    /// `--bf16`.
    pub bf16: bool,
    /// `--fp16`.
    pub fp16: bool,
    /// Adam's and the scheduler's settings at this iteration.
    pub adam: MegatronAdamSettings,
}

impl SaveFormat {
    /// Writes `rank` under `root`. Every rank of `group` (one model replica's ranks) calls
    /// it; the group's rank 0 publishes the iteration once every file is written. Returns the
    /// rank's directory.
    pub fn save_rank(&self, root: &Path, rank: SavedRank<'_>, group: &Group) -> Result<PathBuf> {
        match self {
            SaveFormat::Ferrotron => save_checkpoint(
                root,
                rank.weights,
                rank.config,
                rank.optimizer,
                rank.state,
                group,
                rank.part.place,
            ),
            SaveFormat::MegatronTorch(options) => {
                let run = megatron_run(rank.config, rank.state, Some(&rank.run), options);
                save_megatron_torch_rank(
                    root,
                    rank.weights,
                    &rank.optimizer.moments,
                    &run,
                    options.spec,
                    (group, rank.part),
                )
            }
        }
    }

    /// Writes the whole `model` under `root`, split into its layout, by one process.
    pub fn save_model(&self, root: &Path, model: SavedModel<'_>) -> Result<()> {
        match self {
            SaveFormat::Ferrotron => {
                // ferrotron's checkpoints load at any layout: one file holds the model.
                ensure!(
                    model.layout == (1, 1),
                    "ferrotron's checkpoints load at any tensor-parallel size and hold one \
                     stage: write them without a target layout"
                );
                let weights = model
                    .config
                    .init(0, &burn::tensor::Device::flex())
                    .map_err(anyhow::Error::msg)?;
                let (weights, missing) = load_named_parameters(weights, model.values);
                if let Some(first) = missing.first() {
                    bail!(
                        "no tensor for {first} ({} parameters missing)",
                        missing.len()
                    );
                }
                save_checkpoint(
                    root,
                    &weights,
                    model.config,
                    &OptimizerState::default(),
                    model.state,
                    &Group::single(),
                    ShardPlace::tensor(0, 1),
                )?;
                Ok(())
            }
            SaveFormat::MegatronTorch(options) => {
                let run = megatron_run(model.config, model.state, None, options);
                save_megatron_torch(root, model.values, &run, model.layout, options.spec)
            }
        }
    }
}

/// What Megatron's `args` record of a run (`None`: a converted model, whose run is unknown).
fn megatron_run(
    config: &GptConfig,
    state: &TrainState,
    run: Option<&RunRecord>,
    options: &MegatronSaveOptions,
) -> MegatronRun {
    MegatronRun {
        config: config.clone(),
        iteration: state.iteration,
        consumed_train_samples: state.consumed_train_samples,
        consumed_valid_samples: state.consumed_valid_samples,
        make_vocab_size_divisible_by: options.make_vocab_size_divisible_by,
        vocab_size: options.vocab_size,
        tokenizer_type: options.tokenizer_type.clone(),
        seq_length: run.map(|r| r.seq_length),
        bf16: run.is_some_and(|r| r.bf16),
        fp16: run.is_some_and(|r| r.fp16),
        optimizer: run.map(|r| r.adam.clone()),
    }
}
