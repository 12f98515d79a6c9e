//! `pretrain` (Megatron's `pretrain_gpt.py`): set up every rank, then the training loop —
//! a step, its report, evaluation and checkpoints at their intervals.

use std::sync::Arc;

use anyhow::Result;
use burn::tensor::Device;

use super::buffer_limits;
use super::config::{BatchPlan, PretrainConfig};
use super::evaluate::{evaluate, EvaluationPlace};
use super::param_stats::params_l2_norm;
use super::setup::{build_datasets, print_memory_estimate, set_up_rank, Datasets, RankSetup};
use super::step_graph::StepGraph;
use super::train_step::{overlaps_grad_reduce, train_step, StepReport};
use crate::checkpoint::megatron_optimizer_save::MegatronAdamSettings;
use crate::checkpoint::megatron_torch_save::RankPart;
use crate::checkpoint::torch_save::PyValue;
use crate::checkpoint::{OptimizerState, RunRecord, SavedRank, ShardPlace};
use crate::comm::world::World;
use crate::comm::{run_ranks, Communicator, ReduceOp};
use crate::data::loader::BatchLoader;
use crate::data::loader::SequencePart;
use crate::logging::metrics::{print_validation, IterationRecord, MetricsOptions, MetricsSink};
use crate::optim::mixed_precision::Precision;
use crate::optim::param_scheduler::WeightDecayIncrStyle;
use crate::optim::{LearningRates, WeightDecaySchedule};
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
    /// What the schedules gave every iteration run: its learning rate, weight decay and
    /// global batch size.
    pub schedule: Vec<ScheduledValues>,
    /// The loss scale after every iteration run (1 without a scaler).
    pub loss_scales: Vec<(u64, f64)>,
    /// With `--log-num-zeros-in-grad`: the zero gradient elements of every iteration run
    /// that counted them.
    pub num_zeros_in_grad: Vec<(u64, u64)>,
    /// The iterations skipped for overflowing gradients.
    pub skipped_iterations: Vec<u64>,
    /// Iterations run by replaying the captured step (`--cuda-graph-impl local
    /// --cuda-graph-scope full_iteration`).
    pub replayed_iterations: u64,
    /// The gradient norm before clipping of every iteration that updated the weights (the
    /// log's `grad norm`).
    pub grad_norms: Vec<(u64, f64)>,
    /// With pipeline stages: per iteration, each stage's share of the step spent waiting for
    /// its neighbours (the measured bubble), stage 0 first.
    pub pipeline_idle_fractions: Vec<Vec<f64>>,
    /// Per iteration with more than one data-parallel rank: seconds this rank waited for the
    /// data-parallel gradient reduction after its backward pass (all of it without
    /// `--overlap-grad-reduce`; what the backward pass did not hide with it).
    pub grad_reduce_exposed_seconds: Vec<f64>,
}

/// The hyper-parameters one iteration trained with.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScheduledValues {
    /// The iteration.
    pub iteration: u64,
    /// Its learning rate.
    pub lr: f64,
    /// The word embedding's and output layer's (`--decoupled-lr`; `lr` without it).
    pub decoupled_lr: f64,
    /// Its weight decay.
    pub weight_decay: f64,
    /// Its global batch size.
    pub global_batch_size: usize,
}

/// Trains as configured on `device` (an autodiff device) in this process, printing
/// Megatron's log lines.
///
/// With tensor or pipeline parallelism the model is split over ranks, one thread each, all
/// reading the same batches; world rank 0 logs and reports. Under an MPI launcher use
/// [`pretrain_on`] with the MPI world instead.
pub fn pretrain(cfg: &PretrainConfig, device: &Device) -> Result<PretrainOutcome> {
    cfg.validate(device)?;
    let (tp, pp, cp) = (
        cfg.parallel.tensor_model_parallel_size,
        cfg.parallel.pipeline_model_parallel_size,
        cfg.parallel.context_parallel_size,
    );
    let ranks = cfg.parallel.replica_ranks();
    if ranks == 1 {
        return pretrain_on(cfg, device, World::single().comm());
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ranks > cores {
        eprintln!("warning: {ranks} model-parallel ranks are more than the {cores} cores here; the ranks share them");
    }
    let context = if cp > 1 {
        format!(", context parallel size: {cp}")
    } else {
        String::new()
    };
    println!(" > tensor model parallel size: {tp}, pipeline model parallel size: {pp}{context} ({ranks} ranks, one thread each)");
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
    crate::util::matmul::choose_products(cfg.products).map_err(anyhow::Error::msg)?;
    let started = std::time::Instant::now();
    // Steady-state steps reuse resident memory instead of page-faulting it back in.
    crate::util::allocator::retain_freed_memory();
    let parallel = ParallelState::new(
        world,
        cfg.parallel.tensor_model_parallel_size,
        cfg.parallel.pipeline_model_parallel_size,
        cfg.parallel.context_parallel_size,
    )?;
    let rank0 = parallel.is_world_rank0();
    if rank0 {
        println!("{}", parallel.layout.log_line());
        if let Some(line) = crate::util::matmul::products_log_line(device) {
            println!(" > {line}");
        }
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
    if let Some(limit) = buffer_limits::device_limit(device) {
        // As `setup::build_optimizer` decides; every rank of a run checks the same tensors, so
        // all refuse together.
        let flat = !cfg.parallel.use_distributed_optimizer && parallel.model.size() == 1;
        buffer_limits::check_against(&buffer_limits::largest_tensors(cfg, flat), limit)?;
    }
    let setup = set_up_rank(cfg, plan, &parallel, device, &say)?;
    let dtype = burn::tensor::DType::from(cfg.precision.dtype());
    if let Some(line) = setup.optimizer.model().kernels_in_words(device, dtype) {
        let update = setup.optimizer.update_in_words();
        say(format!(" > {line}; optimizer: {update}"));
    }
    if cfg.parallel.overlap_grad_reduce
        && parallel.layout.gradient_ranks() > 1
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
        started,
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
    /// When this rank started (`--exit-duration-in-mins` counts from here).
    started: std::time::Instant,
}

impl Trainer<'_> {
    /// The step graph `--cuda-graph-impl local --cuda-graph-scope full_iteration` asks for,
    /// or `None` (saying why on rank 0 when it was asked for but cannot be).
    fn step_graph(&self) -> Option<StepGraph> {
        let cfg = self.cfg;
        cfg.cuda_graph_warmup_steps?;
        match StepGraph::new(cfg, self.parallel, &self.setup, self.device) {
            Ok(graph) => Some(graph),
            Err(why) => {
                if self.parallel.is_world_rank0() {
                    eprintln!("warning: --cuda-graph-impl local: steps run eagerly: {why}");
                }
                None
            }
        }
    }

    /// The training loop (Megatron's `train`), then the final checkpoint, the loss plot and
    /// the end-of-training evaluations.
    fn run(mut self) -> Result<PretrainOutcome> {
        let cfg = self.cfg;
        let mut metrics = self.open_metrics()?;
        let loader = self.loader();
        let mut outcome = PretrainOutcome::default();
        let mut step_graph = self.step_graph();
        while self.setup.state.iteration < cfg.train_iters {
            let state = &self.setup.state;
            let iteration = state.iteration + 1;
            let plan = self.setup.plan.after(cfg, state.consumed_train_samples)?;
            let lr = self.set_weight_decay_and_get_lr();
            let batches = (0..plan.micro_batches_per_rank())
                .map(|_| loader.next_batch())
                .collect();
            let step = (iteration, lr);
            let report = match step_graph.as_mut() {
                Some(graph) => {
                    let parallel = (self.parallel, plan);
                    graph.step(cfg, &mut self.setup, parallel, batches, step, self.device)?
                }
                None => train_step(
                    cfg,
                    &mut self.setup,
                    (self.parallel, plan),
                    batches,
                    step,
                    self.device,
                )?,
            };
            self.advance(&report, iteration, plan.global_batch_size, &mut outcome);
            outcome.replayed_iterations = step_graph.as_ref().map_or(0, StepGraph::replayed);
            outcome.schedule.push(ScheduledValues {
                iteration,
                lr: lr.base,
                decoupled_lr: lr.decoupled,
                weight_decay: self.setup.optimizer.weight_decay(),
                global_batch_size: plan.global_batch_size,
            });
            let params_norm = self.params_norm()?;
            if let Some(sink) = metrics.as_mut() {
                sink.record_iteration(&self.record(
                    &report,
                    (iteration, plan),
                    lr.base,
                    params_norm,
                ))?;
            }
            self.validate_at_interval(iteration, metrics.as_mut(), &mut outcome)?;
            if self.checkpoint_and_decide_exit(iteration)? {
                outcome.iteration = iteration;
                return Ok(outcome);
            }
        }
        self.finish(metrics, outcome)
    }

    /// What the scheduler gives at the steps taken so far (Megatron's
    /// `OptimizerParamScheduler.step` writes both into the optimizer's parameter groups): the
    /// weight decay goes to the optimizer, the learning rates to the step.
    fn set_weight_decay_and_get_lr(&mut self) -> LearningRates {
        let steps = self.setup.state.scheduler_steps;
        if let Some(schedule) = &self.cfg.weight_decay_schedule {
            self.setup.optimizer.set_weight_decay(schedule.wd_at(steps));
        }
        let base = self.cfg.schedule.lr_at(steps);
        let decoupled = self.cfg.decoupled_schedule.as_ref();
        LearningRates {
            base,
            decoupled: decoupled.map_or(base, |s| s.lr_at(steps)),
        }
    }

    /// Counts the step (of `global_batch` samples) in the training state and the outcome;
    /// the schedule advances only on iterations that updated the weights.
    fn advance(
        &mut self,
        report: &StepReport,
        iteration: u64,
        global_batch: usize,
        outcome: &mut PretrainOutcome,
    ) {
        let state = &mut self.setup.state;
        if report.skipped {
            state.skipped_iterations += 1;
            outcome.skipped_iterations.push(iteration);
        } else {
            state.scheduler_steps += global_batch as u64;
        }
        state.iteration = iteration;
        state.consumed_train_samples += global_batch as u64;
        outcome.iteration = iteration;
        outcome.losses.push((iteration, report.lm_loss));
        outcome.loss_scales.push((iteration, report.loss_scale));
        outcome
            .grad_norms
            .extend(report.grad_norm.map(|n| (iteration, n)));
        outcome
            .num_zeros_in_grad
            .extend(report.num_zeros_in_grad.map(|z| (iteration, z)));
        outcome
            .grad_reduce_exposed_seconds
            .extend(report.grad_reduce_exposed_seconds);
        outcome
            .pipeline_idle_fractions
            .extend(report.pipeline_idle.clone());
    }

    /// What the metrics sink records of a step (`params_norm` with `--log-params-norm`).
    fn record(
        &self,
        report: &StepReport,
        (iteration, plan): (u64, BatchPlan),
        lr: f64,
        params_norm: Option<f64>,
    ) -> IterationRecord {
        let state = &self.setup.state;
        IterationRecord {
            iteration,
            consumed_samples: state.consumed_train_samples,
            global_batch_size: plan.global_batch_size,
            lr,
            next_lr: self.cfg.schedule.lr_at(state.scheduler_steps),
            lm_loss: report.lm_loss,
            grad_norm: report.grad_norm,
            loss_scale: report.loss_scale,
            skipped: report.skipped,
            pipeline_idle: report.pipeline_idle.clone(),
            grad_reduce_exposed_seconds: report.grad_reduce_exposed_seconds,
            params_norm,
            num_zeros_in_grad: report.num_zeros_in_grad,
        }
    }

    /// With `--log-params-norm`: the parameters' norm after the step (a collective over the
    /// model-parallel ranks, every iteration, as Megatron computes it).
    fn params_norm(&self) -> Result<Option<f64>> {
        if !self.cfg.log_options.params_norm {
            return Ok(None);
        }
        let norm = params_l2_norm(
            self.setup.optimizer.main_weights(),
            &self.setup.roles.not_counted,
            &self.parallel.model,
        )?;
        Ok(Some(norm))
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
            seq_length: cfg.seq_length,
            flops_per_token: cfg.model.flops_per_token(cfg.seq_length),
            log_throughput: cfg.log_options.throughput,
            world_size: self.parallel.world.size(),
            peak_tflops: cfg.log_options.peak_tflops,
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
            (self.cfg.sample_masks(), sequence_part(self.parallel)),
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
            masks: self.cfg.sample_masks(),
            part: sequence_part(self.parallel),
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

    /// Megatron's `checkpoint_and_decide_exit`: saves at `--save-interval`, and saves and
    /// stops on a stop signal (`--exit-signal-handler`), after `--exit-duration-in-mins` or at
    /// `--exit-interval`. Returns whether to stop now.
    fn checkpoint_and_decide_exit(&self, iteration: u64) -> Result<bool> {
        let cfg = self.cfg;
        let every = |k: Option<u64>| k.is_some_and(|k| k > 0 && iteration.is_multiple_of(k));
        let exit = match self.agreed_stop()? {
            Some(reason) => Some(reason),
            None => every(cfg.exit_interval)
                .then(|| format!("at iteration {iteration} (--exit-interval)")),
        };
        if every(cfg.save_interval) || exit.is_some() {
            self.save()?;
        }
        if let (Some(reason), true) = (&exit, self.parallel.is_world_rank0()) {
            println!(" > exiting program {reason}");
        }
        Ok(exit.is_some())
    }

    /// Whether any rank was asked to stop (a signal) or ran out of time: decided together, so
    /// that every rank stops after the same iteration (a collective, only when asked for).
    fn agreed_stop(&self) -> Result<Option<String>> {
        let cfg = self.cfg;
        if !cfg.exit_signal_handler && cfg.exit_duration_in_mins.is_none() {
            return Ok(None);
        }
        let world = &self.parallel.world;
        let signalled = cfg.exit_signal_handler && crate::util::exit_signal::received();
        if world.all_reduce_scalar(f64::from(u8::from(signalled)), ReduceOp::Max)? > 0.0 {
            return Ok(Some(
                "after receiving a stop signal (--exit-signal-handler)".into(),
            ));
        }
        let Some(limit) = cfg.exit_duration_in_mins else {
            return Ok(None);
        };
        let minutes =
            world.all_reduce_scalar(self.started.elapsed().as_secs_f64() / 60.0, ReduceOp::Max)?;
        Ok((minutes > limit)
            .then(|| format!("after {minutes:.2} minutes (--exit-duration-in-mins {limit})")))
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

    /// Saves a checkpoint of the fp32 main weights and the optimizer state under `--save` (if
    /// set), in the run's format: the ranks of data-parallel replica 0 write their shards, and
    /// every rank waits until the checkpoint is complete.
    fn save(&self) -> Result<()> {
        let Some(dir) = &self.cfg.save else {
            return Ok(());
        };
        let (parallel, optimizer, state) =
            (self.parallel, &self.setup.optimizer, &self.setup.state);
        let place = ShardPlace {
            tp: parallel.coordinates.tp,
            tp_size: parallel.layout.tp,
            pp: parallel.coordinates.pp,
            pp_size: parallel.layout.pp,
        };
        // Gathered on every rank (a collective under the distributed optimizer).
        let optimizer_state = OptimizerState {
            steps: optimizer.steps(),
            moments: optimizer.moments()?,
            grad_scaler: optimizer.scaler_state(),
        };
        // The ranks of data-parallel replica 0 (every tensor-parallel rank of every stage) write;
        // context-parallel ranks hold the same parameters, so their rank 0 writes.
        if parallel.coordinates.dp == 0 && parallel.coordinates.cp == 0 {
            let rank = SavedRank {
                weights: optimizer.main_weights(),
                config: &self.cfg.model,
                optimizer: &optimizer_state,
                state,
                part: RankPart {
                    place,
                    stage: &self.setup.stage,
                },
                run: RunRecord {
                    seq_length: self.cfg.seq_length,
                    bf16: self.cfg.precision == Precision::Bf16,
                    fp16: self.cfg.precision == Precision::Fp16,
                    adam: self.megatron_adam_settings(),
                },
            };
            self.cfg.save_format.save_rank(dir, rank, &parallel.model)?;
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

    /// What Megatron's optimizer and scheduler record of this run (its `OptimizerParamScheduler`
    /// counts in samples, as ferrotron's schedule does).
    fn megatron_adam_settings(&self) -> MegatronAdamSettings {
        let (cfg, state) = (self.cfg, &self.setup.state);
        let schedule = &cfg.schedule;
        // Megatron's weight-decay schedule spans the run even when it is constant.
        let run_samples = cfg
            .train_samples
            .unwrap_or(cfg.train_iters * cfg.global_batch_size as u64);
        let mut wd = cfg
            .weight_decay_schedule
            .clone()
            .unwrap_or_else(|| WeightDecaySchedule::constant(cfg.adam.weight_decay));
        if wd.style == WeightDecayIncrStyle::Constant {
            wd.incr_steps = run_samples as f64;
        }
        let steps = |s: f64| PyValue::Int(s.round() as i64);
        MegatronAdamSettings {
            steps: self.setup.optimizer.steps(),
            lr: schedule.lr_at(state.scheduler_steps),
            max_lr: schedule.max_lr,
            min_lr: schedule.min_lr,
            weight_decay: self.setup.optimizer.weight_decay(),
            betas: (cfg.adam.beta1, cfg.adam.beta2),
            eps: cfg.adam.eps,
            mixed_precision: cfg.precision != Precision::Fp32,
            scheduler: vec![
                ("max_lr".into(), PyValue::Float(schedule.max_lr)),
                ("lr_warmup_steps".into(), steps(schedule.warmup_steps)),
                (
                    "num_steps".into(),
                    PyValue::Int(state.scheduler_steps as i64),
                ),
                (
                    "lr_decay_style".into(),
                    PyValue::Str(schedule.style.megatron_name().into()),
                ),
                ("lr_decay_steps".into(), steps(schedule.decay_steps)),
                ("min_lr".into(), PyValue::Float(schedule.min_lr)),
                ("start_wd".into(), PyValue::Float(wd.start)),
                ("end_wd".into(), PyValue::Float(wd.end)),
                (
                    "wd_incr_style".into(),
                    PyValue::Str(wd.style.megatron_name().into()),
                ),
                ("wd_incr_steps".into(), steps(wd.incr_steps)),
            ],
        }
    }
}

/// The part of each sequence this rank reads: its context-parallel rank's two chunks.
pub fn sequence_part(parallel: &ParallelState) -> SequencePart {
    SequencePart {
        size: parallel.layout.cp,
        rank: parallel.coordinates.cp,
    }
}
