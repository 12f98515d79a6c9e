//! Export to a HuggingFace `GPT2LMHeadModel` (`config.json` + `model.safetensors`).
//!
//! Name mapping (ferrotron → HF): `word_embeddings.weight` → `transformer.wte.weight` (padding rows
//! dropped), `position_embeddings` → `transformer.wpe.weight`, per layer `input_layernorm` →
//! `ln_1`, `self_attention.query_key_value` → `attn.c_attn` (columns reordered from Megatron's
//! per-head `[q k v]` to HF's `[all q | all k | all v]`), `self_attention.dense` →
//! `attn.c_proj`, `post_attention_layernorm` → `ln_2`, `mlp.dense_h_to_4h` → `mlp.c_fc`,
//! `mlp.dense_4h_to_h` → `mlp.c_proj`, `final_layernorm` → `transformer.ln_f`. HF's `Conv1D`
//! stores weights `[in, out]` like ferrotron, so no transposes are needed.

use std::collections::HashMap;

use anyhow::{Context, Result};

use crate::model::named_parameters::named_parameters;
use crate::model::{Gpt, GptConfig};
use crate::util::host_tensor::HostTensor;

/// Which way [`permute_qkv`] moves the fused QKV columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QkvOrder {
    /// Megatron's `[head, (q|k|v), head_dim]` → HF's `[(q|k|v), head, head_dim]`.
    ToHf,
    /// HF's order back to Megatron's.
    FromHf,
}

/// Permutes the fused QKV output columns between Megatron's per-head order and HF's
/// per-part order; `rows` is 1 for the bias.
pub(crate) fn permute_qkv(
    values: &[f32],
    rows: usize,
    heads: usize,
    head_dim: usize,
    order: QkvOrder,
) -> Vec<f32> {
    let width = 3 * heads * head_dim;
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for head in 0..heads {
            for part in 0..3 {
                for d in 0..head_dim {
                    let ours = r * width + head * 3 * head_dim + part * head_dim + d;
                    let theirs = r * width + part * heads * head_dim + head * head_dim + d;
                    match order {
                        QkvOrder::ToHf => out[theirs] = values[ours],
                        QkvOrder::FromHf => out[ours] = values[theirs],
                    }
                }
            }
        }
    }
    out
}

/// Per-layer module names, ferrotron's and HF's (`transformer.h.N.<hf>.{weight,bias}`).
pub(crate) const LAYER_MODULES: [(&str, &str); 6] = [
    ("input_layernorm", "ln_1"),
    ("post_attention_layernorm", "ln_2"),
    ("self_attention.query_key_value", "attn.c_attn"),
    ("self_attention.dense", "attn.c_proj"),
    ("mlp.dense_h_to_4h", "mlp.c_fc"),
    ("mlp.dense_4h_to_h", "mlp.c_proj"),
];

/// The HF tensors of `model`, with the embedding cut to `vocab_size` rows.
pub fn hf_gpt2_tensors(
    model: &Gpt,
    config: &GptConfig,
    vocab_size: usize,
) -> Result<Vec<(String, HostTensor)>> {
    let (heads, head_dim) = (config.num_attention_heads, config.head_dim());
    let mut out = Vec::new();
    for p in named_parameters(model) {
        let name = p.name.as_str();
        let (hf, tensor) = if name == "word_embeddings.weight" {
            let h = p.shape[1];
            let values = p.values[..vocab_size * h].to_vec();
            (
                "transformer.wte.weight".to_owned(),
                HostTensor {
                    shape: vec![vocab_size, h],
                    values,
                },
            )
        } else if name == "position_embeddings" {
            (
                "transformer.wpe.weight".to_owned(),
                HostTensor {
                    shape: p.shape,
                    values: p.values,
                },
            )
        } else if let Some(rest) = name.strip_prefix("final_layernorm.") {
            (
                format!("transformer.ln_f.{rest}"),
                HostTensor {
                    shape: p.shape,
                    values: p.values,
                },
            )
        } else if let Some(rest) = name.strip_prefix("layers.") {
            let (layer, local) = rest
                .split_once('.')
                .context("layer parameter without a name")?;
            let (module, kind) = local.rsplit_once('.').context("parameter without a kind")?;
            let hf_module = LAYER_MODULES
                .iter()
                .find(|(ours, _)| *ours == module)
                .map(|(_, hf)| *hf)
                .with_context(|| format!("no HuggingFace name for {module}"))?;
            let values = if module == "self_attention.query_key_value" {
                let rows = if kind == "weight" { p.shape[0] } else { 1 };
                permute_qkv(&p.values, rows, heads, head_dim, QkvOrder::ToHf)
            } else {
                p.values
            };
            (
                format!("transformer.h.{layer}.{hf_module}.{kind}"),
                HostTensor {
                    shape: p.shape,
                    values,
                },
            )
        } else {
            anyhow::bail!("no HuggingFace name for {name}");
        };
        out.push((hf, tensor));
    }
    Ok(out)
}

/// HF's `config.json` for the model.
pub fn hf_gpt2_config(config: &GptConfig, vocab_size: usize, eod: u32) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": config.max_position_embeddings,
        "n_ctx": config.max_position_embeddings,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_attention_heads,
        "n_inner": config.ffn_size(),
        // HF's "gelu" is the exact erf form (Megatron's default); "gelu_new" the tanh one.
        "activation_function": if config.openai_gelu { "gelu_new" } else { "gelu" },
        "layer_norm_epsilon": config.layernorm_epsilon,
        "initializer_range": config.init_method_std,
        "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout,
        "scale_attn_weights": true,
        "tie_word_embeddings": true,
        "bos_token_id": eod,
        "eos_token_id": eod,
        "torch_dtype": "float32",
    })
}

/// Metadata HF expects in the safetensors header.
pub fn hf_metadata() -> HashMap<String, String> {
    HashMap::from([("format".to_owned(), "pt".to_owned())])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qkv_columns_go_from_per_head_to_per_part() {
        // 2 heads × head_dim 1: ours [q0 k0 v0 q1 k1 v1] → HF [q0 q1 k0 k1 v0 v1].
        assert_eq!(
            permute_qkv(&[1., 2., 3., 4., 5., 6.], 1, 2, 1, QkvOrder::ToHf),
            [1., 4., 2., 5., 3., 6.]
        );
    }
}
