//! `idx-dump` and `merge-datasets` from the command line.

use ferrotron::data::IndexedDataset;

use crate::common::*;

const IDX_DUMP: &str = env!("CARGO_BIN_EXE_idx-dump");
const MERGE: &str = env!("CARGO_BIN_EXE_merge-datasets");

fn here() -> std::path::PathBuf {
    std::env::current_dir().unwrap()
}

#[test]
fn idx_dump_json_reports_what_an_independent_reading_finds() {
    let prefix = golden("tinyshakespeare", "text");
    let out = run_tool(IDX_DUMP, &[prefix.to_str().unwrap(), "--json"], &here());
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Independent reading of the raw bytes, following the format description.
    let (bin, idx) = read_pair(&prefix);
    let s = u64::from_le_bytes(idx[18..26].try_into().unwrap()) as usize;
    let lengths: Vec<i64> = (0..s)
        .map(|i| i32::from_le_bytes(idx[34 + 4 * i..38 + 4 * i].try_into().unwrap()) as i64)
        .collect();
    let mut sorted = lengths.clone();
    sorted.sort();
    assert_eq!(report["dtype"], "uint16");
    assert_eq!(report["sequences"], s);
    assert_eq!(report["documents"], 489);
    assert_eq!(report["total_tokens"], bin.len() / 2);
    assert_eq!(report["sequence_length"]["min"], sorted[0]);
    assert_eq!(report["sequence_length"]["max"], sorted[s - 1]);
    assert_eq!(report["sequence_length"]["median"], sorted[(s - 1) / 2]);
    let mean = lengths.iter().sum::<i64>() as f64 / s as f64;
    assert!((report["sequence_length"]["mean"].as_f64().unwrap() - mean).abs() < 1e-9);
    assert_eq!(report["eod_tokens"], 489);
    assert_eq!(report["consistent"], true);
}

#[test]
fn idx_dump_decodes_a_document_back_to_its_text() {
    // Megatron never finalized the multikey text dataset, so make ours and decode from it.
    let line = std::fs::read_to_string(corpus("multikey"))
        .unwrap()
        .lines()
        .nth(4)
        .unwrap()
        .to_owned();
    let expected: serde_json::Value = serde_json::from_str(&line).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let made = run_tool(
        env!("CARGO_BIN_EXE_preprocess"),
        &[
            "--input",
            corpus("multikey").to_str().unwrap(),
            "--output-prefix",
            "m",
            "--append-eod",
            "-q",
        ],
        dir.path(),
    );
    assert!(made.status.success(), "{}", stderr(&made));
    let out = run_tool(
        IDX_DUMP,
        &["m_text_document", "--doc", "4", "--json", "--ids"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = expected["text"].as_str().unwrap();
    assert_eq!(
        report["text"].as_str().unwrap(),
        format!("{text}<|endoftext|>")
    );
    let ids = report["ids"].as_array().unwrap();
    assert_eq!(ids.last().unwrap(), 50256);
    assert_eq!(report["tokens"], ids.len());
    // Plain --ids prints the same ids, space-separated.
    let out = run_tool(
        IDX_DUMP,
        &["m_text_document.bin", "--doc", "4", "--ids"],
        dir.path(),
    );
    let plain: Vec<u64> = String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(plain.len(), ids.len());
}

#[test]
fn idx_dump_rejects_corrupt_files_and_bad_requests() {
    let dir = tempfile::tempdir().unwrap();
    let (bin, idx) = read_pair(&golden("wikitext2_valid", "text"));
    std::fs::write(dir.path().join("t.bin"), &bin).unwrap();
    std::fs::write(dir.path().join("t.idx"), &idx[..idx.len() / 2]).unwrap();
    std::fs::write(dir.path().join("u.bin"), &bin[..bin.len() - 2]).unwrap();
    std::fs::write(dir.path().join("u.idx"), &idx).unwrap();
    std::fs::write(dir.path().join("v.bin"), &bin).unwrap();
    std::fs::write(dir.path().join("v.idx"), &idx).unwrap();
    for (args, expected) in [
        (vec!["t"], "truncated index"),
        (vec!["u"], "beyond the .bin"),
        (vec!["missing"], "missing.idx"),
        (vec!["v", "--doc", "60"], "document 60 does not exist"),
    ] {
        let out = run_tool(IDX_DUMP, &args, dir.path());
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.starts_with("idx-dump: error:") && err.contains(expected),
            "{err}"
        );
    }
}

#[test]
fn merge_datasets_concatenates_a_directory_in_name_order() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    for (i, name) in ["wikitext2_valid", "tinyshakespeare", "wikitext2_test"]
        .iter()
        .enumerate()
    {
        let (bin, idx) = read_pair(&golden(name, "text"));
        std::fs::write(shards.join(format!("{i}_{name}.bin")), bin).unwrap();
        std::fs::write(shards.join(format!("{i}_{name}.idx")), idx).unwrap();
    }
    let out = run_tool(
        MERGE,
        &["--input", "shards", "--output-prefix", "merged"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let merged = IndexedDataset::open(dir.path().join("merged")).unwrap();
    let parts: Vec<IndexedDataset> = ["wikitext2_valid", "tinyshakespeare", "wikitext2_test"]
        .iter()
        .map(|n| IndexedDataset::open(golden(n, "text")).unwrap())
        .collect();
    assert_eq!(
        merged.document_count(),
        parts.iter().map(|p| p.document_count()).sum::<usize>()
    );
    let mut d = 0;
    for part in &parts {
        for k in 0..part.document_count() {
            assert_eq!(merged.document(d).unwrap(), part.document(k).unwrap());
            d += 1;
        }
    }
    // The merged .bin is the concatenation of the parts' .bin files.
    let bins: Vec<u8> = ["wikitext2_valid", "tinyshakespeare", "wikitext2_test"]
        .iter()
        .flat_map(|n| read_pair(&golden(n, "text")).0)
        .collect();
    assert!(read_pair(&dir.path().join("merged")).0 == bins);
}
