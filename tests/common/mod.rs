//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod mpi;

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
