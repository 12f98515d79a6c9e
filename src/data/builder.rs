//! Writing a `.bin`/`.idx` pair, streaming and atomically.
//!
//! Tokens go straight to a temporary `.bin`; sequence lengths and document boundaries are
//! spilled to anonymous temporary files instead of being kept in memory (Megatron keeps them
//! in Python lists), so memory stays constant however large the corpus. `finish` writes the
//! `.idx` to a temporary file too, and only `persist` renames both to their final names: a
//! failed or interrupted run leaves the final names untouched.

use std::fs::File;
use std::io::{BufReader, BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use byteorder::{LittleEndian, ReadBytesExt, WriteBytesExt};
use tempfile::NamedTempFile;

use super::index::encode_header;
use super::{data_file_path, index_file_path, DType, DatasetError, IndexedDataset, Tokens};
use crate::util::atomic_file::{parent_dir, temp_file_beside};

const WRITE_BUFFER: usize = 1 << 20;

/// Counts of a written dataset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatasetSummary {
    /// The dataset prefix.
    pub prefix: PathBuf,
    /// Token dtype.
    pub dtype: DType,
    /// Number of sequences.
    pub sequences: u64,
    /// Number of documents.
    pub documents: u64,
    /// Number of tokens.
    pub tokens: u64,
}

/// Streams documents into a new indexed dataset at `prefix`.
pub struct IndexedDatasetBuilder {
    prefix: PathBuf,
    dtype: DType,
    bin: BufWriter<NamedTempFile>,
    lengths: BufWriter<File>,
    document_ends: BufWriter<File>,
    sequences: u64,
    documents: u64,
    tokens: u64,
    sequences_in_open_document: bool,
    scratch: Vec<u8>,
}

/// A temporary file next to `final_path`, with an error that names the final file.
fn temp_beside(final_path: &Path) -> Result<NamedTempFile, DatasetError> {
    let dir = parent_dir(final_path);
    if !dir.is_dir() {
        let why = format!(
            "cannot create it: directory {} does not exist",
            dir.display()
        );
        return Err(DatasetError::io(
            final_path,
            std::io::Error::new(std::io::ErrorKind::NotFound, why),
        ));
    }
    temp_file_beside(final_path).map_err(|e| {
        // tempfile appends " at path <temporary name>"; the final name is what users know.
        let text = e.to_string();
        let cause = text.split(" at path ").next().unwrap_or(&text);
        let why = format!("cannot create it in {}: {cause}", dir.display());
        DatasetError::io(final_path, std::io::Error::new(e.kind(), why))
    })
}

impl IndexedDatasetBuilder {
    /// Starts a dataset whose files will be `{prefix}.bin` and `{prefix}.idx`.
    pub fn new(prefix: impl AsRef<Path>, dtype: DType) -> Result<Self, DatasetError> {
        let prefix = prefix.as_ref().to_path_buf();
        if !dtype.is_token_type() {
            return Err(DatasetError::Mismatch(format!(
                "cannot write tokens as {dtype}; ferrotron writes uint16 or int32"
            )));
        }
        let bin_path = data_file_path(&prefix);
        let bin = temp_beside(&bin_path)?;
        let dir = parent_dir(&prefix);
        let spill = || tempfile::tempfile_in(&dir).map_err(|e| DatasetError::io(&dir, e));
        Ok(Self {
            prefix,
            dtype,
            bin: BufWriter::with_capacity(WRITE_BUFFER, bin),
            lengths: BufWriter::with_capacity(WRITE_BUFFER, spill()?),
            document_ends: BufWriter::with_capacity(WRITE_BUFFER, spill()?),
            sequences: 0,
            documents: 0,
            tokens: 0,
            sequences_in_open_document: false,
            scratch: Vec::new(),
        })
    }

    /// The token dtype being written.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn bin_io(&self, e: std::io::Error) -> DatasetError {
        DatasetError::io(data_file_path(&self.prefix), e)
    }

    fn spill_io(&self, e: std::io::Error) -> DatasetError {
        DatasetError::io(parent_dir(&self.prefix), e)
    }

    /// Appends one sequence to the open document. An empty slice adds nothing (Megatron
    /// never writes zero-length sequences).
    pub fn add_sequence(&mut self, tokens: &[u32]) -> Result<(), DatasetError> {
        if tokens.is_empty() {
            return Ok(());
        }
        let len = i32::try_from(tokens.len()).map_err(|_| {
            DatasetError::Mismatch(format!(
                "a sequence of {} tokens does not fit the index's int32 lengths",
                tokens.len()
            ))
        })?;
        self.scratch.clear();
        match self.dtype {
            DType::U16 => {
                for &t in tokens {
                    let v = u16::try_from(t).map_err(|_| {
                        DatasetError::Mismatch(format!("token id {t} does not fit uint16 storage"))
                    })?;
                    self.scratch.extend_from_slice(&v.to_le_bytes());
                }
            }
            _ => {
                for &t in tokens {
                    let v = i32::try_from(t).map_err(|_| {
                        DatasetError::Mismatch(format!("token id {t} does not fit int32 storage"))
                    })?;
                    self.scratch.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        self.bin
            .write_all(&self.scratch)
            .map_err(|e| self.bin_io(e))?;
        self.lengths
            .write_i32::<LittleEndian>(len)
            .map_err(|e| self.spill_io(e))?;
        self.sequences += 1;
        self.tokens += tokens.len() as u64;
        self.sequences_in_open_document = true;
        Ok(())
    }

    /// Closes the open document (possibly with no sequences: Megatron still records the
    /// boundary, so `document_indices` repeats a value).
    pub fn end_document(&mut self) -> Result<(), DatasetError> {
        self.document_ends
            .write_i64::<LittleEndian>(self.sequences as i64)
            .map_err(|e| self.spill_io(e))?;
        self.documents += 1;
        self.sequences_in_open_document = false;
        Ok(())
    }

    /// Megatron's `add_document(tokens, lengths)`: one document made of consecutive
    /// sequences of the given lengths.
    pub fn add_document(
        &mut self,
        tokens: &[u32],
        sequence_lengths: &[usize],
    ) -> Result<(), DatasetError> {
        let total: usize = sequence_lengths.iter().sum();
        if total != tokens.len() {
            return Err(DatasetError::Mismatch(format!(
                "document of {} tokens given sequence lengths summing to {total}",
                tokens.len()
            )));
        }
        let mut start = 0;
        for &len in sequence_lengths {
            self.add_sequence(&tokens[start..start + len])?;
            start += len;
        }
        self.end_document()
    }

    /// Appends every document of `other` (Megatron's `add_index`), copying its bytes.
    pub fn append_dataset(&mut self, other: &IndexedDataset) -> Result<(), DatasetError> {
        if other.dtype() != self.dtype {
            return Err(DatasetError::Mismatch(format!(
                "{} holds {} tokens but the output is {}; datasets of different dtypes cannot be merged",
                other.prefix().display(),
                other.dtype(),
                self.dtype
            )));
        }
        if self.sequences_in_open_document {
            self.end_document()?;
        }
        let bytes = match other.all_tokens() {
            Tokens::U16(t) => as_bytes(t),
            Tokens::I32(t) => as_bytes(t),
        };
        self.bin.write_all(bytes).map_err(|e| self.bin_io(e))?;
        for len in other.sequence_lengths() {
            self.lengths
                .write_i32::<LittleEndian>(len as i32)
                .map_err(|e| self.spill_io(e))?;
        }
        for end in other.document_indices().skip(1) {
            let end = self.sequences + end as u64;
            self.document_ends
                .write_i64::<LittleEndian>(end as i64)
                .map_err(|e| self.spill_io(e))?;
        }
        self.sequences += other.sequence_count() as u64;
        self.documents += other.document_count() as u64;
        self.tokens += other.total_tokens();
        Ok(())
    }

    /// Counts written so far.
    pub fn summary(&self) -> DatasetSummary {
        DatasetSummary {
            prefix: self.prefix.clone(),
            dtype: self.dtype,
            sequences: self.sequences,
            documents: self.documents,
            tokens: self.tokens,
        }
    }

    /// Writes the index and flushes everything to temporary files; nothing is visible at
    /// the final names until [`FinishedDataset::persist`].
    pub fn finish(mut self) -> Result<FinishedDataset, DatasetError> {
        if self.sequences_in_open_document {
            self.end_document()?;
        }
        let summary = self.summary();
        let idx_path = index_file_path(&self.prefix);
        let bin = self
            .bin
            .into_inner()
            .map_err(|e| DatasetError::io(data_file_path(&self.prefix), e.into_error()))?;
        bin.as_file()
            .sync_all()
            .map_err(|e| DatasetError::io(data_file_path(&self.prefix), e))?;
        let dir = parent_dir(&self.prefix);
        let spill_err = |e: std::io::Error| DatasetError::io(&dir, e);
        let mut lengths = self
            .lengths
            .into_inner()
            .map_err(|e| spill_err(e.into_error()))?;
        let mut document_ends = self
            .document_ends
            .into_inner()
            .map_err(|e| spill_err(e.into_error()))?;

        let idx = temp_beside(&idx_path)?;
        let idx_err = |e: std::io::Error| DatasetError::io(&idx_path, e);
        let mut out = BufWriter::with_capacity(WRITE_BUFFER, idx);
        out.write_all(&encode_header(
            self.dtype,
            summary.sequences,
            summary.documents + 1,
        ))
        .map_err(idx_err)?;
        // sequence_lengths, copied from the spill file.
        lengths.seek(SeekFrom::Start(0)).map_err(spill_err)?;
        std::io::copy(&mut lengths, &mut out).map_err(idx_err)?;
        // sequence_pointers, recomputed from the lengths in a second pass.
        lengths.seek(SeekFrom::Start(0)).map_err(spill_err)?;
        let mut reader = BufReader::with_capacity(WRITE_BUFFER, lengths);
        let itemsize = self.dtype.itemsize() as i64;
        let mut pointer = 0i64;
        for _ in 0..summary.sequences {
            out.write_i64::<LittleEndian>(pointer).map_err(idx_err)?;
            pointer += reader.read_i32::<LittleEndian>().map_err(spill_err)? as i64 * itemsize;
        }
        // document_indices: the leading 0, then each document's end.
        out.write_i64::<LittleEndian>(0).map_err(idx_err)?;
        document_ends.seek(SeekFrom::Start(0)).map_err(spill_err)?;
        std::io::copy(&mut document_ends, &mut out).map_err(idx_err)?;
        let idx = out.into_inner().map_err(|e| idx_err(e.into_error()))?;
        idx.as_file().sync_all().map_err(idx_err)?;
        Ok(FinishedDataset {
            prefix: self.prefix,
            bin,
            idx,
            summary,
        })
    }
}

/// Reinterprets a token slice as its little-endian bytes (the host is little-endian).
fn as_bytes<T: Copy>(tokens: &[T]) -> &[u8] {
    // SAFETY: u16/i32 have no padding and any alignment is valid for u8.
    unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast(), std::mem::size_of_val(tokens)) }
}

/// A completely written dataset still under temporary names; dropping it deletes them.
pub struct FinishedDataset {
    prefix: PathBuf,
    bin: NamedTempFile,
    idx: NamedTempFile,
    summary: DatasetSummary,
}

impl FinishedDataset {
    /// What was written.
    pub fn summary(&self) -> &DatasetSummary {
        &self.summary
    }

    /// Renames the files to `{prefix}.bin` and `{prefix}.idx`, replacing older ones.
    pub fn persist(self) -> Result<DatasetSummary, DatasetError> {
        let bin_path = data_file_path(&self.prefix);
        let idx_path = index_file_path(&self.prefix);
        self.bin
            .persist(&bin_path)
            .map_err(|e| DatasetError::io(&bin_path, e.error))?;
        self.idx
            .persist(&idx_path)
            .map_err(|e| DatasetError::io(&idx_path, e.error))?;
        Ok(self.summary)
    }
}
