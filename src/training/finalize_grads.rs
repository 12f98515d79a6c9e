//! After the backward passes, before the optimizer (Megatron-Core's `finalize_model_grads`):
//! the tied word embedding's gradient summed over the embedding group, and the gradients
//! summed over the data-parallel ranks in buckets, unless the optimizer reduces them itself
//! (the distributed optimizer's reduce-scatter) or the backward pass already did
//! (`--overlap-grad-reduce`). Also what the global norm counts once.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::Result;
use burn::module::ParamId;

use crate::model::{Gpt, StageLayers};
use crate::optim::GradientAccumulator;
use crate::parallel::state::ParallelState;
use crate::parallel::{holdings::parameter_holdings, sharding::Holding};

/// The parameters a step treats specially, decided once when the model is built.
#[derive(Clone, Debug, Default)]
pub struct ParamRoles {
    /// Parameters held on two pipeline stages whose gradients are summed over the embedding
    /// group (the tied word embedding: the first stage's and the last stage's copy).
    pub shared_across_stages: Vec<ParamId>,
    /// Parameters left out of the global norm on this rank because another rank counts them:
    /// those replicated over tensor-parallel ranks count on tensor-parallel rank 0 only; the
    /// tied word embedding on the first stage only (Megatron leaves the last stage's copy out
    /// as shared).
    pub not_counted: HashSet<ParamId>,
    /// Every parameter's id and whole-model name (checkpoints, optimizer state).
    pub names: Vec<(ParamId, String)>,
}

impl ParamRoles {
    /// The roles of `model`'s parameters on this rank (stage `stage`, tensor-parallel rank
    /// `tp_rank`).
    pub fn of(model: &Gpt, stage: &StageLayers, tp_rank: usize) -> Self {
        let holdings = parameter_holdings(model);
        let shared_across_stages = model.shared_with_other_stages(stage);
        let mut not_counted: HashSet<ParamId> = holdings
            .iter()
            .filter(|p| tp_rank != 0 && p.holding == Holding::Duplicated)
            .map(|p| p.id)
            .collect();
        if !stage.embedding {
            not_counted.extend(shared_across_stages.first());
        }
        Self {
            shared_across_stages,
            not_counted,
            names: holdings.into_iter().map(|p| (p.id, p.name)).collect(),
        }
    }
}

/// How the data-parallel sum is done this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataParallelReduce {
    /// Here, in buckets of this many elements.
    Buckets(usize),
    /// Elsewhere: by the optimizer, by the backward pass, or there is one data-parallel rank.
    Done,
}

/// Finalises this rank's gradients for the optimizer; returns how long the data-parallel
/// sum took when it ran here (time no backward pass hid).
pub fn finalize_model_grads(
    grads: &mut GradientAccumulator,
    roles: &ParamRoles,
    parallel: &ParallelState,
    data_parallel: DataParallelReduce,
) -> Result<Option<Duration>> {
    grads.all_reduce_parameters(&roles.shared_across_stages, &parallel.embedding)?;
    match data_parallel {
        DataParallelReduce::Buckets(elements) if parallel.data_with_context.size() > 1 => {
            let start = Instant::now();
            grads.all_reduce_in_buckets(&parallel.data_with_context, elements.max(1))?;
            Ok(Some(start.elapsed()))
        }
        _ => Ok(None),
    }
}
