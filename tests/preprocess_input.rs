//! `preprocess` on unusual and invalid input: Megatron's edge cases reproduced, every bad line
//! reported with file:line, and no output (old files untouched) when a run fails.

use std::path::Path;

use ferrotron::data::IndexedDataset;

use crate::common::*;

const PREPROCESS: &str = env!("CARGO_BIN_EXE_preprocess");

fn preprocess(dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "--input",
        "in.jsonl",
        "--output-prefix",
        "out",
        "--append-eod",
        "-q",
    ];
    args.extend_from_slice(extra);
    run_tool(PREPROCESS, &args, dir)
}

fn documents(prefix: &Path) -> Vec<Vec<u32>> {
    let ds = IndexedDataset::open(prefix).unwrap();
    (0..ds.document_count())
        .map(|d| ds.document(d).unwrap().to_u32_vec())
        .collect()
}

#[test]
fn megatron_edge_cases_empty_and_whitespace_documents() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("in.jsonl"),
        "{\"text\": \"a\"}\n{\"text\": \"\"}\n{\"text\": \" \"}\n{\"text\": \"\\n\"}\n{\"text\": \"<|endoftext|>\"}",
    )
    .unwrap();
    let out = preprocess(dir.path(), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let prefix = dir.path().join("out_text_document");
    let ds = IndexedDataset::open(&prefix).unwrap();
    // The empty document adds no sequence but a boundary: document_indices repeats a value.
    assert_eq!(
        ds.document_indices().collect::<Vec<_>>(),
        [0, 1, 1, 2, 3, 4]
    );
    assert_eq!(
        documents(&prefix),
        vec![
            vec![64, 50256],
            vec![],
            vec![220, 50256],
            vec![198, 50256],
            vec![27, 91, 437, 1659, 5239, 91, 29, 50256],
        ]
    );
    // With --allow-special-tokens the literal becomes the EOD id.
    let out = preprocess(dir.path(), &["--allow-special-tokens"]);
    assert!(out.status.success());
    assert_eq!(documents(&prefix)[4], [50256, 50256]);
}

#[test]
fn bom_crlf_blank_lines_and_missing_final_newline_are_tolerated() {
    let dir = tempfile::tempdir().unwrap();
    let clean = "{\"text\": \"one\"}\n{\"text\": \"two\"}\n{\"text\": \"three\"}\n";
    std::fs::write(dir.path().join("clean.jsonl"), clean).unwrap();
    let messy =
        "\u{feff}{\"text\": \"one\"}\r\n\r\n   \n{\"text\": \"two\"}\r\n\n{\"text\": \"three\"}";
    std::fs::write(dir.path().join("in.jsonl"), messy).unwrap();
    assert!(preprocess(dir.path(), &[]).status.success());
    let out = run_tool(
        PREPROCESS,
        &["--input", "clean.jsonl", "--append-eod", "-q"],
        dir.path(),
    );
    assert!(out.status.success());
    assert!(
        read_pair(&dir.path().join("out_text_document"))
            == read_pair(&dir.path().join("clean_text_document"))
    );
    assert_eq!(documents(&dir.path().join("out_text_document")).len(), 3);
}

#[test]
fn several_inputs_and_directories_are_read_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    std::fs::write(shards.join("b.jsonl"), "{\"text\": \"second\"}\n").unwrap();
    std::fs::write(shards.join("a.jsonl"), "{\"text\": \"first\"}\n").unwrap();
    std::fs::write(dir.path().join("c.jsonl"), "{\"text\": \"third\"}\n").unwrap();
    let out = run_tool(
        PREPROCESS,
        &[
            "--input",
            "shards",
            "c.jsonl",
            "--output-prefix",
            "all",
            "-q",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let tokenizer = ferrotron::tokenizer::TextTokenizer::gpt2_embedded().unwrap();
    let docs: Vec<String> = documents(&dir.path().join("all_text_document"))
        .iter()
        .map(|d| tokenizer.decode(d).unwrap())
        .collect();
    assert_eq!(docs, ["first", "second", "third"]);
    // Several inputs and no --output-prefix: a clear error instead of a guess.
    let out = run_tool(PREPROCESS, &["--input", "shards", "c.jsonl"], dir.path());
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--output-prefix"), "{}", stderr(&out));
}

/// One bad line of each kind, with the reason the error must give.
const BAD_LINES: &[(&[u8], &str)] = &[
    (b"{\"text\": \"unterminated}", "invalid JSON"),
    (b"{\"title\": \"no text key\"}", "missing key \"text\""),
    (b"{\"text\": 42}", "is a number, expected a string"),
    (
        b"{\"text\": [\"a\", \"b\"]}",
        "is an array, expected a string",
    ),
    (
        b"[\"not\", \"an object\"]",
        "expected a JSON object per line, found an array",
    ),
    (
        b"\"just a string\"",
        "expected a JSON object per line, found a string",
    ),
    (b"{\"text\": \"bad \xff byte\"}", "invalid UTF-8"),
    (
        b"{\"text\": \"lone \\udc00 surrogate\"}",
        "escaped lone surrogate \\udc00 at column 16",
    ),
    (b"{\"text\": \"ok\"} trailing", "invalid JSON"),
];

fn file_with_bad_line(bad: &[u8]) -> Vec<u8> {
    let mut data = b"{\"text\": \"good one\"}\n{\"text\": \"good two\"}\n".to_vec();
    data.extend_from_slice(bad);
    data.extend_from_slice(b"\n{\"text\": \"good three\"}\n");
    data
}

#[test]
fn each_bad_line_stops_the_run_with_file_line_and_reason_and_writes_nothing() {
    for (bad, reason) in BAD_LINES {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("in.jsonl"), file_with_bad_line(bad)).unwrap();
        let out = preprocess(dir.path(), &[]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("in.jsonl:3:"),
            "no file:line for {:?}: {err}",
            String::from_utf8_lossy(bad)
        );
        assert!(err.contains(reason), "expected {reason:?} in: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(
            list_dir(dir.path()),
            ["in.jsonl"],
            "output or temporary files left behind"
        );
    }
}

#[test]
fn a_failed_run_leaves_existing_outputs_untouched() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("in.jsonl"), "{\"text\": \"old\"}\n").unwrap();
    assert!(preprocess(dir.path(), &[]).status.success());
    let before = read_pair(&dir.path().join("out_text_document"));
    std::fs::write(dir.path().join("in.jsonl"), file_with_bad_line(b"{oops")).unwrap();
    assert!(!preprocess(dir.path(), &[]).status.success());
    assert!(read_pair(&dir.path().join("out_text_document")) == before);
    assert_eq!(
        list_dir(dir.path()),
        ["in.jsonl", "out_text_document.bin", "out_text_document.idx"]
    );
}

#[test]
fn skip_bad_lines_skips_and_reports_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut data = Vec::new();
    let mut clean = Vec::new();
    for (i, (bad, _)) in BAD_LINES.iter().enumerate() {
        let good = format!("{{\"text\": \"document {i}\"}}\n");
        data.extend_from_slice(good.as_bytes());
        clean.extend_from_slice(good.as_bytes());
        data.extend_from_slice(bad);
        data.push(b'\n');
    }
    std::fs::write(dir.path().join("in.jsonl"), &data).unwrap();
    std::fs::write(dir.path().join("clean.jsonl"), &clean).unwrap();
    let out = preprocess(dir.path(), &["--skip-bad-lines"]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(&format!("skipped {} bad line(s)", BAD_LINES.len())),
        "{err}"
    );
    assert!(
        err.contains("in.jsonl:2:") && err.contains("in.jsonl:4:") && err.contains("in.jsonl:18:"),
        "{err}"
    );
    let out = run_tool(
        PREPROCESS,
        &["--input", "clean.jsonl", "--append-eod", "-q"],
        dir.path(),
    );
    assert!(out.status.success());
    assert!(
        read_pair(&dir.path().join("out_text_document"))
            == read_pair(&dir.path().join("clean_text_document"))
    );
}

#[test]
fn missing_input_unwritable_output_and_unsupported_flags_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("in.jsonl"), "{\"text\": \"a\"}\n").unwrap();
    std::fs::write(dir.path().join("a_file"), "").unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--input", "missing.jsonl"], "missing.jsonl"),
        (
            &["--input", "in.jsonl", "--output-prefix", "a_file/out"],
            "a_file/out_text_document.bin",
        ),
        (
            &["--input", "in.jsonl", "--output-prefix", "no_dir/out"],
            "does not exist",
        ),
        (
            &["--input", "in.jsonl", "--split-sentences"],
            "not supported",
        ),
        (&["--input", "in.jsonl", "--keep-newlines"], "not supported"),
        (
            &[
                "--input",
                "in.jsonl",
                "--tokenizer-type",
                "BertWordPieceCase",
            ],
            "not supported",
        ),
        (
            &[
                "--input",
                "in.jsonl",
                "--tokenizer-type",
                "SentencePieceTokenizer",
            ],
            "--tokenizer-model tokenizer.model",
        ),
        (
            &[
                "--input",
                "in.jsonl",
                "--tokenizer-type",
                "Llama2Tokenizer",
                "--tokenizer-model",
                "in.jsonl",
            ],
            "not a SentencePiece model",
        ),
        (
            &[
                "--input",
                "in.jsonl",
                "--tokenizer-type",
                "HuggingFaceTokenizer",
            ],
            "--tokenizer-model",
        ),
        (
            &["--input", "in.jsonl", "--vocab-file", "nope.json"],
            "nope.json",
        ),
    ];
    for (args, expected) in cases {
        let out = run_tool(PREPROCESS, args, dir.path());
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("preprocess: error:") && last.contains(expected),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    assert_eq!(list_dir(dir.path()), ["a_file", "in.jsonl"]);
}

#[test]
fn huggingface_tokenizer_json_gives_the_same_ids_as_gpt2() {
    // A tokenizer.json of the GPT-2 pipeline must reproduce the golden file through the
    // HuggingFaceTokenizer path (which calls `tokenizers` directly).
    let dir = tempfile::tempdir().unwrap();
    let vocab = ferrotron::tokenizer::Gpt2Vocabulary::embedded().unwrap();
    let mut reference = vocab.reference_tokenizer();
    reference
        .add_special_tokens(vec![tokenizers::AddedToken::from("<|endoftext|>", true)])
        .unwrap();
    reference
        .save(dir.path().join("tokenizer.json"), false)
        .unwrap();
    std::fs::copy(corpus("wikitext2_valid"), dir.path().join("in.jsonl")).unwrap();
    let out = preprocess(
        dir.path(),
        &[
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            "tokenizer.json",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        read_pair(&dir.path().join("out_text_document"))
            == read_pair(&golden("wikitext2_valid", "text"))
    );
}

#[cfg(unix)]
#[test]
fn ctrl_c_stops_the_run_and_leaves_no_output() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("in.jsonl");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let child = Command::new(PREPROCESS)
        .args([
            "--input",
            "in.jsonl",
            "--output-prefix",
            "out",
            "--chunk-size-mb",
            "0.001",
            "-q",
        ])
        .current_dir(dir.path())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let line = "{\"text\": \"some words to tokenize, again and again\"}\n".repeat(50);
    let mut writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    writer.write_all(line.as_bytes()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    std::thread::sleep(std::time::Duration::from_millis(200));
    // The run notices the request at its next chunk.
    let _ = writer.write_all(line.as_bytes());
    drop(writer);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    assert!(stderr(&out).contains("interrupted"), "{}", stderr(&out));
    assert_eq!(list_dir(dir.path()), ["in.jsonl"]);
}
