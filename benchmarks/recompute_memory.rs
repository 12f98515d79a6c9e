//! Peak memory and speed of training with activation recomputation against keeping every
//! activation (the baseline), the same model and data, each run a separate `pretrain` process.
//!
//! ```text
//! cargo bench --bench recompute_memory
//! ```
//!
//! Model: 8 layers, hidden 256, 4 heads, seq 512, micro-batch 4, dropout 0.1, padded GPT-2
//! vocabulary, fp32 on the CPU, 4 iterations on the bundled wikitext-2 validation data. Prints
//! peak RSS (the `pretrain` memory report), the last iteration's time, and whether the losses
//! equal the baseline's.

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Run {
    peak_mib: f64,
    ms_per_iteration: f64,
    losses: Vec<String>,
}

fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split(name)
        .nth(1)
        .map(|rest| rest.split('|').next().unwrap().trim())
}

fn train(iterations: u32, extra: &[&str], cache: &std::path::Path) -> Run {
    let data = root().join("tests/fixtures/golden/wikitext2_valid_text_document");
    let mut args: Vec<String> = [
        "--num-layers",
        "8",
        "--hidden-size",
        "256",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "512",
        "--max-position-embeddings",
        "512",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "4",
        "--lr",
        "1e-4",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--train-iters".into(), iterations.to_string()]);
    args.extend(["--data-path".into(), data.display().to_string()]);
    args.extend(["--data-cache-path".into(), cache.display().to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args(&args)
        .output()
        .expect("run pretrain");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
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
    let ms_per_iteration = field(
        iterations.last().unwrap(),
        "elapsed time per iteration (ms):",
    )
    .and_then(|v| v.parse().ok())
    .unwrap();
    let losses = iterations
        .iter()
        .filter_map(|l| field(l, "lm loss:").map(str::to_owned))
        .collect();
    Run {
        peak_mib,
        ms_per_iteration,
        losses,
    }
}

fn main() {
    let cache = tempfile::tempdir().expect("temp dir");
    // Build the dataset cache first, so no run pays for it.
    let _ = train(1, &[], cache.path());
    let baseline = train(4, &[], cache.path());
    println!("training memory, 8 layers, hidden 256, seq 512, micro-batch 4, CPU fp32:");
    println!(
        "  keep all activations (baseline): peak RSS {:7.0} MiB, {:7.0} ms/iteration",
        baseline.peak_mib, baseline.ms_per_iteration
    );
    for (name, flags) in [
        (
            "full, uniform, 1 layer",
            [
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
        ),
        (
            "full, uniform, 4 layers",
            [
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "4",
            ],
        ),
        (
            "full, block, 4 layers",
            ["--recompute-method", "block", "--recompute-num-layers", "4"],
        ),
    ] {
        let mut args = vec!["--recompute-granularity", "full"];
        args.extend(flags);
        let run = train(4, &args, cache.path());
        println!(
            "  recompute {name:24}: peak RSS {:7.0} MiB ({:.2}x), {:7.0} ms/iteration ({:.2}x), losses {}",
            run.peak_mib,
            run.peak_mib / baseline.peak_mib,
            run.ms_per_iteration,
            run.ms_per_iteration / baseline.ms_per_iteration,
            if run.losses == baseline.losses { "equal" } else { "DIFFER" }
        );
    }
}
