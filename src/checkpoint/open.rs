//! One way into a checkpoint of any format ferrotron reads: [`Checkpoint::open`] detects the
//! format once ([`super::format::detect`]), and each question a tool or the trainer asks of
//! it (what model it holds, a rank's part of that model, Adam's state) goes to that format's
//! reader. No caller tells formats apart itself.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use burn::tensor::Device;

use super::format::{detect, CheckpointFormat};
use super::megatron_args::MegatronArgs;
use super::megatron_checkpoint::{AdamResume, MegatronCheckpoint};
use super::{load, megatron_torch, torch_dist, LoadedCheckpoint, OptimizerState};
use crate::comm::Group;
use crate::model::{Gpt, GptConfig, StageLayers};

/// A checkpoint directory and the format of its latest iteration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    root: PathBuf,
    format: CheckpointFormat,
}

/// What a training rank resumes from a checkpoint.
pub struct ResumedRank {
    /// This rank's stage of the model, its tensor-parallel shard.
    pub model: Gpt,
    /// What was saved with it.
    pub info: LoadedCheckpoint,
    /// This rank's optimizer state, or why the optimizer starts fresh.
    pub optimizer: std::result::Result<OptimizerState, String>,
}

/// What a training rank asks of a checkpoint.
#[derive(Clone, Copy)]
pub struct RankRequest<'a> {
    /// The run's model (checked against the saved one).
    pub config: &'a GptConfig,
    /// The training device.
    pub device: &'a Device,
    /// The rank's tensor-parallel group.
    pub group: &'a Group,
    /// The rank's pipeline stage.
    pub stage: &'a StageLayers,
    /// The run's global batch: counts the consumed samples of a Megatron file lacking them.
    pub global_batch_size: u64,
    /// Whether to read the optimizer's state too.
    pub with_optimizer: bool,
}

impl Checkpoint {
    /// The checkpoint under `root`, or `None` when there is none (no tracker file, or no
    /// rank file of a format ferrotron reads in its latest iteration).
    pub fn find(root: &Path) -> Option<Self> {
        detect(root).map(|format| Self {
            root: root.to_path_buf(),
            format,
        })
    }

    /// The checkpoint under `root`; an error saying there is none otherwise.
    pub fn open(root: &Path) -> Result<Self> {
        match Self::find(root) {
            Some(checkpoint) => Ok(checkpoint),
            None => bail!(
                "no checkpoint in {} (no {} naming an iteration that holds ferrotron's or \
                 Megatron's rank files)",
                root.display(),
                super::TRACKER_FILE
            ),
        }
    }

    /// Its format.
    pub fn format(&self) -> CheckpointFormat {
        self.format
    }

    /// Its directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The arguments Megatron saved with it; an error for ferrotron's format.
    pub fn megatron_args(&self) -> Result<MegatronArgs> {
        match self.format {
            CheckpointFormat::MegatronTorch => megatron_torch::torch_args(&self.root),
            CheckpointFormat::MegatronTorchDist => torch_dist::torch_dist_args(&self.root),
            CheckpointFormat::Ferrotron => self.not_megatron(),
        }
    }

    /// Why a checkpoint detected a moment ago cannot be read (its tracker file was replaced
    /// or removed in between).
    fn vanished(&self) -> String {
        format!(
            "{}: the checkpoint changed while it was read ({} names no readable iteration)",
            self.root.display(),
            super::TRACKER_FILE
        )
    }

    fn not_megatron<T>(&self) -> Result<T> {
        bail!(
            "{}: a ferrotron checkpoint, not one of Megatron-LM's",
            self.root.display()
        )
    }

    /// The model it holds (ferrotron's saved config, or the one Megatron's saved arguments
    /// describe) and the sequence length it was trained at where it records one: what
    /// `--use-checkpoint-args` takes.
    pub fn saved_model(&self) -> Result<(GptConfig, Option<usize>)> {
        if self.format == CheckpointFormat::Ferrotron {
            let config = load::saved_config(&self.root)?;
            let config = config.with_context(|| self.vanished())?;
            return Ok((config, None));
        }
        let args = self.megatron_args()?;
        Ok((args.model_config()?, args.count("seq_length")?))
    }

    /// The padded vocabulary of a Megatron checkpoint: the word embedding's rows (a `torch`
    /// checkpoint's from its files' tensor headers, a `torch_dist` one's from its arguments).
    pub fn megatron_vocab_rows(&self) -> Result<usize> {
        match self.format {
            CheckpointFormat::MegatronTorch => megatron_torch::torch_vocab_rows(&self.root),
            CheckpointFormat::MegatronTorchDist => self
                .megatron_args()?
                .count("padded_vocab_size")?
                .context("the checkpoint's arguments have no padded_vocab_size"),
            CheckpointFormat::Ferrotron => self.not_megatron(),
        }
    }

    /// A Megatron checkpoint's whole model (Adam's state too `with_adam`, where its format
    /// holds it), and the model config it is: the one Megatron saved in its arguments, or
    /// `config` (a run's flags, which must describe the same model; its vocabulary padding
    /// may differ).
    pub fn read_megatron(
        &self,
        config: Option<&GptConfig>,
        with_adam: bool,
    ) -> Result<(MegatronCheckpoint, GptConfig)> {
        match self.format {
            CheckpointFormat::MegatronTorch => {
                megatron_torch::read_torch(&self.root, config, with_adam)
            }
            CheckpointFormat::MegatronTorchDist => torch_dist::read_torch_dist(&self.root, config),
            CheckpointFormat::Ferrotron => self.not_megatron(),
        }
    }

    /// This rank's shard (of `group`) of the whole model, for inference, without the
    /// optimizer's state.
    pub fn load_model_shard(
        &self,
        device: &Device,
        group: &Group,
    ) -> Result<(Gpt, LoadedCheckpoint)> {
        if self.format == CheckpointFormat::Ferrotron {
            return load::load_model_shard(&self.root, device, group);
        }
        let (checkpoint, config) = self.read_megatron(None, false)?;
        let (model, info, _) = checkpoint.load_rank(config, &self.root, device, group, None, 0)?;
        Ok((model, info))
    }

    /// What a training rank continues from: its stage of the model, resharded to its
    /// tensor-parallel group, and its part of the optimizer's state where asked for and
    /// saved.
    pub fn resume_rank(&self, rank: RankRequest) -> Result<ResumedRank> {
        if self.format == CheckpointFormat::Ferrotron {
            let loaded = load::load_parts(
                &self.root,
                Some(rank.config),
                rank.device,
                rank.group,
                Some(rank.stage),
                rank.with_optimizer,
            )?;
            let (model, info, optimizer) = loaded.with_context(|| self.vanished())?;
            let optimizer = match rank.with_optimizer {
                true => Ok(optimizer),
                false => Err("not asked for".to_owned()),
            };
            return Ok(ResumedRank {
                model,
                info,
                optimizer,
            });
        }
        let (checkpoint, config) = self.read_megatron(Some(rank.config), rank.with_optimizer)?;
        let (model, info, adam) = checkpoint.load_rank(
            config,
            &self.root,
            rank.device,
            rank.group,
            Some(rank.stage),
            rank.global_batch_size,
        )?;
        let optimizer = match adam {
            AdamResume::Loaded(state) => Ok(state),
            AdamResume::Fresh(why) => Err(why),
        };
        Ok(ResumedRank {
            model,
            info,
            optimizer,
        })
    }
}

/// The whole model of the latest Megatron checkpoint under `root`, in either of its formats
/// ([`Checkpoint::read_megatron`]).
pub fn read_megatron(
    root: &Path,
    config: Option<&GptConfig>,
    with_adam: bool,
) -> Result<(MegatronCheckpoint, GptConfig)> {
    Checkpoint::open(root)?.read_megatron(config, with_adam)
}

/// The arguments Megatron saved with its latest checkpoint under `root`, in either of its
/// formats.
pub fn megatron_args(root: &Path) -> Result<MegatronArgs> {
    Checkpoint::open(root)?.megatron_args()
}

/// The model of the latest checkpoint under `root` and the sequence length it records, in
/// any format ([`Checkpoint::saved_model`]); `None` without a checkpoint.
pub fn saved_model(root: &Path) -> Result<Option<(GptConfig, Option<usize>)>> {
    Checkpoint::find(root).map(|c| c.saved_model()).transpose()
}

/// This rank's shard of the whole model of the latest checkpoint under `root`, in any
/// format, for inference ([`Checkpoint::load_model_shard`]); an error when there is none.
pub fn load_model_shard(
    root: &Path,
    device: &Device,
    group: &Group,
) -> Result<(Gpt, LoadedCheckpoint)> {
    Checkpoint::open(root)?.load_model_shard(device, group)
}

/// The whole model of the latest checkpoint under `root` (shards joined), in any format, for
/// inference on `device`; an error when there is none.
pub fn load_model(root: &Path, device: &Device) -> Result<(Gpt, LoadedCheckpoint)> {
    load_model_shard(root, device, &Group::single())
}
