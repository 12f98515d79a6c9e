//! The training loop of `pretrain` (Megatron's `pretrain_gpt.py` on one rank).

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::module::{Module, ParamId};
use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};

use super::checkpoint::{load_checkpoint, save_checkpoint, OptimizerState, ShardPlace, TrainState};
use super::loader::{BatchLoader, MicroBatch};
use super::megatron_log::{iteration_line, validation_line, IterationStats};
use super::pipeline_step::{
    activation_expect, forward_only_schedule, run_stage, training_schedule, GptStage,
};
use super::{AdamW, AdamWConfig, GradientAccumulator, LrSchedule};
use crate::comm::world::World;
use crate::comm::{run_ranks, Communicator, Group, ReduceOp};
use crate::data::{self, DataSources, DatasetBuildConfig, SampleDataset};
use crate::logging::loss_plot::{draw_loss_plot, read_metrics};
use crate::logging::memory::{memory_report_line, peak_rss_bytes};
use crate::logging::memory_estimate::{self, MemoryPlan};
use crate::logging::tensorboard::TensorBoardWriter;
use crate::model::named_parameters::parameter_names;
use crate::model::recompute::lm_loss_backward;
use crate::model::{Gpt, GptConfig, Recompute, StageLayers};
use crate::optim::grad_scaler::DynamicGradScalerConfig;
use crate::optim::DistributedAdamW;
use crate::optim::{BackgroundAllReduce, GradNorm};
use crate::optim::{DynamicGradScaler, GradScaler, Precision};
use crate::parallel::random::seed_micro_batch;
use crate::parallel::sharding::partition_dim;
use crate::parallel::state::ParallelState;
use crate::pipeline::PipelineP2p;

/// Everything `pretrain` needs, already validated by the command line.
#[derive(Clone, Debug)]
pub struct PretrainConfig {
    /// Model shape.
    pub model: GptConfig,
    /// `--seq-length`.
    pub seq_length: usize,
    /// `--micro-batch-size`.
    pub micro_batch_size: usize,
    /// `--global-batch-size` (a multiple of the micro-batch size: gradient accumulation).
    pub global_batch_size: usize,
    /// `--train-iters`.
    pub train_iters: u64,
    /// Learning-rate schedule.
    pub schedule: LrSchedule,
    /// Adam hyper-parameters.
    pub adam: AdamWConfig,
    /// `--clip-grad` (0 disables).
    pub clip_grad: f64,
    /// `--seed`.
    pub seed: u64,
    /// `--fp16` / `--bf16`: the model computes in half precision over fp32 main weights.
    pub precision: Precision,
    /// `--loss-scale`: a constant loss scale (with `--fp16`/`--bf16`); without it `--fp16`
    /// scales dynamically.
    pub loss_scale: Option<f64>,
    /// `--initial-loss-scale`, `--min-loss-scale`, `--loss-scale-window`, `--hysteresis`.
    pub dynamic_loss_scale: DynamicGradScalerConfig,
    /// Activation recomputation (`--recompute-granularity full` with
    /// `--recompute-method` / `--recompute-num-layers`).
    pub recompute: Recompute,
    /// `--data-path` (one dataset or a weighted blend), or a blend per split.
    pub data: DataSources,
    /// `--split`.
    pub split: String,
    /// `--data-cache-path`.
    pub data_cache_path: Option<PathBuf>,
    /// `--eod-mask-loss`.
    pub eod_mask_loss: bool,
    /// The EOD id.
    pub eod: u32,
    /// `--log-interval`.
    pub log_interval: u64,
    /// `--eval-interval`.
    pub eval_interval: u64,
    /// `--eval-iters`.
    pub eval_iters: u64,
    /// `--save`.
    pub save: Option<PathBuf>,
    /// `--save-interval`.
    pub save_interval: Option<u64>,
    /// `--load`.
    pub load: Option<PathBuf>,
    /// `--exit-interval`.
    pub exit_interval: Option<u64>,
    /// `--tensor-model-parallel-size`: ranks the model is split over (threads of this
    /// process, or MPI ranks under a launcher).
    pub tensor_model_parallel_size: usize,
    /// `--pipeline-model-parallel-size`: stages the layers are cut into (ranks, as for
    /// tensor parallelism); tensor × pipeline × data-parallel ranks make the world.
    pub pipeline_model_parallel_size: usize,
    /// `--num-layers-per-virtual-pipeline-stage`: model chunks of this many layers, several
    /// per pipeline rank, run with the interleaved schedule.
    pub num_layers_per_virtual_pipeline_stage: Option<usize>,
    /// `--decoder-first-pipeline-num-layers`: layers on the first stage (the others split
    /// evenly), when the embedding makes it slower or faster than the rest.
    pub decoder_first_pipeline_num_layers: Option<usize>,
    /// `--decoder-last-pipeline-num-layers`: layers on the last stage, which also runs the
    /// output layer and the loss.
    pub decoder_last_pipeline_num_layers: Option<usize>,
    /// `--use-distributed-optimizer`: Adam's state sharded over the data-parallel ranks.
    pub use_distributed_optimizer: bool,
    /// Gradient elements per data-parallel all-reduce (Megatron's `--ddp-bucket-size`).
    pub ddp_bucket_size: usize,
    /// `--overlap-grad-reduce`: all-reduce the gradient buckets on a communication thread
    /// during the last micro-batch's backward pass (see [`crate::optim::background_reduce`]).
    pub overlap_grad_reduce: bool,
    /// `--tensorboard-dir`: where world rank 0 writes TensorBoard scalars.
    pub tensorboard_dir: Option<PathBuf>,
    /// `--tensorboard-log-interval`: iterations between training scalars.
    pub tensorboard_log_interval: u64,
}

impl PretrainConfig {
    /// A run of `model` on `data` with Megatron's defaults for everything a caller usually
    /// leaves alone (seed 1234, split 969,30,1, clip-grad 1.0, Adam's defaults, one rank, fp32,
    /// no recomputation, no checkpoints), one micro-batch of one sample per iteration at the
    /// model's full context, one iteration at a constant `--lr` 1e-4: set the rest with struct
    /// update syntax.
    pub fn new(model: GptConfig, data: DataSources) -> Self {
        Self {
            seq_length: model.max_position_embeddings,
            model,
            micro_batch_size: 1,
            global_batch_size: 1,
            train_iters: 1,
            schedule: LrSchedule {
                max_lr: 1e-4,
                min_lr: 0.0,
                warmup_iters: 0.0,
                decay_iters: 1.0,
                style: crate::optim::LrDecayStyle::Constant,
            },
            adam: AdamWConfig::default(),
            clip_grad: 1.0,
            seed: 1234,
            precision: Precision::Fp32,
            loss_scale: None,
            dynamic_loss_scale: DynamicGradScalerConfig::default(),
            recompute: Recompute::None,
            data,
            split: "969,30,1".into(),
            data_cache_path: None,
            eod_mask_loss: false,
            eod: 50256,
            log_interval: 100,
            eval_interval: 1000,
            eval_iters: 100,
            save: None,
            save_interval: None,
            load: None,
            exit_interval: None,
            tensor_model_parallel_size: 1,
            pipeline_model_parallel_size: 1,
            num_layers_per_virtual_pipeline_stage: None,
            decoder_first_pipeline_num_layers: None,
            decoder_last_pipeline_num_layers: None,
            use_distributed_optimizer: false,
            ddp_bucket_size: DEFAULT_DDP_BUCKET_SIZE,
            overlap_grad_reduce: false,
            tensorboard_dir: None,
            tensorboard_log_interval: 1,
        }
    }

    /// Model chunks per pipeline rank: 1, or more with virtual pipeline stages.
    pub fn virtual_pipeline_stages(&self) -> usize {
        let pp = self.pipeline_model_parallel_size.max(1);
        self.num_layers_per_virtual_pipeline_stage
            .filter(|&n| n > 0)
            .map_or(1, |n| self.model.num_layers / (n * pp))
    }

    /// This pipeline rank's part of the model.
    pub fn stage_layers(&self, pipeline_rank: usize) -> Result<StageLayers> {
        let (first, last) = (
            self.decoder_first_pipeline_num_layers,
            self.decoder_last_pipeline_num_layers,
        );
        if first.is_some() || last.is_some() {
            if self.num_layers_per_virtual_pipeline_stage.is_some() {
                bail!("--decoder-first/last-pipeline-num-layers cannot be combined with --num-layers-per-virtual-pipeline-stage here");
            }
            return StageLayers::uneven(
                self.model.num_layers,
                self.pipeline_model_parallel_size.max(1),
                first,
                last,
                pipeline_rank,
            )
            .map_err(anyhow::Error::msg);
        }
        StageLayers::of(
            self.model.num_layers,
            self.pipeline_model_parallel_size.max(1),
            self.virtual_pipeline_stages(),
            pipeline_rank,
        )
        .map_err(anyhow::Error::msg)
    }

    /// The run's loss scaler, as Megatron's `get_megatron_optimizer` picks it: constant with
    /// `--loss-scale` (half precision only), dynamic with `--fp16`, none otherwise.
    pub fn grad_scaler(&self) -> Option<GradScaler> {
        match (self.precision, self.loss_scale) {
            (Precision::Fp32, _) => None,
            (_, Some(scale)) => Some(GradScaler::Constant(scale)),
            (Precision::Fp16, None) => Some(GradScaler::Dynamic(DynamicGradScaler::new(
                self.dynamic_loss_scale.clone(),
            ))),
            (Precision::Bf16, None) => None,
        }
    }
}

/// Megatron's default bucket: 40 M elements (it grows with the data-parallel size there too).
pub const DEFAULT_DDP_BUCKET_SIZE: usize = 40_000_000;

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

struct Datasets {
    train: Arc<dyn SampleDataset>,
    valid: Option<Arc<dyn SampleDataset>>,
    test: Option<Arc<dyn SampleDataset>>,
}

fn build_datasets(cfg: &PretrainConfig, verbose: bool) -> Result<Datasets> {
    let gbs = cfg.global_batch_size as u64;
    let eval_runs = cfg.train_iters / cfg.eval_interval.max(1) + 1;
    let samples = [
        cfg.train_iters * gbs,
        eval_runs * cfg.eval_iters * gbs,
        cfg.eval_iters * gbs,
    ];
    let config = DatasetBuildConfig {
        split: cfg.split.clone(),
        sequence_length: cfg.seq_length,
        seed: cfg.seed as u32,
        cache_dir: cfg.data_cache_path.clone(),
        verbose,
    };
    let [train, valid, test] = data::build_datasets(&cfg.data, samples, &config)?;
    let train = train.context(
        "there is no training data: check --split and --data-path (or --train-data-path)",
    )?;
    Ok(Datasets { train, valid, test })
}

/// Mean LM loss over `iters` global batches of `dataset` starting at sample `start`, without
/// dropout or gradients. Every rank calls it: each data-parallel rank evaluates its slice of
/// every global batch and the sums are all-reduced over `data`, so all ranks get the mean.
pub fn evaluate(
    model: &Gpt,
    dataset: &dyn SampleDataset,
    start: u64,
    iters: u64,
    cfg: &PretrainConfig,
    data: &Group,
    device: &Device,
) -> Result<f64> {
    let model = model.valid();
    let inner = device.clone().inner();
    let micro_batches = evaluation_micro_batches(iters, cfg);
    let mut total = 0.0;
    for k in 0..micro_batches / data.size() {
        let batch = evaluation_batch(dataset, start, k, cfg, data);
        let (tokens, labels, mask) = batch.to_tensors(&inner);
        total += model.lm_loss(tokens, labels, mask).into_scalar::<f32>() as f64;
    }
    mean_over_data(total, micro_batches, data)
}

/// Micro-batches in `iters` global batches.
fn evaluation_micro_batches(iters: u64, cfg: &PretrainConfig) -> usize {
    (iters * cfg.global_batch_size as u64 / cfg.micro_batch_size as u64) as usize
}

/// The global index of this data-parallel rank's micro-batch `k`: rank r reads micro-batches
/// r, r + DP, … of every global batch, as in training.
fn global_micro_batch(k: usize, data: &Group) -> u64 {
    (k * data.size() + data.rank()) as u64
}

/// This data-parallel rank's micro-batch `k` of an evaluation from sample `start`.
fn evaluation_batch(
    dataset: &dyn SampleDataset,
    start: u64,
    k: usize,
    cfg: &PretrainConfig,
    data: &Group,
) -> MicroBatch {
    MicroBatch::from_dataset(
        dataset,
        start + global_micro_batch(k, data) * cfg.micro_batch_size as u64,
        cfg.micro_batch_size,
        cfg.eod,
        cfg.eod_mask_loss,
    )
}

/// The mean loss of `micro_batches` micro-batches from this rank's sum `local`, summed over
/// the data-parallel ranks.
fn mean_over_data(local: f64, micro_batches: usize, data: &Group) -> Result<f64> {
    let total = data.all_reduce(TensorData::new(vec![local], [1]), ReduceOp::Sum)?;
    Ok(total.try_to_vec::<f64>().expect("f64")[0] / micro_batches.max(1) as f64)
}

/// [`evaluate`] on this rank's pipeline stage: with stages, the micro-batches run through
/// the forward-only schedule and the last stage's losses are summed over the pipeline.
#[allow(clippy::too_many_arguments)]
fn evaluate_stage(
    model: &Gpt,
    dataset: &dyn SampleDataset,
    start: u64,
    iters: u64,
    cfg: &PretrainConfig,
    parallel: &ParallelState,
    (stage, p2p): (&StageLayers, Option<&PipelineP2p>),
    device: &Device,
) -> Result<f64> {
    let data = &parallel.data;
    let Some(p2p) = p2p else {
        return evaluate(model, dataset, start, iters, cfg, data, device);
    };
    let model = model.valid();
    let inner = device.clone().inner();
    let micro_batches = evaluation_micro_batches(iters, cfg);
    let mine = micro_batches / data.size();
    let global_index = |k: usize| global_micro_batch(k, data);
    let batches = (0..mine)
        .map(|k| evaluation_batch(dataset, start, k, cfg, data))
        .collect();
    let mut work = GptStage::new(
        &model,
        stage,
        p2p,
        batches,
        &global_index,
        cfg.seed,
        0,
        parallel.tensor.rank(),
        1.0,
        false,
        true,
        &inner,
    );
    let steps = forward_only_schedule(mine, stage.chunks.len(), parallel.layout.pp);
    run_stage(&steps, &mut work)?;
    let local: f64 = work
        .losses
        .drain(..)
        .map(|l| l.into_scalar::<f32>() as f64)
        .sum();
    // Only the last stage has losses: the pipeline sum brings them to every stage.
    let stages = parallel
        .pipeline
        .all_reduce(TensorData::new(vec![local], [1]), ReduceOp::Sum)?;
    mean_over_data(
        stages.try_to_vec::<f64>().expect("f64")[0],
        micro_batches,
        data,
    )
}

/// Checks what can be checked before any rank starts.
fn validate(cfg: &PretrainConfig, device: &Device) -> Result<()> {
    if !device.is_autodiff() {
        bail!("pretrain needs an autodiff device");
    }
    if cfg.micro_batch_size == 0 || !cfg.global_batch_size.is_multiple_of(cfg.micro_batch_size) {
        bail!(
            "--global-batch-size {} is not a multiple of --micro-batch-size {}",
            cfg.global_batch_size,
            cfg.micro_batch_size
        );
    }
    let tp = cfg.tensor_model_parallel_size;
    cfg.model
        .validate_parallel(tp)
        .map_err(anyhow::Error::msg)?;
    let pp = cfg.pipeline_model_parallel_size;
    if pp == 0 {
        bail!("--pipeline-model-parallel-size must be at least 1");
    }
    if let Some(n) = cfg.num_layers_per_virtual_pipeline_stage {
        if pp == 1 {
            bail!(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
            );
        }
        if n == 0 || !cfg.model.num_layers.is_multiple_of(n * pp) {
            bail!(
                "--num-layers {} is not divisible by --num-layers-per-virtual-pipeline-stage {n} × \
                 --pipeline-model-parallel-size {pp}",
                cfg.model.num_layers
            );
        }
    }
    cfg.stage_layers(0)?;
    if cfg.seq_length == 0 || cfg.seq_length > cfg.model.max_position_embeddings {
        bail!(
            "--seq-length {} must be between 1 and --max-position-embeddings {}",
            cfg.seq_length,
            cfg.model.max_position_embeddings
        );
    }
    Ok(())
}

/// Trains as configured on `device` (an autodiff device) in this process, printing
/// Megatron's log lines.
///
/// With `--tensor-model-parallel-size N` > 1 the model is split over N ranks, one thread
/// each, all reading the same batches; rank 0 logs and reports. Under an MPI launcher use
/// [`pretrain_on`] with the MPI world instead.
pub fn pretrain(cfg: &PretrainConfig, device: &Device) -> Result<PretrainOutcome> {
    validate(cfg, device)?;
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
/// tensor- and data-parallel groups (data-parallel size = world / tensor-parallel size).
/// World rank 0 logs, writes the metrics and the plot, and builds the dataset index cache
/// before the other ranks read it.
pub fn pretrain_on(
    cfg: &PretrainConfig,
    device: &Device,
    world: Arc<dyn Communicator>,
) -> Result<PretrainOutcome> {
    validate(cfg, device)?;
    // Steady-state steps reuse resident memory instead of page-faulting it back in.
    crate::allocator::retain_freed_memory();
    let state = ParallelState::new(
        world,
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
    )?;
    let rank0 = state.is_world_rank0();
    if rank0 {
        println!("{}", state.layout.log_line());
    }
    let dp = state.layout.dp;
    if !cfg
        .global_batch_size
        .is_multiple_of(cfg.micro_batch_size * dp)
    {
        bail!(
            "--global-batch-size {} is not a multiple of --micro-batch-size {} × data-parallel size {dp}",
            cfg.global_batch_size,
            cfg.micro_batch_size
        );
    }
    let per_rank = cfg.global_batch_size / (cfg.micro_batch_size * dp);
    if cfg.virtual_pipeline_stages() > 1
        && (per_rank < state.layout.pp || !per_rank.is_multiple_of(state.layout.pp))
    {
        bail!(
            "the interleaved schedule needs a multiple of --pipeline-model-parallel-size {} \
             micro-batches per step and data-parallel rank, got {per_rank}",
            state.layout.pp
        );
    }
    // Rank 0 builds (and caches) the dataset indices; the others then read the cache.
    let datasets = if rank0 {
        let built = build_datasets(cfg, true);
        state.world.barrier()?;
        built?
    } else {
        state.world.barrier()?;
        build_datasets(cfg, false)?
    };
    train_rank(cfg, device, &datasets, &state)
}

/// The optimizer a run uses: Adam replicated on every data-parallel rank, or sharded.
enum Optimizer {
    Replicated(AdamW),
    Distributed(Box<DistributedAdamW>),
}

/// One rank's training loop.
fn train_rank(
    cfg: &PretrainConfig,
    device: &Device,
    datasets: &Datasets,
    parallel: &ParallelState,
) -> Result<PretrainOutcome> {
    let rank0 = parallel.is_world_rank0();
    macro_rules! say {
        ($($arg:tt)*) => { if rank0 { println!($($arg)*); } };
    }
    let (tensor, data) = (&parallel.tensor, &parallel.data);
    let dp = data.size();
    let pp = parallel.layout.pp;
    let stage = cfg.stage_layers(parallel.coordinates.pp)?;
    let mut state = TrainState::default();
    let loaded = match &cfg.load {
        Some(dir) => load_checkpoint(dir, Some(&cfg.model), device, tensor, Some(&stage))?,
        None => None,
    };
    let (model, saved_optimizer) = match loaded {
        Some((model, checkpoint, optimizer)) => {
            say!(
                " > loaded checkpoint from {} at iteration {} (saved with tensor model parallel size {}, pipeline model parallel size {})",
                cfg.load.as_ref().unwrap().display(),
                checkpoint.state.iteration,
                checkpoint.tensor_model_parallel_size,
                checkpoint.pipeline_model_parallel_size
            );
            if checkpoint.config.padded_vocab_size != cfg.model.padded_vocab_size {
                say!(
                    " > padded vocabulary {} in the checkpoint, {} here: padding rows cut or zero-filled",
                    checkpoint.config.padded_vocab_size,
                    cfg.model.padded_vocab_size
                );
            }
            state = checkpoint.state;
            (model, Some(optimizer))
        }
        None => {
            if let Some(dir) = &cfg.load {
                say!(
                    " > no checkpoint in {}, starting from scratch",
                    dir.display()
                );
            }
            let model = cfg
                .model
                .init_stage(cfg.seed, tensor, &stage, device)
                .map_err(anyhow::Error::msg)?;
            (model, None)
        }
    };
    say!(
        " > number of parameters: {} ({} layers, hidden {}, {} heads, vocab {})",
        cfg.model.num_parameters(),
        cfg.model.num_layers,
        cfg.model.hidden_size,
        cfg.model.num_attention_heads,
        cfg.model.padded_vocab_size
    );
    let mut scaler = cfg.grad_scaler();
    if let (Some(scaler), Some(saved)) = (
        scaler.as_mut(),
        saved_optimizer.as_ref().and_then(|o| o.grad_scaler.clone()),
    ) {
        scaler.load_state(saved);
    }
    if cfg.precision != Precision::Fp32 {
        say!(
            " > mixed precision: model in {}, fp32 main weights, gradients summed in fp32; loss scale: {}",
            cfg.precision.name(),
            match &scaler {
                Some(GradScaler::Dynamic(_)) => "dynamic".to_owned(),
                Some(GradScaler::Constant(s)) => format!("constant {s}"),
                None => "none".to_owned(),
            }
        );
    }
    // The fp32 main weights (what the optimizer updates and checkpoints keep), and the model
    // the micro-batches run: the same one in fp32, a half-precision copy of it otherwise.
    let mut main = model;
    let mut model = cfg.precision.working_copy(&main);
    let names: Vec<(ParamId, String)> = parameter_names(&main)
        .into_iter()
        .map(|p| (p.id, p.name))
        .collect();
    // Parameters another rank counts in the global gradient norm: those replicated over
    // tensor-parallel ranks count on tensor-parallel rank 0; the tied word embedding on the
    // first stage only (Megatron leaves the last stage's copy out as shared).
    // The word embedding's gradient is summed over the embedding group (first and last
    // stage), which holds the two copies of it.
    let tied: Vec<ParamId> = if pp > 1 {
        main.word_embeddings.iter().map(|e| e.weight.id).collect()
    } else {
        Vec::new()
    };
    let shared_copy = if stage.embedding { None } else { tied.first() };
    let mut not_counted: HashSet<ParamId> = names
        .iter()
        .filter(|(_, name)| tensor.rank() != 0 && partition_dim(name).is_none())
        .map(|(id, _)| *id)
        .collect();
    not_counted.extend(shared_copy);
    let chunks = cfg.virtual_pipeline_stages();
    // `--overlap-grad-reduce` overlaps the all-reduce of the replicated optimizer with the
    // last backward pass of a one-stage model.
    let overlap = cfg.overlap_grad_reduce && dp > 1 && pp == 1 && !cfg.use_distributed_optimizer;
    if cfg.overlap_grad_reduce && dp > 1 && !overlap {
        say!(
            " > --overlap-grad-reduce: not overlapped with {}; the gradients are reduced after the backward pass",
            if pp > 1 {
                "pipeline parallelism"
            } else {
                "--use-distributed-optimizer"
            }
        );
    }
    // Parameters two pieces of the backward pass contribute to (the tied word embedding: the
    // output layer's and the embedding's): final only after the last piece.
    let used_twice: HashSet<ParamId> = main.word_embeddings.iter().map(|e| e.weight.id).collect();
    let p2p = if pp > 1 {
        say!(
            " > pipeline: {pp} stages{}, {} schedule; this rank's layers: {:?}",
            if chunks > 1 {
                format!(" × {chunks} virtual stages")
            } else {
                String::new()
            },
            if chunks > 1 {
                "interleaved 1F1B"
            } else {
                "1F1B"
            },
            stage.chunks
        );
        Some(PipelineP2p::new(
            &parallel.pipeline,
            chunks,
            activation_expect(
                cfg.micro_batch_size,
                cfg.seq_length,
                cfg.model.hidden_size,
                DType::from(cfg.precision.dtype()),
            ),
        )?)
    } else {
        None
    };
    let inner = device.clone().inner();
    let mut optimizer = if cfg.use_distributed_optimizer {
        let by_id: HashMap<ParamId, String> = names.iter().cloned().collect();
        let mut opt = DistributedAdamW::new(
            cfg.adam.clone(),
            &main,
            &by_id,
            &not_counted,
            data.clone(),
            &inner,
        );
        if let Some(saved) = &saved_optimizer {
            opt.import(saved.steps, &saved.moments);
        }
        let (mine, whole) = opt.state_elements();
        say!(
            " > distributed optimizer: Adam state {:.1} MB per rank ({:.1} MB unsharded, data-parallel size {dp})",
            mine as f64 * 4e-6,
            whole as f64 * 4e-6
        );
        Optimizer::Distributed(Box::new(opt))
    } else {
        let mut opt = AdamW::new(cfg.adam.clone());
        if let Some(saved) = saved_optimizer {
            opt.import(saved.steps, saved.moments, &names, &inner);
        }
        Optimizer::Replicated(opt)
    };
    let mut metrics = match &cfg.save {
        Some(dir) if rank0 => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating --save {}", dir.display()))?;
            Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(dir.join("metrics.jsonl"))
                    .with_context(|| format!("opening {}/metrics.jsonl", dir.display()))?,
            )
        }
        _ => None,
    };
    let mut tensorboard = match &cfg.tensorboard_dir {
        Some(dir) if rank0 => Some(
            TensorBoardWriter::create(dir)
                .with_context(|| format!("--tensorboard-dir {}", dir.display()))?,
        ),
        _ => None,
    };
    if rank0 {
        let plan = MemoryPlan {
            model: &cfg.model,
            rank_parameters: main.num_params(),
            micro_batch_size: cfg.micro_batch_size,
            seq_length: cfg.seq_length,
            tensor_parallel: tensor.size(),
            data_parallel: dp,
            distributed_optimizer: cfg.use_distributed_optimizer,
            // This rank's (world rank 0's: the first stage's) activations.
            stage: if pp > 1 {
                memory_estimate::StageMemory::pipelined(
                    stage.chunks[0].len(),
                    pp,
                    chunks,
                    0,
                    cfg.global_batch_size / (cfg.micro_batch_size * dp),
                )
            } else {
                memory_estimate::StageMemory::whole(cfg.model.num_layers)
            },
        };
        let ranks = parallel.world.ranks_in_process();
        let lines = memory_estimate::report(
            &plan,
            cfg.precision,
            cfg.recompute,
            ranks,
            memory_estimate::available_bytes(),
        );
        for line in lines {
            println!("{line}");
        }
    }
    // `--eval-iters` global batches of `dataset` from sample `start`, on this rank's stage.
    let evaluate_here = |model: &Gpt, dataset: &dyn SampleDataset, start: u64| {
        evaluate_stage(
            model,
            dataset,
            start,
            cfg.eval_iters,
            cfg,
            parallel,
            (&stage, p2p.as_ref()),
            device,
        )
    };
    let mbs = cfg.micro_batch_size as u64;
    let micro_batches = cfg.global_batch_size / cfg.micro_batch_size;
    let my_micro_batches = micro_batches / dp;
    let loader = BatchLoader::new(
        datasets.train.clone(),
        state.consumed_train_samples + data.rank() as u64 * mbs,
        mbs * dp as u64,
        cfg.micro_batch_size,
        cfg.eod,
        cfg.eod_mask_loss,
        2 * my_micro_batches,
    );
    let mut outcome = PretrainOutcome {
        iteration: state.iteration,
        ..PretrainOutcome::default()
    };
    let (mut interval_loss, mut interval_iters, mut interval_start) = (0.0, 0u64, Instant::now());
    // Megatron's log counters: iterations whose loss is averaged, skipped ones, and skipped
    // ones whose loss was not finite.
    let (mut interval_advanced, mut interval_skipped, mut interval_nan) = (0u64, 0u64, 0u64);
    let flops_per_token = cfg.model.flops_per_token(cfg.seq_length);
    let mut memory_reported = false;
    while state.iteration < cfg.train_iters {
        let iteration = state.iteration + 1;
        // The schedule advances only on iterations that updated the weights.
        let lr = cfg
            .schedule
            .lr_at(state.iteration - state.skipped_iterations);
        let loss_scale = scaler.as_ref().map_or(1.0, GradScaler::scale);
        // Each micro-batch's loss is divided by the global number of micro-batches (summed
        // over data-parallel ranks, the gradients are those of the global batch's mean loss)
        // and multiplied by the loss scale.
        let divisor = micro_batches as f64 / loss_scale;
        let mut bubble: Option<Vec<f64>> = None;
        // Seconds waited for the data-parallel gradient sums (set once they are summed).
        let mut exposed_reduce: Option<f64> = None;
        let (mut grads, micro_losses) = match &p2p {
            Some(p2p) => {
                let batches: Vec<MicroBatch> =
                    (0..my_micro_batches).map(|_| loader.next_batch()).collect();
                let global_index = |k: usize| global_micro_batch(k, data);
                let mut work = GptStage::new(
                    &model,
                    &stage,
                    p2p,
                    batches,
                    &global_index,
                    cfg.seed,
                    iteration,
                    tensor.rank(),
                    divisor,
                    cfg.recompute != Recompute::None,
                    false,
                    device,
                );
                let steps =
                    training_schedule(parallel.coordinates.pp, pp, my_micro_batches, chunks)?;
                let timing = run_stage(&steps, &mut work)?;
                let idle = parallel
                    .pipeline
                    .all_gather(TensorData::new(vec![timing.idle_fraction()], [1]), 0)?;
                let idle = idle.try_to_vec::<f64>().expect("f64");
                outcome.pipeline_idle_fractions.push(idle.clone());
                bubble = Some(idle);
                let mut grads = std::mem::take(&mut work.grads);
                grads.all_reduce_parameters(&tied, &parallel.embedding)?;
                let losses: Vec<_> = work.losses.drain(..).map(|l| l.inner()).collect();
                (grads, losses)
            }
            None => {
                let mut grads = GradientAccumulator::default();
                // Loss values are read after the step, so no micro-batch waits on a device read.
                let mut micro_losses = Vec::with_capacity(my_micro_batches);
                for k in 0..my_micro_batches {
                    let global_index = global_micro_batch(k, data);
                    seed_micro_batch(cfg.seed, iteration, global_index, tensor.rank());
                    let (tokens, labels, mask) = loader.next_batch().to_tensors(device);
                    if overlap && k + 1 == my_micro_batches {
                        // The last backward pass in pieces, each piece's final gradients
                        // all-reduced in the background while the next piece runs.
                        let mut reducer =
                            BackgroundAllReduce::start(data, cfg.ddp_bucket_size.max(1));
                        let mut micro = GradientAccumulator::in_model_dtype();
                        let loss = lm_loss_backward(
                            &model,
                            tokens,
                            labels,
                            mask,
                            divisor,
                            cfg.recompute,
                            true,
                            |g| {
                                for id in micro.add_listing(&model, g) {
                                    // The tied embedding gets its last part at the end.
                                    if !used_twice.contains(&id) {
                                        let g = micro.take(&id).expect("just added");
                                        reducer.push(id, grads.take_sum(id, g));
                                    }
                                }
                            },
                        );
                        for (id, g) in micro.drain() {
                            reducer.push(id, grads.take_sum(id, g));
                        }
                        micro_losses.push(loss.inner());
                        let reduced = reducer.finish()?;
                        for (id, g) in reduced.grads {
                            grads.insert(id, g);
                        }
                        grads.restore_declaration_order(&model);
                        exposed_reduce = Some(reduced.exposed.as_secs_f64());
                        continue;
                    }
                    if cfg.recompute == Recompute::None {
                        let loss = model.lm_loss(tokens, labels, mask);
                        micro_losses.push(loss.clone().inner());
                        grads.add(&model, loss.div_scalar(divisor).backward());
                    } else {
                        let mut micro = GradientAccumulator::in_model_dtype();
                        let loss = lm_loss_backward(
                            &model,
                            tokens,
                            labels,
                            mask,
                            divisor,
                            cfg.recompute,
                            false,
                            |g| micro.add(&model, g),
                        );
                        micro_losses.push(loss.inner());
                        grads.merge(&model, micro);
                    }
                }
                (grads, micro_losses)
            }
        };
        // With a loss scaler: unscale, and skip the step on every rank if any rank's
        // gradients overflowed (checked before the data-parallel reduction, which would only
        // carry the overflow to every rank).
        let found_inf = match scaler.as_mut() {
            Some(scaler) => {
                grads.scale(1.0 / loss_scale);
                let local = if grads.all_finite() { 0.0 } else { 1.0 };
                let any = parallel
                    .world
                    .all_reduce(TensorData::new(vec![local], [1]), ReduceOp::Max)?;
                let found_inf = any.try_to_vec::<f64>().expect("f64")[0] > 0.0;
                scaler.update(found_inf);
                found_inf
            }
            None => false,
        };
        let grad_norm = if found_inf {
            state.skipped_iterations += 1;
            outcome.skipped_iterations.push(iteration);
            None
        } else {
            // The working copy goes first: in fp32 it shares the main weights' storage, and
            // the step replaces them parameter by parameter.
            drop(model);
            let norm;
            (main, norm) = match &mut optimizer {
                Optimizer::Replicated(adam) => {
                    if exposed_reduce.is_none() && dp > 1 {
                        let start = Instant::now();
                        grads.all_reduce_in_buckets(data, cfg.ddp_bucket_size.max(1))?;
                        exposed_reduce = Some(start.elapsed().as_secs_f64());
                    }
                    let norm = grads.clip_global_norm_deferred(
                        cfg.clip_grad,
                        &not_counted,
                        &parallel.model,
                    )?;
                    (adam.step(main, &grads, lr), norm)
                }
                Optimizer::Distributed(adam) => {
                    let (main, norm) =
                        adam.step(main, &grads, lr, cfg.clip_grad, &parallel.world)?;
                    (main, GradNorm::Read(norm))
                }
            };
            model = cfg.precision.working_copy(&main);
            Some(norm)
        };
        drop(grads);
        let loss_scale = scaler.as_ref().map_or(1.0, GradScaler::scale);
        // One read of the device per step: the micro-batches' losses and, unless it went
        // through a host collective already, the gradient norm.
        let (local_loss, grad_norm) = read_step_values(micro_losses, grad_norm);
        // Only the last stage has losses: the pipeline sum brings them to every stage.
        let local_loss = if pp > 1 {
            let summed = parallel
                .pipeline
                .all_reduce(TensorData::new(vec![local_loss], [1]), ReduceOp::Sum)?;
            summed.try_to_vec::<f64>().expect("f64")[0]
        } else {
            local_loss
        };
        let loss_sum = data.all_reduce(TensorData::new(vec![local_loss], [1]), ReduceOp::Sum)?;
        let loss = loss_sum.try_to_vec::<f64>().expect("f64")[0] / micro_batches as f64;
        state.iteration = iteration;
        state.consumed_train_samples += cfg.global_batch_size as u64;
        outcome.losses.push((iteration, loss));
        outcome.grad_reduce_exposed_seconds.extend(exposed_reduce);
        outcome.loss_scales.push((iteration, loss_scale));
        interval_iters += 1;
        if found_inf {
            interval_skipped += 1;
            interval_nan += u64::from(!loss.is_finite());
        } else {
            interval_loss += loss;
            interval_advanced += 1;
        }
        if let Some(file) = metrics.as_mut() {
            writeln!(
                file,
                "{}",
                serde_json::json!({
                    "iteration": iteration,
                    "consumed_samples": state.consumed_train_samples,
                    "tokens": state.consumed_train_samples * cfg.seq_length as u64,
                    "lm_loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "loss_scale": loss_scale,
                    "skipped": found_inf,
                    "peak_rss_mib": peak_rss_bytes().map(|b| b as f64 / 1048576.0),
                    "pipeline_idle_fraction": bubble,
                    "grad_reduce_exposed_seconds": exposed_reduce
                })
            )?;
        }
        if let Some(tb) = tensorboard.as_mut() {
            if iteration.is_multiple_of(cfg.tensorboard_log_interval.max(1)) {
                // Megatron's tags, each also against the consumed samples. The loss scale
                // is 1 without a grad scaler, as Megatron logs it.
                let samples = state.consumed_train_samples;
                let mut scalars = vec![
                    ("learning-rate", lr),
                    ("batch-size", cfg.global_batch_size as f64),
                    ("lm loss", loss),
                    ("loss-scale", loss_scale),
                ];
                scalars.extend(grad_norm.map(|norm| ("grad-norm", norm)));
                for (tag, value) in scalars {
                    tb.add_scalar(tag, value, iteration)?;
                    tb.add_scalar(&format!("{tag} vs samples"), value, samples)?;
                }
            }
        }
        if iteration.is_multiple_of(cfg.log_interval.max(1)) || iteration == cfg.train_iters {
            let elapsed = interval_start.elapsed().as_secs_f64();
            let tokens =
                (interval_iters * cfg.global_batch_size as u64 * cfg.seq_length as u64) as f64;
            if let Some(tb) = tensorboard.as_mut() {
                tb.add_scalar("iteration-time", elapsed / interval_iters as f64, iteration)?;
                tb.add_scalar("tokens-per-sec", tokens / elapsed, iteration)?;
                tb.flush()?;
            }
            say!(
                "{}",
                iteration_line(&IterationStats {
                    iteration,
                    train_iters: cfg.train_iters,
                    consumed_samples: state.consumed_train_samples,
                    ms_per_iteration: 1000.0 * elapsed / interval_iters as f64,
                    learning_rate: cfg.schedule.lr_at(iteration - state.skipped_iterations),
                    global_batch_size: cfg.global_batch_size,
                    lm_loss: (interval_advanced > 0)
                        .then(|| interval_loss / interval_advanced as f64),
                    loss_scale,
                    grad_norm,
                    skipped_iterations: interval_skipped,
                    nan_iterations: interval_nan,
                    tokens_per_second: tokens / elapsed,
                    tflops: tokens * flops_per_token / elapsed / 1e12,
                })
            );
            if !memory_reported {
                // Megatron reports memory once, after the first logged iteration.
                if let Some(peak) = peak_rss_bytes() {
                    say!("{}", memory_report_line(0, iteration, peak));
                }
                memory_reported = true;
            }
            (interval_loss, interval_iters, interval_start) = (0.0, 0, Instant::now());
            (interval_advanced, interval_skipped, interval_nan) = (0, 0, 0);
        }
        if let Some(valid) = &datasets.valid {
            if cfg.eval_interval > 0
                && iteration.is_multiple_of(cfg.eval_interval)
                && cfg.eval_iters > 0
            {
                let loss = evaluate_here(&model, valid.as_ref(), state.consumed_valid_samples)?;
                state.consumed_valid_samples += cfg.eval_iters * cfg.global_batch_size as u64;
                if rank0 {
                    print_validation(&format!("validation loss at iteration {iteration}"), loss);
                }
                if let Some(tb) = tensorboard.as_mut() {
                    tb.add_scalar("lm loss validation", loss, iteration)?;
                    tb.add_scalar(
                        "lm loss validation vs samples",
                        loss,
                        state.consumed_train_samples,
                    )?;
                    tb.add_scalar("lm loss validation ppl", loss.min(20.0).exp(), iteration)?;
                    tb.flush()?;
                }
                outcome.validation.push((iteration, loss));
                if let Some(file) = metrics.as_mut() {
                    writeln!(
                        file,
                        "{}",
                        serde_json::json!({
                            "iteration": iteration,
                            "consumed_samples": state.consumed_train_samples,
                            "tokens": state.consumed_train_samples * cfg.seq_length as u64,
                            "valid_lm_loss": loss
                        })
                    )?;
                }
            }
        }
        let save_now = cfg
            .save_interval
            .is_some_and(|k| k > 0 && iteration.is_multiple_of(k));
        let exit_now = cfg
            .exit_interval
            .is_some_and(|k| k > 0 && iteration.is_multiple_of(k));
        if let Some(dir) = &cfg.save {
            if save_now || exit_now {
                let path = save(
                    dir, &main, cfg, &optimizer, &scaler, &names, &state, parallel,
                )?;
                say!(
                    " > saved checkpoint at iteration {iteration} to {}",
                    path.display()
                );
            }
        }
        if exit_now {
            say!(" > exiting at iteration {iteration} (--exit-interval)");
            outcome.iteration = iteration;
            return Ok(outcome);
        }
    }
    outcome.iteration = state.iteration;
    if let Some(dir) = &cfg.save {
        if cfg
            .save_interval
            .is_none_or(|k| k == 0 || !state.iteration.is_multiple_of(k))
        {
            save(
                dir, &main, cfg, &optimizer, &scaler, &names, &state, parallel,
            )?;
        }
    }
    if let Some(valid) = &datasets.valid {
        let loss = evaluate_here(&model, valid.as_ref(), state.consumed_valid_samples)?;
        if rank0 {
            print_validation("validation loss at the end of training for val data", loss);
        }
        outcome.validation.push((state.iteration, loss));
    }
    if let Some(dir) = cfg.save.as_ref().filter(|_| rank0) {
        // Drawn from the metrics file, so a resumed run's plot shows the whole history.
        drop(metrics);
        let plot = dir.join("loss.png");
        let drawn = read_metrics(&dir.join("metrics.jsonl"), "")
            .and_then(|run| draw_loss_plot(&plot, &[run]));
        if let Err(e) = drawn {
            eprintln!("warning: could not write {}: {e:#}", plot.display());
        }
    }
    if let Some(test) = &datasets.test {
        let loss = evaluate_here(&model, test.as_ref(), 0)?;
        if rank0 {
            print_validation("validation loss at the end of training for test data", loss);
        }
        outcome.test_loss = Some(loss);
    }
    Ok(outcome)
}

/// Saves a checkpoint of the fp32 main weights `model`: the optimizer state is gathered by
/// name (a collective over the data-parallel group when it is sharded), the ranks of
/// data-parallel replica 0 write their tensor-parallel shards, and every rank waits until the
/// checkpoint is complete.
#[allow(clippy::too_many_arguments)]
fn save(
    dir: &std::path::Path,
    model: &Gpt,
    cfg: &PretrainConfig,
    optimizer: &Optimizer,
    scaler: &Option<GradScaler>,
    names: &[(ParamId, String)],
    state: &TrainState,
    parallel: &ParallelState,
) -> Result<std::path::PathBuf> {
    let optimizer_state = match optimizer {
        Optimizer::Replicated(adam) => OptimizerState {
            steps: adam.steps(),
            moments: adam.export(names),
            grad_scaler: scaler.as_ref().map(GradScaler::state),
        },
        Optimizer::Distributed(adam) => OptimizerState {
            steps: adam.steps(),
            moments: adam.export()?,
            grad_scaler: scaler.as_ref().map(GradScaler::state),
        },
    };
    let place = ShardPlace {
        tp: parallel.coordinates.tp,
        tp_size: parallel.layout.tp,
        pp: parallel.coordinates.pp,
        pp_size: parallel.layout.pp,
    };
    // The ranks of data-parallel replica 0 (every tensor-parallel rank of every stage) write.
    let path = if parallel.coordinates.dp == 0 {
        Some(save_checkpoint(
            dir,
            model,
            &cfg.model,
            &optimizer_state,
            state,
            &parallel.model,
            place,
        )?)
    } else {
        None
    };
    parallel.world.barrier()?;
    Ok(path.unwrap_or_else(|| super::checkpoint::checkpoint_dir(dir, state.iteration, place)))
}

/// The sum of `micro_losses` (each a one-element tensor) and the gradient norm, read from
/// the device together.
fn read_step_values(
    micro_losses: Vec<Tensor<1>>,
    grad_norm: Option<GradNorm>,
) -> (f64, Option<f64>) {
    let m = micro_losses.len();
    let mut pending: Vec<Tensor<1>> = micro_losses
        .into_iter()
        .map(|l| l.cast(FloatDType::F32))
        .collect();
    let read_norm = match grad_norm {
        Some(GradNorm::OnDevice(norm)) => {
            pending.push((*norm).cast(FloatDType::F32));
            None
        }
        Some(GradNorm::Read(norm)) => Some(Some(norm)),
        None => Some(None),
    };
    let values: Vec<f64> = if pending.is_empty() {
        Vec::new()
    } else {
        Tensor::cat(pending, 0)
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("f32")
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let loss = values[..m].iter().sum();
    let norm = read_norm.unwrap_or_else(|| values.get(m).copied());
    (loss, norm)
}

fn print_validation(label: &str, loss: f64) {
    let line = validation_line(label, loss);
    let rule = "-".repeat(line.len());
    println!("{rule}\n{line}\n{rule}");
}
