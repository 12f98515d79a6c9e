//! Megatron's model-architecture flags beyond GPT-2's shape: positions, normalization, MLP,
//! attention grouping, biases, the output layer (`arguments.py`'s `_add_network_size_args`).

use clap::Args;

use crate::model::{GptConfig, Normalization, PositionEmbedding, RopeScaling};

/// The flags that turn Megatron's GPT into a Llama-family model (names, defaults and legacy
/// spellings as Megatron-LM's).
#[derive(Args, Clone, Debug, Default)]
pub struct ArchitectureArgs {
    /// learned_absolute, rope or none.
    #[arg(long)]
    pub position_embedding_type: Option<String>,
    /// Legacy spelling of --position-embedding-type rope.
    #[arg(long)]
    pub use_rotary_position_embeddings: bool,
    /// No position embedding at all (--position-embedding-type none).
    #[arg(long)]
    pub no_position_embedding: bool,
    /// Base θ of the rotary wavelengths.
    #[arg(long, default_value_t = 10000.0)]
    pub rotary_base: f64,
    /// Share of each head's channels the rotary embedding rotates.
    #[arg(long, default_value_t = 1.0)]
    pub rotary_percent: f64,
    /// Rotate channel pairs (2i, 2i+1) instead of the two halves.
    #[arg(long)]
    pub rotary_interleaved: bool,
    /// Llama 3.1's long-context scaling of the rotary frequencies.
    #[arg(long)]
    pub use_rope_scaling: bool,
    /// The scaling factor of --use-rope-scaling.
    #[arg(long, default_value_t = 8.0)]
    pub rope_scaling_factor: f64,
    /// LayerNorm or RMSNorm.
    #[arg(long, default_value = "LayerNorm")]
    pub normalization: String,
    /// Norm weights stored zero-centred and applied as 1 + γ.
    #[arg(long)]
    pub apply_layernorm_1p: bool,
    /// Gated SiLU MLP (the FFN width defaults to ⌊(8/3 · hidden) / 64⌋ · 64).
    #[arg(long)]
    pub swiglu: bool,
    /// No biases on the linear layers.
    #[arg(long)]
    pub disable_bias_linear: bool,
    /// A bias on the query/key/value projection even with --disable-bias-linear.
    #[arg(long)]
    pub add_qkv_bias: bool,
    /// Share keys and values among --num-query-groups groups of heads.
    #[arg(long)]
    pub group_query_attention: bool,
    /// Key/value groups under --group-query-attention.
    #[arg(long, default_value_t = 1)]
    pub num_query_groups: usize,
    /// Width of one attention head [default: hidden size / heads].
    #[arg(long)]
    pub kv_channels: Option<usize>,
    /// Norm the queries and keys of each head.
    #[arg(long)]
    pub qk_layernorm: bool,
    /// The output layer gets its own weight instead of the word embedding's.
    #[arg(long)]
    pub untie_embeddings_and_output_weights: bool,
}

impl ArchitectureArgs {
    /// `--position-embedding-type`, with Megatron's legacy flags: `--use-rotary-position-
    /// embeddings` means rope; `--no-position-embedding` drops the learned table, so beside
    /// rope (as Megatron's Llama scripts pass them together) it changes nothing, and alone it
    /// means none.
    fn position_embedding_type(&self) -> Result<PositionEmbedding, String> {
        let named: Option<PositionEmbedding> = match &self.position_embedding_type {
            Some(kind) => Some(kind.parse()?),
            None => None,
        };
        let kind = match (named, self.use_rotary_position_embeddings) {
            (Some(PositionEmbedding::Rope) | None, true) => PositionEmbedding::Rope,
            (Some(other), true) => {
                return Err(format!(
                "--use-rotary-position-embeddings contradicts --position-embedding-type {other:?}"
            ))
            }
            (Some(kind), false) => kind,
            (None, false) => PositionEmbedding::LearnedAbsolute,
        };
        Ok(match kind {
            PositionEmbedding::LearnedAbsolute if self.no_position_embedding => {
                PositionEmbedding::None
            }
            kind => kind,
        })
    }

    /// `config` with these flags applied, or the flag that cannot be used and why. The FFN
    /// width default follows `--swiglu` as Megatron's: `ffn_hidden_size` is `None` when
    /// `--ffn-hidden-size` was not given.
    pub fn apply(&self, config: GptConfig) -> Result<GptConfig, String> {
        let position_embedding_type = self.position_embedding_type()?;
        if self.use_rope_scaling && position_embedding_type != PositionEmbedding::Rope {
            return Err("--use-rope-scaling needs --position-embedding-type rope".into());
        }
        let normalization: Normalization = self.normalization.parse()?;
        let ffn_hidden_size = match config.ffn_hidden_size {
            Some(f) => Some(f),
            // Two projections instead of one: about the same parameters as 4 × hidden.
            None if self.swiglu => Some((4 * config.hidden_size * 2 / 3) / 64 * 64),
            None => None,
        };
        Ok(GptConfig {
            position_embedding_type,
            rotary_base: self.rotary_base,
            rotary_percent: self.rotary_percent,
            rotary_interleaved: self.rotary_interleaved,
            rope_scaling: self
                .use_rope_scaling
                .then(|| RopeScaling::llama3(self.rope_scaling_factor)),
            normalization,
            apply_layernorm_1p: self.apply_layernorm_1p,
            swiglu: self.swiglu,
            add_bias_linear: !self.disable_bias_linear,
            add_qkv_bias: self.add_qkv_bias,
            num_query_groups: self.group_query_attention.then_some(self.num_query_groups),
            kv_channels: self.kv_channels,
            qk_layernorm: self.qk_layernorm,
            untie_embeddings_and_output_weights: self.untie_embeddings_and_output_weights,
            ffn_hidden_size,
            ..config
        })
    }
}
