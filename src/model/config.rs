//! The GPT's shape and regularization, with Megatron's flag names and defaults.

use burn::config::Config;
use burn::tensor::Device;

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
    /// Fused causal attention where the backend has it (`--use-flash-attn`): the
    /// FlashAttention-style kernel with dropout inside, which never stores the `[s, s]`
    /// scores. Off by default, as in Megatron; the math is the composed attention's.
    #[config(default = false)]
    pub flash_attention: bool,
}

impl GptConfig {
    /// The MLP width.
    pub fn ffn_size(&self) -> usize {
        self.ffn_hidden_size.unwrap_or(4 * self.hidden_size)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// The same model with the fusion switches as in `other` (they do not change the math, so
    /// checkpoints compare shapes without them).
    pub fn with_fusion_of(&self, other: &GptConfig) -> GptConfig {
        GptConfig {
            masked_softmax_fusion: other.masked_softmax_fusion,
            layer_norm_fusion: other.layer_norm_fusion,
            flash_attention: other.flash_attention,
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
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "--hidden-size {} is not divisible by --num-attention-heads {}",
                self.hidden_size, self.num_attention_heads
            ));
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

    /// Rejects a tensor-parallel size the shapes cannot be split by, with a one-line reason.
    pub fn validate_parallel(&self, tensor_parallel_size: usize) -> Result<(), String> {
        self.validate()?;
        let n = tensor_parallel_size;
        if n == 0 {
            return Err("--tensor-model-parallel-size must be positive".into());
        }
        for (flag, value) in [
            ("--num-attention-heads", self.num_attention_heads),
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
        let block = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h);
        v * h + self.max_position_embeddings * h + l * block + 2 * h
    }

    /// Forward + backward FLOPs per token at sequence length `seq` (Megatron's accounting:
    /// 6 × matmul parameters + attention, 3 × forward).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let (h, f, v, l) = (
            self.hidden_size as f64,
            self.ffn_size() as f64,
            self.padded_vocab_size as f64,
            self.num_layers as f64,
        );
        let per_layer = 2.0 * (3.0 * h * h + h * h + 2.0 * h * f) + 2.0 * 2.0 * seq as f64 * h;
        3.0 * (l * per_layer + 2.0 * h * v)
    }
}
