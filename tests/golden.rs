//! ferrotron's `preprocess` must write exactly the bytes Megatron-LM's
//! `tools/preprocess_data.py` wrote for the same corpora (`tests/fixtures/golden/`).

use std::path::PathBuf;

use ferrotron::preprocess::{self, PreprocessConfig};
use ferrotron::tokenizer::TextTokenizer;

use crate::common::*;

fn preprocess_corpus(
    name: &str,
    keys: &[&str],
    workers: usize,
    chunk_bytes: usize,
) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join(name);
    let mut config = PreprocessConfig::new(vec![corpus(name)], prefix.clone());
    config.json_keys = keys.iter().map(|k| k.to_string()).collect();
    config.append_eod = true;
    config.workers = workers;
    config.chunk_bytes = chunk_bytes;
    let tokenizer = TextTokenizer::gpt2_embedded().unwrap();
    preprocess::run(&config, &tokenizer).unwrap();
    (dir, prefix)
}

#[test]
fn every_golden_file_is_reproduced_byte_for_byte() {
    for name in ["tinyshakespeare", "wikitext2_test", "wikitext2_valid"] {
        // One worker with big chunks, and two workers with chunks of a few lines, so that
        // reordering across many chunks is exercised too.
        for (workers, chunk) in [(1, 1 << 20), (2, 4096)] {
            let (_dir, prefix) = preprocess_corpus(name, &["text"], workers, chunk);
            let ours = read_pair(&PathBuf::from(format!(
                "{}_text_document",
                prefix.display()
            )));
            let theirs = read_pair(&golden(name, "text"));
            assert!(
                ours.0 == theirs.0,
                "{name}: .bin differs from Megatron's (workers {workers})"
            );
            assert!(
                ours.1 == theirs.1,
                "{name}: .idx differs from Megatron's (workers {workers})"
            );
        }
    }
}

#[test]
fn every_json_key_is_finalized_and_matches() {
    let (_dir, prefix) = preprocess_corpus("multikey", &["text", "title"], 2, 8192);
    let title = read_pair(&PathBuf::from(format!(
        "{}_title_document",
        prefix.display()
    )));
    assert!(
        title == read_pair(&golden("multikey", "title")),
        "title dataset differs from Megatron's"
    );
    // Megatron (2024) never finalized the first key; ours must equal a run on that key alone.
    let text = read_pair(&PathBuf::from(format!(
        "{}_text_document",
        prefix.display()
    )));
    let (_dir2, alone) = preprocess_corpus("multikey", &["text"], 1, 1 << 20);
    assert!(text == read_pair(&PathBuf::from(format!("{}_text_document", alone.display()))));
    assert!(!text.0.is_empty());
}

#[test]
fn the_missions_command_works_as_written() {
    // `preprocess --input data.jsonl --append-eod` writes data_text_document.{bin,idx}.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(corpus("wikitext2_valid"), dir.path().join("data.jsonl")).unwrap();
    let out = run_tool(
        env!("CARGO_BIN_EXE_preprocess"),
        &["--input", "data.jsonl", "--append-eod"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        list_dir(dir.path()),
        [
            "data.jsonl",
            "data_text_document.bin",
            "data_text_document.idx"
        ]
    );
    assert!(
        read_pair(&dir.path().join("data_text_document"))
            == read_pair(&golden("wikitext2_valid", "text"))
    );
    assert!(
        stderr(&out).contains("Done: 60 documents"),
        "{}",
        stderr(&out)
    );
}
