//! Concatenating datasets (Megatron's `tools/merge_datasets.py`).

use std::path::{Path, PathBuf};

use super::builder::DatasetSummary;
use super::{
    index_file_path, normalize_prefix, DatasetError, IndexedDataset, IndexedDatasetBuilder,
};

/// Every dataset prefix in `dir` (each `X.idx` with an `X.bin` beside it), sorted by name as
/// Megatron's merge tool does.
pub fn prefixes_in_directory(dir: &Path) -> Result<Vec<PathBuf>, DatasetError> {
    let entries = std::fs::read_dir(dir).map_err(|e| DatasetError::io(dir, e))?;
    let mut prefixes = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| DatasetError::io(dir, e))?.path();
        if path.extension().is_some_and(|e| e == "idx") {
            let prefix = path.with_extension("");
            if super::data_file_path(&prefix).is_file() {
                prefixes.push(prefix);
            }
        }
    }
    prefixes.sort();
    Ok(prefixes)
}

/// Writes the concatenation of `inputs` (in the given order) to `output`; all inputs are
/// validated first and must share one dtype. The output appears atomically.
pub fn merge_datasets(inputs: &[PathBuf], output: &Path) -> Result<DatasetSummary, DatasetError> {
    if inputs.is_empty() {
        return Err(DatasetError::Mismatch("no datasets to merge".into()));
    }
    let datasets = inputs
        .iter()
        .map(|p| IndexedDataset::open(normalize_prefix(p)))
        .collect::<Result<Vec<_>, _>>()?;
    let output_idx = index_file_path(output);
    for ds in &datasets {
        if index_file_path(ds.prefix()) == output_idx {
            return Err(DatasetError::Mismatch(format!(
                "the output prefix {} is also an input",
                output.display()
            )));
        }
    }
    let mut builder = IndexedDatasetBuilder::new(output, datasets[0].dtype())?;
    for ds in &datasets {
        builder.append_dataset(ds)?;
    }
    builder.finish()?.persist()
}
