//! Megatron-LM's `--ckpt-format torch` checkpoints read as ferrotron parameters, so a model
//! trained with Megatron continues (or is evaluated) here.
//!
//! The layout (Megatron-Core 0.16, read from `megatron/training/checkpointing.py` and checked
//! against checkpoints its own `pretrain_gpt.py` wrote, `tests/fixtures/megatron_ckpt/`):
//! `latest_checkpointed_iteration.txt` names the iteration (or `release`); its directory
//! `iter_NNNNNNN/` holds one `mp_rank_TT/model_optim_rng.pt` per tensor-parallel rank, a
//! `torch.save` zip whose `model` entry is the state dict. Megatron-Core names its tensors
//! `embedding.word_embeddings.weight`, `decoder.layers.N.self_attention.linear_qkv.weight`,
//! …; PyTorch's `Linear` stores `[out, in]` where ferrotron keeps `[in, out]`. The fused
//! `linear_qkv` rows are already ferrotron's order (per query group: its queries, its key, its
//! value), and SwiGLU's `linear_fc1` is `[gate; up]`, which ferrotron keeps as two
//! parameters. Tensor-parallel shards are joined as Megatron split them: the embedding, the
//! output layer, `linear_qkv` and `linear_fc1` by rows (each `linear_fc1` shard is its own
//! `[gate_r; up_r]`), `linear_proj` and `linear_fc2` by columns; norms and the row-parallel
//! biases are replicated. The Transformer-Engine spec's names (the norms fused into the next
//! linear as `layer_norm_weight`) are read too. The pickle and zip are read by the
//! `pytorch-reader` crate (burn's reader, no Python).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use burn::tensor::Device;
use pytorch_reader::{DType, PytorchReader};

use super::load::LoadedCheckpoint;
use super::megatron_args::MegatronArgs;
use super::megatron_legacy_names::core_key;
use super::megatron_optimizer::{
    join_adam, read_rank_adam, JoinedMoments, MegatronAdam, SavedAdam, StageAdam,
};
use super::pickle::read_torch_save_pickle;
use super::torch_dist::{is_torch_dist, read_torch_dist, torch_dist_args};
use super::{OptimizerState, TrainState};
use crate::comm::Group;
use crate::model::named_parameters::load_named_parameters;
use crate::model::{Gpt, GptConfig, StageLayers};
use crate::optim::NamedMoments;
use crate::parallel::sharding::{parameter_holdings, shard_of, ParameterHolding};
use crate::util::host_tensor::HostTensor;

/// Parameter values by ferrotron name: shape and row-major values (what
/// [`crate::model::named_parameters::load_named_parameters`] takes).
pub type ParameterValues = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// A Megatron checkpoint's model, as ferrotron parameters.
pub struct MegatronCheckpoint {
    /// The iteration it was saved at (0 for `release`).
    pub iteration: u64,
    /// The tensor-parallel size it was saved with.
    pub tensor_parallel: usize,
    /// The pipeline-parallel size it was saved with.
    pub pipeline_parallel: usize,
    /// Parameter values by ferrotron name, joined over the tensor-parallel shards and the
    /// pipeline stages.
    pub values: ParameterValues,
    /// Adam's state, joined as the weights are.
    pub adam: MegatronAdam,
    /// The arguments Megatron saved with it (tensor-parallel rank 0's).
    pub args: MegatronArgs,
}

impl MegatronCheckpoint {
    /// The training state to continue from: the iteration, and the consumed samples and
    /// scheduler steps Megatron saved (iterations × `global_batch_size` where a file lacks
    /// them).
    pub fn train_state(&self, global_batch_size: u64) -> Result<TrainState> {
        let samples = match self.args.consumed_train_samples()? {
            Some(n) => n,
            None => self.iteration * global_batch_size,
        };
        Ok(TrainState {
            iteration: self.iteration,
            skipped_iterations: 0,
            scheduler_steps: self.args.scheduler_steps.unwrap_or(samples),
            consumed_train_samples: samples,
            consumed_valid_samples: self.args.consumed_valid_samples()?.unwrap_or(0),
        })
    }
}

/// The arguments saved with the latest Megatron checkpoint in `root` (tensor-parallel rank
/// 0's file, or a `torch_dist` checkpoint's `common.pt`): its model and training state.
pub fn megatron_args(root: &Path) -> Result<MegatronArgs> {
    if is_torch_dist(root) {
        return torch_dist_args(root);
    }
    let (dir, _) = iteration_dir(root)?;
    MegatronArgs::read(&stage_files(&dir)?[0][0])
}

/// Whether `root` holds a Megatron checkpoint: `--ckpt-format torch` (its latest iteration has
/// `mp_rank_00/model_optim_rng.pt`, or `mp_rank_00_000/...` with pipeline stages) or
/// `torch_dist`.
pub fn is_megatron_checkpoint(root: &Path) -> bool {
    is_torch_dist(root)
        || iteration_dir(root).is_ok_and(|(dir, _)| {
            ["mp_rank_00", "mp_rank_00_000"]
                .iter()
                .any(|rank| dir.join(rank).join(FILE).is_file())
        })
}

/// Each rank's file in its `mp_rank_TT[_PPP]` directory.
const FILE: &str = "model_optim_rng.pt";

/// The padded vocabulary of the Megatron checkpoint in `root`: its word embedding's rows over
/// every tensor-parallel rank (read from the files' tensor headers, not their values; a
/// `torch_dist` checkpoint's from its arguments).
pub fn megatron_vocab_rows(root: &Path) -> Result<usize> {
    if is_torch_dist(root) {
        return torch_dist_args(root)?
            .count("padded_vocab_size")?
            .context("the checkpoint's arguments have no padded_vocab_size");
    }
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

/// The latest iteration's directory and number.
pub(crate) fn iteration_dir(root: &Path) -> Result<(PathBuf, u64)> {
    let tracker = root.join("latest_checkpointed_iteration.txt");
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

/// The model of the Megatron checkpoint in `root` (`torch`, or `torch_dist` through
/// [`read_torch_dist`]), and the model config it is: the
/// one Megatron saved in its arguments, or `config` (a run's flags, which must describe the
/// same model; its vocabulary padding may differ, the rows past the real vocabulary being
/// padding).
pub fn read_megatron_torch(
    root: &Path,
    config: Option<&GptConfig>,
    with_adam: bool,
) -> Result<(MegatronCheckpoint, GptConfig)> {
    if is_torch_dist(root) {
        return read_torch_dist(root, config);
    }
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

/// One pipeline stage's tensor-parallel `shards` joined into `values` under ferrotron's
/// names, its layers numbered from `first_layer`; returns how many layers it holds. With
/// `tied_copy`, its `output_layer.weight` is a copy of the word embedding (the last stage's,
/// under a tied output layer), which ferrotron's model does not have.
pub(crate) fn join_stage(
    mut shards: Vec<HashMap<String, HostTensor>>,
    first_layer: usize,
    tied_copy: bool,
    config: &GptConfig,
    values: &mut ParameterValues,
) -> Result<usize> {
    let mut layers = 0;
    let mut keys: Vec<String> = shards[0].keys().cloned().collect();
    keys.sort();
    for key in keys {
        let parts: Vec<HostTensor> = shards
            .iter_mut()
            .map(|s| s.remove(&key))
            .collect::<Option<_>>()
            .with_context(|| format!("{key} is missing from some tensor-parallel rank"))?;
        if tied_copy && key == "output_layer.weight" {
            continue;
        }
        let global = match key.strip_prefix("decoder.layers.") {
            Some(rest) => {
                let (layer, name) = rest
                    .split_once('.')
                    .context("a layer tensor without a name")?;
                let layer: usize = layer
                    .parse()
                    .with_context(|| format!("{key}: a layer number"))?;
                layers = layers.max(layer + 1);
                format!("decoder.layers.{}.{name}", first_layer + layer)
            }
            None => key.clone(),
        };
        for (name, tensor) in
            ferrotron_tensors(&global, parts, config).with_context(|| key.clone())?
        {
            values.insert(name, (tensor.shape, tensor.values));
        }
    }
    Ok(layers)
}

/// The model tensors of a rank file under Megatron-Core's names (legacy names mapped).
pub(crate) fn model_tensors(file: &Path) -> Result<HashMap<String, HostTensor>> {
    Ok(host_tensors(file, "model")?
        .into_iter()
        .map(|(key, t)| (core_key(&key), t))
        .collect())
}

/// The floating-point tensors under the top-level entry `entry` of a rank file (`model`, or
/// `optimizer`), in f32, by their path inside it.
pub(crate) fn host_tensors(file: &Path, entry: &str) -> Result<HashMap<String, HostTensor>> {
    let reader = PytorchReader::with_top_level_key(file, entry).with_context(|| {
        format!(
            "{}: not a readable torch.save file with a `{entry}` entry",
            file.display()
        )
    })?;
    let mut out = HashMap::new();
    for (name, tensor) in reader.into_tensors() {
        let bytes = tensor
            .read()
            .with_context(|| format!("{}: reading {name}", file.display()))?;
        let values: Vec<f32> = match tensor.dtype() {
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_ne_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_ne_bytes([b[0], b[1]]).to_f32())
                .collect(),
            // Integer buffers (none in a GPT state dict today) are not parameters.
            _ => continue,
        };
        out.insert(name, HostTensor::new(tensor.shape().to_vec(), values));
    }
    Ok(out)
}

/// How Megatron split a tensor over tensor-parallel ranks.
pub(crate) enum Split {
    Rows,
    Columns,
    /// SwiGLU's `linear_fc1`: each shard `[gate_r; up_r]`.
    GateUpRows,
    Replicated,
}

/// ferrotron's name(s) and value(s) for the Megatron tensor `key` given as its shards.
pub(crate) fn ferrotron_tensors(
    key: &str,
    parts: Vec<HostTensor>,
    config: &GptConfig,
) -> Result<Vec<(String, HostTensor)>> {
    let (name, split, transpose) = ferrotron_name(key, config)?;
    let join =
        |parts: &[HostTensor], dim| HostTensor::concat(parts, dim).map_err(anyhow::Error::msg);
    let whole = match split {
        Split::Rows => join(&parts, 0)?,
        Split::Columns => join(&parts, 1)?,
        Split::Replicated => parts.into_iter().next().expect("one shard at least"),
        Split::GateUpRows => {
            let halves = |k| -> Result<Vec<HostTensor>> {
                parts
                    .iter()
                    .map(|p| p.chunk(0, 2, k).map_err(anyhow::Error::msg))
                    .collect()
            };
            let (gate, up) = (join(&halves(0)?, 0)?, join(&halves(1)?, 0)?);
            let gate_name = name.replace("dense_h_to_4h", "dense_h_to_4h_gate");
            return [(gate_name, gate), (name, up)]
                .into_iter()
                .map(|(n, t)| Ok((n, oriented(t, transpose)?)))
                .collect();
        }
    };
    let whole = match name.as_str() {
        "word_embeddings.weight" => whole.resized(0, config.padded_vocab_size),
        "output_layer.weight" => whole.resized(0, config.padded_vocab_size),
        _ => whole,
    };
    Ok(vec![(name, oriented(whole, transpose)?)])
}

/// `t`, transposed from PyTorch's `[out, in]` to ferrotron's `[in, out]` when `transpose`.
fn oriented(t: HostTensor, transpose: bool) -> Result<HostTensor> {
    if transpose {
        t.transposed().map_err(anyhow::Error::msg)
    } else {
        Ok(t)
    }
}

/// How Megatron splits the tensor `key` of a Megatron-Core state dict over tensor-parallel
/// ranks (the rule reading joins by, and writing cuts by).
pub(crate) fn megatron_split(key: &str, config: &GptConfig) -> Result<Split> {
    ferrotron_name(key, config).map(|(_, split, _)| split)
}

/// ferrotron's parameter name for a Megatron-Core state-dict key, how the key was split over
/// tensor-parallel ranks, and whether it is a `Linear` weight to transpose.
fn ferrotron_name(key: &str, config: &GptConfig) -> Result<(String, Split, bool)> {
    Ok(match key {
        "embedding.word_embeddings.weight" => ("word_embeddings.weight".into(), Split::Rows, false),
        "embedding.position_embeddings.weight" => {
            ("position_embeddings".into(), Split::Replicated, false)
        }
        "output_layer.weight" => ("output_layer.weight".into(), Split::Rows, true),
        _ => {
            if let Some(kind) = key.strip_prefix("decoder.final_layernorm.") {
                return Ok((format!("final_layernorm.{kind}"), Split::Replicated, false));
            }
            let rest = key
                .strip_prefix("decoder.layers.")
                .context("not a Megatron-Core GPT tensor name (expected embedding.*, decoder.* or output_layer.weight)")?;
            let (layer, local) = rest
                .split_once('.')
                .context("a layer tensor without a name")?;
            let layer: usize = layer.parse().context("a layer number")?;
            ensure!(
                layer < config.num_layers,
                "layer {layer}, but the model has {} layers",
                config.num_layers
            );
            let (module, kind) = local.rsplit_once('.').context("a tensor without a kind")?;
            // The Transformer-Engine spec fuses each norm into the linear after it.
            if let Some(k) = kind.strip_prefix("layer_norm_") {
                let norm = match module {
                    "self_attention.linear_qkv" => "input_layernorm",
                    "mlp.linear_fc1" => "post_attention_layernorm",
                    _ => bail!("no ferrotron norm before {module}"),
                };
                return Ok((
                    format!("layers.{layer}.{norm}.{k}"),
                    Split::Replicated,
                    false,
                ));
            }
            let weight = kind == "weight";
            let (ours, split, transpose) = match (module, kind) {
                ("input_layernorm", _) => ("input_layernorm", Split::Replicated, false),
                ("pre_mlp_layernorm", _) => ("post_attention_layernorm", Split::Replicated, false),
                ("self_attention.q_layernorm", _) => {
                    ("self_attention.q_layernorm", Split::Replicated, false)
                }
                ("self_attention.k_layernorm", _) => {
                    ("self_attention.k_layernorm", Split::Replicated, false)
                }
                ("self_attention.linear_qkv", _) => {
                    ("self_attention.query_key_value", Split::Rows, weight)
                }
                ("self_attention.linear_proj", "weight") => {
                    ("self_attention.dense", Split::Columns, true)
                }
                ("self_attention.linear_proj", _) => {
                    ("self_attention.dense", Split::Replicated, false)
                }
                ("mlp.linear_fc1", _) if config.swiglu => {
                    ("mlp.dense_h_to_4h", Split::GateUpRows, weight)
                }
                ("mlp.linear_fc1", _) => ("mlp.dense_h_to_4h", Split::Rows, weight),
                ("mlp.linear_fc2", "weight") => ("mlp.dense_4h_to_h", Split::Columns, true),
                ("mlp.linear_fc2", _) => ("mlp.dense_4h_to_h", Split::Replicated, false),
                _ => bail!("no ferrotron parameter for {module}.{kind}"),
            };
            (format!("layers.{layer}.{ours}.{kind}"), split, transpose)
        }
    })
}

/// What loading a Megatron checkpoint restores of Adam.
pub enum AdamResume {
    /// This rank's moments and the steps taken.
    Loaded(OptimizerState),
    /// Nothing: training continues with fresh moments, for this reason.
    Fresh(String),
}

/// This rank's `stage` of the model in the Megatron checkpoint at `root`, split for the
/// tensor-parallel `group` (whatever layout the checkpoint was saved with), on `device`, what
/// was saved with it, and Adam's state for this rank's parameters. The model is `config`
/// (checked against Megatron's saved arguments), or the saved one. `global_batch_size`
/// counts the consumed samples of a file that lacks them.
pub fn load_megatron_torch(
    root: &Path,
    config: Option<&GptConfig>,
    device: &Device,
    group: &Group,
    stage: Option<&StageLayers>,
    global_batch_size: u64,
    resume: bool,
) -> Result<(Gpt, LoadedCheckpoint, AdamResume)> {
    let (checkpoint, config) = read_megatron_torch(root, config, resume)?;
    // Training continues from a mixed-precision optimizer's fp32 main weights, of which the
    // model's bf16/fp16 weights are rounded copies.
    let weights = match &checkpoint.adam {
        MegatronAdam::Moments(JoinedMoments {
            main_weights: Some(main),
            ..
        }) => main,
        _ => &checkpoint.values,
    };
    let whole = StageLayers::whole(config.num_layers);
    let stage = stage.unwrap_or(&whole);
    let model = config
        .init_stage(0, group, stage, device)
        .map_err(anyhow::Error::msg)?;
    let holdings = parameter_holdings(&model);
    let rank_part = |values: &ParameterValues, p: &ParameterHolding| {
        rank_part(values, p, group).with_context(|| format!("{}", root.display()))
    };
    let mut values = ParameterValues::new();
    for p in &holdings {
        let part = rank_part(weights, p)?;
        values.insert(p.name.clone(), (part.shape, part.values));
    }
    if let Some(extra) = checkpoint
        .values
        .keys()
        .filter(|name| on_stage(name, stage) && !values.contains_key(*name))
        .min()
    {
        bail!(
            "{}: the checkpoint holds {extra}, which the model these flags describe has not \
             (check the architecture flags against the ones Megatron trained with)",
            root.display()
        );
    }
    let (model, missing) = load_named_parameters(model, &values);
    if let Some(first) = missing.first() {
        bail!(
            "{}: {first} has another shape in the checkpoint than these flags give it",
            root.display()
        );
    }
    let adam = match &checkpoint.adam {
        MegatronAdam::NotSaved => {
            AdamResume::Fresh("the checkpoint holds no optimizer state".into())
        }
        MegatronAdam::NotRead(why) => AdamResume::Fresh(why.clone()),
        MegatronAdam::Moments(joined) => AdamResume::Loaded(OptimizerState {
            steps: joined.steps,
            moments: holdings
                .iter()
                .map(|p| {
                    Ok(NamedMoments {
                        name: p.name.clone(),
                        m: rank_part(&joined.exp_avg, p)?.values,
                        v: rank_part(&joined.exp_avg_sq, p)?.values,
                    })
                })
                .collect::<Result<_>>()?,
            grad_scaler: None,
        }),
    };
    let info = LoadedCheckpoint {
        state: checkpoint.train_state(global_batch_size)?,
        optimizer_steps: match &adam {
            AdamResume::Loaded(state) => state.steps,
            AdamResume::Fresh(_) => 0,
        },
        grad_scaler: None,
        tensor_model_parallel_size: checkpoint.tensor_parallel,
        pipeline_model_parallel_size: checkpoint.pipeline_parallel,
        config,
    };
    Ok((model, info, adam))
}

/// `group`'s rank's part of parameter `p` in whole `values` (its tensor-parallel shard).
fn rank_part(values: &ParameterValues, p: &ParameterHolding, group: &Group) -> Result<HostTensor> {
    let (shape, whole) = values.get(&p.name).with_context(|| {
        format!(
            "no tensor for {} (the checkpoint's model differs from this run's flags)",
            p.name
        )
    })?;
    let whole = HostTensor::new(shape.clone(), whole.clone());
    shard_of(
        &whole,
        p.holding.partition_dim(),
        group.rank(),
        group.size(),
    )
    .map_err(|e| anyhow::anyhow!("{}: {e}", p.name))
}

/// Whether the parameter `name` belongs to `stage` of the model.
fn on_stage(name: &str, stage: &StageLayers) -> bool {
    match name
        .strip_prefix("layers.")
        .and_then(|rest| rest.split_once('.'))
    {
        Some((layer, _)) => layer.parse().is_ok_and(|l| stage.holds_layer(l)),
        None if name.starts_with("word_embeddings") || name.starts_with("position_embeddings") => {
            stage.embedding
        }
        None => stage.head,
    }
}
