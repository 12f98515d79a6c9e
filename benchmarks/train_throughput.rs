//! Training throughput of ferrotron against PyTorch eager on the same machine, same run.
//!
//! ```text
//! python3 -m venv venv && venv/bin/pip install torch        # once, for the baseline
//! FERROTRON_TORCH_PYTHON=venv/bin/python cargo bench --bench train_throughput
//! ```
//!
//! Config (the issue's): 4 layers, hidden 256, 4 heads, seq 256, batch 8, padded vocabulary
//! 50304, dropout 0.1, AdamW, fp32, CPU. Two models: GPT-2's architecture, and a Llama-style
//! one of the same size (rotary embeddings, RMSNorm, SwiGLU of width 640, 2 key/value groups,
//! no biases, untied output layer) against the same architecture in PyTorch. Reports tokens/s
//! of both sides (ratio ≥ 1 is the goal), and achieved GFLOP/s next to a plain 1024³ matmul
//! on each side. `FERROTRON_BENCH_VOCAB=512` shrinks ferrotron's vocabulary to time the
//! transformer alone.

use std::process::Command;
use std::time::Instant;

use burn::tensor::{Device, Distribution, Int, Tensor};
use ferrotron::model::{lm_loss, GptConfig, Normalization, PositionEmbedding};
use ferrotron::training::{AdamW, AdamWConfig, GradientAccumulator};

#[global_allocator]
static ALLOCATOR: ferrotron::util::allocator::TrainingAllocator =
    ferrotron::util::allocator::TrainingAllocator;

const LAYERS: usize = 4;
const HIDDEN: usize = 256;
const HEADS: usize = 4;
const SEQ: usize = 256;
const BATCH: usize = 8;
const STEPS: usize = 10;
/// The Llama-style row's key/value groups and SwiGLU width (Megatron's default for hidden
/// 256: ⌊8·256/3 / 64⌋ · 64).
const GROUPS: usize = 2;
const SWIGLU_FFN: usize = 640;

/// The Llama-style model of the second row.
fn llama_style(vocab: usize) -> GptConfig {
    GptConfig::new(LAYERS, HIDDEN, HEADS, SEQ, vocab)
        .with_position_embedding_type(PositionEmbedding::Rope)
        .with_normalization(Normalization::RmsNorm)
        .with_swiglu(true)
        .with_ffn_hidden_size(Some(SWIGLU_FFN))
        .with_num_query_groups(Some(GROUPS))
        .with_add_bias_linear(false)
        .with_untie_embeddings_and_output_weights(true)
}

fn ferrotron_tokens_per_second(config: &GptConfig) -> f64 {
    let device = Device::flex().autodiff();
    device.seed(0);
    let mut model = config.init(0, &device).expect("valid config");
    let mut optimizer = AdamW::new(AdamWConfig::default());
    let data = Tensor::<2, Int>::random(
        [BATCH, SEQ + 1],
        Distribution::Uniform(0.0, (config.padded_vocab_size.min(50257)) as f64),
        &device,
    );
    let tokens = data.clone().narrow(1, 0, SEQ);
    let labels = data.narrow(1, 1, SEQ);
    let mask = Tensor::<2>::ones([BATCH, SEQ], &device);
    let mut step = |model: ferrotron::model::Gpt| {
        let loss = lm_loss(model.forward(tokens.clone()), labels.clone(), mask.clone());
        let mut grads = GradientAccumulator::default();
        grads.add(&model, loss.backward());
        grads.clip_global_norm(1.0);
        optimizer.step(model, &grads, 1e-4)
    };
    for _ in 0..2 {
        model = step(model);
    }
    let start = Instant::now();
    for _ in 0..STEPS {
        model = step(model);
    }
    let _ = model;
    (STEPS * BATCH * SEQ) as f64 / start.elapsed().as_secs_f64()
}

fn burn_gemm_gflops() -> f64 {
    let device = Device::flex();
    let a = Tensor::<2>::random([1024, 1024], Distribution::Normal(0.0, 1.0), &device);
    let b = Tensor::<2>::random([1024, 1024], Distribution::Normal(0.0, 1.0), &device);
    let _ = a.clone().matmul(b.clone()).into_data();
    let start = Instant::now();
    for _ in 0..10 {
        let _ = a.clone().matmul(b.clone()).into_data();
    }
    10.0 * 2.0 * 1024f64.powi(3) / start.elapsed().as_secs_f64() / 1e9
}

fn main() {
    ferrotron::util::allocator::retain_freed_memory();
    let vocab = std::env::var("FERROTRON_BENCH_VOCAB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50304);
    let gemm = burn_gemm_gflops();
    println!("config: {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, batch {BATCH}, vocab 50304, fp32, CPU");
    let gpt2 = GptConfig::new(LAYERS, HIDDEN, HEADS, SEQ, vocab);
    compare("GPT-2 architecture", &gpt2, &[], gemm);
    let llama = [
        "llama".to_owned(),
        GROUPS.to_string(),
        SWIGLU_FFN.to_string(),
    ];
    compare(
        "Llama-style (rotary, RMSNorm, SwiGLU, 2 query groups, untied)",
        &llama_style(vocab),
        &llama,
        gemm,
    );
}

/// One model's table: ferrotron's tokens/s and PyTorch's (`torch_gpt.py` with `extra`
/// arguments), and their ratio.
fn compare(title: &str, config: &GptConfig, extra: &[String], gemm: f64) {
    let flops = config.flops_per_token(SEQ);
    let ours = ferrotron_tokens_per_second(config);
    println!("\n{title}:\n");
    println!("| | tokens/s | model GFLOP/s | 1024³ gemm GFLOP/s | share of gemm |");
    println!("|---|---|---|---|---|");
    println!(
        "| ferrotron (burn Flex) | {ours:.0} | {:.1} | {gemm:.1} | {:.0}% |",
        ours * flops / 1e9,
        100.0 * ours * flops / 1e9 / gemm
    );
    let python = std::env::var("FERROTRON_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benchmarks/torch_gpt.py");
    let mut args: Vec<String> = [LAYERS, HIDDEN, HEADS, SEQ, BATCH, STEPS]
        .map(|v| v.to_string())
        .to_vec();
    args.extend_from_slice(extra);
    // PyTorch as installed, and PyTorch with glibc's malloc told to keep freed memory (the
    // same favour `ferrotron::util::allocator` does mimalloc): no mmap'd blocks, no trimming.
    let variants: [(&str, &[(&str, &str)]); 2] = [
        ("PyTorch eager", &[]),
        (
            "PyTorch eager, malloc keeps memory",
            &[
                ("MALLOC_MMAP_MAX_", "0"),
                ("MALLOC_TRIM_THRESHOLD_", "1000000000000"),
                ("MALLOC_TOP_PAD_", "1000000000"),
            ],
        ),
    ];
    let mut ratios = Vec::new();
    for (name, env) in variants {
        let run = Command::new(&python)
            .arg(script)
            .args(&args)
            .envs(env.iter().copied())
            .output();
        let Ok(out) = run.as_ref() else { break };
        if !out.status.success() {
            break;
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let value = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or(f64::NAN)
        };
        let theirs = value("tokens/s:");
        let their_gemm = value("gemm GFLOP/s:");
        println!(
            "| {name} | {theirs:.0} | {:.1} | {their_gemm:.1} | {:.0}% |",
            theirs * flops / 1e9,
            100.0 * theirs * flops / 1e9 / their_gemm
        );
        ratios.push((name, ours / theirs));
    }
    if ratios.is_empty() {
        println!("\n(PyTorch baseline skipped: set FERROTRON_TORCH_PYTHON to a python with torch installed)");
    }
    for (name, ratio) in ratios {
        println!("\n{title}: ferrotron / {name} tokens/s ratio: {ratio:.2}x");
    }
}
