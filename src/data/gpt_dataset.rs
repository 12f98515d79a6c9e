//! Megatron's `GPTDataset`: fixed-length training samples that run across document
//! boundaries, in a seeded shuffled order.
//!
//! Three indices, built exactly as Megatron-Core builds them (same numpy RNG, so the same
//! samples in the same order for the same `--seed`):
//! - the **document index**: the split's documents repeated for every epoch needed, shuffled
//!   (the last epoch shuffled separately when it is used for less than 80 % of its samples);
//! - the **sample index**: where each sample starts, as (position in the document index,
//!   token offset); sample i ends where sample i+1 starts, plus one extra token for the labels;
//! - the **shuffle index**: the order samples are visited in.
//!
//! They are cached next to the data (or in `--data-cache-path`) under a name that encodes every
//! parameter, so a second run starts at once.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::npy::{read_npy, write_npy};
use super::{DatasetError, IndexedDataset, MockDocuments, SampleDataset};
use crate::util::numpy_random::NumpyRandomState;

/// Megatron separates the last epoch when fewer than this share of its samples are used.
const SEPARATE_LAST_EPOCH_THRESHOLD: f64 = 0.80;

/// Which part of `--split` a dataset is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Training.
    Train,
    /// Validation.
    Valid,
    /// Test.
    Test,
}

impl Split {
    /// Megatron's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Train => "train",
            Self::Valid => "valid",
            Self::Test => "test",
        }
    }
}

/// The parameters the indices depend on.
#[derive(Clone, Debug, PartialEq)]
pub struct GptDatasetConfig {
    /// `--seq-length`: tokens per sample (each sample holds one more, for the labels).
    pub sequence_length: usize,
    /// `--seed`.
    pub seed: u32,
    /// Samples wanted (training: iterations × global batch); at least one epoch is built.
    pub num_samples: usize,
    /// `--data-cache-path`; `None` caches in `cache/GPTDataset_indices` beside the data.
    pub cache_dir: Option<PathBuf>,
}

/// The three indices of a GPT dataset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GptIndices {
    /// Document ids (indices into the indexed dataset), over all epochs.
    pub document_index: Vec<i32>,
    /// `[position in document_index, token offset]` where each sample starts; one more entry
    /// than samples.
    pub sample_index: Vec<[i64; 2]>,
    /// Visiting order of the samples.
    pub shuffle_index: Vec<i64>,
}

/// How many epochs Megatron builds for `num_samples` samples (`_get_num_epochs`).
fn num_epochs(tokens_per_epoch: u64, sequence_length: usize, num_samples: usize) -> u64 {
    let requested = num_samples as u64 * sequence_length as u64 + 1;
    let mut epochs = 1;
    let mut tokens = tokens_per_epoch;
    while tokens < requested {
        epochs += 1;
        tokens += tokens_per_epoch;
    }
    epochs
}

/// The shapes the indices will have, to check a cache against.
struct IndexShape {
    epochs: u64,
    separate_last_epoch: bool,
    samples: usize,
    samples_sans_last_epoch: usize,
}

fn index_shape(tokens_per_epoch: u64, sequence_length: usize, num_samples: usize) -> IndexShape {
    let epochs = num_epochs(tokens_per_epoch, sequence_length, num_samples);
    let seq = sequence_length as u64;
    let samples_sans_last_epoch =
        (((epochs - 1) * tokens_per_epoch).saturating_sub(1) / seq) as usize;
    let separate_last_epoch = if epochs == 1 {
        false
    } else {
        let from_last = num_samples.saturating_sub(samples_sans_last_epoch);
        let per_epoch = ((tokens_per_epoch - 1) / seq) as usize;
        from_last < (SEPARATE_LAST_EPOCH_THRESHOLD * per_epoch as f64) as usize
    };
    let samples = ((epochs * tokens_per_epoch - 1) / seq) as usize;
    IndexShape {
        epochs,
        separate_last_epoch,
        samples,
        samples_sans_last_epoch,
    }
}

/// `_build_document_index`: the documents once per epoch, shuffled.
fn build_document_index(
    documents: Range<usize>,
    epochs: u64,
    rng: &mut NumpyRandomState,
    separate_last: bool,
) -> Vec<i32> {
    if !separate_last || epochs == 1 {
        let mut index: Vec<i32> = (0..epochs)
            .flat_map(|_| documents.clone().map(|d| d as i32))
            .collect();
        rng.shuffle(&mut index);
        return index;
    }
    let mut first = build_document_index(documents.clone(), epochs - 1, rng, false);
    first.extend(build_document_index(documents, 1, rng, false));
    first
}

/// `build_sample_idx` (Megatron's C++ helper): walk the document index cutting samples of
/// `sequence_length` tokens, each sharing its last token with the next.
fn build_sample_index(
    lengths: &[u32],
    document_index: &[i32],
    sequence_length: usize,
    samples: usize,
) -> Vec<[i64; 2]> {
    let mut index = Vec::with_capacity(samples + 1);
    let mut doc_pos = 0usize;
    let mut offset = 0i64;
    index.push([0, 0]);
    while index.len() <= samples {
        let mut remaining = sequence_length as i64 + 1;
        while remaining != 0 {
            let doc_length = lengths[document_index[doc_pos] as usize] as i64 - offset;
            remaining -= doc_length;
            if remaining <= 0 {
                offset += remaining + doc_length - 1;
                remaining = 0;
            } else if doc_pos == document_index.len() - 1 {
                offset = lengths[document_index[doc_pos] as usize] as i64 - 1;
                break;
            } else {
                doc_pos += 1;
                offset = 0;
            }
        }
        index.push([doc_pos as i64, offset]);
    }
    index
}

/// `_build_shuffle_index`: the first `split_at` samples shuffled among themselves, then the rest.
fn build_shuffle_index(split_at: usize, total: usize, rng: &mut NumpyRandomState) -> Vec<i64> {
    let mut first: Vec<i64> = (0..split_at as i64).collect();
    rng.shuffle(&mut first);
    if split_at == total {
        return first;
    }
    let mut last: Vec<i64> = (split_at as i64..total as i64).collect();
    rng.shuffle(&mut last);
    first.extend(last);
    first
}

/// Builds the three indices for `documents` (whose token counts are `lengths[d]`).
pub fn build_indices(
    lengths: &[u32],
    documents: Range<usize>,
    sequence_length: usize,
    num_samples: usize,
    seed: u32,
) -> Result<GptIndices, DatasetError> {
    let tokens_per_epoch: u64 = documents.clone().map(|d| lengths[d] as u64).sum();
    if tokens_per_epoch <= 1 {
        return Err(DatasetError::OutOfRange(format!(
            "documents {documents:?} hold {tokens_per_epoch} tokens: not enough for one sample"
        )));
    }
    if sequence_length == 0 {
        return Err(DatasetError::OutOfRange(
            "--seq-length must be at least 1".into(),
        ));
    }
    let shape = index_shape(tokens_per_epoch, sequence_length, num_samples);
    let mut rng = NumpyRandomState::new(seed);
    let document_index =
        build_document_index(documents, shape.epochs, &mut rng, shape.separate_last_epoch);
    let sample_index = build_sample_index(lengths, &document_index, sequence_length, shape.samples);
    let split_at = if shape.separate_last_epoch {
        shape.samples_sans_last_epoch
    } else {
        shape.samples
    };
    let shuffle_index = build_shuffle_index(split_at, shape.samples, &mut rng);
    Ok(GptIndices {
        document_index,
        sample_index,
        shuffle_index,
    })
}

/// FNV-1a, 64 bits: a stable name for a cache entry (not a security hash).
pub(crate) fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// One training sample: `sequence_length` input tokens, the next-token labels, the loss
/// mask (0 where the input token is the EOD with `--eod-mask-loss`, as Megatron does), and
/// for packed documents each token's position and first visible key
/// ([`super::sample_masks`]).
#[derive(Clone, Debug, PartialEq)]
pub struct GptSample {
    /// Input ids.
    pub tokens: Vec<u32>,
    /// Target ids (the inputs shifted by one).
    pub labels: Vec<u32>,
    /// 1.0 where the position counts in the loss.
    pub loss_mask: Vec<f32>,
    /// Each token's position in its document (`--reset-position-ids`).
    pub positions: Option<Vec<u32>>,
    /// Each token's first visible key (`--reset-attention-mask`).
    pub first_keys: Option<Vec<u32>>,
}

/// The documents a GPT dataset draws its samples from.
#[derive(Clone, Debug)]
pub enum Documents {
    /// A `.bin`/`.idx` pair from `preprocess`.
    Indexed(Arc<IndexedDataset>),
    /// `--mock-data`'s synthetic documents.
    Mock(Arc<MockDocuments>),
}

impl Documents {
    /// Token count of every document.
    fn lengths(&self) -> Vec<u32> {
        match self {
            Self::Indexed(data) => data.sequence_lengths().map(|l| l as u32).collect(),
            Self::Mock(docs) => docs.lengths().to_vec(),
        }
    }

    /// The tokens of document `doc` from `start` to `end` (its end when `None`), appended to
    /// `out`.
    fn append_tokens(&self, doc: usize, start: usize, end: Option<usize>, out: &mut Vec<u32>) {
        match self {
            Self::Indexed(data) => {
                let tokens = data.sequence(doc);
                let end = end.unwrap_or(tokens.len());
                tokens.slice(start..end).append_to(out);
            }
            Self::Mock(docs) => {
                let end = end.unwrap_or(docs.lengths()[doc] as usize);
                docs.append_tokens(doc, start..end, out);
            }
        }
    }

    /// Megatron's class name for a dataset over these documents (cache file names).
    fn class_name(&self) -> &'static str {
        match self {
            Self::Indexed(_) => "GPTDataset",
            Self::Mock(_) => "MockGPTDataset",
        }
    }

    /// What the indices depend on besides the split and the sample counts.
    fn describe(&self) -> String {
        match self {
            Self::Indexed(data) => format!(
                "dataset: {}\nsequences: {}\ntokens: {}",
                data.prefix().display(),
                data.sequence_count(),
                data.total_tokens()
            ),
            Self::Mock(docs) => docs.describe(),
        }
    }
}

/// A split of an indexed dataset, served as Megatron-ordered fixed-length samples.
pub struct GptDataset {
    data: Documents,
    indices: GptIndices,
    sequence_length: usize,
    split: Split,
    description: String,
}

impl std::fmt::Debug for GptDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GptDataset")
            .field("split", &self.split)
            .field("samples", &self.len())
            .field("sequence_length", &self.sequence_length)
            .finish()
    }
}

impl GptDataset {
    /// Builds (or loads from the cache) the indices of `documents` of `data`.
    pub fn new(
        data: Arc<IndexedDataset>,
        split: Split,
        documents: Range<usize>,
        config: &GptDatasetConfig,
    ) -> Result<Self, DatasetError> {
        if data.sequence_count() != data.document_count() {
            return Err(DatasetError::Unsupported {
                path: data.prefix().to_path_buf(),
                reason: "GPT training needs one sequence per document (data made without --split-sentences)".into(),
            });
        }
        Self::over(Documents::Indexed(data), split, documents, config)
    }

    /// Megatron-Core's `MockGPTDataset`: the indices of `documents` of the mock documents
    /// (cached only in `--data-cache-path`, as Megatron caches them).
    pub fn mock(
        data: Arc<MockDocuments>,
        split: Split,
        documents: Range<usize>,
        config: &GptDatasetConfig,
    ) -> Result<Self, DatasetError> {
        Self::over(Documents::Mock(data), split, documents, config)
    }

    fn over(
        data: Documents,
        split: Split,
        documents: Range<usize>,
        config: &GptDatasetConfig,
    ) -> Result<Self, DatasetError> {
        let lengths = data.lengths();
        let description = describe(&data, split, &documents, config);
        let cache = CacheFiles::new(&data, split, &description, config);
        let tokens_per_epoch: u64 = documents.clone().map(|d| lengths[d] as u64).sum();
        let indices = match cache
            .as_ref()
            .and_then(|c| c.load(&documents, tokens_per_epoch, config).ok())
        {
            Some(indices) => indices,
            None => {
                let indices = build_indices(
                    &lengths,
                    documents,
                    config.sequence_length,
                    config.num_samples,
                    config.seed,
                )?;
                if let Some(cache) = &cache {
                    if let Err(e) = cache.save(&indices) {
                        eprintln!("warning: could not cache the dataset indices: {e}");
                    }
                }
                indices
            }
        };
        Ok(Self {
            description,
            data,
            indices,
            sequence_length: config.sequence_length,
            split,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.indices.shuffle_index.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The indices (for inspection and tests).
    pub fn indices(&self) -> &GptIndices {
        &self.indices
    }

    /// Which split this is.
    pub fn split(&self) -> Split {
        self.split
    }

    /// The `sequence_length + 1` tokens of sample `i` in visiting order (Megatron's
    /// `__getitem__` before it cuts tokens and labels).
    pub fn sample_tokens(&self, i: usize) -> Vec<u32> {
        let idx = self.indices.shuffle_index[i % self.len()] as usize;
        self.unshuffled_sample_tokens(idx)
    }

    /// Sample `idx` in sample-index order (no shuffle).
    pub fn unshuffled_sample_tokens(&self, idx: usize) -> Vec<u32> {
        let [doc_begin, offset_begin] = self.indices.sample_index[idx];
        let [doc_end, offset_end] = self.indices.sample_index[idx + 1];
        let mut out = Vec::with_capacity(self.sequence_length + 1);
        for pos in doc_begin..=doc_end {
            let doc = self.indices.document_index[pos as usize] as usize;
            let start = if pos == doc_begin {
                offset_begin as usize
            } else {
                0
            };
            let end = (pos == doc_end).then_some(offset_end as usize + 1);
            self.data.append_tokens(doc, start, end, &mut out);
        }
        out
    }
}

impl SampleDataset for GptDataset {
    fn len(&self) -> usize {
        GptDataset::len(self)
    }

    fn sample_tokens(&self, i: usize) -> Vec<u32> {
        GptDataset::sample_tokens(self, i)
    }

    fn description(&self) -> String {
        self.description.clone()
    }
}

/// Everything a GPT dataset's indices depend on, as text: the cache key, and how a blend
/// describes its parts.
fn describe(
    data: &Documents,
    split: Split,
    documents: &Range<usize>,
    config: &GptDatasetConfig,
) -> String {
    format!(
        "class: {} (ferrotron)\n{}\nsplit: {}\ndocuments: {}..{}\n\
         num_samples: {}\nsequence_length: {}\nrandom_seed: {}\nadd_extra_token_to_sequence: true\n\
         drop_last_partial_sequence: true\nformat: 1\n",
        data.class_name(),
        data.describe(),
        split.name(),
        documents.start,
        documents.end,
        config.num_samples,
        config.sequence_length,
        config.seed,
    )
}

/// Where a dataset's indices are cached, named by a hash of everything they depend on:
/// `--data-cache-path` (or, for real data, `cache/GPTDataset_indices` beside it), files
/// `<name>-<split>-<hash>-*` for real data and Megatron's `<hash>-MockGPTDataset-<split>-*`
/// for mock data (which Megatron caches only in `--data-cache-path`).
struct CacheFiles {
    stem: PathBuf,
    description: String,
}

impl CacheFiles {
    fn new(
        data: &Documents,
        split: Split,
        description: &str,
        config: &GptDatasetConfig,
    ) -> Option<Self> {
        let hash = fnv1a(description);
        let stem = match data {
            Documents::Indexed(data) => {
                let prefix = data.prefix();
                let dir = match &config.cache_dir {
                    Some(d) => d.clone(),
                    None => prefix
                        .parent()
                        .unwrap_or(Path::new("."))
                        .join("cache")
                        .join("GPTDataset_indices"),
                };
                let name = prefix.file_name()?.to_string_lossy().into_owned();
                dir.join(format!("{name}-{}-{hash:016x}", split.name()))
            }
            Documents::Mock(_) => config
                .cache_dir
                .as_ref()?
                .join(format!("{hash:016x}-MockGPTDataset-{}", split.name())),
        };
        Some(Self {
            stem,
            description: description.to_owned(),
        })
    }

    fn path(&self, what: &str) -> PathBuf {
        let mut s = self.stem.as_os_str().to_owned();
        s.push(format!("-{what}"));
        PathBuf::from(s)
    }

    fn load(
        &self,
        documents: &Range<usize>,
        tokens_per_epoch: u64,
        config: &GptDatasetConfig,
    ) -> Result<GptIndices, DatasetError> {
        let description = std::fs::read_to_string(self.path("description.txt"))
            .map_err(|e| DatasetError::io(self.path("description.txt"), e))?;
        if description != self.description {
            return Err(DatasetError::Mismatch("cache description differs".into()));
        }
        let shape = index_shape(tokens_per_epoch, config.sequence_length, config.num_samples);
        let docs = documents.len() * shape.epochs as usize;
        let document_index = read_npy::<i32>(&self.path("document_index.npy"), &[docs])?;
        let flat = read_npy::<i64>(&self.path("sample_index.npy"), &[shape.samples + 1, 2])?;
        let shuffle_index = read_npy::<i64>(&self.path("shuffle_index.npy"), &[shape.samples])?;
        let sample_index = flat.chunks_exact(2).map(|c| [c[0], c[1]]).collect();
        Ok(GptIndices {
            document_index,
            sample_index,
            shuffle_index,
        })
    }

    fn save(&self, indices: &GptIndices) -> Result<(), DatasetError> {
        let dir = self.stem.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| DatasetError::io(dir, e))?;
        write_npy(
            &self.path("document_index.npy"),
            &indices.document_index,
            &[indices.document_index.len()],
        )?;
        let flat: Vec<i64> = indices.sample_index.iter().flatten().copied().collect();
        write_npy(
            &self.path("sample_index.npy"),
            &flat,
            &[indices.sample_index.len(), 2],
        )?;
        write_npy(
            &self.path("shuffle_index.npy"),
            &indices.shuffle_index,
            &[indices.shuffle_index.len()],
        )?;
        // The description goes last: its presence marks a complete cache entry.
        let path = self.path("description.txt");
        std::fs::write(&path, &self.description).map_err(|e| DatasetError::io(&path, e))
    }
}
