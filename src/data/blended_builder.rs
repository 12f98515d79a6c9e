//! Megatron-Core's `BlendedMegatronDatasetBuilder`: the train / validation / test datasets of
//! a run, from one dataset, a weighted blend cut by `--split`, or a blend per split.
//!
//! For a weighted blend each dataset is cut by `--split` over its own documents and built with
//! its share of each split's samples plus Megatron's 0.5 % margin; the blend then takes
//! exactly `Σ ceil(samples · weight)` samples in Megatron's greedy order. Without weights the
//! datasets are built for one epoch and weighed by their sizes.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::blended_dataset::{normalize, sizes_per_dataset, MID_LEVEL_DATASET_SURPLUS};
use super::split::{parse_split, split_ranges};
use super::{
    Blend, BlendedDataset, DataSources, DatasetError, GptDataset, GptDatasetConfig, IndexedDataset,
    MockDocuments, SampleDataset, Split,
};

/// The three splits, in Megatron's order.
pub const SPLITS: [Split; 3] = [Split::Train, Split::Valid, Split::Test];

/// One split's dataset, if the run has one.
pub type SplitDataset = Option<Arc<dyn SampleDataset>>;

/// What the datasets are built with, besides where their data comes from.
#[derive(Clone, Debug)]
pub struct DatasetBuildConfig {
    /// `--split` (used with `--data-path`).
    pub split: String,
    /// `--seq-length`.
    pub sequence_length: usize,
    /// `--seed`.
    pub seed: u32,
    /// `--data-cache-path`.
    pub cache_dir: Option<PathBuf>,
    /// Print a line per dataset built.
    pub verbose: bool,
}

/// Builds the train, validation and test datasets holding at least `sizes[i]` samples each
/// (a split asked for no samples, or given no share of `--split`, is `None`).
pub fn build_datasets(
    sources: &DataSources,
    sizes: [u64; 3],
    config: &DatasetBuildConfig,
) -> Result<[SplitDataset; 3], DatasetError> {
    match sources {
        DataSources::Blend(blend) => {
            let weights = parse_split(&config.split).map_err(DatasetError::OutOfRange)?;
            let cut = |documents: usize| split_ranges(&weights, documents);
            build_blend(blend, &cut, sizes, config)
        }
        DataSources::PerSplit(blends) => {
            let mut out: [SplitDataset; 3] = [None, None, None];
            for (i, blend) in blends.iter().enumerate() {
                let Some(blend) = blend else { continue };
                // Megatron's "split spoof": this split takes every document of its datasets.
                let cut = |documents: usize| {
                    let mut ranges = [None, None, None];
                    ranges[i] = Some(0..documents);
                    ranges
                };
                let mut only = [0; 3];
                only[i] = sizes[i];
                let mut blend = blend.clone();
                if blend.prefixes.len() == 1 {
                    blend.weights = None; // a single dataset per split is never blended
                }
                let [a, b, c] = build_blend(&blend, &cut, only, config)?;
                out[i] = [a, b, c][i].clone();
            }
            Ok(out)
        }
        DataSources::Mock(documents) => build_mock(documents, sizes, config),
    }
}

/// `--mock-data`: Megatron-Core's `MockGPTDataset` splits, the documents cut `1,1,1`
/// whatever `--split` says (as Megatron does).
fn build_mock(
    documents: &Arc<MockDocuments>,
    sizes: [u64; 3],
    config: &DatasetBuildConfig,
) -> Result<[SplitDataset; 3], DatasetError> {
    let weights = parse_split(MockDocuments::SPLIT).map_err(DatasetError::OutOfRange)?;
    let ranges = split_ranges(&weights, MockDocuments::DOCUMENTS);
    let mut out: [SplitDataset; 3] = [None, None, None];
    for (i, split) in SPLITS.into_iter().enumerate() {
        let Some(range) = ranges[i].clone().filter(|_| sizes[i] > 0) else {
            continue;
        };
        let gpt_config = GptDatasetConfig {
            sequence_length: config.sequence_length,
            seed: config.seed,
            num_samples: sizes[i] as usize,
            cache_dir: config.cache_dir.clone(),
        };
        let dataset = GptDataset::mock(documents.clone(), split, range.clone(), &gpt_config)?;
        if config.verbose {
            println!(
                " > {} split of the mock data (MockGPTDataset): documents {}..{}, {} samples of {} tokens",
                split.name(),
                range.start,
                range.end,
                dataset.len(),
                config.sequence_length
            );
        }
        out[i] = Some(Arc::new(dataset));
    }
    Ok(out)
}

/// `_build_blended_dataset_splits` for one blend whose datasets are cut by `cut`.
fn build_blend(
    blend: &Blend,
    cut: &dyn Fn(usize) -> [Option<Range<usize>>; 3],
    sizes: [u64; 3],
    config: &DatasetBuildConfig,
) -> Result<[SplitDataset; 3], DatasetError> {
    let weights = blend.weights.as_deref().map(normalize);
    if blend.prefixes.len() == 1 && weights.is_none() {
        let wanted = sizes.map(|s| (s > 0).then_some(s));
        let built = build_splits_of(&blend.prefixes[0], cut, wanted, config)?;
        return Ok(built.map(|d| d.map(|d| d as Arc<dyn SampleDataset>)));
    }
    // Samples asked of each dataset per split: its share plus the margin, or one epoch.
    let targets = weights.as_ref().map(|w| sizes_per_dataset(w, &sizes, 0.0));
    let with_margin = weights
        .as_ref()
        .map(|w| sizes_per_dataset(w, &sizes, MID_LEVEL_DATASET_SURPLUS));
    let mut per_dataset: Vec<[Option<Arc<GptDataset>>; 3]> = Vec::new();
    for (d, prefix) in blend.prefixes.iter().enumerate() {
        let wanted: [Option<u64>; 3] = match &with_margin {
            Some(m) => std::array::from_fn(|i| (sizes[i] > 0).then_some(m[d][i])),
            None => sizes.map(|s| (s > 0).then_some(0)),
        };
        per_dataset.push(build_splits_of(prefix, cut, wanted, config)?);
    }
    let cache_dir = blend_cache_dir(config, &blend.prefixes[0]);
    let mut out: [SplitDataset; 3] = [None, None, None];
    for (i, split) in SPLITS.into_iter().enumerate() {
        let parts: Option<Vec<Arc<GptDataset>>> =
            per_dataset.iter().map(|d| d[i].clone()).collect();
        let Some(parts) = parts else { continue };
        let (weights_i, size) = match (&weights, &targets) {
            (Some(w), Some(t)) => (w.clone(), t.iter().map(|t| t[i]).sum::<u64>()),
            _ => {
                let lengths: Vec<f64> = parts.iter().map(|p| p.len() as f64).collect();
                let total = parts.iter().map(|p| p.len() as u64).sum::<u64>();
                (lengths, sizes[i].min(total))
            }
        };
        let parts: Vec<Arc<dyn SampleDataset>> = parts
            .into_iter()
            .map(|p| p as Arc<dyn SampleDataset>)
            .collect();
        let blended = BlendedDataset::new(parts, &weights_i, size as usize, split, &cache_dir)?;
        if config.verbose {
            println!(
                " > {} blend: {} samples from {} datasets, weights {:?}",
                split.name(),
                size,
                blend.prefixes.len(),
                normalize(&weights_i)
            );
        }
        out[i] = Some(Arc::new(blended));
    }
    Ok(out)
}

/// `_build_megatron_dataset_splits`: the GPT datasets of one prefix, split `i` holding
/// documents `cut(n)[i]` and built for `wanted[i]` samples (0: one epoch; `None`: not built).
fn build_splits_of(
    prefix: &Path,
    cut: &dyn Fn(usize) -> [Option<Range<usize>>; 3],
    wanted: [Option<u64>; 3],
    config: &DatasetBuildConfig,
) -> Result<[Option<Arc<GptDataset>>; 3], DatasetError> {
    let data = Arc::new(IndexedDataset::open(prefix)?);
    let ranges = cut(data.document_count());
    let mut out = [None, None, None];
    for (i, split) in SPLITS.into_iter().enumerate() {
        let (Some(range), Some(samples)) = (ranges[i].clone(), wanted[i]) else {
            continue;
        };
        if range.is_empty() {
            // As the Megatron-LM of the seed tutorial: no dataset, so no evaluation on it
            // (Megatron-Core would wait forever for its samples).
            if config.verbose {
                println!(
                    " > --split {}: the {} split of {} gets none of its {} documents: there is no {} dataset and its evaluation is skipped",
                    config.split,
                    split.name(),
                    prefix.display(),
                    data.document_count(),
                    split.name()
                );
            }
            continue;
        }
        let empty = range
            .clone()
            .map(|d| data.sequence_length(d) as u64)
            .sum::<u64>()
            == 0;
        if empty {
            // Megatron-Core would loop forever looking for samples here.
            return Err(DatasetError::OutOfRange(format!(
                "--split {}: the {} split of {} gets only empty documents of its {}, yet {} \
                 samples are asked of it (give it a larger share of --split, or use \
                 --eval-iters 0 for no validation and test)",
                config.split,
                split.name(),
                prefix.display(),
                data.document_count(),
                if samples == 0 {
                    "one epoch of".to_string()
                } else {
                    samples.to_string()
                }
            )));
        }
        let gpt_config = GptDatasetConfig {
            sequence_length: config.sequence_length,
            seed: config.seed,
            num_samples: samples as usize,
            cache_dir: config.cache_dir.clone(),
        };
        let dataset = GptDataset::new(data.clone(), split, range.clone(), &gpt_config)?;
        if config.verbose {
            println!(
                " > {} split of {}: documents {}..{}, {} samples of {} tokens",
                split.name(),
                prefix.display(),
                range.start,
                range.end,
                dataset.len(),
                config.sequence_length
            );
        }
        out[i] = Some(Arc::new(dataset));
    }
    Ok(out)
}

/// `--data-cache-path`, or `cache/BlendedDataset_indices` beside the first dataset (where
/// its GPT indices go under `cache/GPTDataset_indices`).
fn blend_cache_dir(config: &DatasetBuildConfig, first: &Path) -> PathBuf {
    match &config.cache_dir {
        Some(dir) => dir.clone(),
        None => first
            .parent()
            .unwrap_or(Path::new("."))
            .join("cache")
            .join("BlendedDataset_indices"),
    }
}
