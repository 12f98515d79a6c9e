//! `pretrain`'s command line: Megatron-LM's `pretrain_gpt.py` flags as one typed struct,
//! parsed by clap, and their resolution into the run's [`PretrainConfig`] (checked, with the
//! tokenizer's vocabulary padded and `--use-checkpoint-args` applied). The `pretrain` tool
//! only parses, starts the ranks and trains; what each flag means is decided here, and
//! whether a Megatron flag is implemented at all in [`super::megatron_flags`].

mod data_flags;
mod resolve;

use std::path::PathBuf;

use clap::Parser;

use crate::tokenizer::TokenizerArgs;
use crate::training::{ArchitectureArgs, ScheduleArgs};

/// Pretrain a GPT with Megatron-LM's command line: one process (tensor-parallel ranks as
/// threads) or, under `mpirun`/`srun`, one MPI rank per process.
#[derive(Parser, Debug)]
#[command(name = "pretrain", version, args_override_self = true)]
pub struct PretrainArgs {
    // --- model ---
    /// Transformer layers.
    #[arg(long, required_unless_present = "use_checkpoint_args")]
    pub num_layers: Option<usize>,
    /// Hidden size.
    #[arg(long, required_unless_present = "use_checkpoint_args")]
    pub hidden_size: Option<usize>,
    /// Attention heads.
    #[arg(long, required_unless_present = "use_checkpoint_args")]
    pub num_attention_heads: Option<usize>,
    /// MLP width [default: 4 × hidden size].
    #[arg(long)]
    pub ffn_hidden_size: Option<usize>,
    /// Tokens per sample.
    #[arg(long, required_unless_present = "use_checkpoint_args")]
    pub seq_length: Option<usize>,
    /// Learned positions [default: --seq-length].
    #[arg(long)]
    pub max_position_embeddings: Option<usize>,
    /// Pad the vocabulary to a multiple of this × the tensor-parallel size.
    #[arg(long, default_value_t = 128)]
    pub make_vocab_size_divisible_by: usize,
    /// Dropout after embeddings, attention and MLP.
    #[arg(long, default_value_t = 0.1)]
    pub hidden_dropout: f64,
    /// Dropout on attention probabilities.
    #[arg(long, default_value_t = 0.1)]
    pub attention_dropout: f64,
    /// Epsilon of the norms (--norm-epsilon is the same flag).
    #[arg(long, alias = "norm-epsilon", default_value_t = 1e-5)]
    pub layernorm_epsilon: f64,
    /// Std of the normal initialization.
    #[arg(long, default_value_t = 0.02)]
    pub init_method_std: f64,
    /// tanh approximation of GELU instead of the exact erf form.
    #[arg(long)]
    pub openai_gelu: bool,
    #[command(flatten)]
    pub architecture: ArchitectureArgs,
    /// Norms, dropout and residuals on each tensor-parallel rank's chunk of the sequence
    /// (no effect at tensor-parallel size 1).
    #[arg(long)]
    pub sequence_parallel: bool,

    // --- batch and schedule ---
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// Adam β₁.
    #[arg(long, default_value_t = 0.9)]
    pub adam_beta1: f64,
    /// Adam β₂.
    #[arg(long, default_value_t = 0.999)]
    pub adam_beta2: f64,
    /// Adam ε.
    #[arg(long, default_value_t = 1e-8)]
    pub adam_eps: f64,
    /// Clip gradients to this global L2 norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    pub clip_grad: f64,
    /// Only adam (Adam with decoupled weight decay) is implemented.
    #[arg(long, default_value = "adam")]
    pub optimizer: String,
    /// Random seed (initialization, data order, dropout).
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,

    // --- data ---
    /// Dataset prefix (PREFIX.bin/.idx from `preprocess`), several prefixes, or a weighted
    /// blend `W1 PREFIX1 W2 PREFIX2 ...` (weights need not sum to 1), cut by --split.
    #[arg(long, num_args = 1.., allow_negative_numbers = true)]
    pub data_path: Vec<String>,
    /// A file holding what --data-path would (for long blends).
    #[arg(long, conflicts_with = "data_path")]
    pub data_args_path: Option<PathBuf>,
    /// Training data (a prefix or a blend), used whole; instead of --data-path and --split.
    #[arg(long, num_args = 1.., allow_negative_numbers = true)]
    pub train_data_path: Vec<String>,
    /// Validation data, used whole.
    #[arg(long, num_args = 1.., allow_negative_numbers = true)]
    pub valid_data_path: Vec<String>,
    /// Test data, used whole.
    #[arg(long, num_args = 1.., allow_negative_numbers = true)]
    pub test_data_path: Vec<String>,
    /// A JSON file {"train": ..., "valid": ..., "test": ...}, each a list (or a string) of
    /// what --train-data-path and the others would hold.
    #[arg(long)]
    pub per_split_data_args_path: Option<PathBuf>,
    /// Megatron-Core's synthetic documents (MockGPTDataset) instead of a dataset; the split
    /// is 1,1,1 (use with --tokenizer-type NullTokenizer --vocab-size N, or any tokenizer).
    #[arg(long)]
    pub mock_data: bool,
    /// Train/validation/test split of the documents.
    #[arg(long, default_value = "969, 30, 1")]
    pub split: String,
    /// Where to cache the dataset indices [default: cache/ beside the data].
    #[arg(long)]
    pub data_cache_path: Option<PathBuf>,
    /// Do not train on the token that follows an end-of-document.
    #[arg(long)]
    pub eod_mask_loss: bool,
    /// Packed documents: positions restart at 0 after each end-of-document token.
    #[arg(long)]
    pub reset_position_ids: bool,
    /// Packed documents: a token after an end-of-document attends to nothing up to it.
    #[arg(long)]
    pub reset_attention_mask: bool,
    /// Normalize the loss by the global batch's loss tokens (every token counts without
    /// --eod-mask-loss, where this is what ferrotron computes anyway).
    #[arg(long)]
    pub calculate_per_token_loss: bool,
    #[command(flatten)]
    pub tokenizer: TokenizerArgs,

    // --- logging, evaluation, checkpoints ---
    /// Print a log line every N iterations.
    #[arg(long, default_value_t = 100)]
    pub log_interval: u64,
    /// Evaluate every N iterations.
    #[arg(long, default_value_t = 1000)]
    pub eval_interval: u64,
    /// Batches per evaluation.
    #[arg(long, default_value_t = 100)]
    pub eval_iters: u64,
    /// Checkpoint directory to write.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Save every N iterations.
    #[arg(long)]
    pub save_interval: Option<u64>,
    /// torch: --save writes Megatron-LM's `--ckpt-format torch` (`model_optim_rng.pt`, no
    /// optimizer state); otherwise ferrotron's own format (Megatron's default, torch_dist, is
    /// not written).
    #[arg(long)]
    pub ckpt_format: Option<String>,
    /// The Megatron-Core names --ckpt-format torch writes: transformer_engine or local.
    #[arg(long, default_value = "transformer_engine")]
    pub transformer_impl: String,
    /// Checkpoint directory to resume from.
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// The model from the --load checkpoint's saved arguments (Megatron's or ferrotron's):
    /// its architecture always, its shape where the flags give none.
    #[arg(long)]
    pub use_checkpoint_args: bool,
    /// Take only the weights from --load: iteration 0, a fresh optimizer and scheduler
    /// (Megatron's --finetune).
    #[arg(long)]
    pub finetune: bool,
    /// From --load take the weights and the iteration only: Adam's state and the
    /// learning-rate schedule start fresh (Megatron's --no-load-optim).
    #[arg(long)]
    pub no_load_optim: bool,
    /// Accepted for Megatron's scripts: ferrotron's random streams are functions of --seed
    /// and the iteration, so there is no RNG state to load or to skip.
    #[arg(long)]
    pub no_load_rng: bool,
    /// Save and exit after N iterations.
    #[arg(long)]
    pub exit_interval: Option<u64>,
    /// Save and exit once the run has taken this many minutes.
    #[arg(long)]
    pub exit_duration_in_mins: Option<f64>,
    /// On SIGTERM, SIGINT or SIGHUP: finish the iteration, save, exit 0 (every rank).
    #[arg(long)]
    pub exit_signal_handler: bool,
    /// The signal --exit-signal-handler waits for (SIGTERM, SIGINT and SIGHUP are all
    /// handled).
    #[arg(long, default_value = "SIGTERM")]
    pub exit_signal: String,

    /// CUDA graphs (Megatron's): `local` with `--cuda-graph-scope full_iteration` captures the
    /// whole training step once and replays it (CubeCL devices, one rank, one micro-batch per
    /// step, no fp16 loss scaler; on CUDA not with `--cublas-ordering host`); `none` (default).
    #[arg(long, default_value = "none")]
    pub cuda_graph_impl: String,
    /// What `--cuda-graph-impl local` captures: ferrotron captures `full_iteration` only.
    #[arg(long, num_args = 1..)]
    pub cuda_graph_scope: Vec<String>,
    /// Eager steps before the step is captured.
    #[arg(long, default_value_t = 3)]
    pub cuda_graph_warmup_steps: u64,
    /// Where a CUDA run's bf16/fp16 matrix products run (ferrotron's flag): `cublas`
    /// (default) or `cubecl` (CubeCL's kernels for all: one stream, the reference the GPU
    /// scripts compare cuBLAS's products against). f32 products are CubeCL's either way.
    #[arg(long, default_value = "cublas")]
    pub cuda_matmul: String,
    /// How cuBLAS's stream is ordered against CubeCL's (ferrotron's flag): `device` (default:
    /// the host waits for nothing) or `host` (the host waits around each window: slower, the
    /// lowest peak memory; no CUDA graphs).
    #[arg(long, default_value = "device")]
    pub cublas_ordering: String,

    /// Write TensorBoard scalars (loss, learning rate, grad norm, batch size, iteration time,
    /// tokens/s, validation loss and perplexity) to this directory.
    #[arg(long)]
    pub tensorboard_dir: Option<PathBuf>,
    /// Iterations between training scalars in TensorBoard.
    #[arg(long, default_value_t = 1)]
    pub tensorboard_log_interval: u64,
    /// Megatron's `throughput per GPU (TFLOP/s/GPU)` field in the log line.
    #[arg(long)]
    pub log_throughput: bool,
    /// One device's peak TFLOP/s in the run's precision (ferrotron's flag; e.g. 989 for an
    /// H100's dense bf16): with --log-throughput the line adds `MFU: x% |`.
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// The parameters' L2 norm in the log line (and TensorBoard).
    #[arg(long)]
    pub log_params_norm: bool,
    /// The number of zero gradient elements in the log line (and TensorBoard).
    #[arg(long)]
    pub log_num_zeros_in_grad: bool,

    /// Backend: cpu, or (in builds with those features) cuda, cuda:N, wgpu, wgpu-cpu.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// What carries the collectives between ranks: `nccl` (CUDA builds with `--device cuda`:
    /// NCCL between the GPUs, bootstrapped over MPI), or `gloo` / `mpi` (host memory: MPI
    /// under a launcher, threads otherwise). Without the flag: host memory.
    #[arg(long)]
    pub distributed_backend: Option<String>,

    // --- Megatron features not (yet) in ferrotron: said so, never silently ignored ---
    /// Tensor-parallel size: the model is split over this many ranks (threads), Megatron-style.
    #[arg(long, default_value_t = 1)]
    pub tensor_model_parallel_size: usize,
    /// Pipeline-parallel size: the layers are cut into this many stages, one per rank
    /// (threads without a launcher), run with Megatron's 1F1B schedule.
    #[arg(long, default_value_t = 1)]
    pub pipeline_model_parallel_size: usize,
    /// Context-parallel size: each sequence is split over this many ranks (threads without a
    /// launcher), each holding two of its `2·N` chunks (Megatron's load-balanced split).
    #[arg(long, default_value_t = 1)]
    pub context_parallel_size: usize,
    /// How context-parallel ranks exchange keys and values: `p2p` (around the ring,
    /// Megatron's default) or `allgather`; Megatron's per-layer list form takes one type for
    /// every layer.
    #[arg(long, num_args = 1.., default_values_t = vec!["p2p".to_string()])]
    pub cp_comm_type: Vec<String>,
    /// Layers per virtual pipeline stage: each rank holds several model chunks of this many
    /// layers and runs the interleaved 1F1B schedule (a smaller bubble).
    #[arg(long)]
    pub num_layers_per_virtual_pipeline_stage: Option<usize>,
    /// Layers on the first pipeline stage (the other stages split the rest evenly).
    #[arg(long)]
    pub decoder_first_pipeline_num_layers: Option<usize>,
    /// Layers on the last pipeline stage, which also runs the output layer and the loss.
    #[arg(long)]
    pub decoder_last_pipeline_num_layers: Option<usize>,
    /// fp16 mixed precision: the model computes in fp16 over fp32 main weights, with a
    /// dynamic loss scale (or --loss-scale).
    #[arg(long)]
    pub fp16: bool,
    /// bf16 mixed precision: the model computes in bf16 over fp32 main weights (no loss
    /// scaling unless --loss-scale).
    #[arg(long)]
    pub bf16: bool,
    /// A constant loss scale (with --fp16/--bf16) instead of the dynamic one.
    #[arg(long)]
    pub loss_scale: Option<f64>,
    /// The dynamic loss scale's starting value.
    #[arg(long, default_value_t = 4294967296.0)]
    pub initial_loss_scale: f64,
    /// The dynamic loss scale's floor.
    #[arg(long, default_value_t = 1.0)]
    pub min_loss_scale: f64,
    /// Iterations without overflow before the dynamic loss scale doubles.
    #[arg(long, default_value_t = 1000)]
    pub loss_scale_window: u64,
    /// Overflows tolerated before the dynamic loss scale halves.
    #[arg(long, default_value_t = 2)]
    pub hysteresis: u64,
    /// Softmax in fp32 under --fp16/--bf16 (always so here; accepted for Megatron's scripts).
    #[arg(long)]
    pub attention_softmax_in_fp32: bool,
    /// Gradients summed and all-reduced in fp32 (always so here; accepted for Megatron's
    /// scripts).
    #[arg(long)]
    pub accumulate_allreduce_grads_in_fp32: bool,
    /// Legacy form of `--recompute-granularity full --recompute-method METHOD`.
    #[arg(long)]
    pub activations_checkpoint_method: Option<String>,
    /// Legacy form of `--recompute-num-layers`.
    #[arg(long)]
    pub activations_checkpoint_num_layers: Option<usize>,
    /// Legacy form of `--recompute-granularity full --recompute-method uniform`.
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Activation recomputation: `full` (whole layers, from their inputs; needs
    /// --recompute-method) or `selective` (the attention core only).
    #[arg(long)]
    pub recompute_granularity: Option<String>,
    /// `--recompute-granularity selective`, whatever that flag says (as Megatron's
    /// `arguments.py` sets it).
    #[arg(long)]
    pub recompute_activations: bool,
    /// With `full`: `uniform` (the layers in chunks of --recompute-num-layers, every chunk
    /// recomputed) or `block` (only the first --recompute-num-layers layers recomputed).
    #[arg(long)]
    pub recompute_method: Option<String>,
    /// Layers per recomputed chunk (uniform) or recomputed layers (block).
    #[arg(long)]
    pub recompute_num_layers: Option<usize>,
    /// Data-parallel implementation: `local` or `torch` (both are ferrotron's bucketed
    /// all-reduce).
    #[arg(long = "DDP-impl")]
    pub ddp_impl: Option<String>,
    /// Shard Adam's state over the data-parallel ranks (ZeRO-1).
    #[arg(long)]
    pub use_distributed_optimizer: bool,
    /// Gradient elements per data-parallel all-reduce bucket.
    #[arg(long, default_value_t = crate::training::DEFAULT_DDP_BUCKET_SIZE)]
    pub ddp_bucket_size: usize,
    /// All-reduce the gradient buckets during the last micro-batch's backward pass, on a
    /// communication thread (with the replicated optimizer and one pipeline stage).
    #[arg(long)]
    pub overlap_grad_reduce: bool,
    /// Turn off the fused scaled causal-masked softmax kernel (GPU builds; the CPU backend
    /// always uses the composed reference ops).
    #[arg(long)]
    pub no_masked_softmax_fusion: bool,
    /// Turn off the fused LayerNorm kernel (GPU builds; the CPU backend always uses the
    /// composed reference ops).
    #[arg(long)]
    pub no_persist_layer_norm: bool,
    /// Turn off the fused rotary-embedding kernel (GPU builds).
    #[arg(long)]
    pub no_rope_fusion: bool,
    /// Turn off the fused SwiGLU kernel (GPU builds).
    #[arg(long)]
    pub no_bias_swiglu_fusion: bool,
    /// Turn off the fused GELU kernel (GPU builds).
    #[arg(long)]
    pub no_bias_gelu_fusion: bool,
    /// Turn off the fused bias-dropout-add kernel (GPU builds).
    #[arg(long)]
    pub no_bias_dropout_fusion: bool,
    /// Fused causal attention (FlashAttention-style, dropout inside, the `[s, s]` scores never
    /// stored) on CubeCL devices (`--device cuda`, `wgpu`); the CPU backend keeps the composed
    /// attention (the same math).
    #[arg(long)]
    pub use_flash_attn: bool,
    /// Megatron's attention backend: `flash` (the fused kernels, as `--use-flash-attn`),
    /// `fused` (the composed core keeping only its inputs: selective recomputation),
    /// `unfused` or `local` (the composed core keeping its probabilities), `auto` (on CUDA in
    /// bf16/fp16 the core from the QKV rows keeping only q, k, v; `unfused` elsewhere). See
    /// docs/gpu.md.
    #[arg(long, default_value = "auto")]
    pub attention_backend: String,
}
