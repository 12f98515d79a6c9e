//! `pretrain`: Megatron-LM's `pretrain_gpt.py`, same flags, on burn.
//!
//! ```text
//! pretrain --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 \
//!   --max-position-embeddings 256 --micro-batch-size 8 --global-batch-size 8 --lr 6e-4 \
//!   --train-iters 200 --data-path data_text_document --save ckpt
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{CommandFactory, Parser};

use ferrotron::checkpoint::megatron_torch_save::{LayerSpec, MegatronSaveOptions};
use ferrotron::checkpoint::saved_model;
use ferrotron::comm::world::World;
use ferrotron::data::{Blend, DataSources, MockDocuments};
use ferrotron::model::attention_backend::{AttentionBackend, AttentionChoice};
use ferrotron::model::vocab::{padded_vocab_log_line, padded_vocab_size};
use ferrotron::model::{GptConfig, Recompute};
use ferrotron::optim::grad_scaler::DynamicGradScalerConfig;
use ferrotron::optim::Precision;
use ferrotron::tokenizer::{TextTokenizer, TokenizerArgs};
use ferrotron::training::megatron_command_line::screen_megatron_flags;
use ferrotron::training::pretrain::pretrain_on;
use ferrotron::training::{
    pretrain, AdamWConfig, ArchitectureArgs, LogOptions, PretrainConfig, ScheduleArgs,
};

/// Pretrain a GPT with Megatron-LM's command line: one process (tensor-parallel ranks as
/// threads) or, under `mpirun`/`srun`, one MPI rank per process.
#[derive(Parser, Debug)]
#[command(name = "pretrain", version, args_override_self = true)]
struct Args {
    // --- model ---
    /// Transformer layers.
    #[arg(long, required_unless_present = "use_checkpoint_args")]
    num_layers: Option<usize>,
    /// Hidden size.
    #[arg(long, required_unless_present = "use_checkpoint_args")]
    hidden_size: Option<usize>,
    /// Attention heads.
    #[arg(long, required_unless_present = "use_checkpoint_args")]
    num_attention_heads: Option<usize>,
    /// MLP width [default: 4 × hidden size].
    #[arg(long)]
    ffn_hidden_size: Option<usize>,
    /// Tokens per sample.
    #[arg(long, required_unless_present = "use_checkpoint_args")]
    seq_length: Option<usize>,
    /// Learned positions [default: --seq-length].
    #[arg(long)]
    max_position_embeddings: Option<usize>,
    /// Pad the vocabulary to a multiple of this × the tensor-parallel size.
    #[arg(long, default_value_t = 128)]
    make_vocab_size_divisible_by: usize,
    /// Dropout after embeddings, attention and MLP.
    #[arg(long, default_value_t = 0.1)]
    hidden_dropout: f64,
    /// Dropout on attention probabilities.
    #[arg(long, default_value_t = 0.1)]
    attention_dropout: f64,
    /// Epsilon of the norms (--norm-epsilon is the same flag).
    #[arg(long, alias = "norm-epsilon", default_value_t = 1e-5)]
    layernorm_epsilon: f64,
    /// Std of the normal initialization.
    #[arg(long, default_value_t = 0.02)]
    init_method_std: f64,
    /// tanh approximation of GELU instead of the exact erf form.
    #[arg(long)]
    openai_gelu: bool,
    #[command(flatten)]
    architecture: ArchitectureArgs,
    /// Norms, dropout and residuals on each tensor-parallel rank's chunk of the sequence
    /// (no effect at tensor-parallel size 1).
    #[arg(long)]
    sequence_parallel: bool,

    // --- batch and schedule ---
    #[command(flatten)]
    schedule: ScheduleArgs,
    /// Adam β₁.
    #[arg(long, default_value_t = 0.9)]
    adam_beta1: f64,
    /// Adam β₂.
    #[arg(long, default_value_t = 0.999)]
    adam_beta2: f64,
    /// Adam ε.
    #[arg(long, default_value_t = 1e-8)]
    adam_eps: f64,
    /// Clip gradients to this global L2 norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    clip_grad: f64,
    /// Only adam (Adam with decoupled weight decay) is implemented.
    #[arg(long, default_value = "adam")]
    optimizer: String,
    /// Random seed (initialization, data order, dropout).
    #[arg(long, default_value_t = 1234)]
    seed: u64,

    // --- data ---
    /// Dataset prefix (PREFIX.bin/.idx from `preprocess`), several prefixes, or a weighted
    /// blend `W1 PREFIX1 W2 PREFIX2 ...` (weights need not sum to 1), cut by --split.
    #[arg(long, num_args = 1.., allow_negative_numbers = true)]
    data_path: Vec<String>,
    /// A file holding what --data-path would (for long blends).
    #[arg(long, conflicts_with = "data_path")]
    data_args_path: Option<PathBuf>,
    /// Training data (a prefix or a blend), used whole; instead of --data-path and --split.
    #[arg(long, num_args = 1.., allow_negative_numbers = true)]
    train_data_path: Vec<String>,
    /// Validation data, used whole.
    #[arg(long, num_args = 1.., allow_negative_numbers = true)]
    valid_data_path: Vec<String>,
    /// Test data, used whole.
    #[arg(long, num_args = 1.., allow_negative_numbers = true)]
    test_data_path: Vec<String>,
    /// A JSON file {"train": ..., "valid": ..., "test": ...}, each a list (or a string) of
    /// what --train-data-path and the others would hold.
    #[arg(long)]
    per_split_data_args_path: Option<PathBuf>,
    /// Megatron-Core's synthetic documents (MockGPTDataset) instead of a dataset; the split
    /// is 1,1,1 (use with --tokenizer-type NullTokenizer --vocab-size N, or any tokenizer).
    #[arg(long)]
    mock_data: bool,
    /// Train/validation/test split of the documents.
    #[arg(long, default_value = "969, 30, 1")]
    split: String,
    /// Where to cache the dataset indices [default: cache/ beside the data].
    #[arg(long)]
    data_cache_path: Option<PathBuf>,
    /// Do not train on the token that follows an end-of-document.
    #[arg(long)]
    eod_mask_loss: bool,
    /// Normalize the loss by the global batch's loss tokens (every token counts without
    /// --eod-mask-loss, where this is what ferrotron computes anyway).
    #[arg(long)]
    calculate_per_token_loss: bool,
    #[command(flatten)]
    tokenizer: TokenizerArgs,

    // --- logging, evaluation, checkpoints ---
    /// Print a log line every N iterations.
    #[arg(long, default_value_t = 100)]
    log_interval: u64,
    /// Evaluate every N iterations.
    #[arg(long, default_value_t = 1000)]
    eval_interval: u64,
    /// Batches per evaluation.
    #[arg(long, default_value_t = 100)]
    eval_iters: u64,
    /// Checkpoint directory to write.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Save every N iterations.
    #[arg(long)]
    save_interval: Option<u64>,
    /// torch: --save writes Megatron-LM's `--ckpt-format torch` (`model_optim_rng.pt`, no
    /// optimizer state); otherwise ferrotron's own format (Megatron's default, torch_dist, is
    /// not written).
    #[arg(long)]
    ckpt_format: Option<String>,
    /// The Megatron-Core names --ckpt-format torch writes: transformer_engine or local.
    #[arg(long, default_value = "transformer_engine")]
    transformer_impl: String,
    /// Checkpoint directory to resume from.
    #[arg(long)]
    load: Option<PathBuf>,
    /// The model from the --load checkpoint's saved arguments (Megatron's or ferrotron's):
    /// its architecture always, its shape where the flags give none.
    #[arg(long)]
    use_checkpoint_args: bool,
    /// Take only the weights from --load: iteration 0, a fresh optimizer and scheduler
    /// (Megatron's --finetune).
    #[arg(long)]
    finetune: bool,
    /// From --load take the weights and the iteration only: Adam's state and the
    /// learning-rate schedule start fresh (Megatron's --no-load-optim).
    #[arg(long)]
    no_load_optim: bool,
    /// Accepted for Megatron's scripts: ferrotron's random streams are functions of --seed
    /// and the iteration, so there is no RNG state to load or to skip.
    #[arg(long)]
    no_load_rng: bool,
    /// Save and exit after N iterations.
    #[arg(long)]
    exit_interval: Option<u64>,
    /// Save and exit once the run has taken this many minutes.
    #[arg(long)]
    exit_duration_in_mins: Option<f64>,
    /// On SIGTERM, SIGINT or SIGHUP: finish the iteration, save, exit 0 (every rank).
    #[arg(long)]
    exit_signal_handler: bool,
    /// The signal --exit-signal-handler waits for (SIGTERM, SIGINT and SIGHUP are all
    /// handled).
    #[arg(long, default_value = "SIGTERM")]
    exit_signal: String,

    /// CUDA graphs (Megatron's): `local` with `--cuda-graph-scope full_iteration` captures the
    /// whole training step once and replays it (CubeCL devices, one rank, one micro-batch per
    /// step, no fp16 loss scaler; on CUDA with FERROTRON_MATMUL=cubecl); `none` (default).
    #[arg(long, default_value = "none")]
    cuda_graph_impl: String,
    /// What `--cuda-graph-impl local` captures: ferrotron captures `full_iteration` only.
    #[arg(long, num_args = 1..)]
    cuda_graph_scope: Vec<String>,
    /// Eager steps before the step is captured.
    #[arg(long, default_value_t = 3)]
    cuda_graph_warmup_steps: u64,

    /// Write TensorBoard scalars (loss, learning rate, grad norm, batch size, iteration time,
    /// tokens/s, validation loss and perplexity) to this directory.
    #[arg(long)]
    tensorboard_dir: Option<PathBuf>,
    /// Iterations between training scalars in TensorBoard.
    #[arg(long, default_value_t = 1)]
    tensorboard_log_interval: u64,
    /// Megatron's `throughput per GPU (TFLOP/s/GPU)` field in the log line.
    #[arg(long)]
    log_throughput: bool,
    /// One device's peak TFLOP/s in the run's precision (ferrotron's flag; e.g. 989 for an
    /// H100's dense bf16): with --log-throughput the line adds `MFU: x% |`.
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// The parameters' L2 norm in the log line (and TensorBoard).
    #[arg(long)]
    log_params_norm: bool,
    /// The number of zero gradient elements in the log line (and TensorBoard).
    #[arg(long)]
    log_num_zeros_in_grad: bool,

    /// Backend: cpu, or (in builds with those features) cuda, cuda:N, wgpu, wgpu-cpu.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// What carries the collectives between ranks: `nccl` (CUDA builds with `--device cuda`:
    /// NCCL between the GPUs, bootstrapped over MPI), or `gloo` / `mpi` (host memory: MPI
    /// under a launcher, threads otherwise). Without the flag: host memory.
    #[arg(long)]
    distributed_backend: Option<String>,

    // --- Megatron features not (yet) in ferrotron: said so, never silently ignored ---
    /// Tensor-parallel size: the model is split over this many ranks (threads), Megatron-style.
    #[arg(long, default_value_t = 1)]
    tensor_model_parallel_size: usize,
    /// Pipeline-parallel size: the layers are cut into this many stages, one per rank
    /// (threads without a launcher), run with Megatron's 1F1B schedule.
    #[arg(long, default_value_t = 1)]
    pipeline_model_parallel_size: usize,
    /// Layers per virtual pipeline stage: each rank holds several model chunks of this many
    /// layers and runs the interleaved 1F1B schedule (a smaller bubble).
    #[arg(long)]
    num_layers_per_virtual_pipeline_stage: Option<usize>,
    /// Layers on the first pipeline stage (the other stages split the rest evenly).
    #[arg(long)]
    decoder_first_pipeline_num_layers: Option<usize>,
    /// Layers on the last pipeline stage, which also runs the output layer and the loss.
    #[arg(long)]
    decoder_last_pipeline_num_layers: Option<usize>,
    /// fp16 mixed precision: the model computes in fp16 over fp32 main weights, with a
    /// dynamic loss scale (or --loss-scale).
    #[arg(long)]
    fp16: bool,
    /// bf16 mixed precision: the model computes in bf16 over fp32 main weights (no loss
    /// scaling unless --loss-scale).
    #[arg(long)]
    bf16: bool,
    /// A constant loss scale (with --fp16/--bf16) instead of the dynamic one.
    #[arg(long)]
    loss_scale: Option<f64>,
    /// The dynamic loss scale's starting value.
    #[arg(long, default_value_t = 4294967296.0)]
    initial_loss_scale: f64,
    /// The dynamic loss scale's floor.
    #[arg(long, default_value_t = 1.0)]
    min_loss_scale: f64,
    /// Iterations without overflow before the dynamic loss scale doubles.
    #[arg(long, default_value_t = 1000)]
    loss_scale_window: u64,
    /// Overflows tolerated before the dynamic loss scale halves.
    #[arg(long, default_value_t = 2)]
    hysteresis: u64,
    /// Softmax in fp32 under --fp16/--bf16 (always so here; accepted for Megatron's scripts).
    #[arg(long)]
    attention_softmax_in_fp32: bool,
    /// Gradients summed and all-reduced in fp32 (always so here; accepted for Megatron's
    /// scripts).
    #[arg(long)]
    accumulate_allreduce_grads_in_fp32: bool,
    /// Legacy form of `--recompute-granularity full --recompute-method METHOD`.
    #[arg(long)]
    activations_checkpoint_method: Option<String>,
    /// Legacy form of `--recompute-num-layers`.
    #[arg(long)]
    activations_checkpoint_num_layers: Option<usize>,
    /// Legacy form of `--recompute-granularity full --recompute-method uniform`.
    #[arg(long)]
    checkpoint_activations: bool,
    /// Activation recomputation: `full` (whole layers, from their inputs; needs
    /// --recompute-method) or `selective` (the attention core only).
    #[arg(long)]
    recompute_granularity: Option<String>,
    /// `--recompute-granularity selective`, whatever that flag says (as Megatron's
    /// `arguments.py` sets it).
    #[arg(long)]
    recompute_activations: bool,
    /// With `full`: `uniform` (the layers in chunks of --recompute-num-layers, every chunk
    /// recomputed) or `block` (only the first --recompute-num-layers layers recomputed).
    #[arg(long)]
    recompute_method: Option<String>,
    /// Layers per recomputed chunk (uniform) or recomputed layers (block).
    #[arg(long)]
    recompute_num_layers: Option<usize>,
    /// Data-parallel implementation: `local` or `torch` (both are ferrotron's bucketed
    /// all-reduce).
    #[arg(long = "DDP-impl")]
    ddp_impl: Option<String>,
    /// Shard Adam's state over the data-parallel ranks (ZeRO-1).
    #[arg(long)]
    use_distributed_optimizer: bool,
    /// Gradient elements per data-parallel all-reduce bucket.
    #[arg(long, default_value_t = ferrotron::training::DEFAULT_DDP_BUCKET_SIZE)]
    ddp_bucket_size: usize,
    /// All-reduce the gradient buckets during the last micro-batch's backward pass, on a
    /// communication thread (with the replicated optimizer and one pipeline stage).
    #[arg(long)]
    overlap_grad_reduce: bool,
    /// Turn off the fused scaled causal-masked softmax kernel (GPU builds; the CPU backend
    /// always uses the composed reference ops).
    #[arg(long)]
    no_masked_softmax_fusion: bool,
    /// Turn off the fused LayerNorm kernel (GPU builds; the CPU backend always uses the
    /// composed reference ops).
    #[arg(long)]
    no_persist_layer_norm: bool,
    /// Turn off the fused rotary-embedding kernel (GPU builds).
    #[arg(long)]
    no_rope_fusion: bool,
    /// Turn off the fused SwiGLU kernel (GPU builds).
    #[arg(long)]
    no_bias_swiglu_fusion: bool,
    /// Turn off the fused GELU kernel (GPU builds).
    #[arg(long)]
    no_bias_gelu_fusion: bool,
    /// Turn off the fused bias-dropout-add kernel (GPU builds).
    #[arg(long)]
    no_bias_dropout_fusion: bool,
    /// Fused causal attention (FlashAttention-style, dropout inside, the `[s, s]` scores never
    /// stored) on CubeCL devices (`--device cuda`, `wgpu`); the CPU backend keeps the composed
    /// attention (the same math).
    #[arg(long)]
    use_flash_attn: bool,
    /// Megatron's attention backend: `flash` (the fused kernels, as `--use-flash-attn`),
    /// `fused` (the composed core keeping only its inputs: selective recomputation),
    /// `unfused` or `local` (the composed core keeping its probabilities), `auto` (on CUDA in
    /// bf16/fp16 the core from the QKV rows keeping only q, k, v; `unfused` elsewhere). See
    /// docs/gpu.md.
    #[arg(long, default_value = "auto")]
    attention_backend: String,
}

// Why this allocator: see `ferrotron::util::allocator`.
#[global_allocator]
static ALLOCATOR: ferrotron::util::allocator::TrainingAllocator =
    ferrotron::util::allocator::TrainingAllocator;

/// `--cuda-graph-impl` and `--cuda-graph-scope`: the warm-up steps before the whole
/// iteration is captured, or `None` without graphs.
fn cuda_graph(args: &Args) -> Result<Option<u64>> {
    match args.cuda_graph_impl.as_str() {
        "none" => Ok(None),
        "local" if args.cuda_graph_scope.iter().any(|s| s == "full_iteration") => {
            Ok(Some(args.cuda_graph_warmup_steps))
        }
        "local" => bail!(
            "--cuda-graph-impl local: ferrotron captures the whole iteration only; add \
             --cuda-graph-scope full_iteration (got {:?})",
            args.cuda_graph_scope
        ),
        other => bail!(
            "--cuda-graph-impl {other}: ferrotron has `local` (with --cuda-graph-scope \
             full_iteration) and `none`"
        ),
    }
}

fn build_config(args: &Args, verbose: bool) -> Result<PretrainConfig> {
    // Features that would change results: refuse.
    if args.optimizer != "adam" {
        bail!(
            "--optimizer {} is not supported; only adam (decoupled weight decay) is",
            args.optimizer
        );
    }
    if args.calculate_per_token_loss && args.eod_mask_loss {
        bail!("--calculate-per-token-loss with --eod-mask-loss is not implemented (the micro-batches then hold different numbers of loss tokens); drop one of them");
    }
    let tokenizer = args.tokenizer.load()?;
    let data = data_sources(args, &tokenizer)?;
    let precision = Precision::from_flags(args.fp16, args.bf16).map_err(anyhow::Error::msg)?;
    let dynamic_loss_scale = loss_scaling(args)?;
    // Features whose absence does not change the math: say so.
    let attention = attention(args, precision, verbose)?;
    if let Some(ddp) = &args.ddp_impl {
        if ddp != "local" && ddp != "torch" {
            bail!("--DDP-impl {ddp}: expected local or torch");
        }
    }
    let (model, eod, seq_length) = model_config(args, &tokenizer, &attention, verbose)?;
    let schedule = args
        .schedule
        .resolve(seq_length)
        .map_err(anyhow::Error::msg)?;
    if verbose && args.schedule.train_samples.is_some() {
        println!("setting training iterations to {}", schedule.train_iters);
    }
    Ok(PretrainConfig {
        model,
        seq_length,
        micro_batch_size: args.schedule.micro_batch_size,
        global_batch_size: schedule.global_batch_size,
        train_iters: schedule.train_iters,
        train_samples: schedule.train_samples,
        batch_size_schedule: schedule.batch_size_schedule,
        decrease_batch_size_if_needed: args.schedule.decrease_batch_size_if_needed,
        schedule: schedule.lr,
        decoupled_schedule: schedule.decoupled_lr,
        weight_decay_schedule: Some(schedule.weight_decay),
        adam: AdamWConfig {
            beta1: args.adam_beta1,
            beta2: args.adam_beta2,
            eps: args.adam_eps,
            weight_decay: args.schedule.weight_decay,
        },
        clip_grad: args.clip_grad,
        seed: args.seed,
        precision,
        loss_scale: args.loss_scale,
        dynamic_loss_scale,
        data,
        split: args.split.clone(),
        data_cache_path: args.data_cache_path.clone(),
        eod_mask_loss: args.eod_mask_loss,
        eod,
        log_interval: args.log_interval,
        eval_interval: args.eval_interval,
        eval_iters: args.eval_iters,
        save: args.save.clone(),
        save_interval: args.save_interval,
        save_megatron: megatron_save_options(args, verbose)?,
        load: args.load.clone(),
        finetune: args.finetune,
        no_load_optim: args.no_load_optim,
        exit_interval: args.exit_interval,
        exit_duration_in_mins: args.exit_duration_in_mins,
        exit_signal_handler: args.exit_signal_handler,
        cuda_graph_warmup_steps: cuda_graph(args)?,
        tensor_model_parallel_size: args.tensor_model_parallel_size,
        pipeline_model_parallel_size: args.pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage: args.num_layers_per_virtual_pipeline_stage,
        decoder_first_pipeline_num_layers: args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers: args.decoder_last_pipeline_num_layers,
        use_distributed_optimizer: args.use_distributed_optimizer,
        ddp_bucket_size: args.ddp_bucket_size,
        overlap_grad_reduce: args.overlap_grad_reduce,
        tensorboard_dir: args.tensorboard_dir.clone(),
        tensorboard_log_interval: args.tensorboard_log_interval,
        log_options: LogOptions {
            throughput: args.log_throughput,
            peak_tflops: peak_tflops(args)?,
            params_norm: args.log_params_norm,
            num_zeros_in_grad: args.log_num_zeros_in_grad,
        },
        recompute: attention.recompute,
    })
}

/// `--loss-scale` checked, and the dynamic scaler's flags.
fn loss_scaling(args: &Args) -> Result<DynamicGradScalerConfig> {
    if let Some(scale) = args.loss_scale {
        if !(scale > 0.0 && scale.is_finite()) {
            bail!("--loss-scale {scale} must be a positive number");
        }
    }
    if !(args.initial_loss_scale >= args.min_loss_scale && args.min_loss_scale > 0.0)
        || args.loss_scale_window == 0
        || args.hysteresis == 0
    {
        bail!("need 0 < --min-loss-scale <= --initial-loss-scale, and --loss-scale-window and --hysteresis of at least 1");
    }
    Ok(DynamicGradScalerConfig {
        initial_scale: args.initial_loss_scale,
        min_scale: args.min_loss_scale,
        growth_interval: args.loss_scale_window,
        hysteresis: args.hysteresis,
        ..DynamicGradScalerConfig::default()
    })
}

/// `--peak-tflops`, checked: positive, and only with `--log-throughput` (its line field).
fn peak_tflops(args: &Args) -> Result<Option<f64>> {
    match args.peak_tflops {
        Some(p) if !(p.is_finite() && p > 0.0) => {
            bail!("--peak-tflops {p}: expected a positive number of TFLOP/s")
        }
        Some(_) if !args.log_throughput => {
            bail!("--peak-tflops needs --log-throughput (the MFU sits beside its throughput field)")
        }
        peak => Ok(peak),
    }
}

/// `--ckpt-format torch`'s options; a note when another format is asked for, since ferrotron
/// then writes its own.
fn megatron_save_options(args: &Args, verbose: bool) -> Result<Option<MegatronSaveOptions>> {
    let spec: LayerSpec = args.transformer_impl.parse().map_err(anyhow::Error::msg)?;
    match args.ckpt_format.as_deref() {
        Some("torch") => Ok(Some(MegatronSaveOptions {
            spec,
            make_vocab_size_divisible_by: args.make_vocab_size_divisible_by,
            vocab_size: args.tokenizer.vocab_size,
            tokenizer_type: Some(args.tokenizer.tokenizer_type.clone()),
        })),
        Some(other @ ("torch_dist" | "zarr" | "torch_dcp" | "fsdp_dtensor")) => {
            if verbose {
                println!("note: --ckpt-format {other}: ferrotron saves its own format (safetensors shards, loadable at any layout); --ckpt-format torch saves Megatron's");
            }
            Ok(None)
        }
        Some(other) => bail!(
            "--ckpt-format {other:?}: expected torch, torch_dist, zarr, torch_dcp or fsdp_dtensor"
        ),
        None => Ok(None),
    }
}

/// The model's shape from the flags and the tokenizer (its vocabulary padded as Megatron
/// pads it), the tokenizer's end-of-document id, and the sequence length. Under
/// `--use-checkpoint-args` the checkpoint's saved model fills in the shape the flags leave out
/// and sets the architecture.
fn model_config(
    args: &Args,
    tokenizer: &TextTokenizer,
    attention: &AttentionChoice,
    verbose: bool,
) -> Result<(GptConfig, u32, usize)> {
    let vocab = tokenizer.vocab_size();
    let eod = tokenizer
        .eod()
        .context("the tokenizer has no end-of-document token")?;
    let padded = padded_vocab_size(
        vocab,
        args.make_vocab_size_divisible_by,
        args.tensor_model_parallel_size,
    );
    if verbose {
        println!("{}", padded_vocab_log_line(vocab, padded));
    }
    let saved = checkpoint_model(args, verbose)?;
    let from_saved = |flag: Option<usize>, name: &str, take: fn(&GptConfig) -> usize| {
        flag.or_else(|| saved.as_ref().map(|(c, _)| take(c)))
            .with_context(|| format!("--use-checkpoint-args: no checkpoint to take {name} from"))
    };
    let seq_length = match args.seq_length {
        Some(s) => s,
        None => saved
            .as_ref()
            .map(|(c, seq)| seq.unwrap_or(c.max_position_embeddings))
            .context("--use-checkpoint-args: no checkpoint to take --seq-length from")?,
    };
    let max_positions = args
        .max_position_embeddings
        .or_else(|| saved.as_ref().map(|(c, _)| c.max_position_embeddings))
        .unwrap_or(seq_length);
    if seq_length > max_positions {
        bail!("--seq-length {seq_length} is larger than --max-position-embeddings {max_positions}");
    }
    if seq_length == 0 {
        bail!("--seq-length must be positive");
    }
    let model = GptConfig::new(
        from_saved(args.num_layers, "--num-layers", |c| c.num_layers)?,
        from_saved(args.hidden_size, "--hidden-size", |c| c.hidden_size)?,
        from_saved(args.num_attention_heads, "--num-attention-heads", |c| {
            c.num_attention_heads
        })?,
        max_positions,
        padded,
    )
    .with_ffn_hidden_size(args.ffn_hidden_size)
    .with_hidden_dropout(args.hidden_dropout)
    .with_attention_dropout(args.attention_dropout)
    .with_layernorm_epsilon(args.layernorm_epsilon)
    .with_init_method_std(args.init_method_std)
    .with_openai_gelu(args.openai_gelu)
    .with_masked_softmax_fusion(!args.no_masked_softmax_fusion)
    .with_layer_norm_fusion(!args.no_persist_layer_norm)
    .with_rope_fusion(!args.no_rope_fusion)
    .with_bias_swiglu_fusion(!args.no_bias_swiglu_fusion)
    .with_bias_gelu_fusion(!args.no_bias_gelu_fusion)
    .with_bias_dropout_fusion(!args.no_bias_dropout_fusion)
    .with_flash_attention(attention.flash)
    .with_core_keeps_only_inputs(attention.core_keeps_only_inputs);
    let mut model = args.architecture.apply(model).map_err(anyhow::Error::msg)?;
    if let Some((saved, _)) = &saved {
        model = model.with_architecture_of(saved);
        model.ffn_hidden_size = args.ffn_hidden_size.or(saved.ffn_hidden_size);
        model.kv_channels = args.architecture.kv_channels.or(saved.kv_channels);
    }
    let model = model.with_sequence_parallel(args.sequence_parallel);
    if verbose
        && attention.flash
        && !args.device.starts_with("cuda")
        && !args.device.starts_with("wgpu")
    {
        println!("note: the flash attention backend: the fused attention kernel runs on --device cuda or wgpu; on {} the composed attention runs (the same math)", args.device);
    }
    model
        .validate_parallel(args.tensor_model_parallel_size)
        .map_err(anyhow::Error::msg)?;
    Ok((model, eod, seq_length))
}

/// The model saved in `--load` under `--use-checkpoint-args` (`None` without the flag, or
/// when the directory holds no checkpoint yet, as Megatron goes on with the flags then).
fn checkpoint_model(args: &Args, verbose: bool) -> Result<Option<(GptConfig, Option<usize>)>> {
    if !args.use_checkpoint_args {
        return Ok(None);
    }
    let dir = args
        .load
        .as_ref()
        .context("--use-checkpoint-args takes the model from --load: give --load")?;
    let saved = saved_model(dir)?;
    if verbose {
        match &saved {
            Some((c, _)) => println!(
                " > --use-checkpoint-args: the model of {}: {} layers, hidden size {}, {} heads, {}",
                dir.display(),
                c.num_layers,
                c.hidden_size,
                c.num_attention_heads,
                c.architecture()
            ),
            None => println!(
                " > --use-checkpoint-args: no checkpoint in {} to provide arguments, using the flags",
                dir.display()
            ),
        }
    }
    Ok(saved)
}

/// Megatron's recompute flags, the legacy ones mapped as its `arguments.py` maps them.
/// `--attention-backend` (and `--use-flash-attn`) resolved for the run's device and
/// precision, with the recomputation the flags ask for (see
/// `ferrotron::model::attention_backend`).
fn attention(args: &Args, precision: Precision, verbose: bool) -> Result<AttentionChoice> {
    let backend: AttentionBackend = args.attention_backend.parse().map_err(anyhow::Error::msg)?;
    let cuda_in_half_precision = args.device.starts_with("cuda") && precision != Precision::Fp32;
    let asked = recompute(args)?;
    let choice = backend
        .resolve(args.use_flash_attn, asked, cuda_in_half_precision)
        .map_err(anyhow::Error::msg)?;
    if verbose && backend == AttentionBackend::Auto && choice.core_keeps_only_inputs {
        println!(
            "note: --attention-backend auto on {} in half precision: the attention core from \
             the QKV rows keeps only q, k, v and forms its probabilities again in its backward \
             (as Megatron's selective recomputation does; the same losses); \
             --attention-backend unfused keeps them",
            args.device
        );
    }
    Ok(choice)
}

fn recompute(args: &Args) -> Result<Recompute> {
    let mut granularity = args.recompute_granularity.clone();
    let mut method = args.recompute_method.clone();
    if args.checkpoint_activations {
        granularity = Some("full".into());
        method.get_or_insert_with(|| "uniform".into());
    }
    if let Some(m) = &args.activations_checkpoint_method {
        granularity = Some("full".into());
        method = Some(m.clone());
    }
    if args.recompute_activations {
        granularity = Some("selective".into());
    }
    let layers = args
        .recompute_num_layers
        .or(args.activations_checkpoint_num_layers)
        .unwrap_or(1);
    match granularity.as_deref() {
        None => {
            if method.is_some() {
                bail!("--recompute-method needs --recompute-granularity full");
            }
            Ok(Recompute::None)
        }
        Some("full") => {
            let Some(method) = method else {
                bail!("--recompute-granularity full needs --recompute-method uniform or block");
            };
            Recompute::from_flags(&method, layers).map_err(anyhow::Error::msg)
        }
        Some("selective") => {
            // As Megatron's arguments.py: the method and layer count are for `full` only.
            if method.is_some() {
                bail!("--recompute-method is for --recompute-granularity full, not selective");
            }
            Ok(Recompute::Selective)
        }
        Some(other) => bail!("--recompute-granularity {other}: expected full or selective"),
    }
}

fn run(args: Args, world: &World) -> Result<()> {
    // Under a launcher, `--device cuda` means this rank's GPU on its machine (Megatron's
    // `torch.cuda.set_device(local_rank)`).
    let spec = if world.is_mpi() && args.device == "cuda" {
        format!("cuda:{}", ferrotron::comm::world::local_rank())
    } else {
        args.device.clone()
    };
    let device = ferrotron::util::device::parse_device(&spec)
        .map_err(anyhow::Error::msg)?
        .autodiff();
    let config = build_config(&args, world.rank() == 0)?;
    if args.exit_signal_handler {
        match args.exit_signal.as_str() {
            "SIGTERM" | "SIGINT" | "SIGHUP" => {}
            other => bail!("--exit-signal {other}: SIGTERM, SIGINT and SIGHUP are handled (all three, whichever is named)"),
        }
        ferrotron::util::exit_signal::install().map_err(anyhow::Error::msg)?;
    }
    match args.distributed_backend.as_deref() {
        None | Some("gloo") | Some("mpi") => {}
        Some("nccl") => return pretrain_on(&config, &device, nccl_world(&args, world)?).map(drop),
        Some(other) => bail!("--distributed-backend {other}: expected nccl, gloo or mpi"),
    }
    if world.is_mpi() {
        pretrain_on(&config, &device, world.comm())?;
    } else {
        pretrain(&config, &device)?;
    }
    Ok(())
}

/// `--distributed-backend nccl`: the world as an NCCL group on this rank's GPU.
#[cfg(feature = "cuda")]
fn nccl_world(
    args: &Args,
    world: &World,
) -> Result<std::sync::Arc<dyn ferrotron::comm::Communicator>> {
    if !args.device.starts_with("cuda") {
        bail!("--distributed-backend nccl needs --device cuda (NCCL moves GPU memory)");
    }
    let world_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size;
    if !world.is_mpi() && world_size > 1 {
        bail!("--distributed-backend nccl runs one rank per process: start the ranks with mpirun or srun (NCCL cannot join threads on one GPU)");
    }
    let ordinal = match args.device.split_once(':') {
        Some((_, n)) if !world.is_mpi() => n
            .parse()
            .with_context(|| format!("--device {}: expected cuda:N", args.device))?,
        _ => ferrotron::comm::world::local_rank(),
    };
    Ok(world.nccl(ordinal)?)
}

#[cfg(not(feature = "cuda"))]
fn nccl_world(
    _args: &Args,
    _world: &World,
) -> Result<std::sync::Arc<dyn ferrotron::comm::Communicator>> {
    bail!("--distributed-backend nccl needs a CUDA build (cargo build --release --features cuda) and --device cuda")
}

fn main() -> ExitCode {
    // Megatron's scripts pass flags for its own machinery and repeat flags: see
    // docs/megatron-flags.md.
    let screened = match screen_megatron_flags(&Args::command(), std::env::args_os()) {
        Ok(screened) => screened,
        Err(e) => {
            eprintln!("pretrain: error: {e}");
            return ExitCode::from(2);
        }
    };
    let args = Args::parse_from(&screened.argv);
    ferrotron::comm::world::share_cores_among_local_ranks();
    let world = match World::from_environment() {
        Ok(world) => world,
        Err(e) => return ferrotron::util::cli::finish("pretrain", Err(e)),
    };
    if let (Some(warning), 0) = (screened.warning(), world.rank()) {
        eprintln!("{warning}");
    }
    let result = run(args, &world);
    if let (Err(e), true) = (&result, world.size() > 1) {
        // The other ranks may be waiting in a collective for this one: end them all.
        eprintln!("pretrain: rank {}: error: {e:#}", world.rank());
        world.abort(1);
    }
    ferrotron::util::cli::finish("pretrain", result)
}

/// Megatron's `get_blend_and_blend_per_split`: `--data-path` / `--data-args-path` (one blend
/// cut by `--split`) or the per-split flags (a blend per split, each used whole).
fn data_sources(args: &Args, tokenizer: &TextTokenizer) -> Result<DataSources> {
    let per_split_flags = [
        &args.train_data_path,
        &args.valid_data_path,
        &args.test_data_path,
    ];
    let per_split =
        per_split_flags.iter().any(|v| !v.is_empty()) || args.per_split_data_args_path.is_some();
    let whole = !args.data_path.is_empty() || args.data_args_path.is_some();
    if args.mock_data {
        if whole || per_split {
            bail!("--mock-data replaces the data flags: give it or --data-path (or the per-split flags), not both");
        }
        let eod = tokenizer
            .eod()
            .context("--mock-data: the tokenizer has no end-of-document token")?;
        return Ok(DataSources::Mock(std::sync::Arc::new(MockDocuments::new(
            tokenizer.vocab_size() as u32,
            eod,
        ))));
    }
    if whole && per_split {
        bail!("give either --data-path (or --data-args-path) or the per-split data flags (--train-data-path, --valid-data-path, --test-data-path, --per-split-data-args-path), not both");
    }
    if let Some(path) = &args.data_args_path {
        return Ok(DataSources::Blend(
            Blend::from_args_file(path).map_err(anyhow::Error::msg)?,
        ));
    }
    if !args.data_path.is_empty() {
        return Ok(DataSources::Blend(
            Blend::from_args("--data-path", &args.data_path).map_err(anyhow::Error::msg)?,
        ));
    }
    if !per_split {
        bail!("no training data: give --data-path PREFIX (from `preprocess`), a weighted blend --data-path W1 PREFIX1 W2 PREFIX2, --train-data-path, or --mock-data");
    }
    let names = ["train", "valid", "test"];
    let lists: [Vec<String>; 3] = match &args.per_split_data_args_path {
        Some(path) => {
            if per_split_flags.iter().any(|v| !v.is_empty()) {
                bail!("--per-split-data-args-path replaces --train-data-path, --valid-data-path and --test-data-path: give one or the other");
            }
            per_split_lists(path)?
        }
        None => per_split_flags.map(|v| v.clone()),
    };
    let mut blends = [None, None, None];
    for ((blend, list), name) in blends.iter_mut().zip(&lists).zip(names) {
        if !list.is_empty() {
            *blend = Some(
                Blend::from_args(&format!("--{name}-data-path"), list)
                    .map_err(anyhow::Error::msg)?,
            );
        }
    }
    Ok(DataSources::PerSplit(blends))
}

/// Reads `--per-split-data-args-path`.
fn per_split_lists(path: &std::path::Path) -> Result<[Vec<String>; 3]> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--per-split-data-args-path {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "--per-split-data-args-path {}: not JSON like {{\"train\": [\"0.3\", \"a\", \"0.7\", \"b\"], \"valid\": \"c\", \"test\": \"c\"}}",
            path.display()
        )
    })?;
    let mut out: [Vec<String>; 3] = Default::default();
    for (list, key) in out.iter_mut().zip(["train", "valid", "test"]) {
        *list = match &json[key] {
            serde_json::Value::Null => vec![],
            serde_json::Value::String(s) => s.split_whitespace().map(str::to_owned).collect(),
            serde_json::Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    serde_json::Value::String(s) => Ok(s.clone()),
                    serde_json::Value::Number(n) => Ok(n.to_string()),
                    other => bail!(
                        "{}: \"{key}\" holds {other}, expected strings",
                        path.display()
                    ),
                })
                .collect::<Result<_>>()?,
            other => bail!(
                "{}: \"{key}\" is {other}, expected a list of words or a string",
                path.display()
            ),
        };
    }
    Ok(out)
}
