//! Peak memory and speed of training in fp32 keeping every activation (the baseline) against
//! mixed precision (bf16, fp16) and activation recomputation, the same model and data, each
//! run a separate `pretrain` process; then two tensor-parallel ranks (threads of one process)
//! without and with `--sequence-parallel`.
//!
//! ```text
//! cargo bench --bench training_memory
//! ```
//!
//! Model: 8 layers, hidden 256, 4 heads, seq 512, micro-batch 4, dropout 0.1, padded GPT-2
//! vocabulary, on the CPU, 4 iterations on the bundled wikitext-2 validation data. Prints
//! peak RSS (the `pretrain` memory report) beside the estimate `pretrain` printed before
//! training, tokens/s of the last iteration, and whether the losses equal those of the run
//! without recomputation in the same precision (recomputation must not change them).

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Run {
    peak_mib: f64,
    estimate_mib: f64,
    tokens_per_second: f64,
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
    let tokens_per_second = field(iterations.last().unwrap(), "tokens/s:")
        .and_then(|v| v.parse().ok())
        .unwrap();
    let estimate_mib = stdout
        .lines()
        .find_map(|l| l.split("total=").nth(1))
        .and_then(|v| v.trim_end_matches(" MB").parse().ok())
        .expect("a memory estimate line");
    let losses = iterations
        .iter()
        .filter_map(|l| field(l, "lm loss:").map(str::to_owned))
        .collect();
    Run {
        peak_mib,
        estimate_mib,
        tokens_per_second,
        losses,
    }
}

fn main() {
    let cache = tempfile::tempdir().expect("temp dir");
    // Build the dataset cache first, so no run pays for it.
    let _ = train(1, &[], cache.path());
    let recompute = [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ];
    // fp16 starts its dynamic loss scale at 2^12 here, not Megatron's 2^32, so that the four
    // iterations update the weights instead of backing the scale off.
    let fp16 = ["--fp16", "--initial-loss-scale", "4096"];
    // Two tensor-parallel ranks in one process: the peak is both ranks' together.
    let tp2 = ["--tensor-model-parallel-size", "2"];
    let runs: Vec<(&str, Vec<&str>, Option<&str>)> = vec![
        ("fp32 (baseline)", vec![], None),
        (
            "fp32, recompute full uniform 1",
            recompute.to_vec(),
            Some("fp32 (baseline)"),
        ),
        (
            "fp32, recompute full uniform 4",
            {
                let mut r = recompute.to_vec();
                r[5] = "4";
                r
            },
            Some("fp32 (baseline)"),
        ),
        (
            "fp32, recompute full block 4",
            vec![
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                "4",
            ],
            Some("fp32 (baseline)"),
        ),
        (
            "fp32, recompute selective",
            vec!["--recompute-granularity", "selective"],
            Some("fp32 (baseline)"),
        ),
        ("bf16", vec!["--bf16"], None),
        (
            "bf16, recompute full uniform 1",
            [&["--bf16"][..], &recompute].concat(),
            Some("bf16"),
        ),
        ("fp16", fp16.to_vec(), None),
        (
            "fp16, recompute full uniform 1",
            [&fp16[..], &recompute].concat(),
            Some("fp16"),
        ),
        ("fp32, TP=2 (2 threads)", tp2.to_vec(), None),
        (
            "fp32, TP=2, sequence parallel",
            [&tp2[..], &["--sequence-parallel"]].concat(),
            Some("fp32, TP=2 (2 threads)"),
        ),
    ];
    println!("training memory and speed, 8 layers, hidden 256, seq 512, micro-batch 4, CPU:");
    let mut done: Vec<(&str, Run)> = vec![];
    for (name, flags, same_losses_as) in runs {
        let run = train(4, &flags, cache.path());
        let base = done.first().map_or(&run, |(_, r)| r);
        let losses = match same_losses_as {
            Some(name) => {
                let (_, kept) = done.iter().find(|(n, _)| *n == name).expect("run before");
                if run.losses == kept.losses {
                    format!("losses equal those of \"{name}\"")
                } else {
                    format!("losses DIFFER from those of \"{name}\"")
                }
            }
            None => String::new(),
        };
        println!(
            "  {name:32}: peak RSS {:6.0} MiB ({:.2}x; estimate {:6.0} MiB), {:6.0} tokens/s ({:.2}x) {losses}",
            run.peak_mib,
            run.peak_mib / base.peak_mib,
            run.estimate_mib,
            run.tokens_per_second,
            run.tokens_per_second / base.tokens_per_second,
        );
        done.push((name, run));
    }
}
