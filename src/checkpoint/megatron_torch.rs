//! Megatron-LM's `--ckpt-format torch` checkpoints read as ferrotron parameters, so a model
//! trained with Megatron continues (or is evaluated) here.
//!
//! The layout (Megatron-Core 0.16, read from `megatron/training/checkpointing.py` and checked
//! against checkpoints its own `pretrain_gpt.py` wrote, `tests/fixtures/megatron_ckpt/`):
//! `latest_checkpointed_iteration.txt` names the iteration (or `release`); its directory
//! `iter_NNNNNNN/` holds one `mp_rank_TT/model_optim_rng.pt` per tensor-parallel rank, a
//! `torch.save` zip whose `model` entry is the state dict (Megatron-Core's names; legacy
//! names are mapped, and the Transformer-Engine spec's norms fused into the next linear as
//! `layer_norm_weight` are read too), and, from Megatron's local optimizer, Adam's state.
//! Names, orientation and the joining of shards are [`super::megatron_tensors`]'; the pickle
//! and zip are read by the `pytorch-reader` crate (burn's reader, no Python).

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use pytorch_reader::PytorchReader;

use super::format::iteration_dir;
use super::megatron_args::MegatronArgs;
use super::megatron_checkpoint::MegatronCheckpoint;
use super::megatron_optimizer::{join_adam, read_rank_adam, SavedAdam, StageAdam};
use super::megatron_tensors::{join_stage, model_tensors, ParameterValues};
use super::pickle::read_torch_save_pickle;
use crate::model::GptConfig;

/// The arguments saved with the latest `torch` checkpoint in `root` (tensor-parallel rank 0's
/// file): its model and training state.
pub fn torch_args(root: &Path) -> Result<MegatronArgs> {
    let (dir, _) = iteration_dir(root)?;
    MegatronArgs::read(&stage_files(&dir)?[0][0])
}

/// Each rank's file in its `mp_rank_TT[_PPP]` directory.
const FILE: &str = "model_optim_rng.pt";

/// The padded vocabulary of the `torch` checkpoint in `root`: its word embedding's rows over
/// every tensor-parallel rank (read from the files' tensor headers, not their values).
pub fn torch_vocab_rows(root: &Path) -> Result<usize> {
    let (dir, _) = iteration_dir(root)?;
    let mut rows = 0;
    for file in &stage_files(&dir)?[0] {
        let reader = PytorchReader::with_top_level_key(file, "model")
            .with_context(|| format!("{}: not a readable torch.save file", file.display()))?;
        let embedding = [
            "embedding.word_embeddings.weight",
            "language_model.embedding.word_embeddings.weight",
        ]
        .iter()
        .find_map(|key| reader.get(key))
        .with_context(|| format!("{}: no embedding.word_embeddings.weight", file.display()))?;
        rows += embedding.shape()[0];
    }
    Ok(rows)
}

/// The rank files of an iteration directory, `[pipeline stage][tensor-parallel rank]`:
/// `mp_rank_TT/model_optim_rng.pt` without pipeline stages, `mp_rank_TT_PPP/...` with them.
fn stage_files(dir: &Path) -> Result<Vec<Vec<PathBuf>>> {
    let ranks = |stage: Option<usize>| -> Vec<PathBuf> {
        (0..)
            .map(|tp| match stage {
                None => dir.join(format!("mp_rank_{tp:02}")).join(FILE),
                Some(pp) => dir.join(format!("mp_rank_{tp:02}_{pp:03}")).join(FILE),
            })
            .take_while(|file| file.is_file())
            .collect()
    };
    let single = ranks(None);
    if !single.is_empty() {
        return Ok(vec![single]);
    }
    let stages: Vec<Vec<PathBuf>> = (0..)
        .map(|pp| ranks(Some(pp)))
        .take_while(|files| !files.is_empty())
        .collect();
    ensure!(
        !stages.is_empty(),
        "{}: no mp_rank_00/{FILE} or mp_rank_00_000/{FILE}",
        dir.display()
    );
    if let Some(stage) = stages.iter().position(|s| s.len() != stages[0].len()) {
        bail!(
            "{}: pipeline stage {stage} has {} tensor-parallel files, stage 0 has {}",
            dir.display(),
            stages[stage].len(),
            stages[0].len()
        );
    }
    Ok(stages)
}

/// The model of the `torch` checkpoint in `root` (Adam's state too `with_adam`), and the
/// model config it is: the one Megatron saved in its arguments, or `config` (a run's flags,
/// which must describe the same model; its vocabulary padding may differ, the rows past the
/// real vocabulary being padding).
pub fn read_torch(
    root: &Path,
    config: Option<&GptConfig>,
    with_adam: bool,
) -> Result<(MegatronCheckpoint, GptConfig)> {
    let (dir, iteration) = iteration_dir(root)?;
    let stages = stage_files(&dir)?;
    // With Adam's state, every file's pickle, parsed once: the arguments come from the first.
    let pickles = if with_adam {
        stages
            .iter()
            .map(|files| files.iter().map(|f| read_torch_save_pickle(f)).collect())
            .collect::<Result<Vec<Vec<_>>>>()?
    } else {
        Vec::new()
    };
    let args = match pickles.first().and_then(|p| p.first()) {
        Some(top) => MegatronArgs::from_pickle(&stages[0][0], top)?,
        None => MegatronArgs::read(&stages[0][0])?,
    };
    if let Some(version) = args.checkpoint_version.filter(|&v| v < 2.0) {
        bail!(
            "{}: checkpoint_version {version}: Megatron-LM before 2.0 ordered the fused \
             query/key/value rows differently; load it in Megatron-LM and save it again",
            dir.display()
        );
    }
    if args
        .count("virtual_pipeline_model_parallel_size")?
        .unwrap_or(1)
        > 1
    {
        bail!(
            "{}: an interleaved (virtual) pipeline checkpoint (model0, model1, ... per file) is \
             not read yet; convert it with Megatron to one model chunk per stage",
            dir.display()
        );
    }
    let config = args.model_for(root, config)?;
    let mut values = ParameterValues::new();
    // Each stage numbers its layers from 0; they follow the previous stages' (whatever split
    // Megatron used, the files say how many layers each stage holds).
    let mut first_layer = 0;
    let mut adam = Vec::new();
    for (stage, files) in stages.iter().enumerate() {
        let shards = files
            .iter()
            .map(|file| model_tensors(file))
            .collect::<Result<Vec<_>>>()?;
        let ranks = if with_adam {
            files
                .iter()
                .zip(&pickles[stage])
                .zip(&shards)
                .map(|((file, top), model)| read_rank_adam(file, top, model))
                .collect::<Result<Vec<_>>>()?
        } else {
            vec![SavedAdam::NotRead("not asked for".into())]
        };
        // A tied output layer's copy of the word embedding, kept by the last of several stages.
        let tied_copy = stages.len() > 1 && stage + 1 == stages.len() && config.tied_output();
        adam.push(StageAdam {
            ranks,
            first_layer,
            tied_copy,
        });
        first_layer += join_stage(shards, first_layer, tied_copy, &config, &mut values)
            .with_context(|| format!("{}: pipeline stage {stage}", dir.display()))?;
    }
    let adam = join_adam(adam, &config).with_context(|| format!("{}", dir.display()))?;
    ensure!(
        first_layer == config.num_layers,
        "{}: the stages hold {first_layer} layers, the model has {}",
        dir.display(),
        config.num_layers
    );
    let checkpoint = MegatronCheckpoint {
        iteration,
        tensor_parallel: stages[0].len(),
        pipeline_parallel: stages.len(),
        values,
        adam,
        args,
    };
    Ok((checkpoint, config))
}
