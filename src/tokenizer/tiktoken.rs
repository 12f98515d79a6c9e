//! Megatron's `TikTokenizer` (`--tokenizer-type TikTokenizer --tokenizer-model vocab.json
//! --tiktoken-pattern v1|v2 --vocab-size N`): tiktoken's byte-level BPE over Megatron's JSON
//! vocabulary, with Megatron's special tokens in front of it.
//!
//! What Megatron-Core's `TikTokenTokenizer` does, and so what this does:
//! - the vocabulary file is a JSON list of `{"rank", "token_bytes" (base64), "token_str"}`,
//!   entry `i` of rank `i`, the first 256 the single bytes; it is cut to
//!   `vocab_size - num_special` entries and every rank moves up by `num_special`;
//! - ids `0..num_special` are the special tokens `<unk> <s> </s> <mask> <pad> <cls> <sep>`,
//!   then `<SPECIAL_k>` fillers; `</s>` is the end of document;
//! - a special token written in the text becomes its id (`allowed_special="all"`), and the
//!   text between special tokens is cut by the pattern on its own (so `\s+(?!\S)` sees the
//!   end there) and each piece byte-pair encoded: a piece in the vocabulary is one id,
//!   otherwise adjacent parts merge lowest rank first, the leftmost on a tie.

use std::collections::HashMap;
use std::path::Path;

use base64::Engine;
use fancy_regex::Regex;

use super::TokenizerError;

/// Megatron's `--tiktoken-pattern v1`.
const PATTERN_V1: &str =
    r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
/// Megatron's `--tiktoken-pattern v2` (case-aware, as o200k's).
const PATTERN_V2: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
/// The special tokens current Megatron-Core puts first.
const SPECIAL_TOKENS: [&str; 7] = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"];

/// Megatron's defaults.
pub const DEFAULT_NUM_SPECIAL_TOKENS: usize = 1000;
/// Megatron's `--vocab-size` default for TikTokenizer.
pub const DEFAULT_VOCAB_SIZE: usize = 131_072;

/// A loaded TikToken vocabulary.
#[derive(Debug)]
pub struct TikToken {
    ranks: HashMap<Vec<u8>, u32>,
    /// Byte strings by id (the specials' text for ids below `num_special`).
    tokens: Vec<Vec<u8>>,
    special_ids: HashMap<String, u32>,
    pattern: Regex,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    rank: usize,
    token_bytes: String,
    #[allow(dead_code)]
    token_str: serde_json::Value,
}

impl TikToken {
    /// Loads `path` as Megatron does for `--tiktoken-pattern pattern`, `--vocab-size
    /// vocab_size` and `--tiktoken-num-special-tokens num_special`.
    pub fn load(
        path: &Path,
        pattern: &str,
        vocab_size: usize,
        num_special: usize,
    ) -> Result<Self, TokenizerError> {
        let invalid = |reason: String| TokenizerError::Invalid {
            file: path.display().to_string(),
            reason,
        };
        let pattern = match pattern {
            "v1" => PATTERN_V1,
            "v2" => PATTERN_V2,
            other => {
                return Err(TokenizerError::Unsupported(format!(
                    "--tiktoken-pattern {other}: expected v1 or v2"
                )))
            }
        };
        if !(SPECIAL_TOKENS.len() <= num_special && num_special < vocab_size) {
            return Err(TokenizerError::Unsupported(format!(
                "TikTokenizer needs {} <= --tiktoken-num-special-tokens ({num_special}) < --vocab-size ({vocab_size})",
                SPECIAL_TOKENS.len()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|cause| TokenizerError::Io {
            path: path.to_path_buf(),
            cause,
        })?;
        let entries: Vec<Entry> = serde_json::from_str(&text).map_err(|e| {
            invalid(format!(
                "not Megatron's TikToken vocabulary (a JSON list of {{\"rank\", \"token_bytes\", \"token_str\"}}): {e}"
            ))
        })?;
        let wanted = vocab_size - num_special;
        if entries.len() < wanted {
            return Err(invalid(format!(
                "holds {} tokens, fewer than --vocab-size {vocab_size} - {num_special} special tokens",
                entries.len()
            )));
        }
        let specials = special_tokens(num_special);
        let special_ids = specials
            .iter()
            .enumerate()
            .map(|(id, t)| (t.clone(), id as u32))
            .collect();
        let mut tokens: Vec<Vec<u8>> = specials.into_iter().map(String::into_bytes).collect();
        let mut ranks = HashMap::with_capacity(wanted);
        for (i, entry) in entries.into_iter().take(wanted).enumerate() {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(&entry.token_bytes)
                .map_err(|e| invalid(format!("entry {i}: token_bytes is not base64: {e}")))?;
            if entry.rank != i || (i < 256 && bytes != [i as u8]) {
                return Err(invalid(format!(
                    "entry {i} has rank {} and {} bytes: entry i must have rank i, and the first 256 the single bytes",
                    entry.rank,
                    bytes.len()
                )));
            }
            if ranks
                .insert(bytes.clone(), (i + num_special) as u32)
                .is_some()
            {
                return Err(invalid(format!("entry {i} repeats an earlier token")));
            }
            tokens.push(bytes);
        }
        Ok(Self {
            ranks,
            tokens,
            special_ids,
            pattern: Regex::new(pattern).expect("Megatron's patterns compile"),
        })
    }

    /// Vocabulary size, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The end-of-document id (`</s>`).
    pub fn eod(&self) -> u32 {
        self.special_ids["</s>"]
    }

    /// Appends the ids of `text` to `out`.
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let mut start = 0;
        while let Some((at, end, id)) = self.next_special(text, start) {
            self.encode_ordinary(&text[start..at], out)?;
            out.push(id);
            start = end;
        }
        self.encode_ordinary(&text[start..], out)
    }

    /// The first special token at or after `from`: its start, end and id. Every special
    /// token is `<…>` without another `>` inside, so the candidate at each `<` ends at the
    /// next `>`.
    fn next_special(&self, text: &str, from: usize) -> Option<(usize, usize, u32)> {
        let mut search = from;
        while let Some(offset) = text[search..].find('<') {
            let at = search + offset;
            if let Some(len) = text[at..].find('>') {
                let end = at + len + 1;
                if let Some(&id) = self.special_ids.get(&text[at..end]) {
                    return Some((at, end, id));
                }
            }
            search = at + 1;
        }
        None
    }

    /// Text without special tokens: cut by the pattern, each piece byte-pair encoded.
    fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        for piece in self.pattern.find_iter(text) {
            let piece = piece.map_err(|e| TokenizerError::Encode(format!("TikTokenizer: {e}")))?;
            self.byte_pair_encode(piece.as_str().as_bytes(), out);
        }
        Ok(())
    }

    /// One piece: its id if it is in the vocabulary, else the merges of its bytes, lowest
    /// rank first and the leftmost pair on a tie. Each pair's rank is looked up once and
    /// only the two pairs beside a merge are looked up again (tiktoken's scheme), so a long
    /// piece costs one pass per merge rather than one lookup per pair per merge.
    fn byte_pair_encode(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let Some(&id) = self.ranks.get(piece) {
            out.push(id);
            return;
        }
        // Part k is piece[bounds[k]..bounds[k + 1]]; pair_ranks[k] is the rank of parts k
        // and k + 1 together (None: not in the vocabulary).
        let mut bounds: Vec<usize> = (0..=piece.len()).collect();
        let pair_rank = |bounds: &[usize], k: usize| -> Option<u32> {
            let end = *bounds.get(k + 2)?;
            self.ranks.get(&piece[bounds[k]..end]).copied()
        };
        let mut pair_ranks: Vec<Option<u32>> = (0..bounds.len().saturating_sub(2))
            .map(|k| pair_rank(&bounds, k))
            .collect();
        while let Some((_, k)) = pair_ranks
            .iter()
            .enumerate()
            .filter_map(|(k, rank)| Some(((*rank)?, k)))
            .min()
        {
            bounds.remove(k + 1);
            pair_ranks.remove(k);
            if k < pair_ranks.len() {
                pair_ranks[k] = pair_rank(&bounds, k);
            }
            if k > 0 {
                pair_ranks[k - 1] = pair_rank(&bounds, k - 1);
            }
        }
        out.extend(bounds.windows(2).map(|w| self.ranks[&piece[w[0]..w[1]]]));
    }

    /// The text of `ids` (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for &id in ids {
            let token = self.tokens.get(id as usize).ok_or_else(|| {
                TokenizerError::Encode(format!(
                    "TikTokenizer: id {id} is not below the vocabulary size {}",
                    self.tokens.len()
                ))
            })?;
            bytes.extend_from_slice(token);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// Megatron's special tokens, then `<SPECIAL_k>` up to `num_special`.
fn special_tokens(num_special: usize) -> Vec<String> {
    SPECIAL_TOKENS
        .iter()
        .map(|t| t.to_string())
        .chain((SPECIAL_TOKENS.len()..num_special).map(|k| format!("<SPECIAL_{k}>")))
        .collect()
}
