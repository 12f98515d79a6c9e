//! Adam's state in a Megatron `--ckpt-format torch` checkpoint, so a run continues from
//! Megatron's moments rather than fresh ones (Megatron's own resume, not `--no-load-optim`).
//!
//! With the local (non-distributed) optimizer, Megatron saves `torch.optim.Adam`'s
//! `state_dict()` as `optimizer` (in mixed precision as `optimizer.optimizer`, beside the fp32
//! main weights `optimizer.fp32_from_fp16_params`): `state` maps a parameter's index to its `step`, `exp_avg`
//! and `exp_avg_sq`, and `param_groups` lists each group's indices in order. Megatron's
//! `_get_param_groups` builds the groups from `model.named_parameters()`, which is the state
//! dict's order of tensors: one group decays (`wd_mult` 1) every parameter that is neither a
//! bias nor one-dimensional, the other (`wd_mult` 0) holds the rest, each in model order. So
//! the indices name their parameters without any record of the mapping, and the mapping is
//! checked against the groups' sizes. The moments have their parameters' shapes and
//! tensor-parallel splits, so they are joined and renamed as the weights are.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

use super::megatron_legacy_names::core_key;
use super::megatron_tensors::{host_tensors, join_stage, ParameterValues};
use super::pickle::Unpickled;
use crate::model::GptConfig;
use crate::util::host_tensor::HostTensor;

/// Adam's state of a whole checkpoint, joined over its files as its weights are.
pub enum MegatronAdam {
    /// Saved with `--no-save-optim`.
    NotSaved,
    /// Saved by an optimizer this reader does not take (the reason).
    NotRead(String),
    /// The moments, by ferrotron parameter name (whole tensors).
    Moments(JoinedMoments),
}

/// Adam's moments joined over tensor-parallel ranks and pipeline stages.
pub struct JoinedMoments {
    /// Optimizer steps taken.
    pub steps: u64,
    /// First moments.
    pub exp_avg: ParameterValues,
    /// Second moments.
    pub exp_avg_sq: ParameterValues,
    /// A mixed-precision optimizer's fp32 main weights (the weights training continues from;
    /// the model's own are their bf16/fp16 copies).
    pub main_weights: Option<ParameterValues>,
}

/// One pipeline stage's rank files' Adam state, where its layers start, and whether its
/// `output_layer.weight` is a tied copy of the word embedding.
pub struct StageAdam {
    pub ranks: Vec<SavedAdam>,
    pub first_layer: usize,
    pub tied_copy: bool,
}

/// The stages' Adam state joined into ferrotron's names, as [`join_stage`] joins weights.
pub fn join_adam(stages: Vec<StageAdam>, config: &GptConfig) -> Result<MegatronAdam> {
    let mut joined = JoinedMoments {
        steps: 0,
        exp_avg: ParameterValues::new(),
        exp_avg_sq: ParameterValues::new(),
        main_weights: None,
    };
    let mut steps = None;
    let mut main = Some(ParameterValues::new());
    for stage in stages {
        let (mut first, mut second, mut weights) = (Vec::new(), Vec::new(), Some(Vec::new()));
        for rank in stage.ranks {
            match rank {
                SavedAdam::NotSaved => return Ok(MegatronAdam::NotSaved),
                SavedAdam::NotRead(why) => return Ok(MegatronAdam::NotRead(why)),
                SavedAdam::Moments(m) => {
                    ensure!(
                        *steps.get_or_insert(m.steps) == m.steps,
                        "the rank files have taken different numbers of Adam steps"
                    );
                    first.push(m.exp_avg);
                    second.push(m.exp_avg_sq);
                    weights = weights.zip(m.main_weights).map(|(mut w, m)| {
                        w.push(m);
                        w
                    });
                }
            }
        }
        let (at, tied) = (stage.first_layer, stage.tied_copy);
        join_stage(first, at, tied, config, &mut joined.exp_avg).context("Adam's exp_avg")?;
        join_stage(second, at, tied, config, &mut joined.exp_avg_sq)
            .context("Adam's exp_avg_sq")?;
        main = match (main, weights) {
            (Some(mut values), Some(weights)) => {
                join_stage(weights, at, tied, config, &mut values).context("fp32 main weights")?;
                Some(values)
            }
            _ => None,
        };
    }
    joined.steps = steps.unwrap_or(0);
    joined.main_weights = main;
    Ok(MegatronAdam::Moments(joined))
}

/// What a rank file holds of Adam's state.
pub enum SavedAdam {
    /// `--no-save-optim`: no optimizer in the file.
    NotSaved,
    /// An optimizer this reader does not take (a reason to print).
    NotRead(String),
    /// Adam's moments, keyed by their parameters' Megatron names.
    Moments(RankMoments),
}

/// One rank file's Adam moments.
pub struct RankMoments {
    /// Optimizer steps taken.
    pub steps: u64,
    /// First moments by parameter key.
    pub exp_avg: HashMap<String, HostTensor>,
    /// Second moments by parameter key.
    pub exp_avg_sq: HashMap<String, HostTensor>,
    /// A mixed-precision optimizer's fp32 main weights by parameter key.
    pub main_weights: Option<HashMap<String, HostTensor>>,
}

/// The Adam state of the rank file `file`, whose pickle is `top` and whose model tensors are
/// `model` (their shapes).
pub fn read_rank_adam(
    file: &Path,
    top: &Unpickled,
    model: &HashMap<String, HostTensor>,
) -> Result<SavedAdam> {
    let Some(optimizer) = top.get("optimizer") else {
        return Ok(SavedAdam::NotSaved);
    };
    // Megatron's mixed-precision optimizer wraps Adam's state dict as `optimizer` beside its
    // fp32 main weights, `fp32_from_fp16_params[group][j]` for each group's j-th parameter.
    let mixed = optimizer.get("fp32_from_fp16_params").is_some();
    let (adam, prefix) = match optimizer.get("optimizer") {
        Some(inner) if mixed => (inner, "optimizer."),
        _ => (optimizer, ""),
    };
    let unread = if file.with_file_name("distrib_optim.pt").is_file() {
        Some("the distributed optimizer's state (distrib_optim.pt) is not read yet")
    } else if adam.get("state").is_none() || adam.get("param_groups").is_none() {
        Some("the optimizer's state has neither torch's `state` nor `param_groups`")
    } else {
        None
    };
    if let Some(why) = unread {
        return Ok(SavedAdam::NotRead(why.into()));
    }
    let order = model_parameter_order(top, model)
        .with_context(|| format!("{}: the model's parameters", file.display()))?;
    let (names, groups) = index_names(adam, &order, model)
        .with_context(|| format!("{}: the optimizer's parameter groups", file.display()))?;
    let tensors = host_tensors(file, "optimizer")?;
    let take = |path: String| {
        tensors
            .get(&path)
            .cloned()
            .with_context(|| format!("{}: no optimizer tensor {path}", file.display()))
    };
    let mut moments = RankMoments {
        steps: 0,
        exp_avg: HashMap::new(),
        exp_avg_sq: HashMap::new(),
        main_weights: None,
    };
    let mut steps = None;
    for (index, name) in names.iter().enumerate() {
        let state = |kind: &str| take(format!("{prefix}state.{index}.{kind}"));
        let step = state("step")?.values.first().copied().unwrap_or(0.0) as u64;
        ensure!(
            *steps.get_or_insert(step) == step,
            "{}: parameters have taken different numbers of Adam steps",
            file.display()
        );
        moments.exp_avg.insert(name.clone(), state("exp_avg")?);
        moments
            .exp_avg_sq
            .insert(name.clone(), state("exp_avg_sq")?);
    }
    moments.steps = steps.unwrap_or(0);
    if mixed {
        let mut main = HashMap::new();
        for (g, indices) in groups.iter().enumerate() {
            for (j, &index) in indices.iter().enumerate() {
                main.insert(
                    names[index].clone(),
                    take(format!("fp32_from_fp16_params.{g}.{j}"))?,
                );
            }
        }
        moments.main_weights = Some(main);
    }
    Ok(SavedAdam::Moments(moments))
}

/// The model's parameters (its tensor entries, not the `_extra_state` ones) in the state
/// dict's order, under Megatron-Core's names (a legacy model's nested dicts flattened).
fn model_parameter_order(
    top: &Unpickled,
    model: &HashMap<String, HostTensor>,
) -> Result<Vec<String>> {
    fn walk(value: &Unpickled, path: &str, out: &mut Vec<String>) {
        let Unpickled::Dict(items) = value else {
            out.push(core_key(path));
            return;
        };
        for (key, value) in items {
            if let Unpickled::Str(k) = key {
                let path = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                walk(value, &path, out);
            }
        }
    }
    let Some(dict @ Unpickled::Dict(_)) = top.get("model") else {
        bail!("no `model` dict");
    };
    let mut keys = Vec::new();
    walk(dict, "", &mut keys);
    Ok(keys.into_iter().filter(|k| model.contains_key(k)).collect())
}

/// The parameter each optimizer state index belongs to: the decayed group's indices name the
/// decayed parameters in model order, the other group's the rest.
/// Also returns each group's indices in order.
fn index_names(
    optimizer: &Unpickled,
    order: &[String],
    model: &HashMap<String, HostTensor>,
) -> Result<(Vec<String>, Vec<Vec<usize>>)> {
    let decayed = |key: &String| !key.ends_with(".bias") && model[key].shape.len() > 1;
    let (decay, no_decay): (Vec<&String>, Vec<&String>) = order.iter().partition(|k| decayed(k));
    let Some(Unpickled::List(groups)) = optimizer.get("param_groups") else {
        bail!("no param_groups list");
    };
    let mut names: Vec<Option<String>> = vec![None; order.len()];
    let mut group_indices = Vec::with_capacity(groups.len());
    let (mut next_decay, mut next_plain) = (decay.iter(), no_decay.iter());
    for group in groups {
        let mut these = Vec::new();
        let wd_mult = match group.get("wd_mult") {
            Some(Unpickled::Float(x)) => *x,
            Some(Unpickled::Int(n)) => *n as f64,
            other => bail!("a group's wd_mult is {other:?}"),
        };
        let Some(Unpickled::List(indices)) = group.get("params") else {
            bail!("a group without its params list");
        };
        for index in indices {
            let Unpickled::Int(i) = index else {
                bail!("a parameter index {index:?}");
            };
            let slot = usize::try_from(*i)
                .ok()
                .filter(|&i| i < names.len())
                .with_context(|| format!("index {i} for a model of {} parameters", order.len()))?;
            let source = if wd_mult > 0.0 {
                &mut next_decay
            } else {
                &mut next_plain
            };
            let name = source.next().with_context(|| {
                format!("more parameters in the groups than the model has (wd_mult {wd_mult})")
            })?;
            names[slot] = Some((*name).clone());
            these.push(slot);
        }
        group_indices.push(these);
    }
    ensure!(
        next_decay.next().is_none() && next_plain.next().is_none(),
        "the groups hold fewer parameters than the model has"
    );
    let names = names
        .into_iter()
        .enumerate()
        .map(|(i, n)| n.with_context(|| format!("no group holds parameter index {i}")))
        .collect::<Result<_>>()?;
    Ok((names, group_indices))
}
