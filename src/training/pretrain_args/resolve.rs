//! The flags resolved into the run's configuration.

use crate::parallel::context::ContextComm;
use anyhow::{bail, Context, Result};

use super::data_flags::data_sources;
use super::PretrainArgs;
use crate::checkpoint::megatron_torch_save::{LayerSpec, MegatronSaveOptions};
use crate::checkpoint::saved_model;
use crate::checkpoint::SaveFormat;
use crate::model::attention_backend::{AttentionBackend, AttentionChoice};
use crate::model::vocab::{padded_vocab_log_line, padded_vocab_size};
use crate::model::{GptConfig, Recompute};
use crate::optim::grad_scaler::DynamicGradScalerConfig;
use crate::optim::Precision;
use crate::tokenizer::TextTokenizer;
use crate::training::{AdamWConfig, LogOptions, ParallelConfig, PretrainConfig};
use crate::util::matmul::ProductPlan;

impl PretrainArgs {
    /// The run these flags ask for, checked; `verbose` (world rank 0) prints Megatron's notes
    /// on the way (the padded vocabulary, flags whose effect differs).
    pub fn resolve(&self, verbose: bool) -> Result<PretrainConfig> {
        build_config(self, verbose)
    }
}

/// `--cuda-graph-impl` and `--cuda-graph-scope`: the warm-up steps before the whole
/// iteration is captured, or `None` without graphs.
fn cuda_graph(args: &PretrainArgs) -> Result<Option<u64>> {
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

fn build_config(args: &PretrainArgs, verbose: bool) -> Result<PretrainConfig> {
    if args.exit_signal_handler
        && !matches!(args.exit_signal.as_str(), "SIGTERM" | "SIGINT" | "SIGHUP")
    {
        bail!(
            "--exit-signal {}: SIGTERM, SIGINT and SIGHUP are handled (all three, whichever is named)",
            args.exit_signal
        );
    }
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
        save_format: save_format(args, verbose)?,
        load: args.load.clone(),
        finetune: args.finetune,
        no_load_optim: args.no_load_optim,
        exit_interval: args.exit_interval,
        exit_duration_in_mins: args.exit_duration_in_mins,
        exit_signal_handler: args.exit_signal_handler,
        cuda_graph_warmup_steps: cuda_graph(args)?,
        products: ProductPlan::from_flags(&args.cuda_matmul, &args.cublas_ordering)
            .map_err(anyhow::Error::msg)?,
        tensorboard_dir: args.tensorboard_dir.clone(),
        tensorboard_log_interval: args.tensorboard_log_interval,
        log_options: LogOptions {
            throughput: args.log_throughput,
            peak_tflops: peak_tflops(args)?,
            params_norm: args.log_params_norm,
            num_zeros_in_grad: args.log_num_zeros_in_grad,
        },
        recompute: attention.recompute,
        parallel: parallel_layout(args)?,
    })
}

/// How the run is split over ranks (the layout itself is checked with the model, by
/// [`PretrainConfig::validate`]).
fn parallel_layout(args: &PretrainArgs) -> Result<ParallelConfig> {
    // Both of Megatron's data-parallel wrappers reduce the gradients as ferrotron does.
    if let Some(ddp) = &args.ddp_impl {
        if ddp != "local" && ddp != "torch" {
            bail!("--DDP-impl {ddp}: expected local or torch");
        }
    }
    let cp_comm_type = match args.cp_comm_type.as_slice() {
        [one] => ContextComm::parse(one).map_err(anyhow::Error::msg)?,
        [first, rest @ ..] if rest.iter().all(|t| t == first) => {
            ContextComm::parse(first).map_err(anyhow::Error::msg)?
        }
        types => bail!(
            "--cp-comm-type {}: a different type per layer is not implemented (give one)",
            types.join(" ")
        ),
    };
    Ok(ParallelConfig {
        tensor_model_parallel_size: args.tensor_model_parallel_size,
        pipeline_model_parallel_size: args.pipeline_model_parallel_size,
        context_parallel_size: args.context_parallel_size,
        cp_comm_type,
        num_layers_per_virtual_pipeline_stage: args.num_layers_per_virtual_pipeline_stage,
        decoder_first_pipeline_num_layers: args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers: args.decoder_last_pipeline_num_layers,
        use_distributed_optimizer: args.use_distributed_optimizer,
        ddp_bucket_size: args.ddp_bucket_size,
        overlap_grad_reduce: args.overlap_grad_reduce,
    })
}

/// `--loss-scale` checked, and the dynamic scaler's flags.
fn loss_scaling(args: &PretrainArgs) -> Result<DynamicGradScalerConfig> {
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
fn peak_tflops(args: &PretrainArgs) -> Result<Option<f64>> {
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

/// The format `--save` writes: Megatron's under `--ckpt-format torch`, ferrotron's otherwise
/// (with a note when another of Megatron's formats is asked for).
fn save_format(args: &PretrainArgs, verbose: bool) -> Result<SaveFormat> {
    let spec: LayerSpec = args.transformer_impl.parse().map_err(anyhow::Error::msg)?;
    match args.ckpt_format.as_deref() {
        Some("torch") => Ok(SaveFormat::MegatronTorch(MegatronSaveOptions {
            spec,
            make_vocab_size_divisible_by: args.make_vocab_size_divisible_by,
            vocab_size: args.tokenizer.vocab_size,
            tokenizer_type: Some(args.tokenizer.tokenizer_type.clone()),
        })),
        Some(other @ ("torch_dist" | "zarr" | "torch_dcp" | "fsdp_dtensor")) => {
            if verbose {
                println!("note: --ckpt-format {other}: ferrotron saves its own format (safetensors shards, loadable at any layout); --ckpt-format torch saves Megatron's");
            }
            Ok(SaveFormat::Ferrotron)
        }
        Some(other) => bail!(
            "--ckpt-format {other:?}: expected torch, torch_dist, zarr, torch_dcp or fsdp_dtensor"
        ),
        None => Ok(SaveFormat::Ferrotron),
    }
}

/// The model's shape from the flags and the tokenizer (its vocabulary padded as Megatron
/// pads it), the tokenizer's end-of-document id, and the sequence length. Under
/// `--use-checkpoint-args` the checkpoint's saved model fills in the shape the flags leave out
/// and sets the architecture.
fn model_config(
    args: &PretrainArgs,
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
    .with_core_keeps_only_inputs(attention.core_keeps_only_inputs)
    .with_reset_position_ids(args.reset_position_ids)
    .with_reset_attention_mask(args.reset_attention_mask);
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
    Ok((model, eod, seq_length))
}

/// The model saved in `--load` under `--use-checkpoint-args` (`None` without the flag, or
/// when the directory holds no checkpoint yet, as Megatron goes on with the flags then).
fn checkpoint_model(
    args: &PretrainArgs,
    verbose: bool,
) -> Result<Option<(GptConfig, Option<usize>)>> {
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
fn attention(args: &PretrainArgs, precision: Precision, verbose: bool) -> Result<AttentionChoice> {
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

fn recompute(args: &PretrainArgs) -> Result<Recompute> {
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
