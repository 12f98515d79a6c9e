//! `pretrain` (Megatron's `pretrain_gpt.py`): set up every rank, then the training loop —
//! a step, its report, evaluation and checkpoints at their intervals.

use std::sync::Arc;

use anyhow::Result;
use burn::tensor::Device;

use super::config::{BatchPlan, PretrainConfig};
use super::evaluate::{evaluate, EvaluationPlace};
use super::setup::{build_datasets, print_memory_estimate, set_up_rank, Datasets, RankSetup};
use super::train_step::{overlaps_grad_reduce, train_step, StepReport};
use crate::checkpoint::{save_checkpoint, OptimizerState, ShardPlace};
use crate::comm::world::World;
use crate::comm::{run_ranks, Communicator};
use crate::data::loader::BatchLoader;
use crate::logging::metrics::{print_validation, IterationRecord, MetricsOptions, MetricsSink};
use crate::parallel::state::ParallelState;

/// What a run did, for callers and tests.
#[derive(Clone, Debug, Default)]
pub struct PretrainOutcome {
    /// The LM loss of every iteration run (index 0 = first iteration of this run).
    pub losses: Vec<(u64, f64)>,
    /// Validation losses `(iteration, loss)`.
    pub validation: Vec<(u64, f64)>,
    /// Final test loss, if there is a test split.
    pub test_loss: Option<f64>,
    /// Iteration reached.
    pub iteration: u64,
    /// The loss scale after every iteration run (1 without a scaler).
    pub loss_scales: Vec<(u64, f64)>,
    /// The iterations skipped for overflowing gradients.
    pub skipped_iterations: Vec<u64>,
    /// With pipeline stages: per iteration, each stage's share of the step spent waiting for
    /// its neighbours (the measured bubble), stage 0 first.
    pub pipeline_idle_fractions: Vec<Vec<f64>>,
    /// Per iteration with more than one data-parallel rank: seconds this rank waited for the
    /// data-parallel gradient reduction after its backward pass (all of it without
    /// `--overlap-grad-reduce`; what the backward pass did not hide with it).
    pub grad_reduce_exposed_seconds: Vec<f64>,
}

/// Trains as configured on `device` (an autodiff device) in this process, printing
/// Megatron's log lines.
///
/// With tensor or pipeline parallelism the model is split over ranks, one thread each, all
/// reading the same batches; world rank 0 logs and reports. Under an MPI launcher use
/// [`pretrain_on`] with the MPI world instead.
pub fn pretrain(cfg: &PretrainConfig, device: &Device) -> Result<PretrainOutcome> {
    cfg.validate(device)?;
    let (tp, pp) = (
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
    );
    let ranks = tp * pp;
    if ranks == 1 {
        return pretrain_on(cfg, device, World::single().comm());
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ranks > cores {
        eprintln!("warning: {ranks} model-parallel ranks are more than the {cores} cores here; the ranks share them");
    }
    println!(" > tensor model parallel size: {tp}, pipeline model parallel size: {pp} ({ranks} ranks, one thread each)");
    let mut outcomes = run_ranks(ranks, |world| pretrain_on(cfg, device, world))?;
    // World rank 0 is on the first stage; the losses are known everywhere.
    Ok(outcomes.swap_remove(0))
}

/// Trains on this rank of `world` (every rank calls it): the world is cut into Megatron's
/// tensor-, pipeline- and data-parallel groups. World rank 0 logs, writes the metrics and the
/// plot, and builds the dataset index cache before the other ranks read it.
pub fn pretrain_on(
    cfg: &PretrainConfig,
    device: &Device,
    world: Arc<dyn Communicator>,
) -> Result<PretrainOutcome> {
    cfg.validate(device)?;
    // Steady-state steps reuse resident memory instead of page-faulting it back in.
    crate::util::allocator::retain_freed_memory();
    let parallel = ParallelState::new(
        world,
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
    )?;
    let rank0 = parallel.is_world_rank0();
    if rank0 {
        println!("{}", parallel.layout.log_line());
    }
    let plan = BatchPlan::new(cfg, parallel.layout.dp, parallel.coordinates.dp)?;
    // Rank 0 builds (and caches) the dataset indices; the others then read the cache.
    let datasets = if rank0 {
        let built = build_datasets(cfg, true);
        parallel.world.barrier()?;
        built?
    } else {
        parallel.world.barrier()?;
        build_datasets(cfg, false)?
    };
    let say = |line: String| {
        if rank0 {
            println!("{line}");
        }
    };
    let setup = set_up_rank(cfg, plan, &parallel, device, &say)?;
    if cfg.overlap_grad_reduce
        && parallel.layout.dp > 1
        && !overlaps_grad_reduce(cfg, &setup, &parallel)
    {
        say(" > --overlap-grad-reduce: not overlapped with --use-distributed-optimizer; the gradients are reduced after the backward pass".into());
    }
    if rank0 {
        print_memory_estimate(cfg, &setup, &parallel);
    }
    Trainer {
        cfg,
        parallel: &parallel,
        datasets: &datasets,
        device,
        setup,
    }
    .run()
}

/// One rank's training run.
struct Trainer<'a> {
    cfg: &'a PretrainConfig,
    parallel: &'a ParallelState,
    datasets: &'a Datasets,
    device: &'a Device,
    setup: RankSetup,
}

impl Trainer<'_> {
    /// The training loop (Megatron's `train`), then the final checkpoint, the loss plot and
    /// the end-of-training evaluations.
    fn run(mut self) -> Result<PretrainOutcome> {
        let cfg = self.cfg;
        let mut metrics = self.open_metrics()?;
        let loader = self.loader();
        let mut outcome = PretrainOutcome::default();
        while self.setup.state.iteration < cfg.train_iters {
            let state = &self.setup.state;
            let iteration = state.iteration + 1;
            // The schedule advances only on iterations that updated the weights.
            let lr = cfg
                .schedule
                .lr_at(state.iteration - state.skipped_iterations);
            let batches = (0..self.setup.plan.micro_batches_per_rank())
                .map(|_| loader.next_batch())
                .collect();
            let report = train_step(
                cfg,
                &mut self.setup,
                self.parallel,
                batches,
                (iteration, lr),
                self.device,
            )?;
            self.advance(&report, iteration, &mut outcome);
            if let Some(sink) = metrics.as_mut() {
                sink.record_iteration(&self.record(&report, iteration, lr))?;
            }
            self.validate_at_interval(iteration, metrics.as_mut(), &mut outcome)?;
            if self.checkpoint_at_interval(iteration)? {
                outcome.iteration = iteration;
                return Ok(outcome);
            }
        }
        self.finish(metrics, outcome)
    }

    /// Counts the step in the training state and the outcome.
    fn advance(&mut self, report: &StepReport, iteration: u64, outcome: &mut PretrainOutcome) {
        let state = &mut self.setup.state;
        if report.skipped {
            state.skipped_iterations += 1;
            outcome.skipped_iterations.push(iteration);
        }
        state.iteration = iteration;
        state.consumed_train_samples += self.cfg.global_batch_size as u64;
        outcome.iteration = iteration;
        outcome.losses.push((iteration, report.lm_loss));
        outcome.loss_scales.push((iteration, report.loss_scale));
        outcome
            .grad_reduce_exposed_seconds
            .extend(report.grad_reduce_exposed_seconds);
        outcome
            .pipeline_idle_fractions
            .extend(report.pipeline_idle.clone());
    }

    /// What the metrics sink records of a step.
    fn record(&self, report: &StepReport, iteration: u64, lr: f64) -> IterationRecord {
        let state = &self.setup.state;
        IterationRecord {
            iteration,
            consumed_samples: state.consumed_train_samples,
            lr,
            next_lr: self
                .cfg
                .schedule
                .lr_at(iteration - state.skipped_iterations),
            lm_loss: report.lm_loss,
            grad_norm: report.grad_norm,
            loss_scale: report.loss_scale,
            skipped: report.skipped,
            pipeline_idle: report.pipeline_idle.clone(),
            grad_reduce_exposed_seconds: report.grad_reduce_exposed_seconds,
        }
    }

    /// World rank 0's metrics sink.
    fn open_metrics(&self) -> Result<Option<MetricsSink>> {
        if !self.parallel.is_world_rank0() {
            return Ok(None);
        }
        let cfg = self.cfg;
        Ok(Some(MetricsSink::open(MetricsOptions {
            save_dir: cfg.save.clone(),
            tensorboard_dir: cfg.tensorboard_dir.clone(),
            log_interval: cfg.log_interval,
            tensorboard_log_interval: cfg.tensorboard_log_interval,
            train_iters: cfg.train_iters,
            global_batch_size: cfg.global_batch_size,
            seq_length: cfg.seq_length,
            flops_per_token: cfg.model.flops_per_token(cfg.seq_length),
        })?))
    }

    /// This rank's micro-batches of the training set, from where the run stands.
    fn loader(&self) -> BatchLoader {
        let plan = &self.setup.plan;
        let mbs = plan.micro_batch_size as u64;
        BatchLoader::new(
            self.datasets.train.clone(),
            plan.sample_of(self.setup.state.consumed_train_samples, 0),
            mbs * plan.data_parallel as u64,
            plan.micro_batch_size,
            self.cfg.eod,
            self.cfg.eod_mask_loss,
            2 * plan.micro_batches_per_rank(),
        )
    }

    /// `--eval-iters` global batches of `dataset` from sample `start`, on every rank.
    fn evaluate(&self, dataset: &dyn crate::data::SampleDataset, start: u64) -> Result<f64> {
        let place = EvaluationPlace {
            plan: &self.setup.plan,
            stage: &self.setup.stage,
            p2p: &self.setup.p2p,
            parallel: self.parallel,
            device: self.device,
            eod: (self.cfg.eod, self.cfg.eod_mask_loss),
        };
        evaluate(
            self.setup.optimizer.model(),
            dataset,
            start,
            self.cfg.eval_iters,
            &place,
        )
    }

    /// The validation loss every `--eval-interval` iterations.
    fn validate_at_interval(
        &mut self,
        iteration: u64,
        metrics: Option<&mut MetricsSink>,
        outcome: &mut PretrainOutcome,
    ) -> Result<()> {
        let cfg = self.cfg;
        let Some(valid) = &self.datasets.valid else {
            return Ok(());
        };
        if cfg.eval_interval == 0
            || !iteration.is_multiple_of(cfg.eval_interval)
            || cfg.eval_iters == 0
        {
            return Ok(());
        }
        let loss = self.evaluate(valid.as_ref(), self.setup.state.consumed_valid_samples)?;
        let state = &mut self.setup.state;
        state.consumed_valid_samples += cfg.eval_iters * cfg.global_batch_size as u64;
        if let Some(sink) = metrics {
            sink.record_validation(iteration, state.consumed_train_samples, loss)?;
        }
        outcome.validation.push((iteration, loss));
        Ok(())
    }

    /// Saves at `--save-interval` and `--exit-interval`; returns whether to exit now.
    fn checkpoint_at_interval(&self, iteration: u64) -> Result<bool> {
        let cfg = self.cfg;
        let every = |k: Option<u64>| k.is_some_and(|k| k > 0 && iteration.is_multiple_of(k));
        let (save_now, exit_now) = (every(cfg.save_interval), every(cfg.exit_interval));
        if save_now || exit_now {
            self.save()?;
        }
        if exit_now && self.parallel.is_world_rank0() {
            println!(" > exiting at iteration {iteration} (--exit-interval)");
        }
        Ok(exit_now)
    }

    /// After the last iteration: the checkpoint (unless the interval just saved it), the
    /// validation loss, the loss plot, and the test loss.
    fn finish(
        self,
        metrics: Option<MetricsSink>,
        mut outcome: PretrainOutcome,
    ) -> Result<PretrainOutcome> {
        let cfg = self.cfg;
        let state = &self.setup.state;
        outcome.iteration = state.iteration;
        let rank0 = self.parallel.is_world_rank0();
        if cfg
            .save_interval
            .is_none_or(|k| k == 0 || !state.iteration.is_multiple_of(k))
        {
            self.save()?;
        }
        if let Some(valid) = &self.datasets.valid {
            let loss = self.evaluate(valid.as_ref(), state.consumed_valid_samples)?;
            if rank0 {
                print_validation("validation loss at the end of training for val data", loss);
            }
            outcome.validation.push((state.iteration, loss));
        }
        if let Some(sink) = metrics {
            sink.finish();
        }
        if let Some(test) = &self.datasets.test {
            let loss = self.evaluate(test.as_ref(), 0)?;
            if rank0 {
                print_validation("validation loss at the end of training for test data", loss);
            }
            outcome.test_loss = Some(loss);
        }
        Ok(outcome)
    }

    /// Saves a checkpoint of the fp32 main weights under `--save` (if set): the optimizer
    /// state is gathered by name (a collective over the data-parallel group when it is
    /// sharded), the ranks of data-parallel replica 0 write their shards, and every rank
    /// waits until the checkpoint is complete.
    fn save(&self) -> Result<()> {
        let Some(dir) = &self.cfg.save else {
            return Ok(());
        };
        let parallel = self.parallel;
        let optimizer = &self.setup.optimizer;
        let optimizer_state = OptimizerState {
            steps: optimizer.steps(),
            moments: optimizer.moments()?,
            grad_scaler: optimizer.scaler_state(),
        };
        let place = ShardPlace {
            tp: parallel.coordinates.tp,
            tp_size: parallel.layout.tp,
            pp: parallel.coordinates.pp,
            pp_size: parallel.layout.pp,
        };
        let state = &self.setup.state;
        // The ranks of data-parallel replica 0 (every tensor-parallel rank of every stage) write.
        if parallel.coordinates.dp == 0 {
            save_checkpoint(
                dir,
                optimizer.main_weights(),
                &self.cfg.model,
                &optimizer_state,
                state,
                &parallel.model,
                place,
            )?;
        }
        parallel.world.barrier()?;
        if parallel.is_world_rank0() {
            let path = crate::checkpoint::checkpoint_dir(dir, state.iteration, place);
            println!(
                " > saved checkpoint at iteration {} to {}",
                state.iteration,
                path.display()
            );
        }
        Ok(())
    }
}
