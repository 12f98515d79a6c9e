//! Import a HuggingFace `GPT2LMHeadModel` (`config.json` + `model.safetensors`) as a ferrotron
//! checkpoint, so `pretrain --load` continues training published GPT-2 weights.
//!
//! The inverse of [`super::hf_export`]: the same name mapping, QKV columns from HF's
//! `[all q | all k | all v]` back to Megatron's per-head `[q k v]`, and the embedding padded
//! with zero rows to the padded vocabulary. HF files name tensors with or without the
//! `transformer.` prefix and may carry the attention-mask buffers (`attn.bias`,
//! `attn.masked_bias`) and a tied `lm_head.weight`; those are checked or skipped.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

use super::hf_export::{permute_qkv, QkvOrder, LAYER_MODULES};
use super::hf_files::read_weights;
use crate::model::vocab::padded_vocab_size;
use crate::model::GptConfig;

/// The model shape of a HF GPT-2 `config.json`, with the vocabulary padded to a multiple of
/// `divisible_by` (Megatron's `--make-vocab-size-divisible-by`). Returns the config and the
/// unpadded vocabulary size.
pub fn gpt_config_from_hf(path: &Path, divisible_by: usize) -> Result<(GptConfig, usize)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let int = |key: &str| -> Result<usize> {
        json.get(key)
            .and_then(serde_json::Value::as_u64)
            .map(|v| v as usize)
            .with_context(|| format!("{}: expected a number under {key:?}", path.display()))
    };
    let float = |key: &str, default: f64| json.get(key).and_then(|v| v.as_f64()).unwrap_or(default);
    if let Some(kind) = json.get("model_type").and_then(|v| v.as_str()) {
        ensure!(
            kind == "gpt2",
            "{}: model_type {kind:?}, only gpt2 is supported",
            path.display()
        );
    }
    let openai_gelu = match json
        .get("activation_function")
        .and_then(|v| v.as_str())
        .unwrap_or("gelu_new")
    {
        "gelu_new" | "gelu_pytorch_tanh" => true,
        "gelu" => false,
        other => bail!(
            "{}: activation_function {other:?}: expected gelu or gelu_new",
            path.display()
        ),
    };
    let vocab = int("vocab_size")?;
    let hidden = int("n_embd")?;
    let config = GptConfig::new(
        int("n_layer")?,
        hidden,
        int("n_head")?,
        int("n_positions")?,
        padded_vocab_size(vocab, divisible_by, 1),
    )
    .with_ffn_hidden_size(
        json.get("n_inner")
            .and_then(|v| v.as_u64())
            .map(|v| v as usize),
    )
    .with_hidden_dropout(float("resid_pdrop", 0.1))
    .with_attention_dropout(float("attn_pdrop", 0.1))
    .with_layernorm_epsilon(float("layer_norm_epsilon", 1e-5))
    .with_init_method_std(float("initializer_range", 0.02))
    .with_openai_gelu(openai_gelu);
    config.validate().map_err(anyhow::Error::msg)?;
    Ok((config, vocab))
}

/// ferrotron's parameter name for a HF tensor name, `None` for buffers that are not
/// parameters.
fn ferrotron_name(hf: &str) -> Result<Option<String>> {
    let name = hf.strip_prefix("transformer.").unwrap_or(hf);
    if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
        return Ok(None);
    }
    Ok(Some(match name {
        "wte.weight" => "word_embeddings.weight".into(),
        "wpe.weight" => "position_embeddings".into(),
        _ => {
            if let Some(rest) = name.strip_prefix("ln_f.") {
                format!("final_layernorm.{rest}")
            } else if let Some(rest) = name.strip_prefix("h.") {
                let (layer, local) = rest
                    .split_once('.')
                    .context("layer tensor without a name")?;
                let (module, kind) = local.rsplit_once('.').context("tensor without a kind")?;
                let ours = LAYER_MODULES
                    .iter()
                    .find(|(_, theirs)| *theirs == module)
                    .map(|(ours, _)| *ours)
                    .with_context(|| format!("{hf}: no ferrotron parameter for {module}"))?;
                format!("layers.{layer}.{ours}.{kind}")
            } else {
                bail!("{hf}: not a GPT-2 tensor name")
            }
        }
    }))
}

/// Parameter values by ferrotron name: shape and row-major values (what
/// [`crate::model::named_parameters::load_named_parameters`] takes).
pub type ParameterValues = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// The ferrotron parameters (name → shape, values) of the HF model in `dir`, for `config`.
pub fn ferrotron_parameters(
    dir: &Path,
    config: &GptConfig,
    vocab: usize,
) -> Result<ParameterValues> {
    let path = dir;
    let mut tensors = read_weights(dir)?;
    let lm_head = tensors
        .remove("lm_head.weight")
        .or_else(|| tensors.remove("transformer.lm_head.weight"));
    let (heads, head_dim) = (config.num_attention_heads, config.head_dim());
    let mut out = HashMap::new();
    for (hf, t) in tensors {
        let Some(name) = ferrotron_name(&hf)? else {
            continue;
        };
        let (shape, values) = if name == "word_embeddings.weight" {
            ensure!(
                t.shape == [vocab, config.hidden_size],
                "{}: {hf} is {:?}, config.json says [{vocab}, {}]",
                path.display(),
                t.shape,
                config.hidden_size
            );
            if let Some(head) = &lm_head {
                ensure!(
                    head.values == t.values,
                    "{}: lm_head.weight differs from {hf}; only tied embeddings are supported",
                    path.display()
                );
            }
            let padded = t.resized(0, config.padded_vocab_size);
            (padded.shape, padded.values)
        } else if name.contains(".self_attention.query_key_value.") {
            let rows = if name.ends_with(".weight") {
                t.shape[0]
            } else {
                1
            };
            ensure!(
                t.shape.last() == Some(&(3 * heads * head_dim)),
                "{}: {hf} is {:?}, expected {} columns",
                path.display(),
                t.shape,
                3 * heads * head_dim
            );
            let values = permute_qkv(&t.values, rows, heads, head_dim, QkvOrder::FromHf);
            (t.shape, values)
        } else {
            (t.shape, t.values)
        };
        out.insert(name, (shape, values));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qkv_columns_go_back_from_per_part_to_per_head() {
        // 2 heads × head_dim 1: HF [q0 q1 k0 k1 v0 v1] → ours [q0 k0 v0 q1 k1 v1].
        assert_eq!(
            permute_qkv(&[1., 4., 2., 5., 3., 6.], 1, 2, 1, QkvOrder::FromHf),
            [1., 2., 3., 4., 5., 6.]
        );
    }

    #[test]
    fn hf_names_map_with_or_without_the_transformer_prefix() {
        assert_eq!(
            ferrotron_name("transformer.h.3.attn.c_attn.weight").unwrap(),
            Some("layers.3.self_attention.query_key_value.weight".into())
        );
        assert_eq!(
            ferrotron_name("h.0.mlp.c_proj.bias").unwrap(),
            Some("layers.0.mlp.dense_4h_to_h.bias".into())
        );
        assert_eq!(ferrotron_name("h.0.attn.bias").unwrap(), None);
        assert_eq!(
            ferrotron_name("wte.weight").unwrap(),
            Some("word_embeddings.weight".into())
        );
        assert!(ferrotron_name("h.0.attn.q_proj.weight").is_err());
    }
}
