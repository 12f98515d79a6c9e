//! Reading a `.bin`/`.idx` pair through memory maps, zero-copy.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{data_file_path, index_file_path, DType, DatasetError, IndexLayout};

#[cfg(target_endian = "big")]
compile_error!(
    "ferrotron reads little-endian Megatron datasets in place and needs a little-endian host"
);

/// Token ids borrowed straight from the `.bin` memory map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokens<'a> {
    /// `uint16` storage (vocabularies below 65500).
    U16(&'a [u16]),
    /// `int32` storage.
    I32(&'a [i32]),
}

impl<'a> Tokens<'a> {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        match self {
            Self::U16(t) => t.len(),
            Self::I32(t) => t.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token `i` as an `i64` (wide enough for both storage types).
    pub fn get(&self, i: usize) -> Option<i64> {
        match self {
            Self::U16(t) => t.get(i).map(|&x| x as i64),
            Self::I32(t) => t.get(i).map(|&x| x as i64),
        }
    }

    /// The ids as `u32` (negative `int32` ids, which no tokenizer produces, wrap).
    pub fn to_u32_vec(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len());
        self.append_to(&mut out);
        out
    }

    /// Appends the ids as `u32` to `out`.
    pub fn append_to(&self, out: &mut Vec<u32>) {
        match self {
            Self::U16(t) => out.extend(t.iter().map(|&x| x as u32)),
            Self::I32(t) => out.extend(t.iter().map(|&x| x as u32)),
        }
    }

    /// A sub-range of the tokens.
    pub fn slice(&self, range: Range<usize>) -> Tokens<'a> {
        match self {
            Self::U16(t) => Self::U16(&t[range]),
            Self::I32(t) => Self::I32(&t[range]),
        }
    }
}

/// An open, validated Megatron indexed dataset.
///
/// Opening checks the whole index against the format and the `.bin` size, so every access
/// afterwards is in bounds.
pub struct IndexedDataset {
    prefix: PathBuf,
    index: Mmap,
    data: Option<Mmap>,
    layout: IndexLayout,
}

impl std::fmt::Debug for IndexedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexedDataset")
            .field("prefix", &self.prefix)
            .field("layout", &self.layout)
            .finish()
    }
}

fn map_file(path: &Path) -> Result<(Option<Mmap>, u64), DatasetError> {
    let file = File::open(path).map_err(|e| DatasetError::io(path, e))?;
    let len = file
        .metadata()
        .map_err(|e| DatasetError::io(path, e))?
        .len();
    if len == 0 {
        // Zero-length maps are an error on some systems; an empty file has nothing to map.
        return Ok((None, 0));
    }
    // SAFETY: the map is read-only; like every mmap reader (and Megatron's numpy memmap) we
    // assume the file is not truncated underneath us while it is open.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| DatasetError::io(path, e))?;
    Ok((Some(map), len))
}

impl IndexedDataset {
    /// Opens `{prefix}.bin` and `{prefix}.idx`, memory-maps both and validates the index.
    pub fn open(prefix: impl AsRef<Path>) -> Result<Self, DatasetError> {
        let prefix = prefix.as_ref().to_path_buf();
        let idx_path = index_file_path(&prefix);
        let bin_path = data_file_path(&prefix);
        let (index, _) = map_file(&idx_path)?;
        let (data, bin_len) = map_file(&bin_path)?;
        let index = match index {
            Some(m) => m,
            None => {
                return Err(DatasetError::Corrupt {
                    path: idx_path,
                    reason: "empty file (truncated index)".into(),
                })
            }
        };
        let layout =
            IndexLayout::parse(&index, bin_len).map_err(|reason| DatasetError::Corrupt {
                path: idx_path.clone(),
                reason,
            })?;
        if !layout.dtype.is_token_type() {
            return Err(DatasetError::Unsupported {
                path: idx_path,
                reason: format!(
                    "token dtype {} (code {}) is not a token type; ferrotron reads uint16 and int32",
                    layout.dtype,
                    layout.dtype.code()
                ),
            });
        }
        Ok(Self {
            prefix,
            index,
            data,
            layout,
        })
    }

    /// The prefix the dataset was opened from.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// The validated header facts.
    pub fn layout(&self) -> &IndexLayout {
        &self.layout
    }

    /// Token dtype.
    pub fn dtype(&self) -> DType {
        self.layout.dtype
    }

    /// Number of sequences.
    pub fn sequence_count(&self) -> usize {
        self.layout.sequence_count
    }

    /// Number of documents.
    pub fn document_count(&self) -> usize {
        self.layout.document_count()
    }

    /// Total number of tokens.
    pub fn total_tokens(&self) -> u64 {
        self.layout.total_tokens
    }

    /// Size of the `.bin` in bytes.
    pub fn data_bytes(&self) -> u64 {
        self.layout.total_tokens * self.layout.dtype.itemsize() as u64
    }

    /// Size of the `.idx` in bytes.
    pub fn index_bytes(&self) -> u64 {
        self.index.len() as u64
    }

    /// Length of sequence `i` in tokens. Panics if `i` is out of range, like slice indexing.
    pub fn sequence_length(&self, i: usize) -> usize {
        assert!(i < self.sequence_count(), "sequence {i} out of range");
        self.layout.sequence_length(&self.index, i)
    }

    /// Byte offset of sequence `i` in the `.bin`.
    pub fn sequence_pointer(&self, i: usize) -> u64 {
        assert!(i < self.sequence_count(), "sequence {i} out of range");
        self.layout.sequence_pointer(&self.index, i)
    }

    /// All sequence lengths, in order.
    pub fn sequence_lengths(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        (0..self.sequence_count()).map(|i| self.layout.sequence_length(&self.index, i))
    }

    /// All entries of `document_indices` (documents + 1 of them, starting at 0).
    pub fn document_indices(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        (0..self.layout.document_index_len).map(|k| self.layout.document_index(&self.index, k))
    }

    /// The sequences that make up document `d`.
    pub fn document_sequences(&self, d: usize) -> Result<Range<usize>, DatasetError> {
        if d >= self.document_count() {
            return Err(DatasetError::OutOfRange(format!(
                "document {d} does not exist: the dataset has {} documents (0..{})",
                self.document_count(),
                self.document_count()
            )));
        }
        Ok(self.layout.document_index(&self.index, d)
            ..self.layout.document_index(&self.index, d + 1))
    }

    /// Tokens of the whole `.bin` from token `start`, `len` tokens long (bounds-checked).
    fn token_span(&self, start: u64, len: usize) -> Tokens<'_> {
        if len == 0 {
            // An empty `.bin` has no map, so there is no aligned pointer to borrow from.
            return match self.dtype() {
                DType::U16 => Tokens::U16(&[]),
                _ => Tokens::I32(&[]),
            };
        }
        let bytes: &[u8] = self.data.as_deref().unwrap_or(&[]);
        let itemsize = self.dtype().itemsize();
        let from = start as usize * itemsize;
        let span = &bytes[from..from + len * itemsize];
        // SAFETY: the map is page-aligned and `from` is a multiple of the item size, so the
        // pointer is aligned for the element type; the host is little-endian like the file;
        // every bit pattern is a valid u16 / i32; the slice lives as long as `&self`.
        unsafe {
            match self.dtype() {
                DType::U16 => {
                    debug_assert_eq!(span.as_ptr() as usize % 2, 0);
                    Tokens::U16(std::slice::from_raw_parts(span.as_ptr().cast(), len))
                }
                _ => {
                    debug_assert_eq!(span.as_ptr() as usize % 4, 0);
                    Tokens::I32(std::slice::from_raw_parts(span.as_ptr().cast(), len))
                }
            }
        }
    }

    /// The tokens of sequence `i`.
    pub fn sequence(&self, i: usize) -> Tokens<'_> {
        let start = self.sequence_pointer(i) / self.dtype().itemsize() as u64;
        self.token_span(start, self.sequence_length(i))
    }

    /// `length` tokens of sequence `i` starting at `offset` (Megatron's `get(idx, offset,
    /// length)`); `None` for `length` means to the end of the sequence.
    pub fn sequence_range(
        &self,
        i: usize,
        offset: usize,
        length: Option<usize>,
    ) -> Result<Tokens<'_>, DatasetError> {
        if i >= self.sequence_count() {
            return Err(DatasetError::OutOfRange(format!(
                "sequence {i} does not exist: the dataset has {} sequences",
                self.sequence_count()
            )));
        }
        let seq_len = self.sequence_length(i);
        let length = length.unwrap_or(seq_len.saturating_sub(offset));
        if offset.checked_add(length).is_none_or(|end| end > seq_len) {
            return Err(DatasetError::OutOfRange(format!(
                "tokens {offset}..{} are outside sequence {i} of length {seq_len}",
                offset.saturating_add(length)
            )));
        }
        let start = self.sequence_pointer(i) / self.dtype().itemsize() as u64 + offset as u64;
        Ok(self.token_span(start, length))
    }

    /// The tokens of document `d` (all its sequences, which are contiguous in the `.bin`).
    pub fn document(&self, d: usize) -> Result<Tokens<'_>, DatasetError> {
        let seqs = self.document_sequences(d)?;
        if seqs.is_empty() {
            return Ok(self.token_span(0, 0));
        }
        let start = self.sequence_pointer(seqs.start) / self.dtype().itemsize() as u64;
        let len = seqs.map(|i| self.sequence_length(i)).sum();
        Ok(self.token_span(start, len))
    }

    /// Every token of the dataset, in order.
    pub fn all_tokens(&self) -> Tokens<'_> {
        self.token_span(0, self.total_tokens() as usize)
    }
}
