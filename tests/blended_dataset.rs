//! Dataset blending equal to Megatron-Core's: for weighted blends (`0.3 A 0.7 B`,
//! `1 A 2 B 1 C`), an unweighted multi-dataset `--data-path` and per-split data paths, the
//! blend's length and its first samples' (dataset, sample) pairs and tokens equal those of
//! Megatron-Core's algorithm run with numpy (`tests/fixtures/blend_samples.json`, made by
//! `tests/fixtures/megatron_blend.py`); the cached indices are Megatron-named `.npy` files
//! reused on the next build.

use ferrotron::data::{build_datasets, Blend, DataSources, DatasetBuildConfig};

use crate::common::*;

fn words(s: &str) -> Vec<String> {
    s.split_whitespace()
        .map(|w| match w.parse::<f64>() {
            Ok(_) => w.to_owned(),
            Err(_) => fixture(&format!("golden/{w}")).display().to_string(),
        })
        .collect()
}

fn fnv1a(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
        (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn sources(case: &serde_json::Value) -> DataSources {
    if let Some(path) = case["data_path"].as_str() {
        return DataSources::Blend(Blend::from_args("--data-path", &words(path)).unwrap());
    }
    DataSources::PerSplit(["train", "valid", "test"].map(|s| {
        case[format!("{s}_data_path")]
            .as_str()
            .map(|p| Blend::from_args("--x-data-path", &words(p)).unwrap())
    }))
}

fn config(case: &serde_json::Value, cache: &std::path::Path) -> DatasetBuildConfig {
    DatasetBuildConfig {
        split: case["split"].as_str().unwrap_or("969,30,1").to_owned(),
        sequence_length: case["seq_length"].as_u64().unwrap() as usize,
        seed: case["seed"].as_u64().unwrap() as u32,
        cache_dir: Some(cache.to_path_buf()),
        verbose: false,
    }
}

#[test]
fn blends_equal_megatron_cores_samples() {
    let fixture_text = std::fs::read_to_string(fixture("blend_samples.json")).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(&fixture_text).unwrap();
    assert_eq!(cases.len(), 5);
    for case in &cases {
        let cache = tempfile::tempdir().unwrap();
        let sizes: Vec<u64> = case["sizes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let built = build_datasets(
            &sources(case),
            [sizes[0], sizes[1], sizes[2]],
            &config(case, cache.path()),
        )
        .unwrap();
        let splits = case["splits"].as_array().unwrap();
        for (split, (ours, theirs)) in ["train", "valid", "test"]
            .iter()
            .zip(built.iter().zip(splits))
        {
            let what = format!("case {case:.120}, split {split}");
            if theirs.is_null() {
                assert!(ours.is_none(), "{what}: Megatron builds no dataset");
                continue;
            }
            let ours = ours.as_ref().expect("Megatron builds this split");
            assert_eq!(
                ours.len() as u64,
                theirs["length"].as_u64().unwrap(),
                "{what}"
            );
            let datasets = theirs["dataset_index"].as_array().unwrap();
            let samples = theirs["dataset_sample_index"].as_array().unwrap();
            let hashes = theirs["token_hashes"].as_array().unwrap();
            for k in 0..datasets.len() {
                let (d, s) = ours.source(k);
                assert_eq!(
                    (d as u64, s as u64),
                    (datasets[k].as_u64().unwrap(), samples[k].as_u64().unwrap()),
                    "{what}: sample {k}"
                );
                assert_eq!(
                    fnv1a(&ours.sample_tokens(k)),
                    hashes[k].as_u64().unwrap(),
                    "{what}: tokens of sample {k}"
                );
            }
            let first: Vec<u32> = theirs["first_sample_tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(ours.sample_tokens(0), first, "{what}");
        }
    }
}

#[test]
fn blend_indices_are_cached_under_megatrons_names_and_reused() {
    let fixture_text = std::fs::read_to_string(fixture("blend_samples.json")).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(&fixture_text).unwrap();
    let case = &cases[0];
    let cache = tempfile::tempdir().unwrap();
    let build =
        || build_datasets(&sources(case), [2400, 160, 32], &config(case, cache.path())).unwrap();
    let first = build();
    let names = list_dir(cache.path());
    for suffix in [
        "-BlendedDataset-train-dataset_index.npy",
        "-BlendedDataset-train-dataset_sample_index.npy",
        "-BlendedDataset-train-description.txt",
        "-BlendedDataset-valid-dataset_index.npy",
        "-BlendedDataset-test-dataset_sample_index.npy",
        "-document_index.npy",
        "-sample_index.npy",
        "-shuffle_index.npy",
    ] {
        assert!(
            names.iter().any(|n| n.ends_with(suffix)),
            "no cache file ending in {suffix}: {names:?}"
        );
    }
    // numpy's int16 for the dataset index, int64 for the sample index.
    let index = names
        .iter()
        .find(|n| n.ends_with("-BlendedDataset-train-dataset_index.npy"))
        .unwrap();
    let bytes = std::fs::read(cache.path().join(index)).unwrap();
    assert!(String::from_utf8_lossy(&bytes[..80]).contains("'descr': '<i2'"));
    assert_eq!(bytes.len() % 64, (2 * 2400) % 64);

    // A second build reads the cache: make the cached train blend point every sample at
    // dataset 1, sample 0, and the rebuilt dataset must show it (then restore it).
    let sample_index = names
        .iter()
        .find(|n| n.ends_with("-BlendedDataset-train-dataset_sample_index.npy"))
        .unwrap();
    let original = std::fs::read(cache.path().join(sample_index)).unwrap();
    let mut zeroed = original.clone();
    let header = zeroed.len() - 8 * 2400;
    zeroed[header..].fill(0);
    std::fs::write(cache.path().join(sample_index), &zeroed).unwrap();
    let second = build();
    let train = second[0].as_ref().unwrap();
    assert!((0..50).all(|k| train.source(k).1 == 0), "cache not read");
    std::fs::write(cache.path().join(sample_index), &original).unwrap();
    let third = build();
    let (a, b) = (first[0].as_ref().unwrap(), third[0].as_ref().unwrap());
    assert!((0..2400).all(|k| a.source(k) == b.source(k)));
}

/// A split that `--split` leaves without documents in a dataset of the blend has no blended
/// dataset (its evaluation is skipped, as a single dataset's is); the other splits build.
#[test]
fn an_empty_split_of_a_blended_dataset_has_no_dataset() {
    // 969,30,1 of wikitext2_valid's 60 documents leaves its test split empty.
    let sources = DataSources::Blend(
        Blend::from_args(
            "--data-path",
            &words("1 wikitext2_valid_text_document 1 wikitext2_test_text_document"),
        )
        .unwrap(),
    );
    let cache = tempfile::tempdir().unwrap();
    let config = DatasetBuildConfig {
        split: "969,30,1".into(),
        sequence_length: 64,
        seed: 1,
        cache_dir: Some(cache.path().to_path_buf()),
        verbose: false,
    };
    let [train, valid, test] = build_datasets(&sources, [100, 10, 10], &config).unwrap();
    assert!(train.is_some_and(|t| t.len() >= 100) && valid.is_some());
    assert!(test.is_none());
}
