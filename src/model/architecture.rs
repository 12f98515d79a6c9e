//! The choices that make one transformer family or another out of the same GPT: how positions
//! enter, which normalization, which MLP activation. Megatron-Core's `TransformerConfig`
//! spells them as flags; GPT-2 and Llama are two settings of them.

use serde::{Deserialize, Serialize};

/// `--position-embedding-type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PositionEmbedding {
    /// A learned `[max positions, hidden]` table added to the word embeddings (GPT-2).
    LearnedAbsolute,
    /// Rotary embeddings: queries and keys rotated by their position (Llama).
    Rope,
    /// No position information at all (`--no-position-embedding`).
    None,
}

impl std::str::FromStr for PositionEmbedding {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "learned_absolute" => Ok(Self::LearnedAbsolute),
            "rope" => Ok(Self::Rope),
            "none" => Ok(Self::None),
            other => Err(format!(
                "--position-embedding-type {other}: expected learned_absolute, rope or none"
            )),
        }
    }
}

/// `--normalization`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Normalization {
    /// `(x − mean) / √(var + ε) · γ + β`.
    LayerNorm,
    /// `x / √(mean(x²) + ε) · γ`: no centring, no bias.
    RmsNorm,
}

impl std::str::FromStr for Normalization {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "LayerNorm" => Ok(Self::LayerNorm),
            "RMSNorm" => Ok(Self::RmsNorm),
            other => Err(format!(
                "--normalization {other}: expected LayerNorm or RMSNorm"
            )),
        }
    }
}

/// Llama 3.1's rule for stretching rotary frequencies to a longer context
/// (`--use-rope-scaling`, HF's `rope_type: "llama3"`): wavelengths longer than the original
/// context / `low_freq_factor` are slowed by `factor`, those shorter than the original
/// context / `high_freq_factor` are kept, and the band between is blended.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    /// How much the low frequencies are slowed (`--rope-scaling-factor`, 8 in Llama 3.1).
    pub factor: f64,
    /// 1 in Llama 3.1.
    pub low_freq_factor: f64,
    /// 4 in Llama 3.1.
    pub high_freq_factor: f64,
    /// The context the model was first trained at (8192 in Llama 3.1).
    pub original_max_position_embeddings: f64,
}

impl RopeScaling {
    /// Megatron's `--use-rope-scaling` with `--rope-scaling-factor factor`: Llama 3.1's
    /// constants.
    pub fn llama3(factor: f64) -> Self {
        Self {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        }
    }

    /// The scaled inverse frequency of `inv_freq` (Meta's `apply_scaling`).
    pub fn apply(&self, inv_freq: f64) -> f64 {
        let low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor;
        let high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor;
        let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
        if wavelen < high_freq_wavelen {
            inv_freq
        } else if wavelen > low_freq_wavelen {
            inv_freq / self.factor
        } else {
            let smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
        }
    }

    /// Rejects constants the rule cannot use, with a one-line reason.
    pub fn validate(&self) -> Result<(), String> {
        let ok = self.factor > 0.0
            && self.low_freq_factor > 0.0
            && self.high_freq_factor > self.low_freq_factor
            && self.original_max_position_embeddings > 0.0;
        if ok {
            Ok(())
        } else {
            Err(format!("rope scaling {self:?}: need factor > 0, 0 < low_freq_factor < high_freq_factor and a positive original context"))
        }
    }
}

/// YaRN's stretching of the rotary frequencies to a longer context (`--position-embedding-type
/// yarn`; Megatron-Core's `YarnRotaryEmbedding`): the pairs that turn fewer than `beta_slow`
/// times over the original context are interpolated (slowed by `factor`), those that turn more
/// than `beta_fast` times are kept, a linear ramp over the pair index blends the band between,
/// and both `cos` and `sin` are multiplied by a concentration factor (so the scores by its
/// square).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct YarnScaling {
    /// How far the context is stretched (`--rotary-scaling-factor`).
    pub factor: f64,
    /// The context the model was first trained at (`--yarn-original-max-position-embeddings`).
    pub original_max_position_embeddings: f64,
    /// Rotations over the original context above which a pair is kept (`--yarn-beta-fast`, 32).
    pub beta_fast: f64,
    /// Rotations below which a pair is interpolated (`--yarn-beta-slow`, 1).
    pub beta_slow: f64,
    /// `--mscale` (1).
    pub mscale: f64,
    /// `--mscale-all-dim` (0).
    pub mscale_all_dim: f64,
    /// The ramp's ends rounded out to whole pairs (`--yarn-correction-range-round-to-int`,
    /// Megatron's default).
    pub round_to_int: bool,
}

impl YarnScaling {
    /// The inverse frequencies of `dim` rotated channels at rotary base `base`
    /// (`_yarn_find_correction_range` and `_yarn_linear_ramp_mask`, in float64).
    pub fn inverse_frequencies(&self, base: f64, dim: usize) -> Vec<f64> {
        let d = dim as f64;
        // The pair index whose wavelength turns `rotations` times over the original context.
        let pair_for = |rotations: f64| {
            d * (self.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI))
                .ln()
                / (2.0 * base.ln())
        };
        let (mut low, mut high) = (pair_for(self.beta_fast), pair_for(self.beta_slow));
        if self.round_to_int {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
        if low == high {
            high += 0.001;
        }
        (0..dim / 2)
            .map(|i| {
                let extrapolated = base.powf(-((2 * i) as f64) / d);
                let interpolated = extrapolated / self.factor;
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                interpolated * ramp + extrapolated * (1.0 - ramp)
            })
            .collect()
    }

    /// What `cos` and `sin` are multiplied by (`_yarn_get_concentration_factor`).
    pub fn concentration(&self) -> f64 {
        let mscale = |m: f64| match self.factor <= 1.0 {
            true => 1.0,
            false => 0.1 * m * self.factor.ln() + 1.0,
        };
        mscale(self.mscale) / mscale(self.mscale_all_dim)
    }

    /// Rejects constants the rule cannot use, with a one-line reason.
    pub fn validate(&self) -> Result<(), String> {
        let ok = self.factor > 0.0
            && self.original_max_position_embeddings > 0.0
            && self.beta_fast > 0.0
            && self.beta_slow > 0.0
            && self.concentration().is_finite();
        match ok {
            true => Ok(()),
            false => Err(format!(
                "YaRN {self:?}: need a positive factor, original context and betas"
            )),
        }
    }
}
