//! Throughput of `preprocess` against the plain HuggingFace `tokenizers` pipeline.
//!
//! ```text
//! cargo bench --bench preprocess_throughput            # ≥ 100 MB corpus, 1 and 2 workers
//! FERROTRON_BENCH_MB=300 cargo bench --bench preprocess_throughput
//! ```
//!
//! 1. Builds a JSONL corpus of at least 100 MB (10⁸ bytes) from the test corpora (tinyshakespeare,
//!    WikiText-2 valid/test), their documents repeated in a seeded shuffled order, under
//!    `target/bench-data/` (reused when present).
//! 2. Runs the release `preprocess` binary on it with 1 and 2 workers: wall time (start-up
//!    included), MB/s of JSONL input, tokens/s and the child's peak RSS (`wait4`).
//! 3. Baseline in the same run: the plain `tokenizers` pipeline (`Tokenizer::encode`, the
//!    GPT-2 regex pre-tokenizer + BPE) on one thread over the unique corpus text, next to
//!    ferrotron's encoder on one thread over the same text with a cold memo (every word new at
//!    first sight, as on fresh data) — the honest per-core comparison.
//!
//! The repeated corpus flatters the memo (after the first pass every pre-token is a hit);
//! the cold-memo line is the lower bound on fresh text.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use ferrotron::tokenizer::{Gpt2Encoder, Gpt2Vocabulary};

const SOURCES: &[&str] = &["tinyshakespeare", "wikitext2_test", "wikitext2_valid"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn source_lines() -> Vec<String> {
    let mut lines = Vec::new();
    for name in SOURCES {
        let path = root().join(format!("tests/fixtures/corpora/{name}.jsonl"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        lines.extend(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_owned),
        );
    }
    lines
}

/// Builds (or reuses) the benchmark corpus of at least `min_bytes`.
fn build_corpus(lines: &[String], min_bytes: u64, path: &Path) -> u64 {
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.len() >= min_bytes {
            return meta.len();
        }
    }
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut order: Vec<usize> = (0..lines.len()).collect();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut written = 0u64;
    while written < min_bytes {
        // Fisher–Yates with a fixed xorshift generator: the same corpus on every machine.
        for i in (1..order.len()).rev() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            order.swap(i, (state % (i as u64 + 1)) as usize);
        }
        for &i in &order {
            out.write_all(lines[i].as_bytes()).unwrap();
            out.write_all(b"\n").unwrap();
            written += lines[i].len() as u64 + 1;
        }
    }
    out.flush().unwrap();
    written
}

/// Runs a command and returns (wall seconds, peak RSS in MiB).
fn run_measured(cmd: &mut Command) -> (f64, f64) {
    let start = Instant::now();
    let child = cmd.spawn().expect("spawn preprocess");
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: plain wait4 on our own child; `rusage` is written by the kernel.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(rc, pid, "wait4 failed");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "preprocess failed"
    );
    std::mem::forget(child);
    (secs, usage.ru_maxrss as f64 / 1024.0)
}

fn main() {
    let min_mb: u64 = std::env::var("FERROTRON_BENCH_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let data_dir = root().join("target/bench-data");
    let corpus = data_dir.join(format!("corpus_{min_mb}mb.jsonl"));
    let lines = source_lines();
    let corpus_bytes = build_corpus(&lines, min_mb * 1_000_000, &corpus);
    let exe = env!("CARGO_BIN_EXE_preprocess");
    println!(
        "corpus: {} ({:.1} MB, built from {} unique documents)",
        corpus.display(),
        corpus_bytes as f64 / 1e6,
        lines.len()
    );
    println!(
        "machine: {} logical cores",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );

    // Baseline and cold-memo encoder, in process, over the unique documents (one thread each).
    let texts: Vec<String> = lines
        .iter()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    let text_bytes: usize = texts.iter().map(String::len).sum();
    let json_bytes: usize = lines.iter().map(|l| l.len() + 1).sum();
    let vocab = std::sync::Arc::new(Gpt2Vocabulary::embedded().unwrap());
    let reference = vocab.reference_tokenizer();
    let t = Instant::now();
    let mut ref_tokens = 0usize;
    for text in &texts {
        ref_tokens += reference
            .encode(text.as_str(), false)
            .unwrap()
            .get_ids()
            .len();
    }
    let ref_secs = t.elapsed().as_secs_f64();
    let mut encoder = Gpt2Encoder::new(vocab.clone(), false);
    let t = Instant::now();
    let mut ids = Vec::new();
    for text in &texts {
        encoder.encode(text, &mut ids).unwrap();
    }
    let cold_secs = t.elapsed().as_secs_f64();
    assert_eq!(ids.len(), ref_tokens, "encoders disagree");
    let ref_mbs = json_bytes as f64 / 1e6 / ref_secs;
    let cold_mbs = json_bytes as f64 / 1e6 / cold_secs;
    println!();
    println!(
        "| 1 thread, {:.2} MB of unique JSONL ({:.2} MB text) | MB/s (JSONL) | tokens/s | ratio |",
        json_bytes as f64 / 1e6,
        text_bytes as f64 / 1e6
    );
    println!("|---|---|---|---|");
    println!(
        "| tokenizers 0.23 `Tokenizer::encode` (baseline) | {ref_mbs:.2} | {:.2}M | 1.00x |",
        ref_tokens as f64 / ref_secs / 1e6
    );
    println!(
        "| ferrotron encoder, cold memo | {cold_mbs:.2} | {:.2}M | {:.2}x |",
        ids.len() as f64 / cold_secs / 1e6,
        cold_mbs / ref_mbs
    );

    println!();
    println!("| `preprocess --append-eod`, {:.1} MB | wall s | MB/s (JSONL) | tokens/s | peak RSS MiB | vs baseline |", corpus_bytes as f64 / 1e6);
    println!("|---|---|---|---|---|---|");
    let out_prefix = data_dir.join("out");
    for workers in [1, 2] {
        let (secs, rss) = run_measured(
            Command::new(exe)
                .arg("--input")
                .arg(&corpus)
                .arg("--output-prefix")
                .arg(&out_prefix)
                .args(["--append-eod", "-q", "--workers", &workers.to_string()])
                .stderr(std::process::Stdio::null()),
        );
        let ds = ferrotron::data::IndexedDataset::open(data_dir.join("out_text_document")).unwrap();
        let mbs = corpus_bytes as f64 / 1e6 / secs;
        println!(
            "| {workers} worker(s) | {secs:.2} | {mbs:.1} | {:.2}M | {rss:.0} | {:.1}x |",
            ds.total_tokens() as f64 / secs / 1e6,
            mbs / ref_mbs
        );
    }
}
