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

use crate::comm::Group;
use crate::model::named_parameters::load_named_parameters;
use crate::model::{Gpt, GptConfig, StageLayers};
use crate::parallel::sharding::{parameter_holdings, shard_of};
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
    /// Parameter values by ferrotron name, joined over the tensor-parallel shards.
    pub values: ParameterValues,
}

/// Whether `root` holds a Megatron `torch`-format checkpoint (its latest iteration has
/// `mp_rank_00/model_optim_rng.pt`).
pub fn is_megatron_torch(root: &Path) -> bool {
    iteration_dir(root).is_ok_and(|(dir, _)| dir.join("mp_rank_00/model_optim_rng.pt").is_file())
}

/// The padded vocabulary of the Megatron checkpoint in `root`: its word embedding's rows over
/// every tensor-parallel rank (read from the files' tensor headers, not their values).
pub fn megatron_vocab_rows(root: &Path) -> Result<usize> {
    let (dir, _) = iteration_dir(root)?;
    let mut rows = 0;
    for file in rank_files(&dir)? {
        let reader = PytorchReader::with_top_level_key(&file, "model")
            .with_context(|| format!("{}: not a readable torch.save file", file.display()))?;
        let embedding = reader
            .get("embedding.word_embeddings.weight")
            .with_context(|| format!("{}: no embedding.word_embeddings.weight", file.display()))?;
        rows += embedding.shape()[0];
    }
    Ok(rows)
}

/// Each tensor-parallel rank's `mp_rank_TT/model_optim_rng.pt` in an iteration directory,
/// in rank order (at least rank 0's).
fn rank_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let files: Vec<PathBuf> = (0..)
        .map(|rank| dir.join(format!("mp_rank_{rank:02}/model_optim_rng.pt")))
        .take_while(|file| file.is_file())
        .collect();
    ensure!(
        !files.is_empty(),
        "{}: no mp_rank_00/model_optim_rng.pt; pipeline-parallel Megatron checkpoints \
         (mp_rank_TT_PPP) are not read yet",
        dir.display()
    );
    Ok(files)
}

/// The latest iteration's directory and number.
fn iteration_dir(root: &Path) -> Result<(PathBuf, u64)> {
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

/// The model of the Megatron `torch` checkpoint in `root` for a model of `config` (the flags
/// the checkpoint was trained with; its vocabulary padding may differ from `config`'s, the
/// rows past the real vocabulary being padding).
pub fn read_megatron_torch(root: &Path, config: &GptConfig) -> Result<MegatronCheckpoint> {
    let (dir, iteration) = iteration_dir(root)?;
    let mut shards = rank_files(&dir)?
        .iter()
        .map(|file| read_shard(file))
        .collect::<Result<Vec<_>>>()?;
    let tensor_parallel = shards.len();
    let mut values = ParameterValues::new();
    let keys: Vec<String> = shards[0].keys().cloned().collect();
    for key in keys {
        let parts: Vec<HostTensor> = shards
            .iter_mut()
            .map(|s| s.remove(&key))
            .collect::<Option<_>>()
            .with_context(|| {
                format!(
                    "{}: {key} is missing from some tensor-parallel rank",
                    dir.display()
                )
            })?;
        for (name, tensor) in ferrotron_tensors(&key, parts, config)
            .with_context(|| format!("{}: {key}", dir.display()))?
        {
            values.insert(name, (tensor.shape, tensor.values));
        }
    }
    Ok(MegatronCheckpoint {
        iteration,
        tensor_parallel,
        values,
    })
}

/// The floating-point tensors of one rank's state dict, in f32.
fn read_shard(file: &Path) -> Result<HashMap<String, HostTensor>> {
    let reader = PytorchReader::with_top_level_key(file, "model").with_context(|| {
        format!(
            "{}: not a readable torch.save file with a `model` entry",
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
fn ferrotron_tensors(
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

/// This rank's `stage` of the model in the Megatron checkpoint at `root`, split for the
/// tensor-parallel `group` (whatever size the checkpoint was saved with), on `device`, and
/// the iteration it was saved at.
pub fn load_megatron_torch(
    root: &Path,
    config: &GptConfig,
    device: &Device,
    group: &Group,
    stage: &StageLayers,
) -> Result<(Gpt, u64)> {
    let checkpoint = read_megatron_torch(root, config)?;
    let model = config
        .init_stage(0, group, stage, device)
        .map_err(anyhow::Error::msg)?;
    let mut values = ParameterValues::new();
    for p in parameter_holdings(&model) {
        let (shape, whole) = checkpoint.values.get(&p.name).with_context(|| {
            format!(
                "{}: no tensor for {} (the checkpoint's model differs from this run's flags)",
                root.display(),
                p.name
            )
        })?;
        let whole = HostTensor::new(shape.clone(), whole.clone());
        let part = shard_of(
            &whole,
            p.holding.partition_dim(),
            group.rank(),
            group.size(),
        )
        .map_err(|e| anyhow::anyhow!("{}: {}: {e}", root.display(), p.name))?;
        values.insert(p.name, (part.shape, part.values));
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
    Ok((model, checkpoint.iteration))
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
