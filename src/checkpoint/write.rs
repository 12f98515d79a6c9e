//! A training rank's checkpoint written in the format the run saves (`--ckpt-format`): the
//! trainer hands every format the same [`SavedRank`] and calls one [`SaveFormat::save_rank`],
//! so a format added later (Megatron's `torch_dist`) is a variant here, not a branch in the
//! trainer.

use std::path::{Path, PathBuf};

use anyhow::Result;

use super::format::CheckpointFormat;
use super::megatron_optimizer_save::MegatronAdamSettings;
use super::megatron_torch_save::{
    save_megatron_torch_rank, MegatronRun, MegatronSaveOptions, RankPart,
};
use super::save::save_checkpoint;
use super::{OptimizerState, TrainState};
use crate::comm::Group;
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
    /// The format it writes.
    pub fn format(&self) -> CheckpointFormat {
        match self {
            SaveFormat::Ferrotron => CheckpointFormat::Ferrotron,
            SaveFormat::MegatronTorch(_) => CheckpointFormat::MegatronTorch,
        }
    }

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
                let run = megatron_run(&rank, options);
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
}

/// What Megatron's `args` record of the run `rank` belongs to.
fn megatron_run(rank: &SavedRank<'_>, options: &MegatronSaveOptions) -> MegatronRun {
    MegatronRun {
        config: rank.config.clone(),
        iteration: rank.state.iteration,
        consumed_train_samples: rank.state.consumed_train_samples,
        consumed_valid_samples: rank.state.consumed_valid_samples,
        make_vocab_size_divisible_by: options.make_vocab_size_divisible_by,
        vocab_size: options.vocab_size,
        tokenizer_type: options.tokenizer_type.clone(),
        seq_length: Some(rank.run.seq_length),
        bf16: rank.run.bf16,
        fp16: rank.run.fp16,
        optimizer: Some(rank.run.adam.clone()),
    }
}
