//! Everything a rank builds before its first step: the datasets, its stage of the model
//! (from a checkpoint or from scratch), the optimizer around the main weights, and the links
//! to the neighbouring pipeline stages.

use crate::parallel::context::ContextSplit;
use std::sync::Arc;

use anyhow::{Context, Result};
use burn::module::Module;
use burn::tensor::{DType, Device};

use super::config::{BatchPlan, PretrainConfig};
use super::finalize_grads::ParamRoles;
use super::forward_backward::activation_expect;
use crate::checkpoint::open::{Checkpoint, RankRequest, ResumedRank};
use crate::checkpoint::{OptimizerState, TrainState};
use crate::data::{self, DatasetBuildConfig, SampleDataset};
use crate::logging::memory_estimate::{self, MemoryPlan};
use crate::model::{Gpt, Recompute, StageLayers};
use crate::optim::{
    GradScaler, MixedPrecisionOptimizer, Optimizer, OptimizerSetup, Precision, ReplicatedAdamW,
    ShardedAdamW,
};
use crate::parallel::state::ParallelState;
use crate::pipeline::PipelineP2p;

/// The run's datasets (the validation and test splits may be empty).
pub struct Datasets {
    /// Training samples.
    pub train: Arc<dyn SampleDataset>,
    /// Validation samples.
    pub valid: Option<Arc<dyn SampleDataset>>,
    /// Test samples.
    pub test: Option<Arc<dyn SampleDataset>>,
}

/// Builds the datasets with as many samples as the run reads of each split (Megatron's
/// `train_valid_test_num_samples`).
pub fn build_datasets(cfg: &PretrainConfig, verbose: bool) -> Result<Datasets> {
    let gbs = cfg.global_batch_size as u64;
    let eval_runs = cfg.train_iters / cfg.eval_interval.max(1) + 1;
    let samples = [
        cfg.train_samples.unwrap_or(cfg.train_iters * gbs),
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

/// One rank's model, optimizer and links, ready to train.
pub struct RankSetup {
    /// The micro-batch arithmetic at this run's data-parallel size.
    pub plan: BatchPlan,
    /// This rank's layers.
    pub stage: StageLayers,
    /// The links to the neighbouring stages (unused with one stage).
    pub p2p: PipelineP2p,
    /// The main weights, the working model, the loss scaler and Adam.
    pub optimizer: MixedPrecisionOptimizer<Gpt>,
    /// What the step treats specially.
    pub roles: ParamRoles,
    /// Where training stands (iteration, samples consumed).
    pub state: TrainState,
}

/// Sets up this rank: from the checkpoint in `--load` if there is one, else from scratch.
/// `say` prints on world rank 0.
pub fn set_up_rank(
    cfg: &PretrainConfig,
    plan: BatchPlan,
    parallel: &ParallelState,
    device: &Device,
    say: &dyn Fn(String),
) -> Result<RankSetup> {
    let stage = cfg.stage_layers(parallel.coordinates.pp)?;
    let (main, state, saved) = load_or_init(cfg, parallel, &stage, device, say)?;
    let split = ContextSplit::over(&parallel.context, cfg.parallel.cp_comm_type);
    let main = main.with_context_split(split);
    say(format!(
        " > number of parameters: {} ({} layers, hidden {}, {} heads, vocab {})",
        cfg.model.num_parameters(),
        cfg.model.num_layers,
        cfg.model.hidden_size,
        cfg.model.num_attention_heads,
        cfg.model.padded_vocab_size
    ));
    let roles = ParamRoles::of(&main, &stage, parallel.tensor.rank());
    let scaler = grad_scaler(cfg, saved.as_ref(), say);
    let inner = build_optimizer(cfg, &main, &roles, parallel, saved, device, say);
    let optimizer =
        MixedPrecisionOptimizer::new(inner, main, cfg.precision, scaler, parallel.world.clone());
    let p2p = build_p2p(cfg, parallel, &stage, say)?;
    Ok(RankSetup {
        plan,
        stage,
        p2p,
        optimizer,
        roles,
        state,
    })
}

/// This rank's stage of the fp32 model, the training state and the saved optimizer state;
/// with `--finetune`, the loaded weights alone (iteration 0, no optimizer state).
fn load_or_init(
    cfg: &PretrainConfig,
    parallel: &ParallelState,
    stage: &StageLayers,
    device: &Device,
    say: &dyn Fn(String),
) -> Result<(Gpt, TrainState, Option<OptimizerState>)> {
    let (model, state, optimizer) = load_checkpoint_or_init(cfg, parallel, stage, device, say)?;
    if cfg.finetune && cfg.load.is_some() {
        say(" > --finetune: iteration 0, optimizer and scheduler start fresh".into());
        return Ok((model, TrainState::default(), None));
    }
    if cfg.no_load_optim && cfg.load.is_some() {
        // As Megatron's: neither the optimizer nor the scheduler is loaded, so the learning
        // rate starts its schedule again while the iteration and the data continue.
        say(" > --no-load-optim: Adam's state and the learning-rate schedule start fresh".into());
        let state = TrainState {
            scheduler_steps: 0,
            ..state
        };
        return Ok((model, state, None));
    }
    Ok((model, state, optimizer))
}

/// This rank's stage of the model from `--load` (ferrotron's or Megatron's checkpoint), or
/// freshly initialized.
fn load_checkpoint_or_init(
    cfg: &PretrainConfig,
    parallel: &ParallelState,
    stage: &StageLayers,
    device: &Device,
    say: &dyn Fn(String),
) -> Result<(Gpt, TrainState, Option<OptimizerState>)> {
    let tensor = &parallel.tensor;
    if let Some(dir) = &cfg.load {
        if let Some(checkpoint) = Checkpoint::find(dir) {
            let resumed = checkpoint.resume_rank(RankRequest {
                config: &cfg.model,
                device,
                group: tensor,
                stage,
                global_batch_size: cfg.global_batch_size as u64,
                with_optimizer: !cfg.no_load_optim && !cfg.finetune,
            })?;
            say(loaded_line(&checkpoint, &resumed, cfg));
            let ResumedRank {
                model,
                info,
                optimizer,
            } = resumed;
            return Ok((model, info.state, optimizer.ok()));
        }
        say(format!(
            " > no checkpoint in {}, starting from scratch",
            dir.display()
        ));
    }
    let model = cfg
        .model
        .init_stage(cfg.seed, tensor, stage, device)
        .map_err(anyhow::Error::msg)?;
    Ok((model, TrainState::default(), None))
}

/// The log line saying what a rank resumed from `checkpoint`.
fn loaded_line(checkpoint: &Checkpoint, resumed: &ResumedRank, cfg: &PretrainConfig) -> String {
    let (dir, info) = (checkpoint.root().display(), &resumed.info);
    let format = checkpoint.format();
    if format.is_megatron() {
        let adam = match &resumed.optimizer {
            Ok(optimizer) => format!("with Adam's state after {} steps", optimizer.steps),
            Err(why) => format!(
                "model weights only, Adam's state starts fresh (as Megatron's --no-load-optim): {why}"
            ),
        };
        return format!(
            " > loaded Megatron-LM checkpoint (--ckpt-format {}) from {dir} at iteration {} ({} samples consumed): {adam}",
            format.name(),
            info.state.iteration,
            info.state.consumed_train_samples
        );
    }
    let mut line = format!(
        " > loaded checkpoint from {dir} at iteration {} (saved with tensor model parallel size {}, pipeline model parallel size {})",
        info.state.iteration,
        info.tensor_model_parallel_size,
        info.pipeline_model_parallel_size
    );
    if info.config.padded_vocab_size != cfg.model.padded_vocab_size {
        line += &format!(
            "\n > padded vocabulary {} in the checkpoint, {} here: padding rows cut or zero-filled",
            info.config.padded_vocab_size, cfg.model.padded_vocab_size
        );
    }
    line
}

/// The run's loss scaler, as Megatron's `get_megatron_optimizer` picks it (constant with
/// `--loss-scale`, dynamic with `--fp16`, none otherwise), resuming a saved state.
fn grad_scaler(
    cfg: &PretrainConfig,
    saved: Option<&OptimizerState>,
    say: &dyn Fn(String),
) -> Option<GradScaler> {
    let mut scaler = cfg.grad_scaler();
    if let (Some(scaler), Some(state)) =
        (scaler.as_mut(), saved.and_then(|o| o.grad_scaler.clone()))
    {
        scaler.load_state(state);
    }
    if cfg.precision != Precision::Fp32 {
        say(format!(
            " > mixed precision: model in {}, fp32 main weights, gradients summed in fp32; loss scale: {}",
            cfg.precision.name(),
            match &scaler {
                Some(GradScaler::Dynamic(_)) => "dynamic".to_owned(),
                Some(GradScaler::Constant(s)) => format!("constant {s}"),
                None => "none".to_owned(),
            }
        ));
    }
    scaler
}

/// Adam replicated over the data-parallel ranks, or sharded over them.
fn build_optimizer(
    cfg: &PretrainConfig,
    main: &Gpt,
    roles: &ParamRoles,
    parallel: &ParallelState,
    saved: Option<OptimizerState>,
    device: &Device,
    say: &dyn Fn(String),
) -> Box<dyn Optimizer<Gpt>> {
    let setup = OptimizerSetup {
        adam: cfg.adam.clone(),
        clip_grad: cfg.clip_grad,
        names: roles.names.clone(),
        not_counted: roles.not_counted.clone(),
        decoupled_lr: if cfg.decoupled_schedule.is_some() {
            main.embedding_and_output_weights().into_iter().collect()
        } else {
            Default::default()
        },
        count_zeros: cfg.log_options.num_zeros_in_grad,
    };
    let saved = saved.map(|s| (s.steps, s.moments));
    let inner = device.clone().inner();
    if !cfg.parallel.use_distributed_optimizer {
        // One replica on one CubeCL device: flat buffers (flat_adam's docs say why).
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if parallel.model.size() == 1
            && setup.not_counted.is_empty()
            && crate::util::device::is_cube(device)
        {
            return Box::new(crate::optim::FlatAdamW::new(setup, saved));
        }
        return Box::new(ReplicatedAdamW::new(
            setup,
            parallel.model.clone(),
            saved,
            &inner,
        ));
    }
    let sharded = ShardedAdamW::new(
        &setup,
        main,
        parallel.data_with_context.clone(),
        parallel.world.clone(),
        saved,
        &inner,
    );
    let (mine, whole) = sharded.state_elements();
    say(format!(
        " > distributed optimizer: Adam state {:.1} MB per rank ({:.1} MB unsharded, data-parallel size {})",
        mine as f64 * 4e-6,
        whole as f64 * 4e-6,
        parallel.layout.gradient_ranks()
    ));
    Box::new(sharded)
}

/// The links to the neighbouring stages (with one stage, links to nobody).
fn build_p2p(
    cfg: &PretrainConfig,
    parallel: &ParallelState,
    stage: &StageLayers,
    say: &dyn Fn(String),
) -> Result<PipelineP2p> {
    let (pp, chunks) = (parallel.layout.pp, cfg.virtual_pipeline_stages());
    if pp > 1 {
        say(format!(
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
        ));
    }
    // Under sequence parallelism stages exchange each tensor-parallel rank's sequence chunk.
    let sequence_chunks = if cfg.model.sequence_parallel {
        cfg.parallel.tensor_model_parallel_size
    } else {
        1
    };
    // A context-parallel rank holds its part of each sequence.
    let rank_tokens = cfg.seq_length / cfg.parallel.context_parallel_size.max(1);
    let expect = activation_expect(
        cfg.micro_batch_size,
        rank_tokens / sequence_chunks,
        cfg.model.hidden_size,
        DType::from(cfg.precision.dtype()),
    );
    Ok(PipelineP2p::new(&parallel.pipeline, chunks, expect)?)
}

/// Megatron's memory estimate for world rank 0 (the first stage), printed before training.
pub fn print_memory_estimate(cfg: &PretrainConfig, setup: &RankSetup, parallel: &ParallelState) {
    let (pp, chunks) = (parallel.layout.pp, cfg.virtual_pipeline_stages());
    let plan = MemoryPlan {
        model: &cfg.model,
        rank_parameters: setup.optimizer.main_weights().num_params(),
        micro_batch_size: cfg.micro_batch_size,
        // A context-parallel rank's tokens (its attention scores over the whole sequence's
        // keys, `(2C + 1)·c²`, are counted as its tokens' square: an underestimate).
        seq_length: cfg.seq_length / cfg.parallel.context_parallel_size.max(1),
        tensor_parallel: parallel.tensor.size(),
        data_parallel: parallel.layout.dp,
        distributed_optimizer: cfg.parallel.use_distributed_optimizer,
        // This rank's (world rank 0's: the first stage's) activations.
        stage: if pp > 1 {
            memory_estimate::StageMemory::pipelined(
                setup.stage.chunks[0].len(),
                pp,
                chunks,
                0,
                setup.plan.micro_batches_per_rank(),
            )
        } else {
            memory_estimate::StageMemory::whole(cfg.model.num_layers)
        },
    };
    let ranks = parallel.world.ranks_in_process();
    // A core keeping only its inputs keeps what selective recomputation keeps (where the core
    // is the op from the projection's rows, which is where it applies).
    let recompute = match cfg.recompute {
        Recompute::None if cfg.model.core_keeps_only_inputs => Recompute::Selective,
        other => other,
    };
    let lines = memory_estimate::report(
        &plan,
        cfg.precision,
        recompute,
        ranks,
        memory_estimate::available_bytes(),
    );
    for line in lines {
        println!("{line}");
    }
}
