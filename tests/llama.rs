//! The Llama family: Megatron-Core's model options (rotary embeddings, RMSNorm, SwiGLU,
//! grouped-query attention, query/key norms, untied output, qkv-only biases).
//!
//! - Against HuggingFace: tiny `LlamaForCausalLM` (sharded, GQA, θ = 500000, untied), Llama 3.1
//!   (rope scaling), `MistralForCausalLM`, `Qwen2ForCausalLM` (qkv bias, tied) and
//!   `Qwen3ForCausalLM` (q/k norms, head width ≠ hidden / heads) made by
//!   `tests/fixtures/hf_tiny_llama.py`: after `import-hf`, ferrotron's loss equals HF's and
//!   greedy generation equals `generate(do_sample=False)` token for token; `export-hf` gives
//!   back the same tensors and config.
//! - Against the single process: on a Llama-style model, tensor, pipeline and data
//!   parallelism, the distributed optimizer and recomputation give its losses, on threads and
//!   under `mpirun`; a checkpoint saved at one layout continues at another.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use ferrotron::checkpoint::load_model;
use ferrotron::comm::{run_ranks, Communicator};
use ferrotron::export::hf_model::{export_hf, import_hf, write_hf_dir};
use ferrotron::inference::window_eval::mean_window_loss;
use ferrotron::inference::{generate, GenerateOptions, Sampler, SamplingConfig};
use ferrotron::model::named_parameters::named_parameters;
use ferrotron::model::{GptConfig, Normalization, PositionEmbedding, Recompute};
use ferrotron::training::pretrain::pretrain_on;
use ferrotron::training::{pretrain, LrSchedule, ParallelConfig, PretrainConfig};

use crate::common::mpi::*;
use crate::common::*;

const EOS: u32 = 249;
const HF_VOCAB: usize = 250;
const FIXTURES: [&str; 5] = [
    "hf_tiny_llama",
    "hf_tiny_llama31",
    "hf_tiny_mistral",
    "hf_tiny_qwen2",
    "hf_tiny_qwen3",
];

/// Imports fixture `name` with the `import-hf` tool and checks it against HF's greedy tokens
/// (with and without the KV cache) and mean loss.
fn check_against_huggingface(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let input = fixture(name);
    let out = run_tool(
        env!("CARGO_BIN_EXE_import-hf"),
        &["--input", input.to_str().unwrap(), "--save", "ckpt"],
        dir.path(),
    );
    assert!(out.status.success(), "{name}: {}", stderr(&out));
    let (model, checkpoint) = load_model(&dir.path().join("ckpt"), &Device::flex()).unwrap();
    assert_eq!(checkpoint.config.padded_vocab_size, 256);
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(&format!("{name}.json"))).unwrap())
            .unwrap();
    let windows: Vec<Vec<u32>> = reference["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(token_ids)
        .collect();
    let ours = mean_window_loss(&model, &windows, HF_VOCAB, 2, &Device::flex());
    let theirs = reference["mean_loss"].as_f64().unwrap();
    println!("{name}: mean loss ferrotron {ours:.6}, HuggingFace {theirs:.6}");
    assert!((ours - theirs).abs() < 1e-4, "{name}: {ours} vs {theirs}");
    for case in reference["greedy"].as_array().unwrap() {
        let prompt = token_ids(&case["prompt"]);
        for kv_cache in [true, false] {
            let options = GenerateOptions {
                max_new_tokens: 20,
                stop_token: Some(EOS),
                vocab_size: HF_VOCAB,
                kv_cache,
                no_repeat_ngram_size: 0,
            };
            let tokens = generate(
                &model,
                &prompt,
                &options,
                &mut Sampler::new(SamplingConfig::greedy()),
                &Device::flex(),
                |_| {},
            )
            .unwrap()
            .tokens;
            assert_eq!(
                tokens,
                token_ids(&case["tokens"]),
                "{name}: prompt {prompt:?}, kv cache {kv_cache}"
            );
        }
    }
}

#[test]
fn imported_llama_models_score_and_generate_as_huggingface() {
    for name in &FIXTURES[..3] {
        check_against_huggingface(name);
    }
}

#[test]
fn imported_qwen_models_score_and_generate_as_huggingface() {
    for name in &FIXTURES[3..] {
        check_against_huggingface(name);
    }
}

/// `export-hf`'s directory imports back to the same model: every parameter and the config.
/// (That transformers loads it and computes the fixture's loss and tokens is checked by
/// `tests/hf_check_exports.py` on the directories this test leaves, see docs/interop.md.)
#[test]
fn exported_llama_family_models_import_back_unchanged() {
    // Kept for `tests/hf_check_exports.py`, which loads them into transformers.
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("llama_exports");
    for name in FIXTURES {
        let first = import_hf(&fixture(name), 128).unwrap();
        let model = first.config.init(0, &Device::flex()).unwrap();
        let (model, missing) =
            ferrotron::model::named_parameters::load_named_parameters(model, &first.values);
        assert!(missing.is_empty(), "{name}: {missing:?}");
        let (config, tensors) = export_hf(&model, &first.config, HF_VOCAB, EOS).unwrap();
        // Mistral's layout is Llama's: without a sliding window it is written as Llama.
        let class = first.model_type.replace("mistral", "llama");
        assert_eq!(config["model_type"], class, "{name}");
        let out = root.join(name);
        write_hf_dir(&out, &config, &tensors).unwrap();
        let again = import_hf(&out, 128).unwrap();
        assert_eq!(again.config, first.config, "{name}");
        assert_eq!(again.values, first.values, "{name}");
        // And what the model holds is what HF's file held.
        let held: Vec<String> = named_parameters(&model)
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(held.len(), first.values.len(), "{name}");
    }
}

// ---------------------------------------------------------------------------------------
// Parallel layouts against the single process.

type Losses = Vec<(u64, f64)>;

const ITERS: u64 = 16;

/// A Llama-style model with every option that changes what ranks hold or exchange: rotary
/// embeddings (θ = 500000), RMSNorm, SwiGLU, 4 heads in 2 query groups of width 16 (≠ 32 / 4),
/// query/key norms (whole on every rank, their gradients summed over tensor-parallel ranks),
/// a qkv bias without the other biases, and an untied output layer.
fn llama_model() -> GptConfig {
    GptConfig::new(2, 32, 4, 16, 50304)
        .with_hidden_dropout(0.1)
        .with_attention_dropout(0.1)
        .with_ffn_hidden_size(Some(48))
        .with_position_embedding_type(PositionEmbedding::Rope)
        .with_rotary_base(500000.0)
        .with_normalization(Normalization::RmsNorm)
        .with_swiglu(true)
        .with_num_query_groups(Some(2))
        .with_kv_channels(Some(16))
        .with_qk_layernorm(true)
        .with_add_bias_linear(false)
        .with_add_qkv_bias(true)
        .with_untie_embeddings_and_output_weights(true)
}

/// One layout of a 4-rank world.
#[derive(Clone, Copy, Debug)]
struct Layout {
    tp: usize,
    pp: usize,
    cp: usize,
    distributed_optimizer: bool,
    recompute: Recompute,
    overlap_grad_reduce: bool,
    sequence_parallel: bool,
}

const fn layout(tp: usize, pp: usize) -> Layout {
    Layout {
        tp,
        pp,
        cp: 1,
        distributed_optimizer: false,
        recompute: Recompute::None,
        overlap_grad_reduce: false,
        sequence_parallel: false,
    }
}

const fn sequence_parallel(tp: usize, pp: usize) -> Layout {
    Layout {
        sequence_parallel: true,
        ..layout(tp, pp)
    }
}

const LAYOUTS: [Layout; 9] = [
    layout(2, 1),
    Layout {
        distributed_optimizer: true,
        ..layout(2, 1)
    },
    Layout {
        recompute: Recompute::Selective,
        overlap_grad_reduce: true,
        ..layout(1, 2)
    },
    layout(2, 2),
    Layout {
        recompute: Recompute::Uniform(1),
        ..layout(1, 1)
    },
    // Sequence parallelism: with the distributed optimizer and overlapped reduction, with
    // selective recomputation, and between pipeline stages.
    Layout {
        distributed_optimizer: true,
        overlap_grad_reduce: true,
        ..sequence_parallel(2, 1)
    },
    Layout {
        recompute: Recompute::Selective,
        ..sequence_parallel(2, 1)
    },
    sequence_parallel(2, 2),
    // Context parallelism's key exchange beside sequence parallelism's.
    Layout {
        cp: 2,
        ..sequence_parallel(2, 1)
    },
];

/// Under `mpirun`: tensor-parallel collectives with the distributed optimizer across
/// processes, pipeline point-to-point with tensor parallelism, sequence parallelism's
/// all-gathers and reduce-scatters across processes, and context parallelism's ring.
const MPI_LAYOUTS: [Layout; 4] = [LAYOUTS[1], LAYOUTS[3], LAYOUTS[7], LAYOUTS[8]];

fn config(cache: &Path, layout: Layout, train_iters: u64) -> PretrainConfig {
    let base = layout_comparison_run(cache, 2, train_iters, ITERS);
    PretrainConfig {
        // The untied output layer starts small: a higher rate makes the loss fall as fast as
        // the GPT-2 runs' within the iterations.
        schedule: LrSchedule {
            max_lr: 8e-3,
            ..base.schedule
        },
        model: llama_model().with_sequence_parallel(layout.sequence_parallel),
        recompute: layout.recompute,
        parallel: ParallelConfig {
            tensor_model_parallel_size: layout.tp,
            pipeline_model_parallel_size: layout.pp,
            context_parallel_size: layout.cp,
            use_distributed_optimizer: layout.distributed_optimizer,
            overlap_grad_reduce: layout.overlap_grad_reduce,
            ..base.parallel
        },
        ..base
    }
}

fn device() -> Device {
    Device::flex().autodiff()
}

/// The single-process run's training and validation losses, computed once per binary.
fn reference() -> &'static (Losses, Losses) {
    static REFERENCE: std::sync::OnceLock<(Losses, Losses)> = std::sync::OnceLock::new();
    REFERENCE.get_or_init(|| {
        let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("llama_reference");
        let out = pretrain(&config(&cache, layout(1, 1), ITERS), &device()).unwrap();
        (out.losses, out.validation)
    })
}

fn layout_runs(
    cache: &Path,
    layouts: &[Layout],
    world: Arc<dyn Communicator>,
) -> anyhow::Result<Vec<(Losses, Losses)>> {
    layouts
        .iter()
        .map(|&l| {
            let out = pretrain_on(&config(cache, l, ITERS), &device(), world.clone())?;
            Ok((out.losses, out.validation))
        })
        .collect()
}

fn check_layouts(layouts: &[Layout], runs: &[(Losses, Losses)], ranks: &str) {
    let reference = reference();
    assert_eq!(reference.0.len(), ITERS as usize);
    assert!(
        reference.0[ITERS as usize - 1].1 < reference.0[0].1 - 0.5,
        "loss does not fall: {:?}",
        reference.0
    );
    let mut failures = Vec::new();
    for (layout, (losses, validation)) in layouts.iter().zip(runs) {
        let worst = worst_relative(losses, &reference.0);
        let worst_valid = worst_relative(validation, &reference.1);
        println!("{ranks}, {layout:?}: worst relative difference to one process over {ITERS} iterations: training {worst:.2e}, validation {worst_valid:.2e}");
        if !(worst < 1e-5 && worst_valid < 1e-5) {
            failures.push(format!("{layout:?}: {worst} / {worst_valid}"));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

#[test]
fn llama_layouts_on_threads_reproduce_the_single_process_losses() {
    let dir = tempfile::tempdir().unwrap();
    let runs = run_ranks(4, |world| layout_runs(dir.path(), &LAYOUTS, world)).unwrap();
    check_layouts(&LAYOUTS, &runs[0], "4 threads");
}

#[test]
fn llama_layouts_under_mpirun_reproduce_the_single_process_losses() {
    if let Some(world) = mpi_rank() {
        let dir = dir_from_env();
        let runs = layout_runs(&dir.join("cache"), &MPI_LAYOUTS, world.comm()).unwrap();
        if world.rank() == 0 {
            std::fs::write(dir.join("runs.json"), serde_json::to_string(&runs).unwrap()).unwrap();
        }
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (ok, out) = mpirun(
        4,
        &[("FERROTRON_TEST_DIR", dir.path())],
        Duration::from_secs(600),
    );
    assert!(ok, "{out}");
    let runs: Vec<(Losses, Losses)> =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("runs.json")).unwrap())
            .unwrap();
    check_layouts(&MPI_LAYOUTS, &runs, "4 MPI ranks");
}

/// TP=2 × DP=2 with the distributed optimizer saves at iteration 6; TP=2 × PP=2 continues
/// from it, and so does one process: both follow the uninterrupted run.
#[test]
fn llama_checkpoints_continue_at_another_layout() {
    let save_at = 6;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let saved = dir.path().join("saved");
    let saving = PretrainConfig {
        save: Some(saved.clone()),
        exit_interval: Some(save_at),
        ..config(&cache, LAYOUTS[1], ITERS)
    };
    run_ranks(4, |world| {
        pretrain_on(&saving, &device(), world).map(|_| ())
    })
    .unwrap();
    let resuming = |l: Layout| PretrainConfig {
        load: Some(saved.clone()),
        ..config(&cache, l, ITERS)
    };
    let tp_pp = run_ranks(4, |world| {
        pretrain_on(&resuming(layout(2, 2)), &device(), world).map(|o| o.losses)
    })
    .unwrap();
    let single = pretrain(&resuming(layout(1, 1)), &device()).unwrap().losses;
    let tail = reference().0[save_at as usize..].to_vec();
    let a = worst_relative(&tp_pp[0], &tail);
    let b = worst_relative(&single, &tail);
    println!("saved at TP=2 × DP=2: resumed at TP=2 × PP=2 {a:.2e}, in one process {b:.2e}");
    assert!(a < 1e-5 && b < 1e-5, "{a} {b}");
}

/// The model flags of Megatron's Llama-3 8B examples, sizes scaled down, and a short run of
/// the wikitext2 fixture (each run adds its own position-embedding flags and `--seq-length`:
/// a repeated flag is refused).
const LLAMA3_MODEL_FLAGS: &[&str] = &[
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--ffn-hidden-size",
    "96",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--kv-channels",
    "32",
    "--max-position-embeddings",
    "64",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--norm-epsilon",
    "1e-5",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--rotary-base",
    "500000",
    "--use-rope-scaling",
    "--rotary-percent",
    "1.0",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "3e-3",
    "--train-iters",
    "3",
    "--eval-iters",
    "0",
    "--data-cache-path",
    "cache",
];

/// `pretrain` in `dir` with [`LLAMA3_MODEL_FLAGS`], then `extra` (`--seq-length 32` unless
/// `extra` names one).
fn run_llama3_flags(dir: &Path, extra: &[&str]) -> std::process::Output {
    let data = golden("wikitext2_valid", "text");
    let mut args = LLAMA3_MODEL_FLAGS.to_vec();
    args.extend_from_slice(&["--data-path", data.to_str().unwrap()]);
    if !extra.contains(&"--seq-length") {
        args.extend_from_slice(&["--seq-length", "32"]);
    }
    args.extend_from_slice(extra);
    run_tool(env!("CARGO_BIN_EXE_pretrain"), &args, dir)
}

/// The model flags of Megatron's Llama-3 8B examples, as written (sizes scaled down; the
/// legacy `--use-rotary-position-embeddings --no-position-embedding` pair of its Llama-3.1
/// script, and the `--position-embedding-type rope` of its FP8 one): `pretrain` trains the model
/// they describe, and refuses a checkpoint of another architecture in one line.
#[test]
fn megatrons_llama3_model_flags_train_that_model() {
    let dir = tempfile::tempdir().unwrap();
    let legacy_rope = [
        "--use-rotary-position-embeddings",
        "--no-position-embedding",
    ];
    let legacy = run_llama3_flags(dir.path(), &[&legacy_rope[..], &["--save", "a"]].concat());
    assert!(legacy.status.success(), "{}", stderr(&legacy));
    let one_p = ["--position-embedding-type", "rope", "--apply-layernorm-1p"];
    let current = run_llama3_flags(dir.path(), &[&one_p[..], &["--save", "b"]].concat());
    assert!(current.status.success(), "{}", stderr(&current));
    let (model, checkpoint) = load_model(&dir.path().join("a"), &Device::flex()).unwrap();
    let c = &checkpoint.config;
    assert_eq!(c.position_embedding_type, PositionEmbedding::Rope);
    assert_eq!(c.normalization, Normalization::RmsNorm);
    assert!(c.swiglu && !c.add_bias_linear && c.untie_embeddings_and_output_weights);
    assert_eq!((c.query_groups(), c.head_dim(), c.ffn_size()), (2, 32, 96));
    assert_eq!(c.rope_scaling.map(|s| s.factor), Some(8.0));
    assert!(model.position_embeddings.is_none() && model.output_layer.is_some());
    // 4 heads and 2 groups of width 32: q 128 + k 64 + v 64 columns, no bias.
    let qkv = &model.layer(0).unwrap().self_attention.query_key_value;
    assert_eq!(qkv.weight.dims(), [64, 256]);
    assert!(qkv.bias.is_none());
    let (_, loaded_1p) = load_model(&dir.path().join("b"), &Device::flex()).unwrap();
    assert!(loaded_1p.config.apply_layernorm_1p);
    // Loading one into a run of the other architecture is refused in one line.
    let refused = run_llama3_flags(dir.path(), &[&one_p[..], &["--load", "a"]].concat());
    assert_refused_saying(&refused, "the checkpoint's model is");
}

/// `--sequence-parallel` with the Llama-3 flags on two tensor-parallel ranks trains, and is
/// refused where the sequence does not split.
#[test]
fn megatrons_llama3_flags_train_sequence_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let split = [
        "--position-embedding-type",
        "rope",
        "--sequence-parallel",
        "--tensor-model-parallel-size",
        "2",
    ];
    let trained = run_llama3_flags(dir.path(), &split);
    assert!(trained.status.success(), "{}", stderr(&trained));
    let odd = run_llama3_flags(dir.path(), &[&split[..], &["--seq-length", "31"]].concat());
    assert_refused_saying(&odd, "--seq-length 31 is not divisible");
}

/// The parameter count the logs and the memory estimate use equals what the built model
/// holds, and the FLOP count is Megatron's `num_floating_point_operations` (transcribed here
/// from `megatron/training/training.py`, per token, for one of each kind of model).
#[test]
fn parameter_and_flop_counts_follow_the_architecture() {
    let models = [
        GptConfig::new(2, 32, 4, 16, 512),
        GptConfig {
            padded_vocab_size: 512,
            ..llama_model()
        },
        GptConfig {
            padded_vocab_size: 512,
            ..llama_model()
        }
        .with_normalization(Normalization::LayerNorm)
        .with_add_bias_linear(true)
        .with_position_embedding_type(PositionEmbedding::LearnedAbsolute)
        .with_untie_embeddings_and_output_weights(false),
    ];
    for config in models {
        let model = config.init(0, &Device::flex()).unwrap();
        let held: usize = named_parameters(&model)
            .iter()
            .map(|p| p.values.len())
            .sum();
        assert_eq!(config.num_parameters(), held, "{}", config.architecture());
        // Megatron's formula: 12 · s · L · h² · ((1 + G/n + s/h) · (d·n/h) + f/h · (3/2 if
        // SwiGLU) + V / (2·L·h)), over the s tokens of a sample.
        let (s, l, h) = (64.0, config.num_layers as f64, config.hidden_size as f64);
        let (n, g) = (
            config.num_attention_heads as f64,
            config.query_groups() as f64,
        );
        let d = config.head_dim() as f64;
        let f = config.ffn_size() as f64 * if config.swiglu { 1.5 } else { 1.0 };
        let v = config.padded_vocab_size as f64;
        let megatron = 12.0
            * s
            * l
            * h
            * h
            * ((1.0 + g / n + s / h) * (d * n / h) + f / h + v / (2.0 * l * h));
        let ours = config.flops_per_token(64) * s;
        assert!(
            (ours - megatron).abs() < 1e-9 * megatron,
            "{ours} vs {megatron}"
        );
    }
}

/// Under `--sequence-parallel` each of 2 tensor-parallel ranks holds half the sequence between
/// the embeddings and the output layer, whose logits cover the whole sequence again.
#[test]
fn sequence_parallel_ranks_hold_their_chunk_of_the_sequence() {
    use burn::tensor::{Int, Tensor};
    let shapes = run_ranks(2, |world| {
        let group = ferrotron::comm::Group::new(world);
        let config = llama_model().with_sequence_parallel(true);
        let model = config
            .init_parallel(0, &group, &Device::flex())
            .map_err(anyhow::Error::msg)?;
        let tokens = Tensor::<2, Int>::zeros([2, 16], &Device::flex());
        let x = model.embed(tokens.clone(), &ferrotron::model::Documents::none());
        let after = model.layer(0).unwrap().forward(x.clone());
        Ok((x.dims(), after.dims(), model.forward(tokens).dims()))
    })
    .unwrap();
    for shape in shapes {
        assert_eq!(shape, ([2, 8, 32], [2, 8, 32], [2, 16, 50304 / 2]));
    }
}

/// Megatron-LM's `examples/llama/train_llama3_8b_h100_fp8.sh` as its `torchrun` line
/// expands it (mock data, its default; the FP8 flags left out, which `pretrain` refuses with
/// their reason).
const LLAMA3_8B_SCRIPT: &[&str] = &[
    // MODEL_ARGS
    "--use-mcore-models",
    "--num-layers",
    "32",
    "--hidden-size",
    "4096",
    "--ffn-hidden-size",
    "14336",
    "--num-attention-heads",
    "32",
    "--group-query-attention",
    "--num-query-groups",
    "8",
    "--kv-channels",
    "128",
    "--seq-length",
    "8192",
    "--max-position-embeddings",
    "8192",
    "--position-embedding-type",
    "rope",
    "--rotary-base",
    "1000000",
    "--rotary-percent",
    "1.0",
    "--attention-dropout",
    "0.0",
    "--hidden-dropout",
    "0.0",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--init-method-std",
    "0.0134",
    "--attention-backend",
    "fused",
    "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    // TRAINING_ARGS
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "128",
    "--train-samples",
    "1953125000",
    "--lr-decay-samples",
    "1949218748",
    "--lr-warmup-samples",
    "3906252",
    "--lr",
    "0.00015",
    "--min-lr",
    "0.00001",
    "--decoupled-lr",
    "5.0e-4",
    "--decoupled-min-lr",
    "4.5e-5",
    "--lr-decay-style",
    "cosine",
    "--clip-grad",
    "1.0",
    "--weight-decay",
    "0.1",
    "--adam-beta1",
    "0.9",
    "--adam-beta2",
    "0.95",
    "--bf16",
    "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss",
    "--manual-gc",
    "--empty-unused-memory-level",
    "1",
    "--exit-duration-in-mins",
    "235",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    // MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size",
    "1",
    "--context-parallel-size",
    "1",
    "--sequence-parallel",
    // DATA_ARGS_LIST (mock); the script's quotes reach argparse as part of the value.
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128256",
    "--data-cache-path",
    "cache",
    "--tiktoken-pattern",
    "v2",
    "--split",
    "'99,1,0'",
    "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files",
    "--num-workers",
    "1",
    // EVAL_AND_LOGGING_ARGS
    "--log-interval",
    "1",
    "--eval-iters",
    "32",
    "--eval-interval",
    "100",
    "--save-interval",
    "1000",
    "--log-throughput",
    "--profile",
    "--profile-step-start",
    "4",
    "--profile-step-end",
    "6",
    "--ckpt-format",
    "torch_dist",
    "--distributed-timeout-minutes",
    "60",
    "--save",
    "ckpt",
    "--load",
    "ckpt",
    "--tensorboard-dir",
    "tb",
];

/// Trailing overrides that shrink [`LLAMA3_8B_SCRIPT`] to a CPU run.
const LLAMA3_8B_ON_A_CPU: &[&str] = &[
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--ffn-hidden-size",
    "96",
    "--num-attention-heads",
    "4",
    "--num-query-groups",
    "2",
    "--kv-channels",
    "16",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--vocab-size",
    "1000",
    "--train-samples",
    "12",
    "--lr-decay-samples",
    "12",
    "--lr-warmup-samples",
    "4",
    "--eval-iters",
    "1",
    "--eval-interval",
    "2",
    // ferrotron's MFU beside Megatron's throughput, against a tiny stated peak.
    "--peak-tflops",
    "0.001",
];

/// The `iteration` lines of a `pretrain` log: `count` of them, each with Megatron's fields (a
/// global batch of 4, no skipped iteration), and ferrotron's MFU the line's TFLOP/s over the
/// peak (`peak_tflops`).
fn assert_megatron_iteration_lines(stdout: &str, count: usize, peak_tflops: f64) {
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("] iteration "))
        .collect();
    assert_eq!(lines.len(), count, "{stdout}");
    for field in [
        "| consumed samples:",
        "| elapsed time per iteration (ms):",
        "| throughput per GPU (TFLOP/s/GPU):",
        "| learning rate: ",
        "| global batch size:     4 |",
        "| lm loss: ",
        "| loss scale: 1.0 |",
        "| grad norm: ",
        "| number of skipped iterations:   0 |",
    ] {
        assert!(lines.iter().all(|l| l.contains(field)), "{field}: {stdout}");
    }
    // MFU = TFLOP/s per rank over the peak (one rank: the line's TFLOP/s, 4 decimals).
    for line in &lines {
        let field = |name: &str, end: &str| -> f64 {
            let rest = &line[line.find(name).unwrap() + name.len()..];
            rest[..rest.find(end).unwrap()].trim().parse().unwrap()
        };
        let (mfu, tflops) = (field("| MFU:", "%"), field("| TFLOP/s:", "|"));
        let want = 100.0 * tflops / peak_tflops;
        // TFLOP/s is printed to 4 decimals (±0.00005), MFU to 1.
        let rounding = 100.0 * 0.00005 / peak_tflops + 0.05;
        assert!((mfu - want).abs() <= rounding, "{mfu} vs {want}: {line}");
    }
}

/// Megatron-LM's Llama 3 8B script ([`LLAMA3_8B_SCRIPT`]), flag for flag, with trailing
/// overrides that shrink it to a CPU run: it trains, every flag accepted (the ones for Megatron's own machinery named in one
/// warning), and the log lines carry Megatron's fields.
#[test]
fn megatrons_llama3_8b_script_runs_as_written_on_mock_data() {
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<&str> = LLAMA3_8B_SCRIPT
        .iter()
        .chain(LLAMA3_8B_ON_A_CPU)
        .copied()
        .collect();
    let out = run_tool(env!("CARGO_BIN_EXE_pretrain"), &args, dir.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}\n{stdout}");
    assert!(
        err.contains("--use-mcore-models --grad-reduce-in-bf16"),
        "{err}"
    );
    assert!(
        stdout.contains("--ckpt-format torch_dist: ferrotron saves its own format"),
        "{stdout}"
    );
    assert!(
        stdout.contains("setting training iterations to 3"),
        "{stdout}"
    );
    assert!(
        stdout.contains(" > no checkpoint in ckpt, starting from scratch"),
        "{stdout}"
    );
    assert!(
        stdout.contains("train split of the mock data (MockGPTDataset)"),
        "{stdout}"
    );
    assert_megatron_iteration_lines(&stdout, 3, 0.001);
    assert!(
        stdout.contains("validation loss at iteration 2"),
        "{stdout}"
    );
    assert!(dir.path().join("ckpt/iter_0000003").is_dir());
}
