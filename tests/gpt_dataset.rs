//! Megatron's GPTDataset indices: equal to Megatron's own algorithm run with numpy
//! (`tests/fixtures/gpt_indices.json`, made by `tests/fixtures/megatron_gpt_indices.py`), and
//! samples equal to a straightforward reading of the shuffled token stream.

use std::sync::Arc;

use ferrotron::data::gpt_dataset::build_indices;
use ferrotron::data::{GptDataset, GptDatasetConfig, IndexedDataset, SampleDataset, Split};

use crate::common::*;

fn lengths(ds: &IndexedDataset) -> Vec<u32> {
    ds.sequence_lengths().map(|l| l as u32).collect()
}

fn as_i64(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

#[test]
fn indices_equal_megatrons_algorithm_with_numpy() {
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("gpt_indices.json")).unwrap())
            .unwrap();
    let ds = IndexedDataset::open(golden("wikitext2_valid", "text")).unwrap();
    let lengths = lengths(&ds);
    for case in fixture["cases"].as_array().unwrap() {
        let docs = as_i64(&case["documents"]);
        let seq = case["seq_length"].as_u64().unwrap() as usize;
        let n = case["num_samples"].as_u64().unwrap() as usize;
        let seed = case["seed"].as_u64().unwrap() as u32;
        let ours =
            build_indices(&lengths, docs[0] as usize..docs[1] as usize, seq, n, seed).unwrap();
        let doc_index: Vec<i64> = ours.document_index.iter().map(|&d| d as i64).collect();
        assert_eq!(
            doc_index,
            as_i64(&case["document_index"]),
            "document index, case {case:.60}"
        );
        let sample_index: Vec<i64> = ours.sample_index.iter().flatten().copied().collect();
        let theirs: Vec<i64> = case["sample_index"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(as_i64)
            .collect();
        assert_eq!(sample_index, theirs, "sample index");
        assert_eq!(
            ours.shuffle_index,
            as_i64(&case["shuffle_index"]),
            "shuffle index"
        );
    }
}

#[test]
fn samples_are_windows_of_the_shuffled_document_stream() {
    let data = Arc::new(IndexedDataset::open(golden("tinyshakespeare", "text")).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let config = GptDatasetConfig {
        sequence_length: 100,
        seed: 5,
        num_samples: 9000, // more than two epochs of documents 0..400
        cache_dir: Some(dir.path().to_path_buf()),
    };
    let ds = GptDataset::new(data.clone(), Split::Train, 0..400, &config).unwrap();
    // Reference: the documents in document-index order as one token stream; sample i is
    // tokens i·L .. i·L + L + 1.
    let stream: Vec<u32> = ds
        .indices()
        .document_index
        .iter()
        .flat_map(|&d| data.sequence(d as usize).to_u32_vec())
        .collect();
    let l = config.sequence_length;
    assert!(ds.len() >= config.num_samples);
    assert_eq!(ds.len(), (stream.len() - 1) / l);
    for i in 0..ds.len() {
        assert_eq!(
            ds.unshuffled_sample_tokens(i),
            stream[i * l..i * l + l + 1],
            "sample {i}"
        );
    }
    // The shuffle index is a permutation.
    let mut seen = ds.indices().shuffle_index.clone();
    seen.sort();
    assert!(seen.iter().enumerate().all(|(i, &s)| s == i as i64));
    // Every document appears once per epoch (Megatron shuffles the epochs together unless
    // the last one is separate, so epochs are not contiguous).
    let docs = &ds.indices().document_index;
    let epochs = docs.len() / 400;
    assert!(epochs >= 2 && docs.len() == epochs * 400);
    let mut counts = vec![0; 400];
    for &d in docs {
        counts[d as usize] += 1;
    }
    assert!(counts.iter().all(|&c| c == epochs));
}

#[test]
fn labels_are_shifted_inputs_and_eod_masks_loss() {
    let data = Arc::new(IndexedDataset::open(golden("tinyshakespeare", "text")).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let config = GptDatasetConfig {
        sequence_length: 2000,
        seed: 1,
        num_samples: 3,
        cache_dir: Some(dir.path().into()),
    };
    let ds = GptDataset::new(data, Split::Valid, 474..489, &config).unwrap();
    let full = ds.sample_tokens(0);
    let masks = |eod_mask_loss| ferrotron::data::SampleMasks {
        eod_mask_loss,
        ..ferrotron::data::SampleMasks::plain(50256)
    };
    let s = ds.sample(0, &masks(true));
    assert_eq!(s.tokens, full[..2000]);
    assert_eq!(s.labels, full[1..]);
    let eods = s.tokens.iter().filter(|&&t| t == 50256).count();
    assert!(eods > 0, "a 2000-token sample crosses a document boundary");
    assert_eq!(s.loss_mask.iter().filter(|&&m| m == 0.0).count(), eods);
    assert!(ds
        .sample(0, &masks(false))
        .loss_mask
        .iter()
        .all(|&m| m == 1.0));
}

#[test]
fn indices_are_cached_and_a_damaged_cache_is_rebuilt() {
    let data = Arc::new(IndexedDataset::open(golden("wikitext2_test", "text")).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let config = GptDatasetConfig {
        sequence_length: 128,
        seed: 3,
        num_samples: 500,
        cache_dir: Some(dir.path().into()),
    };
    let first = GptDataset::new(data.clone(), Split::Train, 0..60, &config).unwrap();
    let files = list_dir(dir.path());
    assert_eq!(files.len(), 4, "{files:?}");
    assert!(files
        .iter()
        .all(|f| f.starts_with("wikitext2_test_text_document-train-")));
    // A second build reads the cache (same result), and a different seed is another entry.
    let again = GptDataset::new(data.clone(), Split::Train, 0..60, &config).unwrap();
    assert_eq!(again.indices(), first.indices());
    let other = GptDatasetConfig {
        seed: 4,
        ..config.clone()
    };
    let _ = GptDataset::new(data.clone(), Split::Train, 0..60, &other).unwrap();
    assert_eq!(list_dir(dir.path()).len(), 8);
    // Damage a cached array: it is rebuilt, not trusted.
    let shuffle = files
        .iter()
        .find(|f| f.ends_with("shuffle_index.npy"))
        .unwrap();
    std::fs::write(dir.path().join(shuffle), b"garbage").unwrap();
    let rebuilt = GptDataset::new(data, Split::Train, 0..60, &config).unwrap();
    assert_eq!(rebuilt.indices(), first.indices());
}

/// `--split` cuts documents as Megatron-Core does, for every split and document count in
/// `tests/fixtures/split_indices.json` (made by `tests/fixtures/megatron_core_split.py`).
#[test]
fn splits_match_megatron_core_for_every_document_count() {
    #[derive(serde::Deserialize)]
    struct Case {
        split: String,
        documents: usize,
        ranges: Vec<Option<[usize; 2]>>,
    }
    let cases: Vec<Case> =
        serde_json::from_str(&std::fs::read_to_string(fixture("split_indices.json")).unwrap())
            .unwrap();
    assert!(cases.len() > 1000);
    for case in cases {
        let weights = ferrotron::data::split::parse_split(&case.split).unwrap();
        let got = ferrotron::data::split::split_ranges(&weights, case.documents);
        let want: Vec<Option<std::ops::Range<usize>>> =
            case.ranges.iter().map(|r| r.map(|[a, b]| a..b)).collect();
        assert_eq!(
            got.to_vec(),
            want,
            "--split {} over {} documents",
            case.split,
            case.documents
        );
    }
}

/// `--mock-data` builds Megatron-Core's `MockGPTDataset` (`tests/fixtures/megatron_mock/`,
/// made by megatron-core itself): the documents of each split under its forced 1,1,1 split,
/// the three indices bit for bit, the first samples token for token, and its index-cache
/// file names in `--data-cache-path`.
#[test]
fn mock_data_is_megatron_cores_mock_gpt_dataset() {
    use ferrotron::data::{build_datasets, DataSources, DatasetBuildConfig, MockDocuments};
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("megatron_mock/mock_gpt_dataset.json")).unwrap(),
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let vocab = fixture["vocab_size"].as_u64().unwrap() as u32;
    let eod = fixture["eod"].as_u64().unwrap() as u32;
    let sizes = as_i64(&fixture["sizes"]);
    let config = DatasetBuildConfig {
        // Ignored for mock data, as by Megatron.
        split: "969,30,1".into(),
        sequence_length: fixture["sequence_length"].as_u64().unwrap() as usize,
        seed: fixture["seed"].as_u64().unwrap() as u32,
        cache_dir: Some(cache.path().to_path_buf()),
        verbose: false,
    };
    let sources = DataSources::Mock(Arc::new(MockDocuments::new(vocab, eod)));
    let built = build_datasets(&sources, [0, 1, 2].map(|i| sizes[i] as u64), &config).unwrap();
    let files = list_dir(cache.path());
    for (dataset, name) in built.iter().zip(["train", "valid", "test"]) {
        let want = &fixture["splits"][name];
        let dataset = dataset.as_ref().unwrap();
        assert_eq!(
            dataset.len() as u64,
            want["num_samples"].as_u64().unwrap(),
            "{name}"
        );
        for (i, sample) in want["samples"].as_array().unwrap().iter().enumerate() {
            let sample: Vec<u32> = as_i64(sample).into_iter().map(|t| t as u32).collect();
            assert_eq!(dataset.sample_tokens(i), sample, "{name} sample {i}");
        }
        // The same indices through the GPT dataset itself.
        let split = [Split::Train, Split::Valid, Split::Test][["train", "valid", "test"]
            .iter()
            .position(|n| *n == name)
            .unwrap()];
        let docs = as_i64(&want["documents"]);
        let gpt = GptDataset::mock(
            Arc::new(MockDocuments::new(vocab, eod)),
            split,
            docs[0] as usize..docs[1] as usize,
            &GptDatasetConfig {
                sequence_length: config.sequence_length,
                seed: config.seed,
                num_samples: sizes[split as usize] as usize,
                cache_dir: None,
            },
        )
        .unwrap();
        let indices = gpt.indices();
        let document_index = indices.document_index.iter().flat_map(|d| d.to_le_bytes());
        assert_eq!(
            fnv1a_hex(document_index),
            want["document_index"]["fnv1a_int32"],
            "{name}"
        );
        let sample_index = indices
            .sample_index
            .iter()
            .flatten()
            .flat_map(|d| d.to_le_bytes());
        assert_eq!(
            fnv1a_hex(sample_index),
            want["sample_index"]["fnv1a_int64"],
            "{name}"
        );
        let shuffle_index = indices.shuffle_index.iter().flat_map(|d| d.to_le_bytes());
        assert_eq!(
            fnv1a_hex(shuffle_index),
            want["shuffle_index"]["fnv1a_int64"],
            "{name}"
        );
        for file in want["cache_files"].as_array().unwrap() {
            let suffix = format!("-{}", file.as_str().unwrap());
            assert!(
                files
                    .iter()
                    .any(|f| f.ends_with(&suffix) && f.len() == 16 + suffix.len()),
                "{suffix} in {files:?}"
            );
        }
    }
}
