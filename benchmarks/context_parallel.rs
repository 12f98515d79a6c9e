//! Memory per rank and speed of context parallelism against sequence length: the same
//! training run (`pretrain`, 2 layers, hidden 256, 4 heads, micro-batch 1, no dropout, the
//! bundled wikitext-2 data) at `--context-parallel-size` 1 (the baseline), 2 and 4, each
//! context-parallel rank an MPI process (`mpirun`), so that the `max RSS` rank 0 reports is
//! one rank's. Prints peak RSS per rank and tokens/s of the last of 3 iterations, each as a
//! ratio to CP = 1 at the same length, and whether the losses match CP = 1's to 1e-5.
//!
//! ```text
//! cargo bench --bench context_parallel --profile dev
//! FERROTRON_BENCH_SEQS=2048,4096,8192 FERROTRON_BENCH_CPS=1,2,4 cargo bench --bench context_parallel --profile dev
//! # the fused attention on lavapipe (its device memory is the process's)
//! FERROTRON_BENCH_FLAGS="--device wgpu-cpu --use-flash-attn --mock-data --tokenizer-type NullTokenizer --vocab-size 2047" \
//!   cargo bench --bench context_parallel --profile dev
//! ```
//!
//! On this machine's 2 cores, 4 ranks share 2 cores: tokens/s there says what the split
//! costs in work, not what 4 devices would reach.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A comma-separated list of lengths or sizes from `var`, else `default`.
fn list(var: &str, default: &str) -> Vec<usize> {
    std::env::var(var)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|s| s.trim().parse().expect("comma-separated numbers"))
        .collect()
}

fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split(name)
        .nth(1)
        .map(|rest| rest.split('|').next().unwrap().trim())
}

struct Run {
    peak_mib: f64,
    tokens_per_second: f64,
    losses: Vec<f64>,
}

fn train(seq: usize, cp: usize, cache: &Path) -> Run {
    let data = root().join("tests/fixtures/golden/wikitext2_valid_text_document");
    let seq = seq.to_string();
    let flags = [
        "--num-layers",
        "2",
        "--hidden-size",
        "256",
        "--num-attention-heads",
        "4",
        "--seq-length",
        &seq,
        "--max-position-embeddings",
        &seq,
        "--position-embedding-type",
        "rope",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--lr",
        "1e-4",
        "--train-iters",
        "3",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--context-parallel-size",
        &cp.to_string(),
    ];
    let out = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &cp.to_string(),
        ])
        .arg(env!("CARGO_BIN_EXE_pretrain"))
        .args(flags)
        .args(extra_flags())
        .args(data_flags(&data, cache))
        .output()
        .expect("run mpirun (Open MPI: .ci/packages installs it)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let peak_mib = stdout
        .lines()
        .find_map(|l| field(l, "max RSS:"))
        .and_then(|v| v.parse().ok())
        .expect("a memory report line");
    let iterations: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains(" iteration "))
        .collect();
    let tokens_per_second = field(iterations.last().expect("iterations"), "tokens/s:")
        .and_then(|v| v.parse().ok())
        .expect("tokens/s");
    let losses = iterations
        .iter()
        .filter_map(|l| field(l, "lm loss:").and_then(|v| v.parse().ok()))
        .collect();
    Run {
        peak_mib,
        tokens_per_second,
        losses,
    }
}

/// The bundled data, unless the extra flags ask for mock data (a device whose buffers cannot
/// hold a long sequence's logits over GPT-2's vocabulary trains a smaller one).
fn data_flags(data: &Path, cache: &Path) -> Vec<String> {
    if extra_flags().iter().any(|f| f == "--mock-data") {
        return vec![];
    }
    let (data, cache) = (data.display().to_string(), cache.display().to_string());
    vec![
        "--data-path".into(),
        data,
        "--data-cache-path".into(),
        cache,
    ]
}

/// `FERROTRON_BENCH_FLAGS`: more `pretrain` flags for every run (the device, the core).
fn extra_flags() -> Vec<String> {
    std::env::var("FERROTRON_BENCH_FLAGS")
        .map(|f| f.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}

fn main() {
    let cache = tempfile::tempdir().expect("temp dir");
    let seqs = list("FERROTRON_BENCH_SEQS", "2048,4096,8192");
    let cps = list("FERROTRON_BENCH_CPS", "1,2,4");
    println!(
        "context parallelism, 2 layers, hidden 256, 4 heads, RoPE, micro-batch 1, no dropout, \
         one MPI process per rank, flags {:?}; peak RSS of one rank, tokens/s of iteration 3",
        extra_flags()
    );
    println!("| seq | CP | peak RSS per rank (MiB) | vs CP=1 | tokens/s | vs CP=1 | losses |");
    println!("|---|---|---|---|---|---|---|");
    for &seq in &seqs {
        let mut baseline: Option<Run> = None;
        for &cp in &cps {
            let run = train(seq, cp, cache.path());
            let base = baseline.as_ref().unwrap_or(&run);
            let worst = run
                .losses
                .iter()
                .zip(&base.losses)
                .map(|(a, b)| ((a - b) / b).abs())
                .fold(0f64, f64::max);
            let same = if worst < 1e-5 {
                "= CP=1".to_string()
            } else {
                format!("DIFFER ({worst:.1e})")
            };
            println!(
                "| {seq} | {cp} | {:.0} | {:.2}x | {:.0} | {:.2}x | {same} |",
                run.peak_mib,
                run.peak_mib / base.peak_mib,
                run.tokens_per_second,
                run.tokens_per_second / base.tokens_per_second,
            );
            if baseline.is_none() {
                baseline = Some(run);
            }
        }
    }
}
