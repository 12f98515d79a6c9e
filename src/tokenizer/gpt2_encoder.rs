//! The fast GPT-2 encoder: exact pre-tokenizer + a per-thread memo in front of BPE.
//!
//! Natural text repeats the same few hundred thousand pre-tokens ("the", " of", ",", ...), so
//! after a short warm-up almost every pre-token is a hash-map hit and BPE runs only on new
//! words. The memo is per thread (no locks) and bounded in entries and in key length, so
//! memory stays bounded whatever the input.

use std::sync::Arc;

use rustc_hash::FxHashMap;
use tokenizers::Model;

use super::byte_level;
use super::gpt2_split::Gpt2PreTokens;
use super::gpt2_vocabulary::{Gpt2Vocabulary, GPT2_EOD_TOKEN};
use super::TokenizerError;

/// Pre-tokens longer than this are encoded but not remembered (long runs of symbols or
/// white space rarely repeat and would make the memo's memory depend on the input).
const MAX_MEMO_KEY_BYTES: usize = 64;
/// The memo is cleared when it reaches this many entries (≈ 50 MB at worst).
const MAX_MEMO_ENTRIES: usize = 1 << 20;

/// Encodes text to GPT-2 ids; one per worker thread.
pub struct Gpt2Encoder {
    vocab: Arc<Gpt2Vocabulary>,
    allow_special_tokens: bool,
    memo: FxHashMap<Box<str>, Box<[u32]>>,
    mapped: String,
}

impl Gpt2Encoder {
    /// A new encoder with an empty memo. With `allow_special_tokens`, a literal
    /// `<|endoftext|>` in the text becomes the EOD id (newer Megatron's behaviour); without
    /// it, it is ordinary text (Megatron's legacy `GPT2BPETokenizer`).
    pub fn new(vocab: Arc<Gpt2Vocabulary>, allow_special_tokens: bool) -> Self {
        Self {
            vocab,
            allow_special_tokens,
            memo: FxHashMap::default(),
            mapped: String::new(),
        }
    }

    /// Appends the ids of `text` to `out`.
    pub fn encode(&mut self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if !self.allow_special_tokens {
            return self.encode_plain(text, out);
        }
        let eod = self.vocab.eod();
        let mut segments = text.split(GPT2_EOD_TOKEN);
        if let Some(first) = segments.next() {
            self.encode_plain(first, out)?;
        }
        for segment in segments {
            out.push(eod);
            self.encode_plain(segment, out)?;
        }
        Ok(())
    }

    fn encode_plain(&mut self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        for piece in Gpt2PreTokens::new(text) {
            if let Some(ids) = self.memo.get(piece) {
                out.extend_from_slice(ids);
                continue;
            }
            self.mapped.clear();
            byte_level::encode_bytes(piece.as_bytes(), &mut self.mapped);
            let tokens = self
                .vocab
                .bpe()
                .tokenize(&self.mapped)
                .map_err(|e| TokenizerError::Encode(e.to_string()))?;
            let start = out.len();
            out.extend(tokens.iter().map(|t| t.id));
            if piece.len() <= MAX_MEMO_KEY_BYTES {
                if self.memo.len() >= MAX_MEMO_ENTRIES {
                    self.memo.clear();
                }
                self.memo.insert(piece.into(), out[start..].into());
            }
        }
        Ok(())
    }
}
