//! One training step (Megatron-Core's `train_step`): the schedule's forward and backward
//! passes, the gradients finalised, the optimizer's step, and what the step reports.

use anyhow::Result;
use burn::tensor::{Device, Tensor};

use super::config::{BatchPlan, PretrainConfig};
use super::finalize_grads::{finalize_model_grads, DataParallelReduce};
use super::forward_backward::{
    batch_reads, forward_backward, training_schedule, OverlapGradReduce, StepInputs,
};
use super::param_stats::count_zero_grads;
use super::setup::RankSetup;
use crate::comm::ReduceOp;
use crate::data::loader::{DeviceBatch, MicroBatch};
use crate::optim::mixed_precision_optimizer::read_step_values;
use crate::optim::{GradNorm, LearningRates, StepResult};
use crate::parallel::state::ParallelState;

/// What one step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// The global batch's mean LM loss.
    pub lm_loss: f64,
    /// The gradient norm before clipping (`None` when the step was skipped).
    pub grad_norm: Option<f64>,
    /// Skipped for overflowing gradients (no update).
    pub skipped: bool,
    /// The loss scale after the step (1 without a scaler).
    pub loss_scale: f64,
    /// With pipeline stages: each stage's share of the step spent waiting for its
    /// neighbours, stage 0 first.
    pub pipeline_idle: Option<Vec<f64>>,
    /// With more than one data-parallel rank: seconds this rank waited for the gradient
    /// reduction after its backward pass (all of it, or what `--overlap-grad-reduce` did not
    /// hide).
    pub grad_reduce_exposed_seconds: Option<f64>,
    /// With `--log-num-zeros-in-grad`: zero elements of the summed gradients.
    pub num_zeros_in_grad: Option<u64>,
}

/// Whether this run overlaps the data-parallel reduction with the backward pass: it needs
/// more than one data-parallel rank and an optimizer that takes summed gradients.
pub fn overlaps_grad_reduce(
    cfg: &PretrainConfig,
    setup: &RankSetup,
    parallel: &ParallelState,
) -> bool {
    cfg.parallel.overlap_grad_reduce
        && parallel.layout.gradient_ranks() > 1
        && !setup.optimizer.reduces_data_parallel_grads()
}

/// What a step leaves to report, some of it still on the device: reading it is
/// [`report_step`]'s, apart from the step, so that a captured step (which may not read the
/// device) is reported after its replay.
#[derive(Clone)]
pub struct StepOutputs {
    /// This rank's micro-batches' losses.
    losses: Vec<Tensor<1>>,
    /// The gradient norm (`None` for a skipped step).
    norm: Option<GradNorm>,
    skipped: bool,
    pipeline_idle: Option<Vec<f64>>,
    exposed: Option<std::time::Duration>,
    num_zeros_in_grad: Option<u64>,
}

/// Trains on `batches` (this rank's micro-batches of the global batch `plan` describes) at
/// `step` (the iteration and its learning rates), uploading what this rank reads of them.
pub fn train_step(
    cfg: &PretrainConfig,
    setup: &mut RankSetup,
    (parallel, plan): (&ParallelState, BatchPlan),
    batches: Vec<MicroBatch>,
    step: (u64, LearningRates),
    device: &Device,
) -> Result<StepReport> {
    let reads = batch_reads(&setup.p2p);
    let batches: Vec<DeviceBatch> = batches.iter().map(|b| b.to_device(device, reads)).collect();
    let outputs = run_step(cfg, setup, (parallel, plan), &batches, step, device)?;
    report_step(outputs, setup, (parallel, plan))
}

/// [`train_step`] without reading anything from the device: the schedule over `batches`
/// (already on the device: uploaded, or written into a captured step's inputs by
/// [`super::step_graph`]), the gradients finalised and the optimizer's step.
pub fn run_step(
    cfg: &PretrainConfig,
    setup: &mut RankSetup,
    (parallel, plan): (&ParallelState, BatchPlan),
    batches: &[DeviceBatch],
    (iteration, lr): (u64, LearningRates),
    device: &Device,
) -> Result<StepOutputs> {
    let pp = parallel.layout.pp;
    let global_index = |k: usize| plan.global_micro_batch(k);
    let steps = training_schedule(
        parallel.coordinates.pp,
        pp,
        plan.micro_batches_per_rank(),
        setup.stage.chunks.len(),
    )?;
    let overlap = overlaps_grad_reduce(cfg, setup, parallel).then_some(OverlapGradReduce {
        group: &parallel.data_with_context,
        bucket_elements: cfg.parallel.ddp_bucket_size,
    });
    let inputs = StepInputs {
        model: setup.optimizer.model(),
        stage: &setup.stage,
        p2p: &setup.p2p,
        global_index: &global_index,
        seed: cfg.seed,
        iteration,
        device,
    };
    let divisor = plan.loss_divisor(setup.optimizer.loss_scale());
    let mut out = forward_backward(&inputs, batches, &steps, cfg.recompute, divisor, overlap)?;
    let pipeline_idle = if pp > 1 {
        Some(
            parallel
                .pipeline
                .all_gather_scalars(out.timing.idle_fraction())?,
        )
    } else {
        None
    };
    let data_parallel = if out.background_reduce_exposed.is_some()
        || setup.optimizer.reduces_data_parallel_grads()
    {
        DataParallelReduce::Done
    } else {
        DataParallelReduce::Buckets(cfg.parallel.ddp_bucket_size)
    };
    let reduced_here = finalize_model_grads(&mut out.grads, &setup.roles, parallel, data_parallel)?;
    let exposed = out.background_reduce_exposed.or(reduced_here);
    // The distributed optimizer counts them in its step, where the sums are.
    let counted_before_step =
        if cfg.log_options.num_zeros_in_grad && !setup.optimizer.reduces_data_parallel_grads() {
            Some(count_zero_grads(
                &out.grads,
                &setup.roles.not_counted,
                &parallel.model,
            )?)
        } else {
            None
        };
    let result = setup.optimizer.step(&mut out.grads, lr)?;
    drop(out.grads);
    let (skipped, norm) = match result {
        StepResult::Skipped => (true, None),
        StepResult::Updated(norm) => (false, Some(norm)),
    };
    // None for a skipped step, as Megatron's optimizer returns none then.
    let num_zeros_in_grad = if skipped || !cfg.log_options.num_zeros_in_grad {
        None
    } else {
        counted_before_step.or_else(|| setup.optimizer.num_zeros_in_grad())
    };
    Ok(StepOutputs {
        losses: out.losses,
        norm,
        skipped,
        pipeline_idle,
        exposed,
        num_zeros_in_grad,
    })
}

/// The report of a step from what it left: one read of the device (the micro-batches'
/// losses and, unless it went through a host collective already, the gradient norm) and the
/// losses summed over the pipeline stages and data-parallel ranks.
pub fn report_step(
    outputs: StepOutputs,
    setup: &RankSetup,
    (parallel, plan): (&ParallelState, BatchPlan),
) -> Result<StepReport> {
    let (local_loss, grad_norm) = read_step_values(outputs.losses, outputs.norm)?;
    // Only the last stage has losses: the pipeline sum brings them to every stage.
    let stages = parallel
        .pipeline
        .all_reduce_scalar(local_loss, ReduceOp::Sum)?;
    // Context-parallel ranks hold parts of each micro-batch's loss: the sum is over both.
    let loss_sum = parallel
        .data_with_context
        .all_reduce_scalar(stages, ReduceOp::Sum)?;
    Ok(StepReport {
        lm_loss: loss_sum / plan.micro_batches() as f64,
        grad_norm,
        skipped: outputs.skipped,
        loss_scale: setup.optimizer.loss_scale(),
        pipeline_idle: outputs.pipeline_idle,
        grad_reduce_exposed_seconds: outputs.exposed.map(|d| d.as_secs_f64()),
        num_zeros_in_grad: outputs.num_zeros_in_grad,
    })
}
