//! Megatron's mmap indexed dataset: the `.bin`/`.idx` pair every training run reads.
//!
//! The format is documented in `docs/data-format.md`; in short,
//! `.bin` holds the token ids of every sequence back to back and `.idx` a header, the
//! sequence lengths, their byte offsets and the document boundaries.

pub mod blend;
pub mod blended_builder;
pub mod blended_dataset;
pub mod builder;
pub mod dtype;
pub mod error;
pub mod gpt_dataset;
pub mod index;
pub mod indexed_dataset;
pub mod loader;
pub mod merge;
pub mod mock_dataset;
pub mod npy;
pub mod sample_dataset;
pub mod sample_masks;
pub mod split;
pub mod stats;

use std::path::{Path, PathBuf};

pub use blend::{Blend, DataSources};
pub use blended_builder::{build_datasets, DatasetBuildConfig, SplitDataset};
pub use blended_dataset::BlendedDataset;
pub use builder::{FinishedDataset, IndexedDatasetBuilder};
pub use dtype::DType;
pub use error::DatasetError;
pub use gpt_dataset::{Documents, GptDataset, GptDatasetConfig, GptIndices, GptSample, Split};
pub use index::IndexLayout;
pub use indexed_dataset::{IndexedDataset, Tokens};
pub use merge::merge_datasets;
pub use mock_dataset::MockDocuments;
pub use sample_dataset::SampleDataset;
pub use sample_masks::SampleMasks;
pub use stats::DatasetStats;

/// Path of the `.bin` file of a dataset prefix.
pub fn data_file_path(prefix: &Path) -> PathBuf {
    with_suffix(prefix, ".bin")
}

/// Path of the `.idx` file of a dataset prefix.
pub fn index_file_path(prefix: &Path) -> PathBuf {
    with_suffix(prefix, ".idx")
}

/// Accepts a prefix given with or without a trailing `.bin`/`.idx`, as users often paste one
/// of the two file names.
pub fn normalize_prefix(path: &Path) -> PathBuf {
    let s = path.as_os_str().to_string_lossy();
    for ext in [".bin", ".idx"] {
        if let Some(stem) = s.strip_suffix(ext) {
            return PathBuf::from(stem);
        }
    }
    path.to_path_buf()
}

fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}
