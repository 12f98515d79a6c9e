//! Adam's state written into a Megatron `--ckpt-format torch` file as Megatron's local
//! optimizer saves it, so Megatron continues a ferrotron run with its moments (with
//! `--no-load-rng`: no RNG state is written).
//!
//! The layout is the one [`super::megatron_optimizer`] reads: `optimizer` is
//! `torch.optim.Adam`'s `state_dict()` (per parameter index its `step`, `exp_avg` and
//! `exp_avg_sq`; two `param_groups`, the decayed parameters in model order, then the biases
//! and one-dimensional ones), wrapped with the fp32 main weights
//! (`fp32_from_fp16_params`) for a bf16/fp16 run; `opt_param_scheduler` is Megatron's
//! `OptimizerParamScheduler.state_dict()`, which Megatron compares with its own flags on load.

use std::collections::HashMap;

use anyhow::{Context, Result};

use super::torch_save::{PyValue, TensorStorages};
use crate::util::host_tensor::HostTensor;

/// What a Megatron file records of a run's optimizer and schedule besides the moments.
#[derive(Clone, Debug)]
pub struct MegatronAdamSettings {
    /// Steps taken.
    pub steps: u64,
    /// The learning rate of the last step, `--lr`, `--min-lr`.
    pub lr: f64,
    pub max_lr: f64,
    pub min_lr: f64,
    /// The weight decay of the decayed group now.
    pub weight_decay: f64,
    /// `--adam-beta1`, `--adam-beta2`, `--adam-eps`.
    pub betas: (f64, f64),
    pub eps: f64,
    /// Whether the model runs in bf16/fp16 (the file then holds the fp32 main weights).
    pub mixed_precision: bool,
    /// Megatron's `opt_param_scheduler` entries.
    pub scheduler: Vec<(String, PyValue)>,
}

/// One rank's moments in Megatron's names and orientation, beside its model entries.
pub struct RankAdam<'a> {
    /// The model entries written (Megatron's keys in order; the main weights).
    pub model: &'a [(String, Option<HostTensor>)],
    /// First moments by Megatron key.
    pub exp_avg: HashMap<&'a str, &'a HostTensor>,
    /// Second moments by Megatron key.
    pub exp_avg_sq: HashMap<&'a str, &'a HostTensor>,
    /// The step count as one float per parameter (each `step` is its own tensor in torch).
    pub steps: &'a [f32],
}

/// The `optimizer` entry, its tensors' storages added to `storages`.
pub fn optimizer_value<'a>(
    rank: &RankAdam<'a>,
    settings: &MegatronAdamSettings,
    storages: &mut TensorStorages<'a>,
) -> Result<PyValue> {
    let params: Vec<(&'a str, &'a HostTensor)> = rank
        .model
        .iter()
        .filter_map(|(k, t)| t.as_ref().map(|t| (k.as_str(), t)))
        .collect();
    let decayed = |(key, t): &(&str, &HostTensor)| !key.ends_with(".bias") && t.shape.len() > 1;
    let (decay, plain): (Vec<_>, Vec<_>) = params.iter().copied().partition(decayed);
    let ordered: Vec<(&'a str, &'a HostTensor)> = decay.iter().chain(&plain).copied().collect();
    let mut state = Vec::with_capacity(ordered.len());
    for (index, (key, _)) in ordered.iter().enumerate() {
        let moment = |m: &HashMap<&'a str, &'a HostTensor>| {
            m.get(key)
                .copied()
                .with_context(|| format!("no Adam moment for {key}"))
        };
        let (m, v) = (moment(&rank.exp_avg)?, moment(&rank.exp_avg_sq)?);
        let step = rank
            .steps
            .get(index..index + 1)
            .context("a step count per parameter")?;
        state.push((
            index as i64,
            PyValue::Dict(vec![
                ("step".into(), storages.tensor(step, &[])),
                ("exp_avg".into(), storages.tensor(&m.values, &m.shape)),
                ("exp_avg_sq".into(), storages.tensor(&v.values, &v.shape)),
            ]),
        ));
    }
    let groups = PyValue::List(vec![
        group(settings, true, 0..decay.len()),
        group(settings, false, decay.len()..ordered.len()),
    ]);
    let adam = PyValue::Dict(vec![
        ("state".into(), PyValue::IntDict(state)),
        ("param_groups".into(), groups),
    ]);
    if !settings.mixed_precision {
        return Ok(adam);
    }
    let mut main = |list: &[(&'a str, &'a HostTensor)]| {
        PyValue::List(
            list.iter()
                .map(|(_, t)| storages.tensor(&t.values, &t.shape))
                .collect(),
        )
    };
    let fp32 = PyValue::List(vec![main(&decay), main(&plain)]);
    Ok(PyValue::Dict(vec![
        ("optimizer".into(), adam),
        ("fp32_from_fp16_params".into(), fp32),
    ]))
}

/// One of Megatron's two parameter groups, with the keys its groups carry.
fn group(
    settings: &MegatronAdamSettings,
    decayed: bool,
    indices: std::ops::Range<usize>,
) -> PyValue {
    let float = PyValue::Float;
    let wd_mult = if decayed { 1.0 } else { 0.0 };
    PyValue::Dict(vec![
        ("is_expert_parallel".into(), PyValue::Bool(false)),
        ("default_config".into(), PyValue::Bool(true)),
        ("wd_mult".into(), float(wd_mult)),
        ("lr_mult".into(), float(1.0)),
        ("is_decoupled_lr".into(), PyValue::Bool(false)),
        ("max_lr".into(), float(settings.max_lr)),
        ("min_lr".into(), float(settings.min_lr)),
        ("lr".into(), float(settings.lr)),
        (
            "betas".into(),
            PyValue::Tuple(vec![float(settings.betas.0), float(settings.betas.1)]),
        ),
        ("eps".into(), float(settings.eps)),
        (
            "weight_decay".into(),
            float(settings.weight_decay * wd_mult),
        ),
        ("amsgrad".into(), PyValue::Bool(false)),
        ("maximize".into(), PyValue::Bool(false)),
        ("foreach".into(), PyValue::None),
        ("capturable".into(), PyValue::Bool(false)),
        ("differentiable".into(), PyValue::Bool(false)),
        ("fused".into(), PyValue::None),
        ("decoupled_weight_decay".into(), PyValue::Bool(true)),
        (
            "params".into(),
            PyValue::List(indices.map(|i| PyValue::Int(i as i64)).collect()),
        ),
    ])
}
