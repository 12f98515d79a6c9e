//! Context parallelism (`--context-parallel-size`) trains the single process's model: each
//! layout below, on thread ranks, over 20 iterations with every dropout on, held by the layout
//! fuzzer's oracle (losses within 1e-5 in fp32, gradient norms, validation losses and every
//! weight's update) to the same run in one process. The fuzzer draws CP among its other
//! choices too; these are the combinations the issue names, fixed.

use ferrotron::data::DataSources;
use ferrotron::model::{GptConfig, Normalization, PositionEmbedding};
use ferrotron::optim::{AdamWConfig, LrDecayStyle, LrSchedule};
use ferrotron::parallel::context::ContextComm;
use ferrotron::training::layout_fuzz::generate::short_documents;
use ferrotron::training::layout_fuzz::FuzzCase;
use ferrotron::training::{ParallelConfig, PretrainConfig};

use crate::common::*;

const ITERS: u64 = 20;

fn device() -> burn::tensor::Device {
    burn::tensor::Device::flex().autodiff()
}

/// A two-layer Llama-style model (RoPE, RMSNorm, SwiGLU, grouped queries) or GPT-2-style
/// (learned positions, LayerNorm), at 32 tokens: chunks of 8 tokens at CP = 2, of 4 at 4.
fn model(llama: bool, tp: usize) -> GptConfig {
    let vocab = ferrotron::model::vocab::padded_vocab_size(50257, 128, tp);
    let m = GptConfig::new(2, 32, 4, 32, vocab)
        .with_hidden_dropout(0.1)
        .with_attention_dropout(0.1);
    if llama {
        m.with_position_embedding_type(PositionEmbedding::Rope)
            .with_normalization(Normalization::RmsNorm)
            .with_swiglu(true)
            .with_ffn_hidden_size(Some(48))
            .with_num_query_groups(Some(2))
            .with_add_bias_linear(false)
    } else {
        m
    }
}

/// The layout and what the run packs: `documents` trains on short packed documents with
/// per-document positions, attention and loss mask; `window` adds a sliding window.
struct Layout {
    tp: usize,
    pp: usize,
    cp: usize,
    dp: usize,
    comm: ContextComm,
    distributed_optimizer: bool,
    sequence_parallel: bool,
    documents: bool,
    window: Option<usize>,
}

const BASE: Layout = Layout {
    tp: 1,
    pp: 1,
    cp: 2,
    dp: 1,
    comm: ContextComm::P2p,
    distributed_optimizer: false,
    sequence_parallel: false,
    documents: false,
    window: None,
};

fn case(index: u64, l: &Layout, llama: bool, cache: &std::path::Path) -> FuzzCase {
    let data = golden("wikitext2_valid", "text");
    let mut model = model(llama, l.tp).with_sequence_parallel(l.sequence_parallel);
    model.window_size = l.window;
    model.reset_position_ids = l.documents;
    model.reset_attention_mask = l.documents;
    let data = if l.documents {
        short_documents(&data, cache).unwrap()
    } else {
        data
    };
    let (micro_batch_size, micro_batches) = (2, 2);
    let global_batch_size = micro_batch_size * micro_batches * l.dp;
    let config = PretrainConfig {
        seq_length: 32,
        micro_batch_size,
        global_batch_size,
        train_iters: ITERS,
        schedule: LrSchedule {
            max_lr: 4e-3,
            min_lr: 4e-4,
            decay_steps: (global_batch_size as u64 * ITERS) as f64,
            style: LrDecayStyle::Cosine,
            ..Default::default()
        },
        split: "90,10,0".into(),
        data_cache_path: Some(cache.to_path_buf()),
        log_interval: ITERS,
        eval_interval: ITERS / 2,
        eval_iters: 1,
        eod_mask_loss: l.documents,
        seed: 1234 + index,
        // The fuzzer's ε (its generator says why): updates proportional to the gradients.
        adam: AdamWConfig {
            eps: 1e-2,
            ..AdamWConfig::default()
        },
        parallel: ParallelConfig {
            tensor_model_parallel_size: l.tp,
            pipeline_model_parallel_size: l.pp,
            context_parallel_size: l.cp,
            cp_comm_type: l.comm,
            use_distributed_optimizer: l.distributed_optimizer,
            ..ParallelConfig::default()
        },
        ..PretrainConfig::new(model, DataSources::single(data))
    };
    FuzzCase {
        index,
        seed: 0,
        data_parallel: l.dp,
        config,
    }
}

fn check(layouts: &[(Layout, bool)]) {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let cases: Vec<FuzzCase> = layouts
        .iter()
        .enumerate()
        .map(|(i, (layout, llama))| case(i as u64, layout, *llama, &cache))
        .collect();
    assert_cases_reproduce_one_process(&cases, dir.path());
}

/// CP = 2 and 4 on their own, each exchange, with and without packed documents and a window.
#[test]
fn context_parallel_ranks_train_the_single_process_model() {
    check(&[
        (BASE, true),
        (
            Layout {
                cp: 4,
                comm: ContextComm::AllGather,
                documents: true,
                ..BASE
            },
            true,
        ),
        (
            Layout {
                documents: true,
                window: Some(5),
                comm: ContextComm::AllGather,
                ..BASE
            },
            false,
        ),
    ]);
}

/// CP with TP (and sequence parallelism), with PP, and with DP under the distributed
/// optimizer (which shards over data × context ranks).
#[test]
fn context_parallelism_composes_with_tensor_pipeline_and_data_parallelism() {
    check(&[
        (
            Layout {
                tp: 2,
                sequence_parallel: true,
                documents: true,
                ..BASE
            },
            true,
        ),
        (
            Layout {
                pp: 2,
                window: Some(6),
                ..BASE
            },
            false,
        ),
        (
            Layout {
                dp: 2,
                distributed_optimizer: true,
                documents: true,
                ..BASE
            },
            true,
        ),
    ]);
}

/// Context parallelism does not shard parameters, so a checkpoint saved at one CP continues
/// at any other: CP = 2 × DP = 2 with the distributed optimizer saves at iteration 6; CP = 4
/// continues from it, and so does one process, both following the uninterrupted run.
#[test]
fn checkpoints_saved_at_one_context_parallel_size_continue_at_another() {
    use ferrotron::comm::run_ranks;
    use ferrotron::training::{pretrain, pretrain_on};
    let save_at = 6;
    let dir = tempfile::tempdir().unwrap();
    let (cache, saved) = (dir.path().join("cache"), dir.path().join("saved"));
    // One global batch (and learning-rate schedule) for every layout.
    let run = |l: &Layout| {
        let config = case(0, l, true, &cache).config;
        PretrainConfig {
            global_batch_size: 4,
            eval_iters: 0,
            schedule: LrSchedule {
                decay_steps: (4 * ITERS) as f64,
                ..config.schedule.clone()
            },
            ..config
        }
    };
    let saving = Layout {
        dp: 2,
        distributed_optimizer: true,
        documents: true,
        ..BASE
    };
    let saving = PretrainConfig {
        save: Some(saved.clone()),
        exit_interval: Some(save_at),
        ..run(&saving)
    };
    run_ranks(4, |world| {
        pretrain_on(&saving, &device(), world).map(|_| ())
    })
    .unwrap();
    let whole = |cp| Layout {
        cp,
        documents: true,
        ..BASE
    };
    let uninterrupted = pretrain(&run(&whole(1)), &device()).unwrap().losses;
    let resuming = |l: &Layout| PretrainConfig {
        load: Some(saved.clone()),
        ..run(l)
    };
    let cp4 = run_ranks(4, |world| {
        pretrain_on(&resuming(&whole(4)), &device(), world).map(|o| o.losses)
    })
    .unwrap();
    let single = pretrain(&resuming(&whole(1)), &device()).unwrap().losses;
    let tail = uninterrupted[save_at as usize..].to_vec();
    let (a, b) = (
        worst_relative(&cp4[0], &tail),
        worst_relative(&single, &tail),
    );
    println!("saved at CP=2 × DP=2: resumed at CP=4 {a:.2e}, in one process {b:.2e}");
    assert_eq!(cp4[0].len(), tail.len());
    assert!(a < 1e-5 && b < 1e-5, "{a} {b}");
}

/// With `--use-flash-attn` on a CubeCL device (wgpu on lavapipe) a context-parallel rank runs
/// the fused kernels, each chunk's queries over the keys before them, and its dropouts draw on
/// the device: CP = 2 × TP = 2 with sequence parallelism, packed documents and dropout trains
/// the single process's fused-kernel model.
#[test]
fn context_parallel_ranks_run_the_fused_attention_on_a_cubecl_device() {
    if crate::common::own_process::ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::comm::run_ranks;
    use ferrotron::training::{pretrain, pretrain_on};
    let device = ferrotron::util::device::parse_device("wgpu-cpu")
        .unwrap()
        .autodiff();
    let dir = tempfile::tempdir().unwrap();
    let layout = Layout {
        tp: 2,
        sequence_parallel: true,
        documents: true,
        ..BASE
    };
    let mut config = PretrainConfig {
        train_iters: 6,
        eval_iters: 0,
        ..case(0, &layout, true, &dir.path().join("cache")).config
    };
    config.model = config.model.with_flash_attention(true);
    let single = pretrain(&config.in_one_process(), &device).unwrap().losses;
    let split = run_ranks(4, |world| {
        pretrain_on(&config, &device, world).map(|o| o.losses)
    })
    .unwrap();
    let worst = worst_relative(&split[0], &single);
    println!(
        "CP=2 × TP=2 with the fused attention on lavapipe: worst relative loss difference {worst:.2e}"
    );
    assert_eq!(split[0].len(), 6);
    assert!(worst < 1e-5, "{worst}");
}
