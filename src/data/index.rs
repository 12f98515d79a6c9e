//! Parsing and validating a `.idx` file.
//!
//! Everything in an index is checked once when a dataset is opened, so that later zero-copy
//! reads can trust it: a corrupt or truncated file is an error at open, never a panic or a
//! silent out-of-bounds read at training time. This parser is also the fuzz target.

use byteorder::{ByteOrder, LittleEndian};

use super::DType;

/// The 9-byte magic every Megatron index starts with.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The only index version Megatron writes.
pub const VERSION: u64 = 1;
/// Size of the fixed header: magic, version, dtype code, sequence and document counts.
pub const HEADER_LEN: usize = 9 + 8 + 1 + 8 + 8;

/// The validated shape of an index: counts and where each array starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexLayout {
    /// Token dtype of the `.bin`.
    pub dtype: DType,
    /// Number of sequences, S.
    pub sequence_count: usize,
    /// Length of `document_indices` (documents + 1), D.
    pub document_index_len: usize,
    /// Total number of tokens in the `.bin`.
    pub total_tokens: u64,
}

fn read_u64(bytes: &[u8], at: usize) -> u64 {
    LittleEndian::read_u64(&bytes[at..at + 8])
}

fn read_i32(bytes: &[u8], at: usize) -> i32 {
    LittleEndian::read_i32(&bytes[at..at + 4])
}

/// The header: dtype, sequence count and document-index count, checked against the
/// file's length.
fn parse_header(idx: &[u8]) -> Result<(DType, u64, u64), String> {
    if idx.len() < HEADER_LEN {
        return Err(format!(
            "truncated index: {} bytes, but the header alone is {HEADER_LEN}",
            idx.len()
        ));
    }
    if &idx[..9] != MAGIC {
        return Err(format!(
            "not a Megatron index: magic is {:02x?}, expected {:02x?} (\"MMIDIDX\\0\\0\")",
            &idx[..9],
            MAGIC
        ));
    }
    let version = read_u64(idx, 9);
    if version != VERSION {
        return Err(format!(
            "unsupported index version {version}, expected {VERSION}"
        ));
    }
    let code = idx[17];
    let dtype = DType::from_code(code)
        .ok_or_else(|| format!("unknown dtype code {code}, expected 1..=8"))?;
    let s = read_u64(idx, 18);
    let d = read_u64(idx, 26);
    let expected_len = s
        .checked_mul(12)
        .and_then(|x| d.checked_mul(8).and_then(|y| x.checked_add(y)))
        .and_then(|x| x.checked_add(HEADER_LEN as u64))
        .ok_or_else(|| format!("impossible counts: {s} sequences, {d} document indices"))?;
    if (idx.len() as u64) < expected_len {
        return Err(format!(
            "truncated index: {s} sequences and {d} document indices need {expected_len} \
                 bytes, the file has {}",
            idx.len()
        ));
    }
    if idx.len() as u64 != expected_len {
        return Err(format!(
            "index has {} bytes, expected {expected_len} for {s} sequences and {d} document \
                 indices (trailing data: a multimodal index, or a corrupt file)",
            idx.len()
        ));
    }
    Ok((dtype, s, d))
}

impl IndexLayout {
    /// Checks `idx` (the whole `.idx` file) against Megatron's format and a `.bin` of
    /// `bin_len` bytes; the error says what was expected and what was found.
    pub fn parse(idx: &[u8], bin_len: u64) -> Result<Self, String> {
        let (dtype, s, d) = parse_header(idx)?;
        let (s, d) = (s as usize, d as usize);
        if d == 0 {
            return Err("document_indices is empty; it must at least hold the leading 0".into());
        }
        let itemsize = dtype.itemsize() as u64;
        check_sequences(idx, s, itemsize, bin_len)?;
        check_document_indices(idx, s, d)?;
        Ok(Self {
            dtype,
            sequence_count: s,
            document_index_len: d,
            total_tokens: bin_len / itemsize,
        })
    }

    /// Number of documents (`document_indices` has one more entry).
    pub fn document_count(&self) -> usize {
        self.document_index_len - 1
    }

    /// Length of sequence `i`; `idx` must be the bytes this layout was parsed from.
    pub fn sequence_length(&self, idx: &[u8], i: usize) -> usize {
        let at = HEADER_LEN + 4 * i;
        read_i32(idx, at) as usize
    }

    /// Byte offset of sequence `i` in the `.bin`.
    pub fn sequence_pointer(&self, idx: &[u8], i: usize) -> u64 {
        read_u64(idx, HEADER_LEN + 4 * self.sequence_count + 8 * i)
    }

    /// Entry `k` of `document_indices`.
    pub fn document_index(&self, idx: &[u8], k: usize) -> usize {
        read_u64(idx, HEADER_LEN + 12 * self.sequence_count + 8 * k) as usize
    }
}

/// Encodes an index header; shared by the builder and by tests that forge corrupt files.
pub fn encode_header(
    dtype: DType,
    sequence_count: u64,
    document_index_len: u64,
) -> [u8; HEADER_LEN] {
    let mut header = [0u8; HEADER_LEN];
    header[..9].copy_from_slice(MAGIC);
    header[9..17].copy_from_slice(&VERSION.to_le_bytes());
    header[17] = dtype.code();
    header[18..26].copy_from_slice(&sequence_count.to_le_bytes());
    header[26..34].copy_from_slice(&document_index_len.to_le_bytes());
    header
}

/// The sequence lengths and pointers: non-negative, back to back, exactly covering the
/// `.bin`'s `bin_len` bytes.
fn check_sequences(idx: &[u8], s: usize, itemsize: u64, bin_len: u64) -> Result<(), String> {
    let lengths_at = HEADER_LEN;
    let pointers_at = lengths_at + 4 * s;
    let mut expected_pointer = 0u64;
    for i in 0..s {
        let at = lengths_at + 4 * i;
        let len = read_i32(idx, at);
        if len < 0 {
            return Err(format!("sequence {i} has negative length {len}"));
        }
        let pointer = read_u64(idx, pointers_at + 8 * i);
        if pointer != expected_pointer {
            return Err(format!(
                "sequence {i} starts at byte {} of .bin, expected {expected_pointer} \
                 (sequences are stored back to back)",
                pointer as i64
            ));
        }
        expected_pointer += len as u64 * itemsize;
        if expected_pointer > bin_len {
            return Err(format!(
                "sequence {i} ends at byte {expected_pointer}, beyond the .bin's {bin_len} bytes"
            ));
        }
    }
    if expected_pointer != bin_len {
        return Err(format!(
            "the index describes {expected_pointer} bytes of tokens, but the .bin has {bin_len}"
        ));
    }
    Ok(())
}

/// The document indices: from 0, non-decreasing, ending at the sequence count.
fn check_document_indices(idx: &[u8], s: usize, d: usize) -> Result<(), String> {
    let docs_at = HEADER_LEN + 12 * s;
    let mut previous = 0u64;
    for k in 0..d {
        let value = read_u64(idx, docs_at + 8 * k);
        if k == 0 && value != 0 {
            return Err(format!(
                "document_indices[0] is {}, expected 0",
                value as i64
            ));
        }
        if value < previous || value > s as u64 {
            return Err(format!(
                "document_indices[{k}] = {} is not between the previous entry {previous} and \
                 the sequence count {s}",
                value as i64
            ));
        }
        previous = value;
    }
    if previous != s as u64 {
        return Err(format!(
            "the last document index is {previous}, expected the sequence count {s}"
        ));
    }
    Ok(())
}
