//! The GPT's shape and regularization, with Megatron's flag names and defaults.

use burn::config::Config;
use burn::tensor::Device;

use super::architecture::{Normalization, PositionEmbedding, RopeScaling, YarnScaling};
use super::stage::StageLayers;
use super::Gpt;
use crate::comm::Group;

/// Megatron's model flags.
#[derive(Config, Debug, PartialEq)]
pub struct GptConfig {
    /// `--num-layers`.
    pub num_layers: usize,
    /// `--hidden-size`.
    pub hidden_size: usize,
    /// `--num-attention-heads`.
    pub num_attention_heads: usize,
    /// `--max-position-embeddings`.
    pub max_position_embeddings: usize,
    /// The padded vocabulary size (see [`super::padded_vocab_size`]).
    pub padded_vocab_size: usize,
    /// `--ffn-hidden-size` (default 4 × hidden).
    pub ffn_hidden_size: Option<usize>,
    /// `--hidden-dropout`.
    #[config(default = 0.1)]
    pub hidden_dropout: f64,
    /// `--attention-dropout`.
    #[config(default = 0.1)]
    pub attention_dropout: f64,
    /// `--layernorm-epsilon`.
    #[config(default = 1e-5)]
    pub layernorm_epsilon: f64,
    /// `--init-method-std`.
    #[config(default = 0.02)]
    pub init_method_std: f64,
    /// `--openai-gelu`: the tanh approximation instead of the exact erf GELU.
    #[config(default = false)]
    pub openai_gelu: bool,
    /// The fused scaled causal-masked softmax kernel where the backend has it
    /// (`--no-masked-softmax-fusion` turns it off; the math is the same).
    #[config(default = true)]
    pub masked_softmax_fusion: bool,
    /// The fused LayerNorm kernel where the backend has it (`--no-persist-layer-norm` turns it
    /// off; the math is the same).
    #[config(default = true)]
    pub layer_norm_fusion: bool,
    /// The fused rotary-embedding kernel where the backend has it (`--no-rope-fusion` turns it
    /// off; the math is the same).
    #[config(default = true)]
    pub rope_fusion: bool,
    /// The fused SwiGLU kernel where the backend has it (`--no-bias-swiglu-fusion` turns it
    /// off; the math is the same).
    #[config(default = true)]
    pub bias_swiglu_fusion: bool,
    /// The fused GELU kernel where the backend has it (`--no-bias-gelu-fusion` turns it off;
    /// the math is the same).
    #[config(default = true)]
    pub bias_gelu_fusion: bool,
    /// The fused bias-dropout-add kernel where the backend has it (`--no-bias-dropout-fusion`
    /// turns it off; the math is the same).
    #[config(default = true)]
    pub bias_dropout_fusion: bool,
    /// Fused causal attention where the backend has it (`--use-flash-attn`): the
    /// FlashAttention-style kernel with dropout inside, which never stores the `[s, s]`
    /// scores. Off by default, as in Megatron; the math is the composed attention's.
    #[config(default = false)]
    pub flash_attention: bool,
    /// The attention core from the projection's rows (CubeCL devices) keeps only q, k, v and
    /// forms its probabilities again in its backward, as selective recomputation makes it:
    /// `--attention-backend fused`, and `auto` on CUDA in half precision. Where the core is
    /// not that op it keeps what its ops keep. The math is the same, bit for bit.
    #[config(default = false)]
    pub core_keeps_only_inputs: bool,
    /// `--position-embedding-type`.
    #[config(default = "PositionEmbedding::LearnedAbsolute")]
    pub position_embedding_type: PositionEmbedding,
    /// `--rotary-base`: the rotary wavelengths' base θ.
    #[config(default = 10000.0)]
    pub rotary_base: f64,
    /// `--rotary-percent`: the share of each head's channels that is rotated.
    #[config(default = 1.0)]
    pub rotary_percent: f64,
    /// `--rotary-interleaved`: rotate channel pairs (2i, 2i+1) instead of the two halves of
    /// the rotated channels (HF's and Megatron's default).
    #[config(default = false)]
    pub rotary_interleaved: bool,
    /// `--use-rope-scaling` (Llama 3.1's long-context frequencies).
    pub rope_scaling: Option<RopeScaling>,
    /// `--position-embedding-type yarn`: YaRN's frequencies and concentration (with the
    /// rotary embedding; not with `rope_scaling`).
    pub yarn: Option<YarnScaling>,
    /// `--normalization`.
    #[config(default = "Normalization::LayerNorm")]
    pub normalization: Normalization,
    /// `--apply-layernorm-1p`: norm weights stored zero-centred, applied as `1 + γ`.
    #[config(default = false)]
    pub apply_layernorm_1p: bool,
    /// `--swiglu`: the MLP is `silu(x·W_gate) ⊙ (x·W_up)`, then down.
    #[config(default = false)]
    pub swiglu: bool,
    /// Biases on the linear layers (`--disable-bias-linear` turns them off).
    #[config(default = true)]
    pub add_bias_linear: bool,
    /// `--add-qkv-bias`: a bias on the query/key/value projection even without the others
    /// (Qwen2).
    #[config(default = false)]
    pub add_qkv_bias: bool,
    /// `--num-query-groups` (with `--group-query-attention`): heads share key/value heads in
    /// this many groups. `None`: one group per head.
    pub num_query_groups: Option<usize>,
    /// `--kv-channels`: the width of one head (default hidden / heads).
    pub kv_channels: Option<usize>,
    /// `--qk-layernorm`: queries and keys normalized per head before the rotary embedding
    /// (Qwen3, OLMo).
    #[config(default = false)]
    pub qk_layernorm: bool,
    /// `--untie-embeddings-and-output-weights`: the output layer has its own weight.
    #[config(default = false)]
    pub untie_embeddings_and_output_weights: bool,
    /// `--sequence-parallel`: between the tensor-parallel layers (norms, dropout, residuals)
    /// each tensor-parallel rank holds only its chunk of the sequence. The math is the same;
    /// activation memory per rank is lower.
    #[config(default = false)]
    pub sequence_parallel: bool,
    /// `--reset-position-ids`: the micro-batches carry each token's position in its own
    /// document (packed documents), which the position embeddings are taken at.
    #[config(default = false)]
    pub reset_position_ids: bool,
    /// `--reset-attention-mask`: the micro-batches carry each query's first visible key (its
    /// document's first token), and attention sees nothing before it.
    #[config(default = false)]
    pub reset_attention_mask: bool,
    /// `--window-size L,0`: sliding-window attention, each query seeing itself and the `L`
    /// keys before it (Megatron's `window_size[0]`; HF's `sliding_window` is `L + 1`), within
    /// its document under `--reset-attention-mask`. `None`: every key before it.
    pub window_size: Option<usize>,
    /// Which layers the window applies to, one entry per layer (`--window-attn-skip-freq`:
    /// the others see every key before them). `None`: every layer.
    pub window_layers: Option<Vec<bool>>,
}

impl GptConfig {
    /// The config saved as `json` (a checkpoint's `model_config`). Settings added after the
    /// checkpoint was written take their defaults, which are what the model computed then.
    pub fn from_json(json: &str) -> Result<GptConfig, serde_json::Error> {
        let mut saved: serde_json::Value = serde_json::from_str(json)?;
        let defaults = serde_json::to_value(GptConfig::new(0, 0, 0, 0, 0))?;
        if let (Some(saved), serde_json::Value::Object(defaults)) =
            (saved.as_object_mut(), defaults)
        {
            for (key, value) in defaults {
                saved.entry(key).or_insert(value);
            }
        }
        serde_json::from_value(saved)
    }

    /// This run's settings (dropout, init std, fusions, sequence parallelism, the padded
    /// vocabulary) with `saved`'s architecture: what a model is computed as (positions, norm and
    /// its epsilon, activation, biases, query groups, the output layer), as Megatron's
    /// `--use-checkpoint-args` forces it from a checkpoint. The shape stays this config's.
    pub fn with_architecture_of(self, saved: &GptConfig) -> GptConfig {
        GptConfig {
            position_embedding_type: saved.position_embedding_type,
            rotary_base: saved.rotary_base,
            rotary_percent: saved.rotary_percent,
            rotary_interleaved: saved.rotary_interleaved,
            rope_scaling: saved.rope_scaling,
            yarn: saved.yarn,
            normalization: saved.normalization,
            layernorm_epsilon: saved.layernorm_epsilon,
            apply_layernorm_1p: saved.apply_layernorm_1p,
            openai_gelu: saved.openai_gelu,
            swiglu: saved.swiglu,
            add_bias_linear: saved.add_bias_linear,
            add_qkv_bias: saved.add_qkv_bias,
            num_query_groups: saved.num_query_groups,
            qk_layernorm: saved.qk_layernorm,
            untie_embeddings_and_output_weights: saved.untie_embeddings_and_output_weights,
            window_size: saved.window_size,
            window_layers: saved.window_layers.clone(),
            ..self
        }
    }

    /// The MLP width.
    pub fn ffn_size(&self) -> usize {
        self.ffn_hidden_size.unwrap_or(4 * self.hidden_size)
    }

    /// Width of one attention head (`--kv-channels`, default hidden / heads).
    pub fn head_dim(&self) -> usize {
        self.kv_channels
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The keys before each query that layer `layer` (from 0) sees besides itself: the
    /// sliding window where the layer has one (`window_size`, `window_layers`), `None` where
    /// it sees every key before it.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let windowed = self
            .window_layers
            .as_ref()
            .is_none_or(|layers| layers.get(layer).copied().unwrap_or(false));
        self.window_size.filter(|_| windowed)
    }

    /// Key/value heads: one per query group (one per head without grouped-query attention).
    pub fn query_groups(&self) -> usize {
        self.num_query_groups.unwrap_or(self.num_attention_heads)
    }

    /// Width of the fused query/key/value projection's output: every head's query, and a
    /// key and a value per group.
    pub fn qkv_size(&self) -> usize {
        (self.num_attention_heads + 2 * self.query_groups()) * self.head_dim()
    }

    /// Whether the query/key/value projection has a bias.
    pub fn qkv_bias(&self) -> bool {
        self.add_bias_linear || self.add_qkv_bias
    }

    /// Whether the output layer shares the word embedding's weight.
    pub fn tied_output(&self) -> bool {
        !self.untie_embeddings_and_output_weights
    }

    /// Whether a learned position table is added to the word embeddings.
    pub fn learned_positions(&self) -> bool {
        self.position_embedding_type == PositionEmbedding::LearnedAbsolute
    }

    /// The settings that decide which parameters exist and what the layers compute, in
    /// words, for refusing to load one model's checkpoint into another.
    pub fn architecture(&self) -> String {
        let mut parts = vec![format!("{:?}", self.normalization)];
        parts.push(match self.position_embedding_type {
            PositionEmbedding::LearnedAbsolute => "learned positions".to_owned(),
            PositionEmbedding::None => "no positions".to_owned(),
            PositionEmbedding::Rope => format!(
                "rotary (base {}, {} of each head{}{})",
                self.rotary_base,
                self.rotary_percent,
                if self.rotary_interleaved {
                    ", interleaved"
                } else {
                    ""
                },
                match (&self.rope_scaling, &self.yarn) {
                    (Some(r), _) => format!(", scaled by {}", r.factor),
                    (None, Some(y)) => format!(", YaRN × {}", y.factor),
                    (None, None) => String::new(),
                }
            ),
        });
        parts.push(if self.swiglu {
            "SwiGLU".to_owned()
        } else if self.openai_gelu {
            "tanh GELU (--openai-gelu)".to_owned()
        } else {
            "exact GELU".to_owned()
        });
        for (on, what) in [
            (self.apply_layernorm_1p, "zero-centred norm weights"),
            (!self.add_bias_linear, "no linear biases"),
            (self.add_qkv_bias, "a qkv bias"),
            (self.qk_layernorm, "query/key norms"),
            (
                self.untie_embeddings_and_output_weights,
                "an untied output layer",
            ),
        ] {
            if on {
                parts.push(what.to_owned());
            }
        }
        parts.join(", ")
    }

    /// The same model with the fusion switches and sequence parallelism as in `other` (they
    /// do not change the math, so checkpoints compare shapes without them).
    pub fn with_fusion_of(&self, other: &GptConfig) -> GptConfig {
        GptConfig {
            masked_softmax_fusion: other.masked_softmax_fusion,
            layer_norm_fusion: other.layer_norm_fusion,
            rope_fusion: other.rope_fusion,
            bias_swiglu_fusion: other.bias_swiglu_fusion,
            bias_gelu_fusion: other.bias_gelu_fusion,
            bias_dropout_fusion: other.bias_dropout_fusion,
            flash_attention: other.flash_attention,
            core_keeps_only_inputs: other.core_keeps_only_inputs,
            sequence_parallel: other.sequence_parallel,
            ..self.clone()
        }
    }

    /// Rejects shapes that cannot work, with a one-line reason.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
            ("--max-position-embeddings", self.max_position_embeddings),
            ("--ffn-hidden-size", self.ffn_size()),
            ("the vocabulary size", self.padded_vocab_size),
        ];
        for (flag, value) in positive {
            if value == 0 {
                return Err(format!("{flag} must be positive"));
            }
        }
        if self.kv_channels.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(format!(
                "--hidden-size {} is not divisible by --num-attention-heads {} (or give --kv-channels)",
                self.hidden_size, self.num_attention_heads
            ));
        }
        self.validate_attention()?;
        if let Some(layers) = &self.window_layers {
            if self.window_size.is_none() || layers.len() != self.num_layers {
                return Err(format!(
                    "--window-attn-skip-freq names {} layers of {} (and needs --window-size)",
                    layers.len(),
                    self.num_layers
                ));
            }
        }
        for (flag, p) in [
            ("--hidden-dropout", self.hidden_dropout),
            ("--attention-dropout", self.attention_dropout),
        ] {
            if !(0.0..1.0).contains(&p) {
                return Err(format!("{flag} {p} must be in [0, 1)"));
            }
        }
        let positive_float = |v: f64| v.is_finite() && v > 0.0;
        if !positive_float(self.layernorm_epsilon) || !positive_float(self.init_method_std) {
            return Err("--layernorm-epsilon and --init-method-std must be positive".into());
        }
        Ok(())
    }

    /// Rejects head and rotary settings that cannot work, with a one-line reason.
    fn validate_attention(&self) -> Result<(), String> {
        let groups = self.query_groups();
        if self.head_dim() == 0 || groups == 0 {
            return Err("--kv-channels and --num-query-groups must be positive".into());
        }
        if !self.num_attention_heads.is_multiple_of(groups) {
            return Err(format!(
                "--num-attention-heads {} is not divisible by --num-query-groups {groups}",
                self.num_attention_heads
            ));
        }
        if self.yarn.is_some() && self.position_embedding_type != PositionEmbedding::Rope {
            return Err("YaRN scales the rotary embedding; the model has none".into());
        }
        if self.position_embedding_type == PositionEmbedding::Rope {
            if !(self.rotary_percent > 0.0 && self.rotary_percent <= 1.0) {
                return Err(format!(
                    "--rotary-percent {} must be in (0, 1]",
                    self.rotary_percent
                ));
            }
            if !self.rotary_dim().is_multiple_of(2)
                || self.rotary_base.is_nan()
                || self.rotary_base <= 0.0
            {
                return Err(format!(
                    "rotary embeddings need an even number of rotated channels (head width {} × --rotary-percent {} = {}) and a positive --rotary-base",
                    self.head_dim(),
                    self.rotary_percent,
                    self.rotary_dim()
                ));
            }
            if let Some(scaling) = &self.rope_scaling {
                scaling.validate()?;
            }
            if let Some(yarn) = &self.yarn {
                yarn.validate()?;
                if self.rope_scaling.is_some()
                    || self.rotary_percent != 1.0
                    || self.rotary_interleaved
                {
                    return Err("YaRN rotates every channel in halves (--rotary-percent 1, not --rotary-interleaved) and replaces --use-rope-scaling".into());
                }
            }
        }
        Ok(())
    }

    /// The channels of each head the rotary embedding rotates (Megatron's
    /// `kv_channels × rotary_percent`).
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim() as f64 * self.rotary_percent) as usize
    }

    /// Rejects a tensor-parallel size the shapes cannot be split by, with a one-line reason.
    pub fn validate_parallel(&self, tensor_parallel_size: usize) -> Result<(), String> {
        self.validate()?;
        let n = tensor_parallel_size;
        if n == 0 {
            return Err("--tensor-model-parallel-size must be positive".into());
        }
        for (flag, value) in [
            ("--num-attention-heads", self.num_attention_heads),
            ("--num-query-groups", self.query_groups()),
            ("--ffn-hidden-size", self.ffn_size()),
            ("the padded vocabulary size", self.padded_vocab_size),
        ] {
            if !value.is_multiple_of(n) {
                return Err(format!(
                    "{flag} {value} is not divisible by --tensor-model-parallel-size {n}"
                ));
            }
        }
        Ok(())
    }

    /// Builds the model with Megatron's initialization from `seed`, on `device`.
    pub fn init(&self, seed: u64, device: &Device) -> Result<Gpt, String> {
        self.init_parallel(seed, &Group::single(), device)
    }

    /// Builds `group`'s rank of the model: its shards of the same master weights that
    /// [`Self::init`] builds whole.
    pub fn init_parallel(&self, seed: u64, group: &Group, device: &Device) -> Result<Gpt, String> {
        self.init_stage(seed, group, &StageLayers::whole(self.num_layers), device)
    }

    /// Builds `group`'s rank of pipeline stage `stage` of the model: the parameters
    /// [`Self::init_parallel`] builds for that stage's parts, with the same names and values.
    pub fn init_stage(
        &self,
        seed: u64,
        group: &Group,
        stage: &StageLayers,
        device: &Device,
    ) -> Result<Gpt, String> {
        self.validate_parallel(group.size())?;
        Ok(Gpt::new(self, seed, group, stage, device))
    }

    /// Number of trainable parameters.
    pub fn num_parameters(&self) -> usize {
        let (h, f, v, l) = (
            self.hidden_size,
            self.ffn_size(),
            self.padded_vocab_size,
            self.num_layers,
        );
        let norm_of = |width: usize| match self.normalization {
            Normalization::LayerNorm => 2 * width,
            Normalization::RmsNorm => width,
        };
        let norm = norm_of(h);
        let bias = |n: usize| if self.add_bias_linear { n } else { 0 };
        let (qkv, attention_out) = (self.qkv_size(), self.num_attention_heads * self.head_dim());
        let attention =
            h * qkv + if self.qkv_bias() { qkv } else { 0 } + attention_out * h + bias(h);
        let qk_norms = if self.qk_layernorm {
            2 * norm_of(self.head_dim())
        } else {
            0
        };
        let fc1 = if self.swiglu { 2 * f } else { f };
        let mlp = h * fc1 + bias(fc1) + f * h + bias(h);
        let block = 2 * norm + attention + qk_norms + mlp;
        let positions = if self.learned_positions() {
            self.max_position_embeddings * h
        } else {
            0
        };
        let output = if self.tied_output() { 0 } else { v * h };
        v * h + positions + l * block + norm + output
    }

    /// Forward + backward FLOPs per token at sequence length `seq`: Megatron's
    /// `num_floating_point_operations` (3 × the forward's 2 per multiply-add; attention scores
    /// over the whole square; grouped keys/values and the SwiGLU's third matrix counted).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let (h, f, v, l) = (
            self.hidden_size as f64,
            self.ffn_size() as f64,
            self.padded_vocab_size as f64,
            self.num_layers as f64,
        );
        let heads = self.num_attention_heads as f64;
        let query_projection = self.head_dim() as f64 * heads / h;
        let groups = self.query_groups() as f64 / heads;
        let gated = if self.swiglu { 1.5 } else { 1.0 };
        let per_h2 =
            (1.0 + groups + seq as f64 / h) * query_projection + f / h * gated + v / (2.0 * l * h);
        12.0 * l * h * h * per_h2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint written before the architecture options existed holds none of their
    /// keys: it reads as the GPT-2 it was.
    #[test]
    fn configs_saved_without_the_newer_settings_read_as_gpt2() {
        let gpt2 = GptConfig::new(2, 16, 4, 32, 64).with_openai_gelu(true);
        let mut json: serde_json::Value = serde_json::to_value(&gpt2).unwrap();
        let old_keys = [
            "ffn_hidden_size",
            "flash_attention",
            "masked_softmax_fusion",
            "layer_norm_fusion",
            "openai_gelu",
            "hidden_dropout",
            "attention_dropout",
            "layernorm_epsilon",
            "init_method_std",
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "max_position_embeddings",
            "padded_vocab_size",
        ];
        json.as_object_mut()
            .unwrap()
            .retain(|k, _| old_keys.contains(&k.as_str()));
        assert_eq!(json.as_object().unwrap().len(), old_keys.len());
        let read = GptConfig::from_json(&json.to_string()).unwrap();
        assert_eq!(read, gpt2);
        assert_eq!(
            read.position_embedding_type,
            PositionEmbedding::LearnedAbsolute
        );
        assert!(read.tied_output() && read.add_bias_linear && !read.swiglu);
    }
}
