//! ferrotron parameters written as a Megatron-LM `--ckpt-format torch` checkpoint, so a model
//! trained (or converted) here continues in Megatron: `iter_NNNNNNN/mp_rank_TT[_PPP]/
//! model_optim_rng.pt` per tensor-parallel rank and pipeline stage, and
//! `latest_checkpointed_iteration.txt`.
//!
//! Each file holds what Megatron's `load_checkpoint` reads: `args` (an `argparse.Namespace`
//! with the model's shape, the parallel sizes its `check_checkpoint_args` compares, and the
//! consumed samples it resumes from), `checkpoint_version` 3.0, `iteration` and `model`, the
//! Megatron-Core state dict, every key a strict `load_state_dict` expects (the `_extra_state`
//! entries of the linear layers included, as `None`). Names, orientation and the
//! tensor-parallel split are the inverse of [`super::megatron_torch`]'s reading, whose
//! [`Split`] rules cut a whole tensor into ranks here. A training run's files also hold
//! Adam's state and the scheduler's ([`super::megatron_optimizer_save`]); a converted
//! checkpoint's do not (Megatron loads it with `--no-load-optim`). There is no RNG state
//! (`--no-load-rng`). Weights are written in float32, ferrotron's main weights.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};

use super::megatron_optimizer_save::{optimizer_value, MegatronAdamSettings, RankAdam};
use super::megatron_tensors::{megatron_split, ParameterValues, Split};
use super::torch_save::{write_torch_file, PyValue, TensorStorages};
use super::{begin_iteration, checkpoint_dir, publish_iteration, staging_dir, ShardPlace};
use crate::comm::Group;
use crate::model::named_parameters::named_parameters;
use crate::model::{Gpt, GptConfig, Normalization, PositionEmbedding, StageLayers};
use crate::optim::NamedMoments;
use crate::util::host_tensor::HostTensor;

/// Which Megatron-Core layer spec's names the state dict uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerSpec {
    /// `--transformer-impl transformer_engine` (Megatron's default): each norm is fused into
    /// the linear after it (`linear_qkv.layer_norm_weight`).
    TransformerEngine,
    /// `--transformer-impl local`: `input_layernorm`, `pre_mlp_layernorm`.
    Local,
}

impl std::str::FromStr for LayerSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "transformer_engine" => Ok(Self::TransformerEngine),
            "local" => Ok(Self::Local),
            other => Err(format!(
                "--transformer-impl {other:?}: expected transformer_engine or local"
            )),
        }
    }
}

/// A Megatron state dict: its keys in order, `None` for the `_extra_state` entries.
type StateDict = Vec<(String, Option<HostTensor>)>;

/// What a Megatron checkpoint records about the run besides the weights.
#[derive(Clone, Debug)]
pub struct MegatronRun {
    /// The model's shape.
    pub config: GptConfig,
    /// Iterations completed.
    pub iteration: u64,
    /// Samples consumed (Megatron resumes its data and schedule from these).
    pub consumed_train_samples: u64,
    /// Validation samples consumed.
    pub consumed_valid_samples: u64,
    /// `--make-vocab-size-divisible-by`.
    pub make_vocab_size_divisible_by: usize,
    /// The real vocabulary size, where known (NullTokenizer's `--vocab-size` + 1, ...).
    pub vocab_size: Option<usize>,
    /// `--tokenizer-type`, where known.
    pub tokenizer_type: Option<String>,
    /// `--seq-length`, where known.
    pub seq_length: Option<usize>,
    /// `--bf16`, `--fp16`.
    pub bf16: bool,
    /// `--fp16`.
    pub fp16: bool,
    /// The optimizer's settings, when its state is written (`pretrain`'s saves).
    pub optimizer: Option<MegatronAdamSettings>,
}

/// How `pretrain --ckpt-format torch` writes Megatron's format: the names, and what the run
/// knows of its vocabulary that the model does not.
#[derive(Clone, Debug)]
pub struct MegatronSaveOptions {
    /// `--transformer-impl`.
    pub spec: LayerSpec,
    /// `--make-vocab-size-divisible-by`.
    pub make_vocab_size_divisible_by: usize,
    /// The tokenizer's vocabulary size.
    pub vocab_size: Option<usize>,
    /// `--tokenizer-type`.
    pub tokenizer_type: Option<String>,
}

/// Where a rank's part of a model sits: its file's place, and the layers it holds.
pub struct RankPart<'a> {
    /// Tensor-parallel rank and pipeline stage (`mp_rank_TT[_PPP]`).
    pub place: ShardPlace,
    /// The pipeline stage's layers.
    pub stage: &'a StageLayers,
}

/// Saves this rank's shard `model` of a training run (with Adam's `moments`) as its
/// `mp_rank_TT[_PPP]/model_optim_rng.pt` under `root`. Every rank of `group` (one model
/// replica's ranks, every tensor-parallel rank of every stage) calls it; its rank 0 creates the
/// staging directory and publishes it once every shard is written.
pub(super) fn save_megatron_torch_rank(
    root: &Path,
    model: &Gpt,
    moments: &[NamedMoments],
    run: &MegatronRun,
    spec: LayerSpec,
    (group, part): (&Group, RankPart),
) -> Result<PathBuf> {
    let params = named_parameters(model);
    let shapes: HashMap<&str, &[usize]> = params
        .iter()
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    let values: ParameterValues = params
        .iter()
        .map(|p| (p.name.clone(), (p.shape.clone(), p.values.clone())))
        .collect();
    let entries = megatron_stage_state_dict(&values, &run.config, spec, part.stage)?;
    // Adam's moments take their parameters' Megatron names and orientation.
    let moment =
        |pick: fn(&NamedMoments) -> &Vec<f32>| -> Result<Vec<(String, Option<HostTensor>)>> {
            let values: ParameterValues = moments
                .iter()
                .map(|m| {
                    let shape = shapes.get(m.name.as_str()).with_context(|| {
                        format!("Adam's moments of {}, which the model has not", m.name)
                    })?;
                    Ok((m.name.clone(), (shape.to_vec(), pick(m).clone())))
                })
                .collect::<Result<_>>()?;
            megatron_stage_state_dict(&values, &run.config, spec, part.stage)
        };
    let adam = match run.optimizer {
        Some(_) => Some((moment(|m| &m.m)?, moment(|m| &m.v)?)),
        None => None,
    };
    let leader = group.rank() == 0;
    if leader {
        begin_iteration(root, run.iteration)?;
    }
    group.barrier()?;
    let staging = staging_dir(root, run.iteration);
    write_rank_file(&staging, part.place, &entries, adam.as_ref(), run)?;
    group.barrier()?;
    if leader {
        publish_iteration(root, run.iteration)?;
    }
    group.barrier()?;
    Ok(checkpoint_dir(root, run.iteration, part.place))
}

/// Saves whole (unsharded) parameter `values` as a Megatron checkpoint under `root` at
/// tensor-parallel size `tensor_parallel` (the vocabulary padded as Megatron pads it for that
/// size) and pipeline-parallel size `pipeline_parallel` (the layers split evenly, as
/// Megatron's default). Written into a staging directory renamed into place, the tracker
/// last.
pub(super) fn save_megatron_torch(
    root: &Path,
    values: &ParameterValues,
    run: &MegatronRun,
    (tensor_parallel, pipeline_parallel): (usize, usize),
    spec: LayerSpec,
) -> Result<()> {
    let whole = megatron_state_dict(values, &run.config, spec)?;
    let staging = begin_iteration(root, run.iteration)?;
    for stage in 0..pipeline_parallel {
        let stage_dict = stage_state_dict(&whole, &run.config, stage, pipeline_parallel)?;
        for rank in 0..tensor_parallel {
            let mut entries = Vec::with_capacity(stage_dict.len());
            for (key, tensor) in &stage_dict {
                let part = match tensor {
                    None => None,
                    Some(t) => Some(
                        rank_part(key, t, &run.config, rank, tensor_parallel).with_context(
                            || format!("splitting {key} over {tensor_parallel} ranks"),
                        )?,
                    ),
                };
                entries.push((key.clone(), part));
            }
            let place = ShardPlace {
                tp: rank,
                tp_size: tensor_parallel,
                pp: stage,
                pp_size: pipeline_parallel,
            };
            write_rank_file(&staging, place, &entries, None, run)?;
        }
    }
    publish_iteration(root, run.iteration)
}

/// Pipeline stage `stage` of `stages`' part of the whole state dict `whole`, as Megatron-Core
/// saves it: an even share of the layers, numbered from 0; the embedding on the first stage;
/// the final norm and the output layer on the last, which under a tied output layer holds
/// its own copy of the word embedding as `output_layer.weight` when it is not also the first.
fn stage_state_dict(
    whole: &[(String, Option<HostTensor>)],
    config: &GptConfig,
    stage: usize,
    stages: usize,
) -> Result<Vec<(String, Option<HostTensor>)>> {
    ensure!(
        stages >= 1 && config.num_layers.is_multiple_of(stages),
        "{} layers do not split evenly over {stages} pipeline stages (Megatron's default split)",
        config.num_layers
    );
    if stages == 1 {
        return Ok(whole.to_vec());
    }
    let per_stage = config.num_layers / stages;
    let first = per_stage * stage;
    let last_stage = stage + 1 == stages;
    let mut out = Vec::new();
    for (key, tensor) in whole {
        let local = if let Some(rest) = key.strip_prefix("decoder.layers.") {
            let (layer, name) = rest.split_once('.').expect("a layer entry has a name");
            let layer: usize = layer.parse().expect("a layer entry has a number");
            if !(first..first + per_stage).contains(&layer) {
                continue;
            }
            format!("decoder.layers.{}.{name}", layer - first)
        } else if key.starts_with("embedding.") {
            if stage != 0 {
                continue;
            }
            key.clone()
        } else {
            if !last_stage {
                continue;
            }
            if key == "output_layer._extra_state" && config.tied_output() {
                let embedding = whole
                    .iter()
                    .find(|(k, _)| k == "embedding.word_embeddings.weight")
                    .and_then(|(_, t)| t.clone())
                    .context("no word embedding to copy into the last stage's output layer")?;
                out.push(("output_layer.weight".to_owned(), Some(embedding)));
            }
            key.clone()
        };
        out.push((local, tensor.clone()));
    }
    Ok(out)
}

/// One tensor-parallel rank's part of the Megatron tensor `key` (whole, Megatron's
/// orientation), cut as Megatron cuts it.
fn rank_part(
    key: &str,
    t: &HostTensor,
    config: &GptConfig,
    rank: usize,
    size: usize,
) -> Result<HostTensor> {
    let chunk = |t: &HostTensor, dim| t.chunk(dim, size, rank).map_err(anyhow::Error::msg);
    Ok(match megatron_split(key, config)? {
        Split::Rows => chunk(t, 0)?,
        Split::Columns => chunk(t, 1)?,
        Split::Replicated => t.clone(),
        Split::GateUpRows => {
            let half = |k| t.chunk(0, 2, k).map_err(anyhow::Error::msg);
            HostTensor::concat(&[chunk(&half(0)?, 0)?, chunk(&half(1)?, 0)?], 0)
                .map_err(anyhow::Error::msg)?
        }
    })
}

/// The Megatron-Core state dict of a model held as ferrotron `values` (whole, or one
/// tensor-parallel rank's shards: renaming and transposing do not care), in the order
/// Megatron-Core registers its modules; `None` for the `_extra_state` entries.
pub fn megatron_state_dict(
    values: &ParameterValues,
    config: &GptConfig,
    spec: LayerSpec,
) -> Result<Vec<(String, Option<HostTensor>)>> {
    megatron_stage_state_dict(values, config, spec, &StageLayers::whole(config.num_layers))
}

/// [`megatron_state_dict`] of pipeline stage `stage`, as Megatron-Core saves a stage: its
/// layers numbered from 0, the embeddings on the first stage, the final norm and the output
/// layer on the last, which under a tied output layer holds its copy of the word embedding as
/// `output_layer.weight` when it is not also the first. Interleaved stages (several model
/// chunks) are refused: Megatron saves them as `model0`, `model1`, ….
pub fn megatron_stage_state_dict(
    values: &ParameterValues,
    config: &GptConfig,
    spec: LayerSpec,
    stage: &StageLayers,
) -> Result<Vec<(String, Option<HostTensor>)>> {
    let [layers] = stage.chunks.as_slice() else {
        bail!("interleaved pipeline stages are not written in Megatron's torch format yet");
    };
    let mut out = StateDictBuilder {
        values,
        entries: Vec::new(),
        used: HashSet::new(),
    };
    if stage.embedding {
        out.copy("word_embeddings.weight", "embedding.word_embeddings.weight")?;
        if config.position_embedding_type == PositionEmbedding::LearnedAbsolute {
            out.copy(
                "position_embeddings",
                "embedding.position_embeddings.weight",
            )?;
        }
    }
    for (local, l) in layers.clone().enumerate() {
        out.layer(l, local, config, spec)?;
    }
    if stage.head {
        for k in norm_kinds(config) {
            out.copy(
                &format!("final_layernorm.{k}"),
                &format!("decoder.final_layernorm.{k}"),
            )?;
        }
        if config.untie_embeddings_and_output_weights {
            out.transposed("output_layer.weight", "output_layer.weight")?;
        } else if !stage.embedding {
            out.copy("word_embeddings.weight", "output_layer.weight")?;
        }
        out.extra_state("output_layer");
    }
    if let Some(extra) = values.keys().filter(|k| !out.used.contains(*k)).min() {
        bail!("{extra} has no Megatron-Core name for this model's flags");
    }
    Ok(out.entries)
}

/// The parameters of one norm.
fn norm_kinds(config: &GptConfig) -> &'static [&'static str] {
    match config.normalization {
        Normalization::LayerNorm => &["weight", "bias"],
        Normalization::RmsNorm => &["weight"],
    }
}

/// Collects a state dict's entries from ferrotron's values.
struct StateDictBuilder<'a> {
    values: &'a ParameterValues,
    entries: Vec<(String, Option<HostTensor>)>,
    /// The ferrotron parameters read so far: one the flags do not read is an error.
    used: HashSet<String>,
}

impl StateDictBuilder<'_> {
    /// Layer `l`'s entries, numbered `local` in the file (its place in its pipeline stage).
    fn layer(&mut self, l: usize, local: usize, config: &GptConfig, spec: LayerSpec) -> Result<()> {
        let norm_kinds = norm_kinds(config);
        let linear_bias = config.add_bias_linear;
        let ours = |name: &str| format!("layers.{l}.{name}");
        let theirs = |name: &str| format!("decoder.layers.{local}.{name}");
        let (input_norm, mlp_norm) = match spec {
            LayerSpec::Local => (
                "input_layernorm.".to_owned(),
                "pre_mlp_layernorm.".to_owned(),
            ),
            LayerSpec::TransformerEngine => (
                "self_attention.linear_qkv.layer_norm_".to_owned(),
                "mlp.linear_fc1.layer_norm_".to_owned(),
            ),
        };
        for k in norm_kinds {
            self.copy(
                &ours(&format!("input_layernorm.{k}")),
                &theirs(&format!("{input_norm}{k}")),
            )?;
        }
        if spec == LayerSpec::TransformerEngine {
            self.extra_state(&theirs("self_attention.core_attention"));
        }
        self.linear(
            &ours("self_attention.dense"),
            &theirs("self_attention.linear_proj"),
            linear_bias,
        )?;
        self.linear(
            &ours("self_attention.query_key_value"),
            &theirs("self_attention.linear_qkv"),
            linear_bias || config.add_qkv_bias,
        )?;
        if config.qk_layernorm {
            for which in ["q_layernorm", "k_layernorm"] {
                for k in norm_kinds {
                    self.copy(
                        &ours(&format!("self_attention.{which}.{k}")),
                        &theirs(&format!("self_attention.{which}.{k}")),
                    )?;
                }
            }
        }
        for k in norm_kinds {
            self.copy(
                &ours(&format!("post_attention_layernorm.{k}")),
                &theirs(&format!("{mlp_norm}{k}")),
            )?;
        }
        if config.swiglu {
            self.gated_linear(
                &ours("mlp.dense_h_to_4h"),
                &theirs("mlp.linear_fc1"),
                linear_bias,
            )?;
        } else {
            self.linear(
                &ours("mlp.dense_h_to_4h"),
                &theirs("mlp.linear_fc1"),
                linear_bias,
            )?;
        }
        self.linear(
            &ours("mlp.dense_4h_to_h"),
            &theirs("mlp.linear_fc2"),
            linear_bias,
        )?;
        Ok(())
    }
    fn get(&mut self, ours: &str) -> Result<HostTensor> {
        self.used.insert(ours.to_owned());
        let (shape, values) = self
            .values
            .get(ours)
            .with_context(|| format!("the model has no {ours}, which its flags call for"))?;
        Ok(HostTensor::new(shape.clone(), values.clone()))
    }

    fn copy(&mut self, ours: &str, theirs: &str) -> Result<()> {
        let t = self.get(ours)?;
        self.entries.push((theirs.to_owned(), Some(t)));
        Ok(())
    }

    /// A `Linear` weight: ferrotron's `[in, out]` becomes PyTorch's `[out, in]`.
    fn transposed(&mut self, ours: &str, theirs: &str) -> Result<()> {
        let t = self.get(ours)?.transposed().map_err(anyhow::Error::msg)?;
        self.entries.push((theirs.to_owned(), Some(t)));
        Ok(())
    }

    fn extra_state(&mut self, module: &str) {
        self.entries.push((format!("{module}._extra_state"), None));
    }

    fn linear(&mut self, ours: &str, theirs: &str, bias: bool) -> Result<()> {
        self.transposed(&format!("{ours}.weight"), &format!("{theirs}.weight"))?;
        if bias {
            self.copy(&format!("{ours}.bias"), &format!("{theirs}.bias"))?;
        }
        self.extra_state(theirs);
        Ok(())
    }

    /// SwiGLU's first linear: ferrotron's separate gate and up become `[gate; up]`.
    fn gated_linear(&mut self, ours: &str, theirs: &str, bias: bool) -> Result<()> {
        let gate = ours.replace("dense_h_to_4h", "dense_h_to_4h_gate");
        let mut kinds = vec!["weight"];
        if bias {
            kinds.push("bias");
        }
        for kind in kinds {
            let orient = |t: HostTensor| -> Result<HostTensor> {
                if kind == "weight" {
                    t.transposed().map_err(anyhow::Error::msg)
                } else {
                    Ok(t)
                }
            };
            let g = orient(self.get(&format!("{gate}.{kind}"))?)?;
            let u = orient(self.get(&format!("{ours}.{kind}"))?)?;
            let joined = HostTensor::concat(&[g, u], 0).map_err(anyhow::Error::msg)?;
            self.entries
                .push((format!("{theirs}.{kind}"), Some(joined)));
        }
        self.extra_state(theirs);
        Ok(())
    }
}

/// The `args` Namespace Megatron's loader reads (field names and types as Megatron's
/// `arguments.py` gives them).
fn args_namespace(run: &MegatronRun, place: ShardPlace) -> PyValue {
    let c = &run.config;
    let int = |v: usize| PyValue::Int(v as i64);
    let mut fields: Vec<(&str, PyValue)> = vec![
        ("num_layers", int(c.num_layers)),
        ("hidden_size", int(c.hidden_size)),
        ("ffn_hidden_size", int(c.ffn_size())),
        ("num_attention_heads", int(c.num_attention_heads)),
        ("kv_channels", int(c.head_dim())),
        (
            "group_query_attention",
            PyValue::Bool(c.num_query_groups.is_some()),
        ),
        ("num_query_groups", int(c.query_groups())),
        ("max_position_embeddings", int(c.max_position_embeddings)),
        (
            "position_embedding_type",
            PyValue::Str(
                match c.position_embedding_type {
                    PositionEmbedding::LearnedAbsolute => "learned_absolute",
                    PositionEmbedding::Rope => "rope",
                    PositionEmbedding::None => "none",
                }
                .into(),
            ),
        ),
        // The legacy `--no-position-embedding`'s destination: True unless it was given,
        // which also makes the type `none` (rotary models keep it True).
        (
            "add_position_embedding",
            PyValue::Bool(c.position_embedding_type != PositionEmbedding::None),
        ),
        ("rotary_base", PyValue::Int(c.rotary_base.round() as i64)),
        ("rotary_percent", PyValue::Float(c.rotary_percent)),
        ("rotary_interleaved", PyValue::Bool(c.rotary_interleaved)),
        ("use_rope_scaling", PyValue::Bool(c.rope_scaling.is_some())),
        (
            "normalization",
            PyValue::Str(
                match c.normalization {
                    Normalization::LayerNorm => "LayerNorm",
                    Normalization::RmsNorm => "RMSNorm",
                }
                .into(),
            ),
        ),
        ("norm_epsilon", PyValue::Float(c.layernorm_epsilon)),
        ("apply_layernorm_1p", PyValue::Bool(c.apply_layernorm_1p)),
        ("swiglu", PyValue::Bool(c.swiglu)),
        ("add_bias_linear", PyValue::Bool(c.add_bias_linear)),
        (
            "add_qkv_bias",
            PyValue::Bool(c.add_bias_linear || c.add_qkv_bias),
        ),
        ("qk_layernorm", PyValue::Bool(c.qk_layernorm)),
        (
            "untie_embeddings_and_output_weights",
            PyValue::Bool(c.untie_embeddings_and_output_weights),
        ),
        ("openai_gelu", PyValue::Bool(c.openai_gelu)),
        ("hidden_dropout", PyValue::Float(c.hidden_dropout)),
        ("attention_dropout", PyValue::Float(c.attention_dropout)),
        ("init_method_std", PyValue::Float(c.init_method_std)),
        ("padded_vocab_size", int(c.padded_vocab_size)),
        (
            "make_vocab_size_divisible_by",
            int(run.make_vocab_size_divisible_by),
        ),
        ("tensor_model_parallel_size", int(place.tp_size)),
        ("pipeline_model_parallel_size", int(place.pp_size)),
        ("bf16", PyValue::Bool(run.bf16)),
        ("fp16", PyValue::Bool(run.fp16)),
        ("iteration", PyValue::Int(run.iteration as i64)),
        (
            "consumed_train_samples",
            PyValue::Int(run.consumed_train_samples as i64),
        ),
        (
            "consumed_valid_samples",
            PyValue::Int(run.consumed_valid_samples as i64),
        ),
        ("ckpt_format", PyValue::Str("torch".into())),
        ("no_save_optim", PyValue::Bool(run.optimizer.is_none())),
        ("no_save_rng", PyValue::Bool(true)),
    ];
    let attention = window_and_yarn_fields(c);
    fields.retain(|(name, _)| attention.iter().all(|(replaced, _)| replaced != name));
    fields.extend(attention);
    if let Some(v) = run.vocab_size {
        fields.push(("vocab_size", int(v)));
    }
    if let Some(t) = &run.tokenizer_type {
        fields.push(("tokenizer_type", PyValue::Str(t.clone())));
    }
    if let Some(s) = run.seq_length {
        fields.push(("seq_length", int(s)));
    }
    PyValue::Namespace(fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

/// Megatron's arguments for Llama 3.1's rotary scaling (`rope_scaling_factor`), a sliding
/// window (`window_size` as its `(left, 0)` tuple,
/// `window_attn_skip_freq` as the per-layer list) and YaRN (`position_embedding_type` `yarn`
/// replaced, and its constants), so that Megatron builds the same attention.
fn window_and_yarn_fields(c: &GptConfig) -> Vec<(&'static str, PyValue)> {
    let mut fields = Vec::new();
    if let Some(scaling) = &c.rope_scaling {
        fields.push(("rope_scaling_factor", PyValue::Float(scaling.factor)));
    }
    if let Some(window) = c.window_size {
        let pair = vec![PyValue::Int(window as i64), PyValue::Int(0)];
        fields.push(("window_size", PyValue::Tuple(pair)));
        if let Some(layers) = &c.window_layers {
            let list = layers.iter().map(|&w| PyValue::Int(i64::from(w))).collect();
            fields.push(("window_attn_skip_freq", PyValue::List(list)));
        }
    }
    if let Some(y) = &c.yarn {
        fields.push(("position_embedding_type", PyValue::Str("yarn".into())));
        fields.push(("rotary_scaling_factor", PyValue::Float(y.factor)));
        let original = y.original_max_position_embeddings as i64;
        fields.push((
            "yarn_original_max_position_embeddings",
            PyValue::Int(original),
        ));
        fields.push(("yarn_beta_fast", PyValue::Float(y.beta_fast)));
        fields.push(("yarn_beta_slow", PyValue::Float(y.beta_slow)));
        fields.push(("mscale", PyValue::Float(y.mscale)));
        fields.push(("mscale_all_dim", PyValue::Float(y.mscale_all_dim)));
        let round = PyValue::Bool(y.round_to_int);
        fields.push(("yarn_correction_range_round_to_int", round));
    }
    fields
}

/// Writes one model-parallel rank's `model_optim_rng.pt` into the staging directory, with
/// Adam's moments (Megatron's names, as `entries`) when `adam` holds them.
fn write_rank_file(
    staging: &Path,
    place: ShardPlace,
    entries: &[(String, Option<HostTensor>)],
    adam: Option<&(StateDict, StateDict)>,
    run: &MegatronRun,
) -> Result<()> {
    let steps = run
        .optimizer
        .as_ref()
        .map_or(vec![], |o| vec![o.steps as f32; entries.len()]);
    let mut storages = TensorStorages::default();
    let model = entries
        .iter()
        .map(|(key, t)| {
            let value = match t {
                None => PyValue::None,
                Some(t) => storages.tensor(&t.values, &t.shape),
            };
            (key.clone(), value)
        })
        .collect();
    let mut top = vec![
        ("args".into(), args_namespace(run, place)),
        ("checkpoint_version".into(), PyValue::Float(3.0)),
        ("iteration".into(), PyValue::Int(run.iteration as i64)),
        ("model".into(), PyValue::OrderedDict(model)),
    ];
    if let (Some((m, v)), Some(settings)) = (adam, &run.optimizer) {
        let rank = RankAdam {
            model: entries,
            exp_avg: by_key(m),
            exp_avg_sq: by_key(v),
            steps: &steps,
        };
        top.push((
            "optimizer".into(),
            optimizer_value(&rank, settings, &mut storages)?,
        ));
        top.push((
            "opt_param_scheduler".into(),
            PyValue::Dict(settings.scheduler.clone()),
        ));
    }
    top.push((
        "num_floating_point_operations_so_far".into(),
        PyValue::Int(0),
    ));
    let top = PyValue::Dict(top);
    let dir = staging.join(place.dir_name());
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    write_torch_file(
        &dir.join("model_optim_rng.pt"),
        "model_optim_rng",
        &top,
        &storages.0,
    )
}

/// A state dict's tensors by key.
fn by_key(dict: &StateDict) -> HashMap<&str, &HostTensor> {
    dict.iter()
        .filter_map(|(k, t)| t.as_ref().map(|t| (k.as_str(), t)))
        .collect()
}
