//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod mpi;
pub mod own_process;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The corpora (copies of the project's shared Megatron-style JSONL files).
pub const CORPORA: &[&str] = &[
    "tinyshakespeare",
    "wikitext2_test",
    "wikitext2_valid",
    "multikey",
];

/// `tests/fixtures/...`.
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// A corpus JSONL file.
pub fn corpus(name: &str) -> PathBuf {
    fixture(&format!("corpora/{name}.jsonl"))
}

/// Megatron's own output for a corpus and key (prefix without extension).
pub fn golden(name: &str, key: &str) -> PathBuf {
    fixture(&format!("golden/{name}_{key}_document"))
}

/// Reads both files of a dataset prefix.
pub fn read_pair(prefix: &Path) -> (Vec<u8>, Vec<u8>) {
    let bin = std::fs::read(ferrotron::data::data_file_path(prefix)).expect("read .bin");
    let idx = std::fs::read(ferrotron::data::index_file_path(prefix)).expect("read .idx");
    (bin, idx)
}

/// Runs one of the project's binaries.
pub fn run_tool(exe: &str, args: &[&str], cwd: &Path) -> Output {
    Command::new(exe)
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("spawn tool")
}

/// Stderr of a finished command, as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A run that failed, saying `message` on stderr, without a panic.
pub fn assert_refused_saying(out: &Output, message: &str) {
    let err = stderr(out);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(message) && !err.contains("panicked"), "{err}");
}

/// The `(iteration, lm loss as printed)` of each iteration line of a `pretrain` log.
pub fn logged_losses(stdout: &str) -> Vec<(u64, String)> {
    stdout
        .lines()
        .filter_map(|l| {
            let it = l
                .split(" iteration ")
                .nth(1)?
                .split('/')
                .next()?
                .trim()
                .parse()
                .ok()?;
            let loss = l.split("lm loss: ").nth(1)?.split(' ').next()?;
            Some((it, loss.to_owned()))
        })
        .collect()
}

/// Names of the files in a directory, sorted.
pub fn list_dir(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The largest relative difference between two loss curves over the same iterations.
pub fn worst_relative(a: &[(u64, f64)], b: &[(u64, f64)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((ia, la), (ib, lb))| {
            assert_eq!(ia, ib);
            (la - lb).abs() / lb.abs()
        })
        .fold(0.0, f64::max)
}

/// The run the multi-rank tests compare parallel layouts on: a tiny GPT of `layers` layers
/// (hidden 32, 4 heads, 16 positions, vocabulary 50304, which divides by 2 and 4 so every
/// TP size pads alike), hidden and attention dropout 0.1 (every layout draws the same
/// masks), global batch 8 of 1-sample micro-batches, a cosine schedule over `decay_iters`,
/// validation every 15 iterations, small DDP buckets (several all-reduces per step), on
/// wikitext-2 with its index cache in `cache`. Layouts are set with struct update syntax.
pub fn layout_comparison_run(
    cache: &Path,
    layers: usize,
    train_iters: u64,
    decay_iters: u64,
) -> ferrotron::training::PretrainConfig {
    use ferrotron::data::DataSources;
    use ferrotron::model::GptConfig;
    use ferrotron::training::{LrDecayStyle, LrSchedule, ParallelConfig, PretrainConfig};
    PretrainConfig {
        seq_length: 16,
        global_batch_size: 8,
        train_iters,
        schedule: LrSchedule {
            max_lr: 2e-3,
            min_lr: 1e-4,
            warmup_steps: 32.0,
            decay_steps: decay_iters as f64 * 8.0,
            style: LrDecayStyle::Cosine,
            ..Default::default()
        },
        split: "95,5,0".into(),
        data_cache_path: Some(cache.to_path_buf()),
        log_interval: 10,
        eval_interval: 15,
        eval_iters: 1,
        parallel: ParallelConfig {
            ddp_bucket_size: 20_000,
            ..ParallelConfig::default()
        },
        ..PretrainConfig::new(
            GptConfig::new(layers, 32, 4, 16, 50304)
                .with_hidden_dropout(0.1)
                .with_attention_dropout(0.1),
            DataSources::single(golden("wikitext2_valid", "text")),
        )
    }
}

/// Megatron's partition dimension of each GPT parameter by its name, transcribed from its
/// `tensor_parallel/layers.py` (column-parallel layers split their output: the weight's
/// dimension 1 as ferrotron stores it `[in, out]`, and the bias; row-parallel layers their
/// input rows; the vocab-parallel embedding its rows; everything else is whole): the
/// independent reference for the holdings the layers declare.
#[allow(dead_code)]
pub fn megatron_partition_dim(name: &str) -> Option<usize> {
    const COLUMN: [&str; 2] = [".self_attention.query_key_value.", ".mlp.dense_h_to_4h."];
    const ROW: [&str; 2] = [".self_attention.dense.weight", ".mlp.dense_4h_to_h.weight"];
    if name == "word_embeddings.weight" {
        Some(0)
    } else if COLUMN.iter().any(|c| name.contains(c)) {
        Some(if name.ends_with(".weight") { 1 } else { 0 })
    } else if ROW.iter().any(|r| name.ends_with(r)) {
        Some(0)
    } else {
        None
    }
}

/// Token ids from a JSON array (the HuggingFace fixtures' prompts, continuations, windows).
#[allow(dead_code)]
pub fn token_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// FNV-1a, 64 bits, of `bytes`, as 16 hex digits (how the fixture scripts hash numpy arrays
/// and id lists, as little-endian bytes).
pub fn fnv1a_hex(bytes: impl IntoIterator<Item = u8>) -> String {
    let h = bytes.into_iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// Holds each of `cases` (on thread ranks, run under `dir`) to its single-process run with the
/// layout fuzzer's oracle, printing each verdict; panics naming every case that differs.
pub fn assert_cases_reproduce_one_process(
    cases: &[ferrotron::training::layout_fuzz::FuzzCase],
    dir: &Path,
) {
    use ferrotron::training::layout_fuzz::{case_dir, check_case, Ranks, References};
    let mut references = References::default();
    let mut differ = Vec::new();
    for case in cases {
        let case_dir = case_dir(dir, case.index).unwrap();
        let verdict = check_case(case, &Ranks::Threads, &case_dir, &mut references)
            .unwrap()
            .expect("thread ranks compare in this process");
        println!("{verdict}");
        if !verdict.passed() {
            differ.push(verdict.to_string());
        }
    }
    assert!(differ.is_empty(), "{differ:#?}");
}
