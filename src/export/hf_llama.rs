//! HuggingFace's Llama family (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
//! `Qwen3ForCausalLM`) to ferrotron and back.
//!
//! The four share one layout: `model.embed_tokens`, per layer `input_layernorm`,
//! `self_attn.{q,k,v,o}_proj` (Qwen3 adds `self_attn.{q,k}_norm`), `post_attention_layernorm`,
//! `mlp.{gate,up,down}_proj`, then `model.norm` and `lm_head` (absent when tied). PyTorch's
//! `Linear` stores `[out, in]`, ferrotron `[in, out]`, so weights are transposed; the separate
//! q, k and v join into ferrotron's fused per-group projection (`[the group's queries, its key,
//! its value]` per group, Megatron-Core's `linear_qkv` order). HF rotates the two halves of
//! each head (`rotate_half`), which is ferrotron's (and Megatron's) default rotary layout, so
//! no permutation of q and k is needed.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

use super::hf_import::ParameterValues;
use crate::model::named_parameters::named_parameters;
use crate::model::vocab::padded_vocab_size;
use crate::model::{Gpt, GptConfig, Normalization, PositionEmbedding, RopeScaling};
use crate::util::host_tensor::HostTensor;

/// The HF model class a ferrotron model of the Llama family is written as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlamaFamily {
    /// `LlamaForCausalLM`.
    Llama,
    /// `MistralForCausalLM` (Llama's layout; a sliding window).
    Mistral,
    /// `Qwen2ForCausalLM`: biases on q, k and v only.
    Qwen2,
    /// `Qwen3ForCausalLM`: per-head q/k RMSNorm, explicit head width.
    Qwen3,
}

impl LlamaFamily {
    /// The family of HF's `model_type`, `None` for other models.
    pub fn of_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "llama" => Some(Self::Llama),
            "mistral" => Some(Self::Mistral),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            _ => None,
        }
    }

    /// The HF class that can hold `config`, or why none can.
    pub fn for_config(config: &GptConfig) -> Result<Self> {
        let unsupported = |what: &str| -> Result<Self> {
            bail!("a model with {what} has no HuggingFace Llama-family class; export-hf writes GPT-2 (LayerNorm, learned positions, GELU, biases, tied output) or Llama/Qwen2/Qwen3 (RMSNorm, rotary, SwiGLU)")
        };
        if config.normalization != Normalization::RmsNorm {
            return unsupported("LayerNorm");
        }
        if config.position_embedding_type != PositionEmbedding::Rope {
            return unsupported("no rotary embedding");
        }
        if !config.swiglu {
            return unsupported("a GELU MLP");
        }
        if config.apply_layernorm_1p || config.rotary_interleaved {
            return unsupported("--apply-layernorm-1p or --rotary-interleaved");
        }
        let family = match (
            config.qk_layernorm,
            config.add_bias_linear,
            config.add_qkv_bias,
        ) {
            (true, false, false) => Self::Qwen3,
            (false, false, true) => Self::Qwen2,
            (false, _, false) => Self::Llama,
            _ => return unsupported("this combination of biases and query/key norms"),
        };
        if config.window_size.is_none() {
            return Ok(family);
        }
        match family {
            // Mistral is Llama with a window on every layer (and no MLP bias).
            Self::Llama if config.window_layers.is_none() && !config.add_bias_linear => {
                Ok(Self::Mistral)
            }
            Self::Llama => unsupported(
                "a sliding window on some layers only, or biases (Mistral windows every layer, without biases)",
            ),
            _ => first_windowed_layer(config).map(|_| family),
        }
    }

    /// HF's `model_type` and class name.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Self::Llama => ("llama", "LlamaForCausalLM"),
            Self::Mistral => ("mistral", "MistralForCausalLM"),
            Self::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
            Self::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
        }
    }
}

/// Reads one key of a `config.json`.
struct ConfigJson<'a> {
    json: &'a Value,
    path: &'a Path,
}

impl ConfigJson<'_> {
    fn int(&self, key: &str) -> Result<usize> {
        self.json
            .get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .with_context(|| format!("{}: expected a number under {key:?}", self.path.display()))
    }
    fn int_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => self.int(key),
        }
    }
    fn float(&self, key: &str, default: f64) -> f64 {
        self.json
            .get(key)
            .and_then(Value::as_f64)
            .unwrap_or(default)
    }
    fn flag(&self, key: &str, default: bool) -> bool {
        self.json
            .get(key)
            .and_then(Value::as_bool)
            .unwrap_or(default)
    }
}

/// The rotary settings of a `config.json`: transformers 5's `rope_parameters`, or the
/// top-level `rope_theta` and `rope_scaling` most published checkpoints carry.
fn rope_from_hf(c: &ConfigJson) -> Result<(f64, Option<RopeScaling>)> {
    let parameters = c.json.get("rope_parameters").filter(|v| v.is_object());
    let theta = parameters
        .and_then(|p| p.get("rope_theta"))
        .and_then(Value::as_f64)
        .unwrap_or(c.float("rope_theta", 10000.0));
    let scaling = parameters.or_else(|| c.json.get("rope_scaling").filter(|v| v.is_object()));
    let Some(scaling) = scaling else {
        return Ok((theta, None));
    };
    let kind = scaling
        .get("rope_type")
        .or_else(|| scaling.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| scaling.get(key).and_then(Value::as_f64);
    match kind {
        "default" => Ok((theta, None)),
        "llama3" => {
            let original = number("original_max_position_embeddings").with_context(|| {
                format!(
                    "{}: llama3 rope scaling without original_max_position_embeddings",
                    c.path.display()
                )
            })?;
            let scaling = RopeScaling {
                factor: number("factor").unwrap_or(8.0),
                low_freq_factor: number("low_freq_factor").unwrap_or(1.0),
                high_freq_factor: number("high_freq_factor").unwrap_or(4.0),
                original_max_position_embeddings: original,
            };
            scaling.validate().map_err(anyhow::Error::msg)?;
            Ok((theta, Some(scaling)))
        }
        other => bail!(
            "{}: rope_type {other:?} is not supported (default and llama3 are)",
            c.path.display()
        ),
    }
}

/// The model of a Llama-family `config.json` (`path`, for messages), with the vocabulary
/// padded to a multiple of `divisible_by`. Returns the config and the unpadded vocabulary.
pub fn llama_config_from_hf(
    json: &Value,
    path: &Path,
    family: LlamaFamily,
    divisible_by: usize,
) -> Result<(GptConfig, usize)> {
    let c = ConfigJson { json, path };
    let activation = json
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    ensure!(
        activation == "silu",
        "{}: hidden_act {activation:?}: only silu (SwiGLU) is supported",
        path.display()
    );
    let (hidden, heads) = (c.int("hidden_size")?, c.int("num_attention_heads")?);
    let groups = c.int_or("num_key_value_heads", heads)?;
    let head_dim = c.int_or("head_dim", hidden / heads.max(1))?;
    let max_positions = c.int("max_position_embeddings")?;
    let layers = c.int("num_hidden_layers")?;
    let (window_size, window_layers) = sliding_window_from_hf(&c, family, layers)?;
    let (rotary_base, rope_scaling) = rope_from_hf(&c)?;
    let attention_bias = c.flag("attention_bias", false);
    let mlp_bias = c.flag("mlp_bias", false);
    ensure!(
        attention_bias == mlp_bias,
        "{}: attention_bias {attention_bias} with mlp_bias {mlp_bias}: Megatron's --disable-bias-linear covers both",
        path.display()
    );
    let vocab = c.int("vocab_size")?;
    let config = GptConfig::new(
        c.int("num_hidden_layers")?,
        hidden,
        heads,
        max_positions,
        padded_vocab_size(vocab, divisible_by, 1),
    )
    .with_ffn_hidden_size(Some(c.int("intermediate_size")?))
    .with_hidden_dropout(0.0)
    .with_attention_dropout(c.float("attention_dropout", 0.0))
    .with_layernorm_epsilon(c.float("rms_norm_eps", 1e-6))
    .with_init_method_std(c.float("initializer_range", 0.02))
    .with_position_embedding_type(PositionEmbedding::Rope)
    .with_rotary_base(rotary_base)
    .with_rotary_percent(c.float("partial_rotary_factor", 1.0))
    .with_rope_scaling(rope_scaling)
    .with_normalization(Normalization::RmsNorm)
    .with_swiglu(true)
    .with_add_bias_linear(attention_bias && family != LlamaFamily::Qwen2)
    .with_add_qkv_bias(family == LlamaFamily::Qwen2)
    .with_num_query_groups(Some(groups))
    .with_kv_channels(Some(head_dim))
    .with_qk_layernorm(family == LlamaFamily::Qwen3)
    .with_untie_embeddings_and_output_weights(!c.flag("tie_word_embeddings", false))
    .with_window_size(window_size)
    .with_window_layers(window_layers);
    config.validate().map_err(anyhow::Error::msg)?;
    Ok((config, vocab))
}

/// The sliding window of a `config.json` as ferrotron's (Megatron's) `window_size` and
/// `window_layers`: HF's `sliding_window` W lets a query see W keys, itself included
/// (`kv_idx > q_idx - W`), which is Megatron's window of W − 1 keys before it. Mistral windows
/// every layer; Qwen2 and Qwen3 only with `use_sliding_window`, the layers `layer_types` names
/// `sliding_attention` or else those from `max_window_layers` on.
fn sliding_window_from_hf(
    c: &ConfigJson<'_>,
    family: LlamaFamily,
    layers: usize,
) -> Result<(Option<usize>, Option<Vec<bool>>)> {
    let windowed_family = match family {
        LlamaFamily::Llama => false,
        LlamaFamily::Mistral => true,
        LlamaFamily::Qwen2 | LlamaFamily::Qwen3 => c.flag("use_sliding_window", false),
    };
    let window = match c.json.get("sliding_window") {
        _ if !windowed_family => return Ok((None, None)),
        None | Some(Value::Null) => return Ok((None, None)),
        Some(_) => c.int("sliding_window")?,
    };
    ensure!(
        window > 0,
        "{}: sliding_window 0 sees no key",
        c.path.display()
    );
    if family == LlamaFamily::Mistral {
        return Ok((Some(window - 1), None));
    }
    let pattern: Vec<bool> = match c.json.get("layer_types").and_then(Value::as_array) {
        Some(types) => types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => bail!(
                    "{}: layer_types entry {t}: expected sliding_attention or full_attention",
                    c.path.display()
                ),
            })
            .collect::<Result<_>>()?,
        None => {
            let first = c.int_or("max_window_layers", 28)?;
            (0..layers).map(|i| i >= first).collect()
        }
    };
    ensure!(
        pattern.len() == layers,
        "{}: {} layer_types for {layers} layers",
        c.path.display(),
        pattern.len()
    );
    Ok(match pattern.iter().all(|&w| w) {
        true => (Some(window - 1), None),
        false if pattern.iter().any(|&w| w) => (Some(window - 1), Some(pattern)),
        false => (None, None),
    })
}

/// The first windowed layer of `config` when the window covers exactly the layers from it on
/// (what Qwen2's `max_window_layers` can say), or why not.
fn first_windowed_layer(config: &GptConfig) -> Result<usize> {
    let windowed: Vec<bool> = (0..config.num_layers)
        .map(|i| config.layer_window(i).is_some())
        .collect();
    let first = windowed
        .iter()
        .position(|&w| w)
        .unwrap_or(config.num_layers);
    ensure!(
        windowed[first..].iter().all(|&w| w),
        "a sliding window on layers {windowed:?}: HF's Qwen2/Qwen3 classes window the layers from max_window_layers on"
    );
    Ok(first)
}

/// HF's `config.json` for `config` as `family`, with the unpadded vocabulary and `eod` as the
/// begin/end token. The rotary settings are written both ways (top-level `rope_theta` and
/// `rope_scaling`, and transformers 5's `rope_parameters`), so old and new versions read them.
pub fn hf_llama_config(config: &GptConfig, family: LlamaFamily, vocab: usize, eod: u32) -> Value {
    let (model_type, class) = family.names();
    let rope_scaling = config.rope_scaling.map(|s| {
        json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        })
    });
    let mut rope_parameters = rope_scaling
        .clone()
        .unwrap_or_else(|| json!({"rope_type": "default"}));
    rope_parameters["rope_theta"] = json!(config.rotary_base);
    let mut out = json!({
        "architectures": [class],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_size(),
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.query_groups(),
        "head_dim": config.head_dim(),
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon,
        "initializer_range": config.init_method_std,
        "rope_theta": config.rotary_base,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "partial_rotary_factor": config.rotary_percent,
        "attention_bias": config.add_bias_linear,
        "attention_dropout": config.attention_dropout,
        "tie_word_embeddings": config.tied_output(),
        "bos_token_id": eod,
        "eos_token_id": eod,
        "torch_dtype": "float32",
        "use_cache": true,
    });
    if family == LlamaFamily::Llama {
        out["mlp_bias"] = json!(config.add_bias_linear);
    }
    // HF's window counts the query itself (see `sliding_window_from_hf`).
    let hf_window = config.window_size.map(|w| w + 1);
    match family {
        LlamaFamily::Mistral => out["sliding_window"] = json!(hf_window),
        LlamaFamily::Qwen2 | LlamaFamily::Qwen3 => {
            out["use_sliding_window"] = json!(hf_window.is_some());
            out["sliding_window"] = json!(hf_window);
            if hf_window.is_some() {
                // `for_config` chose the family only if the windowed layers are a suffix.
                let first = first_windowed_layer(config).unwrap_or(0);
                let kinds: Vec<&str> = (0..config.num_layers)
                    .map(|i| match config.layer_window(i) {
                        Some(_) => "sliding_attention",
                        None => "full_attention",
                    })
                    .collect();
                out["max_window_layers"] = json!(first);
                out["layer_types"] = json!(kinds);
            }
        }
        LlamaFamily::Llama => {}
    }
    out
}

/// Per-layer modules whose weights only transpose (ferrotron's name, HF's).
const LAYER_LINEARS: [(&str, &str); 4] = [
    ("self_attention.dense", "self_attn.o_proj"),
    ("mlp.dense_h_to_4h_gate", "mlp.gate_proj"),
    ("mlp.dense_h_to_4h", "mlp.up_proj"),
    ("mlp.dense_4h_to_h", "mlp.down_proj"),
];

/// Per-layer norms (ferrotron's name, HF's).
const LAYER_NORMS: [(&str, &str); 4] = [
    ("input_layernorm", "input_layernorm"),
    ("post_attention_layernorm", "post_attention_layernorm"),
    ("self_attention.q_layernorm", "self_attn.q_norm"),
    ("self_attention.k_layernorm", "self_attn.k_norm"),
];

/// The head layout of the fused projection: query heads per group, groups, head width.
#[derive(Clone, Copy)]
struct Groups {
    per_group: usize,
    groups: usize,
    head_dim: usize,
}

impl Groups {
    fn of(config: &GptConfig) -> Self {
        let groups = config.query_groups();
        Self {
            per_group: config.num_attention_heads / groups,
            groups,
            head_dim: config.head_dim(),
        }
    }

    /// HF's q `[heads·d, …]`, k and v `[groups·d, …]` (rows) interleaved per group into
    /// `[groups · (per group + 2) · d, …]`.
    fn fuse(self, [q, k, v]: [&HostTensor; 3]) -> Result<HostTensor> {
        let d = self.head_dim;
        let mut parts = Vec::with_capacity(3 * self.groups);
        for g in 0..self.groups {
            parts.push(q.narrow(0, g * self.per_group * d, self.per_group * d));
            parts.push(k.narrow(0, g * d, d));
            parts.push(v.narrow(0, g * d, d));
        }
        HostTensor::concat(&parts, 0).map_err(anyhow::Error::msg)
    }

    /// [`Self::fuse`] undone: q, k and v rows of the fused rows.
    fn split(self, fused: &HostTensor) -> Result<[HostTensor; 3]> {
        let d = self.head_dim;
        let stride = (self.per_group + 2) * d;
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for g in 0..self.groups {
            q.push(fused.narrow(0, g * stride, self.per_group * d));
            k.push(fused.narrow(0, g * stride + self.per_group * d, d));
            v.push(fused.narrow(0, g * stride + (self.per_group + 1) * d, d));
        }
        let join =
            |parts: Vec<HostTensor>| HostTensor::concat(&parts, 0).map_err(anyhow::Error::msg);
        Ok([join(q)?, join(k)?, join(v)?])
    }
}

/// `t` transposed when it is a matrix (weights), as it is otherwise (biases).
fn transpose_weight(t: &HostTensor) -> Result<HostTensor> {
    if t.shape.len() == 2 {
        t.transposed().map_err(anyhow::Error::msg)
    } else {
        Ok(t.clone())
    }
}

/// Takes HF tensor `name` out of `tensors`, or says which file lacks it.
fn take(tensors: &mut HashMap<String, HostTensor>, name: &str, dir: &Path) -> Result<HostTensor> {
    tensors
        .remove(name)
        .or_else(|| tensors.remove(name.strip_prefix("model.").unwrap_or(name)))
        .with_context(|| format!("{}: no tensor {name}", dir.display()))
}

/// The ferrotron parameters of the Llama-family `tensors` (by HF name, read from `dir`) for
/// `config`; `vocab` is the unpadded vocabulary.
pub fn llama_parameters(
    mut tensors: HashMap<String, HostTensor>,
    config: &GptConfig,
    vocab: usize,
    dir: &Path,
) -> Result<ParameterValues> {
    let mut out = ParameterValues::new();
    let mut put = |name: String, t: HostTensor| {
        out.insert(name, (t.shape, t.values));
    };
    let embedding = take(&mut tensors, "model.embed_tokens.weight", dir)?;
    ensure!(
        embedding.shape == [vocab, config.hidden_size],
        "{}: model.embed_tokens.weight is {:?}, config.json says [{vocab}, {}]",
        dir.display(),
        embedding.shape,
        config.hidden_size
    );
    let padded = config.padded_vocab_size;
    let head = tensors.remove("lm_head.weight");
    if !config.tied_output() {
        let head = head.with_context(|| {
            format!(
                "{}: no lm_head.weight, yet tie_word_embeddings is false",
                dir.display()
            )
        })?;
        put(
            "output_layer.weight".into(),
            transpose_weight(&head.resized(0, padded))?,
        );
    }
    put(
        "word_embeddings.weight".into(),
        embedding.resized(0, padded),
    );
    put(
        "final_layernorm.weight".into(),
        take(&mut tensors, "model.norm.weight", dir)?,
    );
    let groups = Groups::of(config);
    for layer in 0..config.num_layers {
        let hf = |module: &str| format!("model.layers.{layer}.{module}");
        let ours = |module: &str| format!("layers.{layer}.{module}");
        let mut kinds = vec!["weight"];
        if config.qkv_bias() {
            kinds.push("bias");
        }
        for kind in kinds {
            let [q, k, v] = ["q_proj", "k_proj", "v_proj"]
                .map(|p| take(&mut tensors, &hf(&format!("self_attn.{p}.{kind}")), dir));
            let fused = groups.fuse([&q?, &k?, &v?])?;
            put(
                ours(&format!("self_attention.query_key_value.{kind}")),
                transpose_weight(&fused)?,
            );
        }
        for (module, theirs) in LAYER_LINEARS {
            put(
                ours(&format!("{module}.weight")),
                transpose_weight(&take(&mut tensors, &hf(&format!("{theirs}.weight")), dir)?)?,
            );
            if config.add_bias_linear {
                put(
                    ours(&format!("{module}.bias")),
                    take(&mut tensors, &hf(&format!("{theirs}.bias")), dir)?,
                );
            }
        }
        for (module, theirs) in LAYER_NORMS {
            if module.starts_with("self_attention.") && !config.qk_layernorm {
                continue;
            }
            put(
                ours(&format!("{module}.weight")),
                take(&mut tensors, &hf(&format!("{theirs}.weight")), dir)?,
            );
        }
    }
    // Rotary tables some files carry are computed, not parameters.
    tensors.retain(|name, _| !name.ends_with("rotary_emb.inv_freq"));
    if let Some(name) = tensors.keys().min() {
        bail!(
            "{}: tensor {name} has no ferrotron parameter",
            dir.display()
        );
    }
    Ok(out)
}

/// The HF tensors of `model` (a whole model of the Llama family), with the vocabulary cut to
/// `vocab` rows.
pub fn hf_llama_tensors(
    model: &Gpt,
    config: &GptConfig,
    vocab: usize,
) -> Result<Vec<(String, HostTensor)>> {
    let groups = Groups::of(config);
    let mut out = Vec::new();
    for p in named_parameters(model) {
        let t = HostTensor::new(p.shape, p.values);
        let name = p.name.as_str();
        match name {
            "word_embeddings.weight" => {
                out.push(("model.embed_tokens.weight".into(), t.resized(0, vocab)));
            }
            "output_layer.weight" => {
                out.push((
                    "lm_head.weight".into(),
                    transpose_weight(&t)?.resized(0, vocab),
                ));
            }
            "final_layernorm.weight" => out.push(("model.norm.weight".into(), t)),
            _ => out.extend(hf_layer_tensors(name, t, groups)?),
        }
    }
    Ok(out)
}

/// HF's tensors for one layer parameter (`layers.N.…`).
fn hf_layer_tensors(
    name: &str,
    t: HostTensor,
    groups: Groups,
) -> Result<Vec<(String, HostTensor)>> {
    let rest = name
        .strip_prefix("layers.")
        .with_context(|| format!("no HuggingFace name for {name}"))?;
    let (layer, local) = rest
        .split_once('.')
        .context("layer parameter without a name")?;
    let (module, kind) = local.rsplit_once('.').context("parameter without a kind")?;
    let hf = |theirs: &str| format!("model.layers.{layer}.{theirs}.{kind}");
    if module == "self_attention.query_key_value" {
        let fused = transpose_weight(&t)?;
        let [q, k, v] = groups.split(&fused)?;
        // The fused rows are HF's `[out, in]` rows already.
        return Ok([("q_proj", q), ("k_proj", k), ("v_proj", v)]
            .into_iter()
            .map(|(p, part)| (hf(&format!("self_attn.{p}")), part))
            .collect());
    }
    if let Some((_, theirs)) = LAYER_LINEARS.iter().find(|(ours, _)| *ours == module) {
        return Ok(vec![(hf(theirs), transpose_weight(&t)?)]);
    }
    if let Some((_, theirs)) = LAYER_NORMS.iter().find(|(ours, _)| *ours == module) {
        return Ok(vec![(hf(theirs), t)]);
    }
    bail!("no HuggingFace name for {name}")
}
