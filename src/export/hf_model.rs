//! Which HuggingFace class a model is read from or written as: GPT-2, or one of the Llama
//! family, decided by `config.json`'s `model_type` on the way in and by the model's
//! architecture on the way out.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::hf_export::{hf_gpt2_config, hf_gpt2_tensors, hf_metadata};
use super::hf_files::{read_config, read_weights, WEIGHTS_FILE};
use super::hf_import::{ferrotron_parameters, gpt_config_from_hf, ParameterValues};
use super::hf_llama::{
    hf_llama_config, hf_llama_tensors, llama_config_from_hf, llama_parameters, LlamaFamily,
};
use crate::checkpoint::tensor_file::write_tensors;
use crate::model::{Gpt, GptConfig, Normalization, PositionEmbedding};
use crate::util::atomic_file::temp_file_beside;
use crate::util::host_tensor::HostTensor;

/// A HF model read as ferrotron's.
pub struct ImportedModel {
    /// The model, its vocabulary padded.
    pub config: GptConfig,
    /// The unpadded vocabulary.
    pub vocab: usize,
    /// Parameter values by ferrotron name.
    pub values: ParameterValues,
    /// HF's `model_type`.
    pub model_type: String,
}

/// The HF model in `dir` (GPT-2, Llama, Mistral, Qwen2 or Qwen3), its vocabulary padded to a
/// multiple of `divisible_by`.
pub fn import_hf(dir: &Path, divisible_by: usize) -> Result<ImportedModel> {
    let json = read_config(dir)?;
    let config_path = dir.join("config.json");
    let model_type = json
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("gpt2")
        .to_owned();
    let (config, vocab, values) = if model_type == "gpt2" {
        let (config, vocab) = gpt_config_from_hf(&config_path, divisible_by)?;
        let values = ferrotron_parameters(dir, &config, vocab)?;
        (config, vocab, values)
    } else if let Some(family) = LlamaFamily::of_model_type(&model_type) {
        let (config, vocab) = llama_config_from_hf(&json, &config_path, family, divisible_by)?;
        let values = llama_parameters(read_weights(dir)?, &config, vocab, dir)?;
        (config, vocab, values)
    } else {
        bail!(
            "{}: model_type {model_type:?}: supported are gpt2, llama, mistral, qwen2 and qwen3",
            config_path.display()
        );
    };
    Ok(ImportedModel {
        config,
        vocab,
        values,
        model_type,
    })
}

/// Whether `GPT2LMHeadModel` can hold the model: LayerNorm, learned positions, a GELU MLP,
/// biases everywhere, one key/value head per head of width hidden / heads, tied output.
fn fits_gpt2(config: &GptConfig) -> bool {
    config.position_embedding_type == PositionEmbedding::LearnedAbsolute
        && config.normalization == Normalization::LayerNorm
        && !config.swiglu
        && config.add_bias_linear
        && !config.qk_layernorm
        && !config.apply_layernorm_1p
        && config.tied_output()
        && config.query_groups() == config.num_attention_heads
        && config.head_dim() * config.num_attention_heads == config.hidden_size
        && config.window_size.is_none()
}

/// HF's `config.json` and tensors for `model` (a whole model), with the vocabulary cut to
/// `vocab` and `eod` as the begin/end token: GPT-2 for a model of GPT-2's architecture,
/// otherwise the Llama-family class that holds it.
pub fn export_hf(
    model: &Gpt,
    config: &GptConfig,
    vocab: usize,
    eod: u32,
) -> Result<(Value, Vec<(String, HostTensor)>)> {
    if fits_gpt2(config) {
        return Ok((
            hf_gpt2_config(config, vocab, eod),
            hf_gpt2_tensors(model, config, vocab)?,
        ));
    }
    let family = LlamaFamily::for_config(config)?;
    Ok((
        hf_llama_config(config, family, vocab, eod),
        hf_llama_tensors(model, config, vocab)?,
    ))
}

/// Writes a HF model directory: `config.json` and `model.safetensors` (each atomically).
pub fn write_hf_dir(dir: &Path, config: &Value, tensors: &[(String, HostTensor)]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write_tensors(&dir.join(WEIGHTS_FILE), tensors, hf_metadata())?;
    let path = dir.join("config.json");
    let write = || -> std::io::Result<()> {
        let mut file = temp_file_beside(&path)?;
        file.write_all(serde_json::to_string_pretty(config)?.as_bytes())?;
        file.persist(&path)?;
        Ok(())
    };
    write().with_context(|| format!("writing {}", path.display()))
}
