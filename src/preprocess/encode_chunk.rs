//! A worker's job: turn one chunk of JSONL lines into token ids for every key.

use std::path::Path;
use std::sync::Arc;

use super::input::Chunk;
use super::jsonl::{parse_line, LineError};
use crate::tokenizer::TextEncoder;

/// A line that was not a valid document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadLine {
    /// The input file.
    pub file: Arc<Path>,
    /// 1-based line number.
    pub line: u64,
    /// What was wrong.
    pub error: LineError,
}

impl std::fmt::Display for BadLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.file.display(), self.line, self.error)
    }
}

/// The ids of one key's documents in a chunk.
#[derive(Default)]
pub(crate) struct KeyTokens {
    /// All ids, document after document.
    pub tokens: Vec<u32>,
    /// Each document's number of ids (0 for an empty document).
    pub document_lengths: Vec<u32>,
}

/// What a worker made of a chunk.
pub(crate) struct EncodedChunk {
    pub seq: u64,
    /// One entry per `--json-keys` key.
    pub keys: Vec<KeyTokens>,
    /// Documents in the chunk.
    pub documents: u64,
    /// Input bytes the chunk covered.
    pub bytes: u64,
    /// Lines skipped (with `--skip-bad-lines`).
    pub skipped: Vec<BadLine>,
    /// The first bad line, which stops the run (without `--skip-bad-lines`).
    pub failure: Option<BadLine>,
}

/// Settings every worker shares.
pub(crate) struct EncodeSettings<'a> {
    pub json_keys: &'a [String],
    pub eod: Option<u32>,
    pub skip_bad_lines: bool,
}

pub(crate) fn encode_chunk(
    chunk: &Chunk,
    settings: &EncodeSettings,
    encoder: &mut TextEncoder,
) -> EncodedChunk {
    let mut out = EncodedChunk {
        seq: chunk.seq,
        keys: settings
            .json_keys
            .iter()
            .map(|_| KeyTokens::default())
            .collect(),
        documents: 0,
        bytes: chunk.data.len() as u64,
        skipped: Vec::new(),
        failure: None,
    };
    let mut data: &[u8] = &chunk.data;
    let mut line_number = chunk.first_line;
    while !data.is_empty() {
        let (line, rest) = match memchr_newline(data) {
            Some(i) => (&data[..i], &data[i + 1..]),
            None => (data, &data[data.len()..]),
        };
        data = rest;
        let this_line = line_number;
        line_number += 1;
        match encode_line(line, settings, encoder, &mut out.keys) {
            Ok(true) => out.documents += 1,
            Ok(false) => {}
            Err(error) => {
                let bad = BadLine {
                    file: chunk.file.clone(),
                    line: this_line,
                    error,
                };
                if settings.skip_bad_lines {
                    out.skipped.push(bad);
                } else {
                    out.failure = Some(bad);
                    return out;
                }
            }
        }
    }
    out
}

fn memchr_newline(data: &[u8]) -> Option<usize> {
    data.iter().position(|&b| b == b'\n')
}

/// Encodes one line into `keys`; `Ok(false)` for a blank line. On error nothing is added.
fn encode_line(
    line: &[u8],
    settings: &EncodeSettings,
    encoder: &mut TextEncoder,
    keys: &mut [KeyTokens],
) -> Result<bool, LineError> {
    let Some(texts) = parse_line(line, settings.json_keys)? else {
        return Ok(false);
    };
    let marks: Vec<usize> = keys.iter().map(|k| k.tokens.len()).collect();
    for (i, text) in texts.iter().enumerate() {
        let key = &mut keys[i];
        let start = key.tokens.len();
        if let Err(e) = encoder.encode(text, &mut key.tokens) {
            for (k, &mark) in keys.iter_mut().zip(&marks) {
                k.tokens.truncate(mark);
            }
            for k in keys.iter_mut().take(i) {
                k.document_lengths.pop();
            }
            return Err(LineError::Tokenizer(e.to_string()));
        }
        if key.tokens.len() > start {
            if let Some(eod) = settings.eod {
                key.tokens.push(eod);
            }
        }
        key.document_lengths.push((key.tokens.len() - start) as u32);
    }
    Ok(true)
}
