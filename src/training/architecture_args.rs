//! Megatron's model-architecture flags beyond GPT-2's shape: positions, normalization, MLP,
//! attention grouping, biases, the output layer (`arguments.py`'s `_add_network_size_args`).

use clap::Args;

use crate::model::{GptConfig, Normalization, PositionEmbedding, RopeScaling, YarnScaling};

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
    /// YaRN's context stretch (with --position-embedding-type yarn).
    #[arg(long, default_value_t = 1.0)]
    pub rotary_scaling_factor: f64,
    /// The context the model was first trained at, for YaRN [required with yarn].
    #[arg(long)]
    pub yarn_original_max_position_embeddings: Option<usize>,
    /// YaRN: rotations over the original context above which a pair is kept [default: 32].
    #[arg(long)]
    pub yarn_beta_fast: Option<f64>,
    /// YaRN: rotations below which a pair is interpolated [default: 1].
    #[arg(long)]
    pub yarn_beta_slow: Option<f64>,
    /// YaRN: round the ramp's ends out to whole pairs (Megatron's default).
    #[arg(long, overrides_with = "no_yarn_correction_range_round_to_int")]
    pub yarn_correction_range_round_to_int: bool,
    /// YaRN: keep the ramp's ends where they fall.
    #[arg(long)]
    pub no_yarn_correction_range_round_to_int: bool,
    /// YaRN's concentration: `mscale` of `0.1 · mscale · ln(factor) + 1`.
    #[arg(long, default_value_t = 1.0)]
    pub mscale: f64,
    /// YaRN's concentration is divided by the same with this `mscale`.
    #[arg(long, default_value_t = 0.0)]
    pub mscale_all_dim: f64,
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
    /// Sliding-window attention as Megatron's `(left, right)` pair, `L,0` or `(L, 0)`: each
    /// query sees itself and the L keys before it (HF's `sliding_window` is L + 1); right
    /// must be 0 (a GPT is causal), and a left of -1 means no window.
    #[arg(long)]
    pub window_size: Option<String>,
    /// Layers that skip the window: N (every N-th layer, counting from 1, sees every key) or
    /// a pattern of one entry per layer, 1 windowed, 0 full (`"([1]*3+[0])*2"`).
    #[arg(long)]
    pub window_attn_skip_freq: Option<String>,
}

impl ArchitectureArgs {
    /// `--position-embedding-type`, with Megatron's legacy flags: `--use-rotary-position-
    /// embeddings` means rope; `--no-position-embedding` drops the learned table, so beside
    /// rope (as Megatron's Llama scripts pass them together) it changes nothing, and alone it
    /// means none.
    fn position_embedding_type(&self) -> Result<PositionEmbedding, String> {
        let named: Option<PositionEmbedding> = match self.position_embedding_type.as_deref() {
            // YaRN is the rotary embedding with its frequencies stretched (`Self::yarn`).
            Some("yarn") => Some(PositionEmbedding::Rope),
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
            yarn: self.yarn()?,
            window_size: self.window()?,
            window_layers: self.window_layers(config.num_layers)?,
            ..config
        })
    }

    /// YaRN's constants under `--position-embedding-type yarn` (Megatron-Core's
    /// `YarnRotaryEmbedding` defaults where a flag is not given), `None` otherwise.
    fn yarn(&self) -> Result<Option<YarnScaling>, String> {
        if self.position_embedding_type.as_deref() != Some("yarn") {
            return Ok(None);
        }
        let original = self.yarn_original_max_position_embeddings.ok_or(
            "--position-embedding-type yarn needs --yarn-original-max-position-embeddings (the context the model was first trained at)",
        )?;
        Ok(Some(YarnScaling {
            factor: self.rotary_scaling_factor,
            original_max_position_embeddings: original as f64,
            beta_fast: self.yarn_beta_fast.unwrap_or(32.0),
            beta_slow: self.yarn_beta_slow.unwrap_or(1.0),
            mscale: self.mscale,
            mscale_all_dim: self.mscale_all_dim,
            round_to_int: !self.no_yarn_correction_range_round_to_int,
        }))
    }

    /// `--window-size`'s left side, `None` without a window (or with Megatron's -1, no bound).
    fn window(&self) -> Result<Option<usize>, String> {
        let Some(text) = &self.window_size else {
            return Ok(None);
        };
        let bad = || format!("--window-size {text:?}: expected two integers, `L,0` or `(L, 0)`");
        let sides: Vec<i64> = text
            .trim()
            .trim_start_matches('(')
            .trim_end_matches(')')
            .split(',')
            .map(|side| side.trim().parse::<i64>().map_err(|_| bad()))
            .collect::<Result<_, _>>()?;
        let [left, right] = sides[..] else {
            return Err(bad());
        };
        if right != 0 {
            return Err(format!(
                "--window-size {text:?}: a right side of {right} lets a query see keys after it; \
                 a GPT's attention is causal (0)"
            ));
        }
        match left {
            -1 => Ok(None),
            0.. => Ok(Some(left as usize)),
            _ => Err(format!(
                "--window-size {text:?}: the left side must be -1 or at least 0"
            )),
        }
    }

    /// `--window-attn-skip-freq` as one entry per layer (true: windowed), Megatron's
    /// `is_layer_window_attention`: N windows every layer but each N-th (counting from 1); a
    /// pattern gives each layer's entry.
    fn window_layers(&self, layers: usize) -> Result<Option<Vec<bool>>, String> {
        let Some(text) = &self.window_attn_skip_freq else {
            return Ok(None);
        };
        if self.window_size.is_none() {
            return Err("--window-attn-skip-freq needs --window-size".into());
        }
        if let Ok(every) = text.trim().parse::<usize>() {
            if every == 0 {
                return Err("--window-attn-skip-freq 0: must be positive".into());
            }
            return Ok(Some((1..=layers).map(|n| n % every != 0).collect()));
        }
        let pattern = super::layer_pattern::parse_layer_pattern(text)
            .map_err(|e| format!("--window-attn-skip-freq {text:?}: {e}"))?;
        if pattern.len() != layers {
            return Err(format!(
                "--window-attn-skip-freq {text:?}: {} entries for {layers} layers",
                pattern.len()
            ));
        }
        Ok(Some(pattern.into_iter().map(|entry| entry != 0).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::ArchitectureArgs;
    use crate::model::GptConfig;

    fn windowed(size: &str, skip: Option<&str>) -> Result<GptConfig, String> {
        let args = ArchitectureArgs {
            window_size: Some(size.into()),
            window_attn_skip_freq: skip.map(Into::into),
            normalization: "LayerNorm".into(),
            ..Default::default()
        };
        args.apply(GptConfig::new(4, 8, 2, 16, 32))
    }

    /// `--window-size` in Megatron's spellings, `--window-attn-skip-freq` as Megatron's
    /// `is_layer_window_attention` reads it (N: every N-th layer from 1 is full), and what is
    /// refused.
    #[test]
    fn window_flags_read_as_megatrons() {
        assert_eq!(windowed("4095,0", None).unwrap().window_size, Some(4095));
        assert_eq!(windowed("(7, 0)", None).unwrap().window_size, Some(7));
        assert_eq!(windowed("-1,0", None).unwrap().window_size, None);
        let every_second = windowed("7,0", Some("2")).unwrap();
        assert_eq!(
            every_second.window_layers,
            Some(vec![true, false, true, false])
        );
        assert_eq!(
            (0..4)
                .map(|i| every_second.layer_window(i))
                .collect::<Vec<_>>(),
            [Some(7), None, Some(7), None]
        );
        let pattern = windowed("7,0", Some("[0]+[1]*3")).unwrap();
        assert_eq!(pattern.window_layers, Some(vec![false, true, true, true]));
        for (size, skip, says) in [
            ("7,1", None, "causal"),
            ("7", None, "two integers"),
            ("-2,0", None, "at least 0"),
            ("7,0", Some("[1]*3"), "3 entries for 4 layers"),
            ("7,0", Some("0"), "positive"),
        ] {
            let err = windowed(size, skip).unwrap_err();
            assert!(err.contains(says), "{size} {skip:?}: {err}");
        }
    }
}
