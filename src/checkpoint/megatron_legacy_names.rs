//! Megatron-LM's legacy GPT names (`--use-legacy-models`, and every checkpoint from before
//! Megatron-Core), mapped to Megatron-Core's, which the rest of the reader knows.
//!
//! The legacy `GPTModel` nests its state dict under `language_model` (read back flattened):
//! `language_model.embedding.{word,position}_embeddings.weight`,
//! `language_model.encoder.layers.N.{input_norm, self_attention.query_key_value,
//! self_attention.dense, post_attention_norm, mlp.dense_h_to_4h, mlp.dense_4h_to_h}`,
//! `language_model.encoder.final_norm` and, untied, `language_model.output_layer.weight`
//! (checked against checkpoints Megatron-LM core_v0.16.1's legacy model wrote,
//! `tests/fixtures/megatron_ckpt/gpt2_legacy/` and `llama_legacy/`). Older releases spell the
//! norms `input_layernorm`, `post_attention_layernorm` and `final_layernorm`, and the encoder
//! `transformer`. The tensors themselves are laid out as Megatron-Core's: the fused
//! query/key/value rows per query group, SwiGLU's `dense_h_to_4h` as `[gate; up]`, the same
//! tensor-parallel splits.

/// Megatron-Core's name for the state-dict key `key` (itself when it is not a legacy name).
pub fn core_key(key: &str) -> String {
    let Some(rest) = key.strip_prefix("language_model.") else {
        return key.to_owned();
    };
    if let Some(embedding) = rest.strip_prefix("embedding.") {
        return format!("embedding.{embedding}");
    }
    if let Some(output) = rest.strip_prefix("output_layer.") {
        return format!("output_layer.{output}");
    }
    let Some(block) = rest
        .strip_prefix("encoder.")
        .or_else(|| rest.strip_prefix("transformer."))
    else {
        return key.to_owned();
    };
    for norm in ["final_norm.", "final_layernorm."] {
        if let Some(kind) = block.strip_prefix(norm) {
            return format!("decoder.final_layernorm.{kind}");
        }
    }
    let Some((layer, module)) = block
        .strip_prefix("layers.")
        .and_then(|l| l.split_once('.'))
    else {
        return key.to_owned();
    };
    let (module, kind) = module.rsplit_once('.').unwrap_or((module, ""));
    let core = match module {
        "input_norm" | "input_layernorm" => "input_layernorm",
        "self_attention.query_key_value" => "self_attention.linear_qkv",
        "self_attention.dense" => "self_attention.linear_proj",
        "post_attention_norm" | "post_attention_layernorm" => "pre_mlp_layernorm",
        "mlp.dense_h_to_4h" => "mlp.linear_fc1",
        "mlp.dense_4h_to_h" => "mlp.linear_fc2",
        _ => return key.to_owned(),
    };
    format!("decoder.layers.{layer}.{core}.{kind}")
}

#[cfg(test)]
mod tests {
    use super::core_key;

    #[test]
    fn legacy_names_become_megatron_cores() {
        for (legacy, core) in [
            (
                "language_model.embedding.word_embeddings.weight",
                "embedding.word_embeddings.weight",
            ),
            (
                "language_model.encoder.layers.1.post_attention_norm.bias",
                "decoder.layers.1.pre_mlp_layernorm.bias",
            ),
            (
                "language_model.transformer.layers.0.input_layernorm.weight",
                "decoder.layers.0.input_layernorm.weight",
            ),
            (
                "language_model.encoder.layers.0.self_attention.query_key_value._extra_state",
                "decoder.layers.0.self_attention.linear_qkv._extra_state",
            ),
            (
                "language_model.encoder.final_layernorm.weight",
                "decoder.final_layernorm.weight",
            ),
            ("language_model.output_layer.weight", "output_layer.weight"),
            (
                "decoder.layers.0.mlp.linear_fc1.weight",
                "decoder.layers.0.mlp.linear_fc1.weight",
            ),
        ] {
            assert_eq!(core_key(legacy), core, "{legacy}");
        }
    }
}
