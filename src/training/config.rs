//! The run's configuration (what `pretrain`'s flags say), its one validation, and the batch
//! plan that owns the micro-batch arithmetic.

use std::path::PathBuf;

use anyhow::{bail, Result};
use burn::tensor::{Device, FloatDType};

use super::batch_size_schedule::BatchSizeSchedule;
use crate::checkpoint::SaveFormat;
use crate::data::{DataSources, SampleMasks};
use crate::model::{GptConfig, Recompute, StageLayers};
use crate::optim::grad_scaler::DynamicGradScalerConfig;
use crate::optim::{
    AdamWConfig, DynamicGradScaler, GradScaler, LrSchedule, Precision, WeightDecaySchedule,
};
use crate::util::matmul::ProductPlan;

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
    /// `--train-iters` (with `--train-samples`, the iterations those samples take).
    pub train_iters: u64,
    /// `--train-samples`: the run is counted in samples (sizes the training set).
    pub train_samples: Option<u64>,
    /// `--rampup-batch-size` or `--step-batch-size-schedule`.
    pub batch_size_schedule: BatchSizeSchedule,
    /// `--decrease-batch-size-if-needed`: a scheduled batch that does not split into whole
    /// micro-batches per data-parallel rank is rounded down instead of refused.
    pub decrease_batch_size_if_needed: bool,
    /// Learning-rate schedule, in samples.
    pub schedule: LrSchedule,
    /// `--decoupled-lr` / `--decoupled-min-lr`: the word embedding's and the output layer's
    /// schedule (the same shape, its own peak and floor).
    pub decoupled_schedule: Option<LrSchedule>,
    /// Weight-decay schedule, in samples (`None`: Adam's `weight_decay` throughout).
    pub weight_decay_schedule: Option<WeightDecaySchedule>,
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
    /// The format `--save` writes (`--ckpt-format torch`: Megatron-LM's).
    pub save_format: SaveFormat,
    /// `--load`.
    pub load: Option<PathBuf>,
    /// `--finetune`: from `--load` take the weights only (iteration 0, a fresh optimizer).
    pub finetune: bool,
    /// `--no-load-optim`: from `--load` take the weights and the iteration; Adam's state and
    /// the learning-rate schedule start fresh (Megatron loads neither then).
    pub no_load_optim: bool,
    /// `--exit-interval`.
    pub exit_interval: Option<u64>,
    /// `--exit-duration-in-mins`: save and exit once the run has taken this long.
    pub exit_duration_in_mins: Option<f64>,
    /// `--exit-signal-handler`: save and exit after the iteration during which a stop signal
    /// arrived (the tool installs the handler: [`crate::util::exit_signal`]).
    pub exit_signal_handler: bool,
    /// `--cuda-graph-impl local --cuda-graph-scope full_iteration`: capture the training step
    /// as one graph after this many eager warm-up steps (`--cuda-graph-warmup-steps`) and
    /// replay it ([`super::step_graph`]); `None`: every step eager.
    pub cuda_graph_warmup_steps: Option<u64>,
    /// `--cuda-matmul`, `--cublas-ordering` (ferrotron's): which kernels a CUDA run's
    /// products use, fixed for the process when the run starts; no effect on other devices.
    pub products: ProductPlan,
    /// How the run is split over ranks.
    pub parallel: ParallelConfig,
    /// `--tensorboard-dir`: where world rank 0 writes TensorBoard scalars.
    pub tensorboard_dir: Option<PathBuf>,
    /// `--tensorboard-log-interval`: iterations between training scalars.
    pub tensorboard_log_interval: u64,
    /// `--log-throughput`, `--log-params-norm`, `--log-num-zeros-in-grad`: the log line's
    /// optional fields.
    pub log_options: LogOptions,
}

/// The optional fields of Megatron's training log line.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LogOptions {
    /// `--log-throughput`: TFLOP/s per rank.
    pub throughput: bool,
    /// `--peak-tflops` (ferrotron's): one device's peak TFLOP/s; with `--log-throughput` the
    /// line adds the model FLOPs utilization (throughput per rank over this peak).
    pub peak_tflops: Option<f64>,
    /// `--log-params-norm`: the parameters' L2 norm.
    pub params_norm: bool,
    /// `--log-num-zeros-in-grad`: zero gradient elements.
    pub num_zeros_in_grad: bool,
}

/// How a run is split over ranks (Megatron's distributed flags); the data-parallel size is
/// what the world leaves over tensor × pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParallelConfig {
    /// `--tensor-model-parallel-size`: ranks the model is split over (threads of this
    /// process, or MPI ranks under a launcher).
    pub tensor_model_parallel_size: usize,
    /// `--pipeline-model-parallel-size`: stages the layers are cut into (ranks, as for
    /// tensor parallelism); tensor × pipeline × data-parallel ranks make the world.
    pub pipeline_model_parallel_size: usize,
    /// `--context-parallel-size`: ranks each sequence is split over (Megatron's load-balanced
    /// two chunks per rank, `parallel::context`); they sum gradients with the data-parallel
    /// ranks.
    pub context_parallel_size: usize,
    /// `--cp-comm-type`: how the keys and values of the whole sequence reach every rank.
    pub cp_comm_type: crate::parallel::context::ContextComm,
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
}

impl Default for ParallelConfig {
    /// One process: one tensor-parallel rank, one stage, the replicated optimizer.
    fn default() -> Self {
        Self {
            tensor_model_parallel_size: 1,
            pipeline_model_parallel_size: 1,
            context_parallel_size: 1,
            cp_comm_type: Default::default(),
            num_layers_per_virtual_pipeline_stage: None,
            decoder_first_pipeline_num_layers: None,
            decoder_last_pipeline_num_layers: None,
            use_distributed_optimizer: false,
            ddp_bucket_size: DEFAULT_DDP_BUCKET_SIZE,
            overlap_grad_reduce: false,
        }
    }
}

impl ParallelConfig {
    /// Ranks one model replica spans: tensor × pipeline parallel (the data-parallel size is
    /// the world's over this).
    pub fn model_parallel_size(&self) -> usize {
        self.tensor_model_parallel_size * self.pipeline_model_parallel_size.max(1)
    }

    /// Ranks one data-parallel replica spans: tensor × pipeline × context parallel (the
    /// threads of a run without a launcher).
    pub fn replica_ranks(&self) -> usize {
        self.model_parallel_size() * self.context_parallel_size.max(1)
    }
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
            train_samples: None,
            batch_size_schedule: BatchSizeSchedule::Constant,
            decrease_batch_size_if_needed: false,
            schedule: LrSchedule::default(),
            decoupled_schedule: None,
            weight_decay_schedule: None,
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
            save_format: SaveFormat::Ferrotron,
            load: None,
            finetune: false,
            no_load_optim: false,
            exit_interval: None,
            exit_duration_in_mins: None,
            exit_signal_handler: false,
            cuda_graph_warmup_steps: None,
            products: ProductPlan::default(),
            parallel: ParallelConfig::default(),
            tensorboard_dir: None,
            tensorboard_log_interval: 1,
            log_options: LogOptions::default(),
        }
    }

    /// What the run's samples carry besides their tokens (Megatron's
    /// `_get_ltor_masks_and_position_ids` switches): the loss mask's rule, and the packed
    /// documents' positions and attention starts the model was built for.
    pub fn sample_masks(&self) -> SampleMasks {
        SampleMasks {
            eod: self.eod,
            eod_mask_loss: self.eod_mask_loss,
            reset_position_ids: self.model.reset_position_ids,
            reset_attention_mask: self.model.reset_attention_mask,
        }
    }

    /// The same run in one process: every choice of parallel layout at its one-rank default
    /// (no sequence parallelism, no recomputation, the replicated optimizer reducing after the
    /// backward pass), the model, data, batches, precision and seeds unchanged. What a
    /// layout's run must reproduce.
    pub fn in_one_process(&self) -> Self {
        Self {
            model: self.model.clone().with_sequence_parallel(false),
            parallel: ParallelConfig {
                ddp_bucket_size: self.parallel.ddp_bucket_size,
                ..ParallelConfig::default()
            },
            recompute: Recompute::None,
            ..self.clone()
        }
    }

    /// Model chunks per pipeline rank: 1, or more with virtual pipeline stages.
    pub fn virtual_pipeline_stages(&self) -> usize {
        let pp = self.parallel.pipeline_model_parallel_size.max(1);
        self.parallel
            .num_layers_per_virtual_pipeline_stage
            .filter(|&n| n > 0)
            .map_or(1, |n| self.model.num_layers / (n * pp))
    }

    /// This pipeline rank's part of the model.
    pub fn stage_layers(&self, pipeline_rank: usize) -> Result<StageLayers> {
        let (first, last) = (
            self.parallel.decoder_first_pipeline_num_layers,
            self.parallel.decoder_last_pipeline_num_layers,
        );
        if first.is_some() || last.is_some() {
            if self
                .parallel
                .num_layers_per_virtual_pipeline_stage
                .is_some()
            {
                bail!("--decoder-first/last-pipeline-num-layers cannot be combined with --num-layers-per-virtual-pipeline-stage here");
            }
            return StageLayers::uneven(
                self.model.num_layers,
                self.parallel.pipeline_model_parallel_size.max(1),
                first,
                last,
                pipeline_rank,
            )
            .map_err(anyhow::Error::msg);
        }
        StageLayers::of(
            self.model.num_layers,
            self.parallel.pipeline_model_parallel_size.max(1),
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

impl PretrainConfig {
    /// Checks what can be checked before any rank starts (the data-parallel size is known
    /// only then: [`BatchPlan::new`] checks the rest).
    pub fn validate(&self, device: &Device) -> Result<()> {
        if !device.is_autodiff() {
            bail!("pretrain needs an autodiff device");
        }
        // The batches' one check ([`BatchPlan`]'s), on one data-parallel rank: what fails
        // there fails on any number.
        BatchPlan::new(self, 1, 0)?;
        if !device.supports_dtype(self.precision.dtype()) {
            // WGSL, the shader language of wgpu devices, has no bf16, for one.
            bail!(
                "--{}: this device cannot compute in {:?}; use {}",
                self.precision.flag(),
                self.precision.dtype(),
                if self.precision == Precision::Bf16 && device.supports_dtype(FloatDType::F16) {
                    "--fp16, or a device with bf16 (CUDA or the CPU)"
                } else {
                    "fp32 (neither --fp16 nor --bf16)"
                }
            );
        }
        self.schedule.validate().map_err(anyhow::Error::msg)?;
        if let Some(wd) = &self.weight_decay_schedule {
            wd.validate().map_err(anyhow::Error::msg)?;
        }
        self.model
            .validate_parallel(self.parallel.tensor_model_parallel_size)
            .map_err(anyhow::Error::msg)?;
        self.validate_pipeline()?;
        if matches!(self.save_format, SaveFormat::MegatronTorch(_))
            && self
                .parallel
                .num_layers_per_virtual_pipeline_stage
                .is_some()
        {
            bail!("--ckpt-format torch with --num-layers-per-virtual-pipeline-stage: pretrain does not write interleaved stages in Megatron's format yet; save ferrotron's format (no --ckpt-format torch) and convert it with convert-checkpoint --target-pipeline-parallel-size");
        }
        if self.seq_length == 0 || self.seq_length > self.model.max_position_embeddings {
            bail!(
                "--seq-length {} must be between 1 and --max-position-embeddings {}",
                self.seq_length,
                self.model.max_position_embeddings
            );
        }
        let tp = self.parallel.tensor_model_parallel_size;
        if self.model.sequence_parallel && !self.seq_length.is_multiple_of(tp) {
            bail!(
                "--sequence-parallel: --seq-length {} is not divisible by --tensor-model-parallel-size {tp}",
                self.seq_length
            );
        }
        self.validate_context_parallel()
    }

    /// Megatron's checks of `--context-parallel-size`: each rank holds two equal chunks of
    /// every sequence, and under sequence parallelism its tokens split over the tensor ranks.
    fn validate_context_parallel(&self) -> Result<()> {
        let cp = self.parallel.context_parallel_size;
        if cp == 0 {
            bail!("--context-parallel-size must be at least 1");
        }
        if cp == 1 {
            return Ok(());
        }
        if !self.seq_length.is_multiple_of(2 * cp) {
            bail!(
                "--context-parallel-size {cp}: --seq-length {} is not divisible by 2 × {cp} (each rank holds two equal chunks of every sequence)",
                self.seq_length
            );
        }
        let tp = self.parallel.tensor_model_parallel_size;
        if self.model.sequence_parallel && !(self.seq_length / cp).is_multiple_of(tp) {
            bail!(
                "--sequence-parallel with --context-parallel-size {cp}: a rank's {} tokens are not divisible by --tensor-model-parallel-size {tp}",
                self.seq_length / cp
            );
        }
        Ok(())
    }

    fn validate_pipeline(&self) -> Result<()> {
        let pp = self.parallel.pipeline_model_parallel_size;
        if pp == 0 {
            bail!("--pipeline-model-parallel-size must be at least 1");
        }
        if let Some(n) = self.parallel.num_layers_per_virtual_pipeline_stage {
            if pp == 1 {
                bail!(
                    "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
                );
            }
            if n == 0 || !self.model.num_layers.is_multiple_of(n * pp) {
                bail!(
                    "--num-layers {} is not divisible by --num-layers-per-virtual-pipeline-stage {n} × \
                     --pipeline-model-parallel-size {pp}",
                    self.model.num_layers
                );
            }
        }
        self.stage_layers(0)?;
        Ok(())
    }
}

/// The micro-batch arithmetic of a run at its data-parallel size (Megatron's
/// `num_microbatches_calculator`): every micro-batch count and index comes from here.
///
/// Data-parallel rank r runs micro-batches r, r + DP, r + 2·DP, … of each global batch, so
/// a layout reads the samples, and draws the dropout masks, of the single-process run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchPlan {
    /// `--micro-batch-size`.
    pub micro_batch_size: usize,
    /// `--global-batch-size`.
    pub global_batch_size: usize,
    /// Data-parallel ranks.
    pub data_parallel: usize,
    /// This rank's place among them.
    pub data_parallel_rank: usize,
}

impl BatchPlan {
    /// The plan of `cfg` on `data_parallel` ranks, checked: the global batch must split into
    /// whole micro-batches per data-parallel rank, and the interleaved schedule needs a
    /// multiple of the pipeline size of them.
    pub fn new(
        cfg: &PretrainConfig,
        data_parallel: usize,
        data_parallel_rank: usize,
    ) -> Result<Self> {
        Self {
            micro_batch_size: cfg.micro_batch_size,
            global_batch_size: cfg.global_batch_size,
            data_parallel,
            data_parallel_rank,
        }
        .checked(cfg)
    }

    /// This plan for the iteration after `consumed` samples: the batch-size schedule's
    /// global batch (the whole `--global-batch-size` without a ramp-up).
    pub fn after(&self, cfg: &PretrainConfig, consumed: u64) -> Result<Self> {
        let unit = self.micro_batch_size * self.data_parallel;
        let global_batch_size = cfg
            .batch_size_schedule
            .running_batch_at(
                cfg.global_batch_size,
                consumed,
                unit,
                cfg.decrease_batch_size_if_needed,
            )
            .map_err(anyhow::Error::msg)?;
        Self {
            global_batch_size,
            ..*self
        }
        .checked(cfg)
    }

    /// The global batch must split into whole micro-batches per data-parallel rank, and the
    /// interleaved schedule needs a multiple of the pipeline size of them.
    fn checked(self, cfg: &PretrainConfig) -> Result<Self> {
        let (plan, data_parallel) = (self, self.data_parallel);
        if plan.micro_batch_size == 0
            || plan.global_batch_size == 0
            || !plan
                .global_batch_size
                .is_multiple_of(plan.micro_batch_size * data_parallel)
        {
            bail!(
                "--global-batch-size {} is not a multiple of --micro-batch-size {} × data-parallel size {data_parallel}",
                plan.global_batch_size,
                plan.micro_batch_size
            );
        }
        let pp = cfg.parallel.pipeline_model_parallel_size;
        let per_rank = plan.micro_batches_per_rank();
        if cfg.virtual_pipeline_stages() > 1 && (per_rank < pp || !per_rank.is_multiple_of(pp)) {
            bail!(
                "the interleaved schedule needs a multiple of --pipeline-model-parallel-size {pp} \
                 micro-batches per step and data-parallel rank, got {per_rank}"
            );
        }
        Ok(plan)
    }

    /// Micro-batches in one global batch (all data-parallel ranks together).
    pub fn micro_batches(&self) -> usize {
        self.global_batch_size / self.micro_batch_size
    }

    /// Micro-batches this rank runs per step.
    pub fn micro_batches_per_rank(&self) -> usize {
        self.micro_batches() / self.data_parallel
    }

    /// The index in the global batch of this rank's micro-batch `k` (keys its dropout masks).
    pub fn global_micro_batch(&self, k: usize) -> u64 {
        (k * self.data_parallel + self.data_parallel_rank) as u64
    }

    /// The first sample of this rank's micro-batch `k` of a pass over a dataset from `start`.
    pub fn sample_of(&self, start: u64, k: usize) -> u64 {
        start + self.global_micro_batch(k) * self.micro_batch_size as u64
    }

    /// The divisor of each micro-batch's loss before its backward: the global number of
    /// micro-batches (summed over data-parallel ranks, the gradients are those of the global
    /// batch's mean loss), divided by the loss scale (the gradients are of the scaled loss).
    pub fn loss_divisor(&self, loss_scale: f64) -> f64 {
        self.micro_batches() as f64 / loss_scale
    }

    /// Micro-batches in `iters` global batches, and this rank's share of them (evaluation).
    pub fn evaluation_micro_batches(&self, iters: u64) -> (usize, usize) {
        let all = (iters * self.global_batch_size as u64 / self.micro_batch_size as u64) as usize;
        (all, all / self.data_parallel)
    }
}
