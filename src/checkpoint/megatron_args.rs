//! The arguments Megatron saves in every `model_optim_rng.pt`, read as a ferrotron model and
//! training state, so a Megatron checkpoint loads without repeating the flags it was trained
//! with (Megatron's own `--use-checkpoint-args`), and its exact consumed samples come back.
//!
//! Megatron pickles its whole `argparse.Namespace` as `args` (about 700 fields, named as the
//! flags with `_`), beside `iteration`, `checkpoint_version` and `opt_param_scheduler`
//! (whose `num_steps` is the scheduler's sample count). The names read here are those of
//! Megatron-LM's `arguments.py` (core_v0.16), with the older spellings it still accepts
//! (`layernorm_epsilon` for `norm_epsilon`, `use_rotary_position_embeddings`).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::check_same_model;
use super::pickle::{read_torch_save_pickle, Unpickled};
use crate::model::{GptConfig, Normalization, PositionEmbedding, RopeScaling, YarnScaling};

/// What a Megatron checkpoint file says about its model and run.
#[derive(Clone, Debug)]
pub struct MegatronArgs {
    /// The file read, for messages.
    file: String,
    /// `args`' attributes.
    values: HashMap<String, Unpickled>,
    /// The top-level `iteration`.
    pub iteration: Option<u64>,
    /// `opt_param_scheduler.num_steps`: the learning-rate schedule's samples.
    pub scheduler_steps: Option<u64>,
    /// The top-level `checkpoint_version` (3.0 since 2020).
    pub checkpoint_version: Option<f64>,
}

/// The model features Megatron has and ferrotron does not, as `args` marks them: a checkpoint
/// with one is refused rather than loaded into a model that computes something else.
const UNSUPPORTED: [(&str, &str); 7] = [
    ("num_experts", "mixture of experts"),
    ("multi_latent_attention", "multi-latent attention"),
    ("squared_relu", "squared ReLU"),
    ("mtp_num_layers", "multi-token prediction"),
    (
        "apply_residual_connection_post_layernorm",
        "residuals taken after the norm",
    ),
    (
        "rotary_seq_len_interpolation_factor",
        "rotary sequence-length interpolation",
    ),
    ("heterogeneous_layers_config_path", "heterogeneous layers"),
];

impl MegatronArgs {
    /// The arguments saved in the `torch.save` file `file`.
    pub fn read(file: &Path) -> Result<MegatronArgs> {
        Self::from_pickle(file, &read_torch_save_pickle(file)?)
    }

    /// The arguments in `top`, the pickle of the `torch.save` file `file`.
    pub fn from_pickle(file: &Path, top: &Unpickled) -> Result<MegatronArgs> {
        let args = top.get("args").with_context(|| {
            format!(
                "{}: no `args` (Megatron saves its arguments with every checkpoint)",
                file.display()
            )
        })?;
        let count = |v: Option<&Unpickled>| match v {
            Some(Unpickled::Int(n)) => u64::try_from(*n).ok(),
            _ => None,
        };
        Ok(MegatronArgs {
            file: file.display().to_string(),
            values: args.attributes(),
            iteration: count(top.get("iteration")),
            scheduler_steps: count(
                top.get("opt_param_scheduler")
                    .and_then(|s| s.get("num_steps")),
            ),
            checkpoint_version: match top.get("checkpoint_version") {
                Some(Unpickled::Float(v)) => Some(*v),
                Some(Unpickled::Int(v)) => Some(*v as f64),
                _ => None,
            },
        })
    }

    fn value(&self, name: &str) -> Option<&Unpickled> {
        self.values.get(name).filter(|v| **v != Unpickled::None)
    }

    fn error(&self, name: &str, expected: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "{}: args.{name} is {:?}, expected {expected}",
            self.file,
            self.values.get(name)
        )
    }

    /// A non-negative integer field, `None` when absent or `None`.
    pub fn count(&self, name: &str) -> Result<Option<usize>> {
        match self.value(name) {
            None => Ok(None),
            Some(Unpickled::Int(n)) => usize::try_from(*n)
                .map(Some)
                .map_err(|_| self.error(name, "a count")),
            Some(_) => Err(self.error(name, "an integer")),
        }
    }

    fn required_count(&self, name: &str) -> Result<usize> {
        self.count(name)?.ok_or_else(|| self.error(name, "a count"))
    }

    fn float(&self, name: &str) -> Result<Option<f64>> {
        match self.value(name) {
            None => Ok(None),
            Some(Unpickled::Int(n)) => Ok(Some(*n as f64)),
            Some(Unpickled::Float(x)) => Ok(Some(*x)),
            Some(_) => Err(self.error(name, "a number")),
        }
    }

    /// A switch: absent or `None` is off.
    fn flag(&self, name: &str) -> Result<bool> {
        match self.value(name) {
            None => Ok(false),
            Some(Unpickled::Bool(b)) => Ok(*b),
            Some(Unpickled::Int(n)) => Ok(*n != 0),
            Some(_) => Err(self.error(name, "True or False")),
        }
    }

    /// A string field, `None` when absent or `None`.
    pub fn string(&self, name: &str) -> Result<Option<&str>> {
        match self.value(name) {
            None => Ok(None),
            Some(Unpickled::Str(s)) => Ok(Some(s)),
            Some(_) => Err(self.error(name, "a string")),
        }
    }

    /// The tensor-parallel size the checkpoint was saved with.
    pub fn tensor_parallel(&self) -> Result<usize> {
        Ok(self.count("tensor_model_parallel_size")?.unwrap_or(1))
    }

    /// Training samples consumed when it was saved.
    pub fn consumed_train_samples(&self) -> Result<Option<u64>> {
        Ok(self.count("consumed_train_samples")?.map(|n| n as u64))
    }

    /// Validation samples consumed when it was saved.
    pub fn consumed_valid_samples(&self) -> Result<Option<u64>> {
        Ok(self.count("consumed_valid_samples")?.map(|n| n as u64))
    }

    /// The model to load the checkpoint at `root` as: these arguments' model, or `wanted` (a
    /// run's flags), which must describe the same one.
    pub fn model_for(&self, root: &Path, wanted: Option<&GptConfig>) -> Result<GptConfig> {
        let saved = self.model_config()?;
        match wanted {
            Some(wanted) => {
                check_same_model(root, &saved, wanted)?;
                Ok(wanted.clone())
            }
            None => Ok(saved),
        }
    }

    /// The model Megatron built from these arguments, as ferrotron's config (dropout and init
    /// std as Megatron trained with). A feature ferrotron lacks is an error naming it.
    pub fn model_config(&self) -> Result<GptConfig> {
        for (name, what) in UNSUPPORTED {
            let used = match self.value(name) {
                None | Some(Unpickled::Bool(false)) | Some(Unpickled::Int(0)) => false,
                Some(_) => true,
            };
            if used {
                bail!(
                    "{}: the checkpoint's model uses {what} (args.{name} = {:?}), which ferrotron does not implement",
                    self.file,
                    self.values[name]
                );
            }
        }
        let hidden = self.required_count("hidden_size")?;
        let heads = self.required_count("num_attention_heads")?;
        let positions = match self.count("max_position_embeddings")? {
            Some(p) => p,
            None => self.required_count("seq_length")?,
        };
        let mut config = GptConfig::new(
            self.required_count("num_layers")?,
            hidden,
            heads,
            positions,
            self.required_count("padded_vocab_size")?,
        );
        config.ffn_hidden_size = self.count("ffn_hidden_size")?;
        // Megatron always fills these in; ferrotron's config keeps `None` for the defaults.
        config.kv_channels = self.count("kv_channels")?.filter(|&c| c * heads != hidden);
        config.num_query_groups = if self.flag("group_query_attention")? {
            Some(self.required_count("num_query_groups")?)
        } else {
            None
        };
        config.position_embedding_type = self.position_embedding()?;
        // Megatron-LM's legacy model builds its rotary embedding without `--rotary-base`: its
        // checkpoints computed with 10000 whatever the saved flag says.
        if let Some(base) = self.float("rotary_base")? {
            if !self.flag("use_legacy_models")? {
                config.rotary_base = base;
            }
        }
        if let Some(percent) = self.float("rotary_percent")? {
            config.rotary_percent = percent;
        }
        config.rotary_interleaved = self.flag("rotary_interleaved")?;
        if self.flag("use_rope_scaling")? {
            let factor = self.float("rope_scaling_factor")?.unwrap_or(8.0);
            config.rope_scaling = Some(RopeScaling::llama3(factor));
        }
        config.normalization = match self.string("normalization")? {
            None => Normalization::LayerNorm,
            Some(name) => name
                .parse()
                .map_err(|e: String| anyhow::anyhow!("{}: args.normalization: {e}", self.file))?,
        };
        let epsilon = match self.float("norm_epsilon")? {
            Some(e) => Some(e),
            None => self.float("layernorm_epsilon")?,
        };
        if let Some(epsilon) = epsilon {
            config.layernorm_epsilon = epsilon;
        }
        config.apply_layernorm_1p = self.flag("apply_layernorm_1p")?;
        config.swiglu = self.flag("swiglu")?;
        config.openai_gelu = self.flag("openai_gelu")?;
        // Megatron's `add_bias_linear` defaults to True (`--disable-bias-linear` clears it).
        config.add_bias_linear =
            self.value("add_bias_linear").is_none() || self.flag("add_bias_linear")?;
        config.add_qkv_bias = self.flag("add_qkv_bias")? && !config.add_bias_linear;
        config.qk_layernorm = self.flag("qk_layernorm")?;
        config.untie_embeddings_and_output_weights =
            self.flag("untie_embeddings_and_output_weights")?;
        if let Some(std) = self.float("init_method_std")? {
            config.init_method_std = std;
        }
        if let Some(p) = self.float("hidden_dropout")? {
            config.hidden_dropout = p;
        }
        if let Some(p) = self.float("attention_dropout")? {
            config.attention_dropout = p;
        }
        self.read_window(&mut config)?;
        config.yarn = self.yarn()?;
        Ok(config)
    }

    /// `window_size` (Megatron's `(left, right)` tuple, `None` without a window) and
    /// `window_attn_skip_freq` (an int or a per-layer list) into `config`.
    fn read_window(&self, config: &mut GptConfig) -> Result<()> {
        let sides = match self.value("window_size") {
            None => return Ok(()),
            Some(Unpickled::Tuple(sides) | Unpickled::List(sides)) => sides,
            Some(_) => return Err(self.error("window_size", "a (left, right) pair")),
        };
        let [Unpickled::Int(left), Unpickled::Int(0)] = sides[..] else {
            return Err(self.error("window_size", "a (left, 0) pair of ints (a causal window)"));
        };
        config.window_size = (left >= 0).then_some(left as usize);
        let layers = config.num_layers;
        config.window_layers = match self.value("window_attn_skip_freq") {
            None => None,
            Some(Unpickled::Int(every)) if *every > 0 => {
                Some((1..=layers).map(|n| n % *every as usize != 0).collect())
            }
            Some(Unpickled::List(entries)) if entries.len() == layers => Some(
                entries
                    .iter()
                    .map(|e| matches!(e, Unpickled::Int(1) | Unpickled::Bool(true)))
                    .collect(),
            ),
            Some(_) => {
                return Err(self.error(
                    "window_attn_skip_freq",
                    "a positive int or one entry per layer",
                ))
            }
        };
        Ok(())
    }

    /// YaRN's constants where `position_embedding_type` is `yarn` (Megatron-Core's
    /// `YarnRotaryEmbedding` defaults where an argument is missing).
    fn yarn(&self) -> Result<Option<YarnScaling>> {
        if self.string("position_embedding_type")? != Some("yarn") {
            return Ok(None);
        }
        let original = self
            .count("yarn_original_max_position_embeddings")?
            .unwrap_or(4096);
        Ok(Some(YarnScaling {
            factor: self.float("rotary_scaling_factor")?.unwrap_or(1.0),
            original_max_position_embeddings: original as f64,
            beta_fast: self.float("yarn_beta_fast")?.unwrap_or(32.0),
            beta_slow: self.float("yarn_beta_slow")?.unwrap_or(1.0),
            mscale: self.float("mscale")?.unwrap_or(1.0),
            mscale_all_dim: self.float("mscale_all_dim")?.unwrap_or(0.0),
            round_to_int: self.value("yarn_correction_range_round_to_int").is_none()
                || self.flag("yarn_correction_range_round_to_int")?,
        }))
    }

    /// `position_embedding_type`, with the legacy `use_rotary_position_embeddings` and
    /// `add_position_embedding` (False without rope: no positions at all).
    fn position_embedding(&self) -> Result<PositionEmbedding> {
        let named = match self.string("position_embedding_type")? {
            // YaRN stretches the rotary embedding (`Self::yarn`).
            Some("yarn") => PositionEmbedding::Rope,
            Some(name) => name
                .parse()
                .map_err(|e: String| anyhow::anyhow!("{}: {e}", self.file))?,
            None => PositionEmbedding::LearnedAbsolute,
        };
        Ok(match named {
            PositionEmbedding::LearnedAbsolute
                if self.flag("use_rotary_position_embeddings")? =>
            {
                PositionEmbedding::Rope
            }
            PositionEmbedding::LearnedAbsolute
                if self.value("add_position_embedding") == Some(&Unpickled::Bool(false)) =>
            {
                PositionEmbedding::None
            }
            kind => kind,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> MegatronArgs {
        let file = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/megatron_ckpt")
            .join(name)
            .join("iter_0000004/mp_rank_00/model_optim_rng.pt");
        MegatronArgs::read(&file).unwrap()
    }

    /// The fixtures' flags (tests/fixtures/megatron_ckpt/README.md), as Megatron saved them.
    #[test]
    fn megatrons_saved_arguments_describe_the_fixture_models() {
        let gpt2 = fixture("gpt2_tp1");
        let mut want = GptConfig::new(2, 64, 4, 32, 256);
        want.ffn_hidden_size = Some(256);
        want.init_method_std = 0.2;
        want.hidden_dropout = 0.0;
        want.attention_dropout = 0.0;
        assert_eq!(gpt2.model_config().unwrap(), want);
        assert_eq!(gpt2.iteration, Some(4));
        assert_eq!(gpt2.consumed_train_samples().unwrap(), Some(8));
        assert_eq!(gpt2.scheduler_steps, Some(8));
        assert_eq!(gpt2.tensor_parallel().unwrap(), 1);
        assert_eq!(
            gpt2.string("tokenizer_type").unwrap(),
            Some("NullTokenizer")
        );

        let llama = fixture("llama_tp2");
        let config = llama.model_config().unwrap();
        assert_eq!(config.position_embedding_type, PositionEmbedding::Rope);
        assert_eq!(config.rotary_base, 500000.0);
        assert_eq!(config.normalization, Normalization::RmsNorm);
        assert!(config.swiglu && config.untie_embeddings_and_output_weights);
        assert!(!config.add_bias_linear && !config.add_qkv_bias);
        assert_eq!(config.ffn_hidden_size, Some(172));
        assert_eq!(config.num_query_groups, Some(2));
        assert_eq!(config.head_dim(), 16);
        assert_eq!(llama.tensor_parallel().unwrap(), 2);
    }
}
