//! Which format a checkpoint directory holds, decided in one place: every tool and the
//! trainer read the same directory the same way, and a directory that is none of them is
//! named as such instead of failing later in a reader of the wrong format.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::{CHECKPOINT_FILE, TRACKER_FILE};

/// A checkpoint format ferrotron reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointFormat {
    /// ferrotron's: safetensors shards per model-parallel rank, the optimizer state in them.
    Ferrotron,
    /// Megatron-LM's `--ckpt-format torch`: a `torch.save` file per model-parallel rank.
    MegatronTorch,
    /// Megatron-LM's `--ckpt-format torch_dist` (its default): PyTorch Distributed
    /// Checkpointing's files and metadata.
    MegatronTorchDist,
}

impl CheckpointFormat {
    /// The name `--ckpt-format` and `convert-checkpoint --target-format` give it.
    pub fn name(self) -> &'static str {
        match self {
            CheckpointFormat::Ferrotron => "ferrotron",
            CheckpointFormat::MegatronTorch => "torch",
            CheckpointFormat::MegatronTorchDist => "torch_dist",
        }
    }

    /// Whether Megatron-LM wrote it.
    pub fn is_megatron(self) -> bool {
        self != CheckpointFormat::Ferrotron
    }
}

/// The format of the latest checkpoint under `root`: `None` when there is none (no tracker
/// file, or its iteration holds no rank file of any format).
pub fn detect(root: &Path) -> Option<CheckpointFormat> {
    let (dir, _) = iteration_dir(root).ok()?;
    let rank_file = |name: &str| {
        ["mp_rank_00", "mp_rank_00_000"]
            .iter()
            .any(|rank| dir.join(rank).join(name).is_file())
    };
    let torch_dist = std::fs::read_to_string(dir.join("metadata.json"))
        .is_ok_and(|text| text.contains("\"torch_dist\"") && dir.join(".metadata").is_file());
    if torch_dist {
        Some(CheckpointFormat::MegatronTorchDist)
    } else if rank_file("model_optim_rng.pt") {
        Some(CheckpointFormat::MegatronTorch)
    } else if rank_file(CHECKPOINT_FILE) {
        Some(CheckpointFormat::Ferrotron)
    } else {
        None
    }
}

/// The latest iteration's directory under `root` and its number, as the tracker file names
/// it (Megatron's `release` is iteration 0 in `release/`).
pub fn iteration_dir(root: &Path) -> Result<(PathBuf, u64)> {
    let tracker = root.join(TRACKER_FILE);
    let text = std::fs::read_to_string(&tracker)
        .with_context(|| format!("reading {}", tracker.display()))?;
    let text = text.trim();
    if text == "release" {
        return Ok((root.join("release"), 0));
    }
    let iteration: u64 = text.parse().with_context(|| {
        format!(
            "{}: expected an iteration number or `release`, found {text:?}",
            tracker.display()
        )
    })?;
    Ok((root.join(format!("iter_{iteration:07}")), iteration))
}
