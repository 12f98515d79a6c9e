//! The indexed dataset library: builder → reader round trips against a naive model, merging,
//! and rejection of every kind of corrupt or truncated index.

use std::path::Path;

use ferrotron::data::index::{encode_header, HEADER_LEN};
use ferrotron::data::{merge_datasets, DType, DatasetError, IndexedDataset, IndexedDatasetBuilder};
use proptest::prelude::*;

use crate::common::*;

/// A document as the naive model sees it: its sequences.
type Doc = Vec<Vec<u32>>;

fn write(prefix: &Path, dtype: DType, docs: &[Doc]) {
    let mut builder = IndexedDatasetBuilder::new(prefix, dtype).unwrap();
    for doc in docs {
        let tokens: Vec<u32> = doc.concat();
        let lengths: Vec<usize> = doc.iter().map(|s| s.len()).collect();
        builder.add_document(&tokens, &lengths).unwrap();
    }
    builder.finish().unwrap().persist().unwrap();
}

/// The `.idx` bytes written straight from the format description, independently of the builder.
fn naive_index(dtype: DType, docs: &[Doc]) -> Vec<u8> {
    let seqs: Vec<&Vec<u32>> = docs.iter().flatten().filter(|s| !s.is_empty()).collect();
    let mut out = encode_header(dtype, seqs.len() as u64, docs.len() as u64 + 1).to_vec();
    for s in &seqs {
        out.extend_from_slice(&(s.len() as i32).to_le_bytes());
    }
    let mut pointer = 0i64;
    for s in &seqs {
        out.extend_from_slice(&pointer.to_le_bytes());
        pointer += (s.len() * dtype.itemsize()) as i64;
    }
    let mut count = 0i64;
    out.extend_from_slice(&0i64.to_le_bytes());
    for doc in docs {
        count += doc.iter().filter(|s| !s.is_empty()).count() as i64;
        out.extend_from_slice(&count.to_le_bytes());
    }
    out
}

fn docs_strategy(max_id: u32) -> impl Strategy<Value = Vec<Doc>> {
    prop::collection::vec(
        prop::collection::vec(prop::collection::vec(0..max_id, 0..20), 0..4),
        0..30,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn round_trip_matches_a_naive_model(docs in docs_strategy(65536), wide in any::<bool>()) {
        let dtype = if wide { DType::I32 } else { DType::U16 };
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("ds");
        write(&prefix, dtype, &docs);
        let (bin, idx) = read_pair(&prefix);
        prop_assert_eq!(&idx, &naive_index(dtype, &docs));
        prop_assert_eq!(bin.len(), docs.iter().flatten().flatten().count() * dtype.itemsize());

        let ds = IndexedDataset::open(&prefix).unwrap();
        prop_assert_eq!(ds.document_count(), docs.len());
        let seqs: Vec<&Vec<u32>> = docs.iter().flatten().filter(|s| !s.is_empty()).collect();
        prop_assert_eq!(ds.sequence_count(), seqs.len());
        for (i, s) in seqs.iter().enumerate() {
            prop_assert_eq!(&ds.sequence(i).to_u32_vec(), *s);
            if s.len() >= 2 {
                prop_assert_eq!(ds.sequence_range(i, 1, Some(s.len() - 2)).unwrap().to_u32_vec(), s[1..s.len() - 1].to_vec());
            }
            prop_assert!(ds.sequence_range(i, 0, Some(s.len() + 1)).is_err());
        }
        for (d, doc) in docs.iter().enumerate() {
            prop_assert_eq!(ds.document(d).unwrap().to_u32_vec(), doc.concat());
        }
        prop_assert!(ds.document(docs.len()).is_err());
    }

    #[test]
    fn merge_equals_building_the_concatenation(a in docs_strategy(50257), b in docs_strategy(50257)) {
        let dir = tempfile::tempdir().unwrap();
        write(&dir.path().join("a"), DType::U16, &a);
        write(&dir.path().join("b"), DType::U16, &b);
        write(&dir.path().join("ab"), DType::U16, &[a.clone(), b.clone()].concat());
        merge_datasets(&[dir.path().join("a"), dir.path().join("b")], &dir.path().join("merged")).unwrap();
        prop_assert!(read_pair(&dir.path().join("merged")) == read_pair(&dir.path().join("ab")));
    }
}

#[test]
fn golden_files_open_and_agree_with_their_own_arrays() {
    for name in ["tinyshakespeare", "wikitext2_test", "wikitext2_valid"] {
        let ds = IndexedDataset::open(golden(name, "text")).unwrap();
        assert_eq!(ds.dtype(), DType::U16);
        let total: usize = ds.sequence_lengths().sum();
        assert_eq!(total as u64, ds.total_tokens());
        // Every document of a GPT-2 --append-eod dataset ends in <|endoftext|>.
        for d in 0..ds.document_count() {
            let doc = ds.document(d).unwrap();
            assert_eq!(doc.get(doc.len() - 1), Some(50256));
        }
    }
}

#[test]
fn tokens_that_do_not_fit_the_dtype_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut builder = IndexedDatasetBuilder::new(dir.path().join("x"), DType::U16).unwrap();
    assert!(matches!(
        builder.add_document(&[65536], &[1]),
        Err(DatasetError::Mismatch(_))
    ));
    assert!(matches!(
        builder.add_document(&[1, 2], &[1]),
        Err(DatasetError::Mismatch(_))
    ));
    drop(builder);
    assert!(
        list_dir(dir.path()).is_empty(),
        "a dropped builder must leave no files"
    );
}

#[test]
fn merge_refuses_mixed_dtypes() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("a"), DType::U16, &[vec![vec![1]]]);
    write(&dir.path().join("b"), DType::I32, &[vec![vec![1]]]);
    let err = merge_datasets(
        &[dir.path().join("a"), dir.path().join("b")],
        &dir.path().join("m"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("different dtypes"), "{err}");
}

/// Changes the `.bin` and `.idx` bytes of a dataset.
type Corruption = dyn FnOnce(&mut Vec<u8>, &mut Vec<u8>);

/// Writes a good dataset, lets `corrupt` change its files, and returns the open error.
fn open_corrupted(corrupt: impl FnOnce(&mut Vec<u8>, &mut Vec<u8>)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("ds");
    write(
        &prefix,
        DType::U16,
        &[vec![vec![1, 2, 3]], vec![], vec![vec![4, 5], vec![6]]],
    );
    let (mut bin, mut idx) = read_pair(&prefix);
    corrupt(&mut bin, &mut idx);
    std::fs::write(ferrotron::data::data_file_path(&prefix), bin).unwrap();
    std::fs::write(ferrotron::data::index_file_path(&prefix), idx).unwrap();
    match IndexedDataset::open(&prefix) {
        Ok(_) => panic!("corrupt dataset opened"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn corrupt_and_truncated_indexes_are_clear_errors() {
    let s = 3; // sequences in the dataset above
    let cases: Vec<(&str, Box<Corruption>)> = vec![
        ("truncated", Box::new(|_, idx| idx.truncate(20))),
        ("empty file", Box::new(|_, idx| idx.clear())),
        (
            "truncated index",
            Box::new(|_, idx| idx.truncate(idx.len() - 1)),
        ),
        ("not a Megatron index", Box::new(|_, idx| idx[0] = b'X')),
        ("unsupported index version", Box::new(|_, idx| idx[9] = 2)),
        ("unknown dtype code", Box::new(|_, idx| idx[17] = 9)),
        ("not a token type", Box::new(|_, idx| idx[17] = 3)),
        ("trailing data", Box::new(|_, idx| idx.push(0))),
        (
            "negative length",
            Box::new(|_, idx| idx[HEADER_LEN + 3] = 0x80),
        ),
        ("beyond the .bin", Box::new(|_, idx| idx[HEADER_LEN] = 200)),
        (
            "expected 6",
            Box::new(move |_, idx| idx[HEADER_LEN + 4 * s + 8] = 7),
        ),
        ("but the .bin has", Box::new(|bin, _| bin.push(0))),
        ("beyond the .bin", Box::new(|bin, _| bin.truncate(4))),
        (
            "document_indices[0]",
            Box::new(move |_, idx| idx[HEADER_LEN + 12 * s] = 1),
        ),
        (
            "is not between",
            Box::new(move |_, idx| idx[HEADER_LEN + 12 * s + 8] = 9),
        ),
        ("impossible counts", Box::new(|_, idx| idx[25] = 0xff)),
    ];
    for (expected, corrupt) in cases {
        let err = open_corrupted(corrupt);
        assert!(err.contains(expected), "expected {expected:?} in {err:?}");
        assert!(err.contains("ds.idx"), "error names the file: {err}");
    }
}

#[test]
fn every_truncation_of_a_real_index_is_rejected() {
    let (bin, idx) = read_pair(&golden("multikey", "title"));
    for cut in 0..idx.len() {
        assert!(
            ferrotron::data::IndexLayout::parse(&idx[..cut], bin.len() as u64).is_err(),
            "cut at {cut}"
        );
    }
    assert!(ferrotron::data::IndexLayout::parse(&idx, bin.len() as u64).is_ok());
}
