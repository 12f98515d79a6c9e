//! Validation and test losses during training (Megatron's `evaluate`): `--eval-iters` global
//! batches through the forward-only schedule, without dropout or gradients, on every rank.

use anyhow::Result;
use burn::module::Module;
use burn::tensor::Device;

use super::config::BatchPlan;
use super::forward_backward::{batch_reads, forward_only_losses, StepInputs};
use crate::comm::ReduceOp;
use crate::data::loader::{DeviceBatch, MicroBatch};
use crate::data::SampleDataset;
use crate::model::{Gpt, StageLayers};
use crate::parallel::state::ParallelState;
use crate::pipeline::PipelineP2p;

/// Where an evaluation runs: this rank's stage, its links and groups.
pub struct EvaluationPlace<'a> {
    /// The run's batch plan.
    pub plan: &'a BatchPlan,
    /// This rank's layers.
    pub stage: &'a StageLayers,
    /// The links to the neighbouring stages.
    pub p2p: &'a PipelineP2p,
    /// The run's groups.
    pub parallel: &'a ParallelState,
    /// The device.
    pub device: &'a Device,
    /// What the samples carry besides their tokens.
    pub masks: crate::data::SampleMasks,
    /// The part of each sequence this rank reads.
    pub part: crate::data::loader::SequencePart,
}

/// Mean LM loss over `iters` global batches of `dataset` from sample `start`. Every rank
/// calls it: each data-parallel rank evaluates its micro-batches of every global batch, the
/// last stage's sums are summed over the pipeline and the data-parallel ranks, so every rank
/// gets the mean.
pub fn evaluate(
    model: &Gpt,
    dataset: &dyn SampleDataset,
    start: u64,
    iters: u64,
    place: &EvaluationPlace<'_>,
) -> Result<f64> {
    let plan = place.plan;
    let model = model.valid();
    let inner = place.device.clone().inner();
    let (all, mine) = plan.evaluation_micro_batches(iters);
    let reads = batch_reads(place.p2p);
    let batches: Vec<DeviceBatch> = (0..mine)
        .map(|k| {
            MicroBatch::from_dataset(
                dataset,
                plan.sample_of(start, k),
                plan.micro_batch_size,
                &place.masks,
            )
            .part(place.part)
            .to_device(&inner, reads)
        })
        .collect();
    let global_index = |k: usize| plan.global_micro_batch(k);
    let inputs = StepInputs {
        model: &model,
        stage: place.stage,
        p2p: place.p2p,
        global_index: &global_index,
        seed: 0,
        iteration: 0,
        device: &inner,
    };
    let losses = forward_only_losses(&inputs, &batches, place.parallel.layout.pp)?;
    let local: f64 = losses
        .into_iter()
        .map(|l| l.into_scalar::<f32>() as f64)
        .sum();
    // Only the last stage has losses: the pipeline sum brings them to every stage.
    let stages = place
        .parallel
        .pipeline
        .all_reduce_scalar(local, ReduceOp::Sum)?;
    let total = place
        .parallel
        .data_with_context
        .all_reduce_scalar(stages, ReduceOp::Sum)?;
    Ok(total / all.max(1) as f64)
}
