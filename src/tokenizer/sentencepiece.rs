//! Megatron's SentencePiece tokenizers (`--tokenizer-type SentencePieceTokenizer`,
//! `GPTSentencePieceTokenizer` or `Llama2Tokenizer` with `--tokenizer-model tokenizer.model`),
//! encoded by Google's SentencePiece library itself (the `sentencepiece` crate, linked to the
//! system's `libsentencepiece` or built from its vendored source), so the ids are the
//! library's by construction.
//!
//! Current Megatron-Core (`megatron/core/tokenizers/text/libraries/sentencepiece_tokenizer.py`)
//! treats the three types alike: a document's ids are `encode_as_ids(text)` (no BOS is
//! prepended, no special tokens are added to the vocabulary), the vocabulary is the model's
//! pieces, and the end of document is the model's `eos` piece. The legacy tokenizers of
//! Megatron-LM ≤ core 0.14 differed (the legacy `Llama2Tokenizer` prepended BOS, the legacy
//! `SentencePieceTokenizer` appended `<CLS>`, `<SEP>`, `<EOD>`, … to the vocabulary); those are
//! not reproduced.

use std::path::Path;

use super::TokenizerError;

/// A loaded SentencePiece model.
pub struct SentencePiece {
    #[cfg(feature = "sentencepiece")]
    processor: sentencepiece::SentencePieceProcessor,
}

impl std::fmt::Debug for SentencePiece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentencePiece")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

#[cfg(feature = "sentencepiece")]
impl SentencePiece {
    /// Loads `tokenizer.model` (a serialized `ModelProto`).
    pub fn load(path: &Path) -> Result<Self, TokenizerError> {
        if !path.is_file() {
            return Err(TokenizerError::Io {
                path: path.to_path_buf(),
                cause: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "not a file (a SentencePiece tokenizer.model is needed)",
                ),
            });
        }
        let processor = sentencepiece::SentencePieceProcessor::open(path).map_err(|e| {
            TokenizerError::Invalid {
                file: path.display().to_string(),
                reason: format!("not a SentencePiece model: {e}"),
            }
        })?;
        Ok(Self { processor })
    }

    /// The model's pieces.
    pub fn vocab_size(&self) -> usize {
        self.processor.len()
    }

    /// The end of document: the model's `eos` piece, if it has one.
    pub fn eod(&self) -> Option<u32> {
        self.processor.eos_id()
    }

    /// Appends the ids of `text` to `out`.
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let pieces = self
            .processor
            .encode(text)
            .map_err(|e| TokenizerError::Encode(format!("SentencePiece: {e}")))?;
        out.extend(pieces.into_iter().map(|p| p.id));
        Ok(())
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size()) {
            return Err(TokenizerError::Encode(format!(
                "SentencePiece: id {bad} is not below the vocabulary size {}",
                self.vocab_size()
            )));
        }
        self.processor
            .decode_piece_ids(ids)
            .map_err(|e| TokenizerError::Encode(format!("SentencePiece: {e}")))
    }
}

/// Without the `sentencepiece` feature the types are known but refused.
#[cfg(not(feature = "sentencepiece"))]
impl SentencePiece {
    /// Always an error: this build has no SentencePiece library.
    pub fn load(_path: &Path) -> Result<Self, TokenizerError> {
        Err(TokenizerError::Unsupported(
            "this ferrotron was built without the `sentencepiece` feature; rebuild with it \
             (the default) to use SentencePiece tokenizers"
                .into(),
        ))
    }

    /// Unreachable (no value can be built).
    pub fn vocab_size(&self) -> usize {
        0
    }

    /// Unreachable (no value can be built).
    pub fn eod(&self) -> Option<u32> {
        None
    }

    /// Unreachable (no value can be built).
    pub fn encode(&self, _text: &str, _out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        Ok(())
    }

    /// Unreachable (no value can be built).
    pub fn decode(&self, _ids: &[u32]) -> Result<String, TokenizerError> {
        Ok(String::new())
    }
}
