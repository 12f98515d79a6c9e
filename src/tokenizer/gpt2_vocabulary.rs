//! GPT-2's BPE vocabulary and merges, embedded in the binaries.
//!
//! `--vocab-file` and `--merge-file` default to these embedded copies of OpenAI's files (see
//! `assets/gpt2/ATTRIBUTION.md`), so the tools work with no download.

use std::path::Path;

use ahash::AHashMap;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::Tokenizer;

use super::byte_level;
use super::TokenizerError;

/// OpenAI's GPT-2 `vocab.json`, embedded.
pub const EMBEDDED_GPT2_VOCAB: &str = include_str!("../../assets/gpt2/vocab.json");
/// OpenAI's GPT-2 `merges.txt`, embedded.
pub const EMBEDDED_GPT2_MERGES: &str = include_str!("../../assets/gpt2/merges.txt");
/// GPT-2's end-of-document token, id 50256 in the standard vocabulary.
pub const GPT2_EOD_TOKEN: &str = "<|endoftext|>";

/// A GPT-2 byte-level BPE vocabulary: the merge model plus what decoding needs.
#[derive(Clone)]
pub struct Gpt2Vocabulary {
    bpe: BPE,
    id_to_token: Vec<String>,
    eod: u32,
}

impl std::fmt::Debug for Gpt2Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt2Vocabulary")
            .field("vocab_size", &self.id_to_token.len())
            .field("eod", &self.eod)
            .finish()
    }
}

impl Gpt2Vocabulary {
    /// The GPT-2 vocabulary compiled into ferrotron.
    pub fn embedded() -> Result<Self, TokenizerError> {
        Self::parse(
            EMBEDDED_GPT2_VOCAB,
            EMBEDDED_GPT2_MERGES,
            "embedded GPT-2 vocab.json",
            "embedded GPT-2 merges.txt",
        )
    }

    /// Reads a `vocab.json` / `merges.txt` pair, falling back to the embedded file for a
    /// path that is `None`.
    pub fn from_files(vocab: Option<&Path>, merges: Option<&Path>) -> Result<Self, TokenizerError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|cause| TokenizerError::Io {
                path: path.to_path_buf(),
                cause,
            })
        };
        let (vocab_text, vocab_name) = match vocab {
            Some(p) => (read(p)?, p.display().to_string()),
            None => (
                EMBEDDED_GPT2_VOCAB.to_owned(),
                "embedded GPT-2 vocab.json".into(),
            ),
        };
        let (merges_text, merges_name) = match merges {
            Some(p) => (read(p)?, p.display().to_string()),
            None => (
                EMBEDDED_GPT2_MERGES.to_owned(),
                "embedded GPT-2 merges.txt".into(),
            ),
        };
        Self::parse(&vocab_text, &merges_text, &vocab_name, &merges_name)
    }

    /// Builds the vocabulary from the text of `vocab.json` and `merges.txt`; the names are
    /// only used in error messages.
    pub fn parse(
        vocab_json: &str,
        merges_txt: &str,
        vocab_name: &str,
        merges_name: &str,
    ) -> Result<Self, TokenizerError> {
        let vocab: AHashMap<String, u32> =
            serde_json::from_str(vocab_json).map_err(|e| TokenizerError::Invalid {
                file: vocab_name.to_owned(),
                reason: format!("expected a JSON object of token → id: {e}"),
            })?;
        let mut merges = Vec::new();
        for (i, line) in merges_txt.lines().enumerate() {
            if line.starts_with("#version") || line.trim().is_empty() {
                continue;
            }
            let mut parts = line.split(' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(a), Some(b), None) => merges.push((a.to_owned(), b.to_owned())),
                _ => {
                    return Err(TokenizerError::Invalid {
                        file: format!("{merges_name}:{}", i + 1),
                        reason: format!("expected two space-separated symbols, found {line:?}"),
                    })
                }
            }
        }
        let mut id_to_token = vec![String::new(); vocab.len()];
        for (token, &id) in &vocab {
            let slot = id_to_token
                .get_mut(id as usize)
                .ok_or_else(|| TokenizerError::Invalid {
                    file: vocab_name.to_owned(),
                    reason: format!(
                        "id {id} of {token:?} is not below the vocabulary size {}",
                        vocab.len()
                    ),
                })?;
            *slot = token.clone();
        }
        let eod = *vocab
            .get(GPT2_EOD_TOKEN)
            .ok_or_else(|| TokenizerError::Invalid {
                file: vocab_name.to_owned(),
                reason: format!("the end-of-document token {GPT2_EOD_TOKEN} is missing"),
            })?;
        // BPE keeps its default word cache so that `reference_tokenizer` is the plain
        // `tokenizers` pipeline, untouched; ferrotron's encoder puts its own per-thread memo
        // in front, so that cache is only consulted on memo misses.
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| TokenizerError::Invalid {
                file: merges_name.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            bpe,
            id_to_token,
            eod,
        })
    }

    /// Number of ids (50257 for GPT-2).
    pub fn vocab_size(&self) -> usize {
        self.id_to_token.len()
    }

    /// Id of `<|endoftext|>`.
    pub fn eod(&self) -> u32 {
        self.eod
    }

    /// The BPE merge model.
    pub fn bpe(&self) -> &BPE {
        &self.bpe
    }

    /// Decodes ids to text; invalid UTF-8 (a multi-byte character cut by a window) is
    /// replaced with U+FFFD, and ids outside the vocabulary are an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let token = self
                .id_to_token
                .get(id as usize)
                .ok_or(TokenizerError::UnknownId {
                    id,
                    vocab_size: self.vocab_size(),
                })?;
            byte_level::decode_chars(token, &mut bytes);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The plain HuggingFace `tokenizers` pipeline for this vocabulary (byte-level
    /// pre-tokenizer with the GPT-2 regex, BPE, byte-level decoder).
    ///
    /// ferrotron's fast encoder must give exactly the same ids; tests and benchmarks use this
    /// as the reference and the baseline.
    pub fn reference_tokenizer(&self) -> Tokenizer {
        let mut tokenizer = Tokenizer::new(self.bpe.clone());
        tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
        tokenizer.with_decoder(Some(ByteLevel::default()));
        tokenizer
    }
}
