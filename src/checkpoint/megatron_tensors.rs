//! Megatron's tensors as ferrotron's, for both of Megatron's formats: a `torch.save` file's
//! tensors read in f32, Megatron-Core's names and `[out, in]` orientation mapped to
//! ferrotron's `[in, out]` parameters, and tensor-parallel shards joined as Megatron split
//! them (the embedding, the output layer, `linear_qkv` and `linear_fc1` by rows, each
//! `linear_fc1` shard its own `[gate_r; up_r]`; `linear_proj` and `linear_fc2` by columns;
//! norms and the row-parallel biases replicated). The writer cuts by the same rule
//! ([`megatron_split`]).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use pytorch_reader::{DType, PytorchReader};

use super::megatron_legacy_names::core_key;
use crate::model::GptConfig;
use crate::util::host_tensor::HostTensor;

/// Parameter values by ferrotron name: shape and row-major values (what
/// [`crate::model::named_parameters::load_named_parameters`] takes).
pub type ParameterValues = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// One pipeline stage's tensor-parallel `shards` joined into `values` under ferrotron's
/// names, its layers numbered from `first_layer`; returns how many layers it holds. With
/// `tied_copy`, its `output_layer.weight` is a copy of the word embedding (the last stage's,
/// under a tied output layer), which ferrotron's model does not have.
pub fn join_stage(
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
pub fn model_tensors(file: &Path) -> Result<HashMap<String, HostTensor>> {
    Ok(host_tensors(file, "model")?
        .into_iter()
        .map(|(key, t)| (core_key(&key), t))
        .collect())
}

/// The floating-point tensors under the top-level entry `entry` of a rank file (`model`, or
/// `optimizer`), in f32, by their path inside it.
pub fn host_tensors(file: &Path, entry: &str) -> Result<HashMap<String, HostTensor>> {
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
pub enum Split {
    Rows,
    Columns,
    /// SwiGLU's `linear_fc1`: each shard `[gate_r; up_r]`.
    GateUpRows,
    Replicated,
}

/// ferrotron's name(s) and value(s) for the Megatron tensor `key` given as its shards.
pub fn ferrotron_tensors(
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
pub fn megatron_split(key: &str, config: &GptConfig) -> Result<Split> {
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
