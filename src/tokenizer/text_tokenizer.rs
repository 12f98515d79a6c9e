//! The tokenizer `preprocess` uses, chosen with Megatron's `--tokenizer-type`.

use std::path::PathBuf;
use std::sync::Arc;

use tokenizers::Tokenizer;

use super::sentencepiece::SentencePiece;
use super::tiktoken::TikToken;
use super::{Gpt2Encoder, Gpt2Vocabulary, TokenizerError, GPT2_EOD_TOKEN};

/// Megatron's `--tokenizer-type` values that ferrotron implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerType {
    /// `GPT2BPETokenizer`: GPT-2 byte-level BPE from `vocab.json` + `merges.txt`.
    Gpt2Bpe,
    /// `HuggingFaceTokenizer`: any `tokenizer.json` (`--tokenizer-model`).
    HuggingFace,
    /// `NullTokenizer`: the text is space-separated ids already (`--vocab-size`); for mock
    /// data and benchmarks.
    Null,
    /// `TikTokenizer`: tiktoken BPE over Megatron's JSON vocabulary (`--tokenizer-model`,
    /// `--tiktoken-pattern`, `--vocab-size`).
    TikToken,
    /// `SentencePieceTokenizer`, `GPTSentencePieceTokenizer`, `Llama2Tokenizer`: a
    /// SentencePiece `tokenizer.model` (`--tokenizer-model`), the three alike as in current
    /// Megatron-Core.
    SentencePiece,
}

/// Megatron tokenizer types that exist there but not (yet) here, for a clear message.
const MEGATRON_ONLY_TYPES: &[&str] = &[
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "MultimodalTokenizer",
];

impl std::str::FromStr for TokenizerType {
    type Err = TokenizerError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "GPT2BPETokenizer" => Ok(Self::Gpt2Bpe),
            "HuggingFaceTokenizer" => Ok(Self::HuggingFace),
            "NullTokenizer" => Ok(Self::Null),
            "TikTokenizer" => Ok(Self::TikToken),
            "SentencePieceTokenizer" | "GPTSentencePieceTokenizer" | "Llama2Tokenizer" => {
                Ok(Self::SentencePiece)
            }
            other if MEGATRON_ONLY_TYPES.contains(&other) => Err(TokenizerError::Unsupported(
                format!(
                    "--tokenizer-type {other} is not supported by ferrotron; use GPT2BPETokenizer, \
                     HuggingFaceTokenizer with --tokenizer-model tokenizer.json, TikTokenizer, \
                     a SentencePiece type or NullTokenizer"
                ),
            )),
            other => Err(TokenizerError::Unsupported(format!(
                "unknown --tokenizer-type {other:?}; expected GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer or NullTokenizer"
            ))),
        }
    }
}

/// Everything that selects and configures a tokenizer (Megatron's tokenizer flags).
#[derive(Clone, Debug)]
pub struct TokenizerOptions {
    /// `--tokenizer-type`.
    pub tokenizer_type: TokenizerType,
    /// `--vocab-file`; the embedded GPT-2 file when `None`.
    pub vocab_file: Option<PathBuf>,
    /// `--merge-file`; the embedded GPT-2 file when `None`.
    pub merge_file: Option<PathBuf>,
    /// `--tokenizer-model`: a HuggingFace `tokenizer.json`.
    pub tokenizer_model: Option<PathBuf>,
    /// `--allow-special-tokens`: special tokens written literally in the text become their ids.
    pub allow_special_tokens: bool,
    /// `--eod-token`: the end-of-document token of a HuggingFace tokenizer.
    pub eod_token: Option<String>,
    /// `--vocab-size`: NullTokenizer's and TikTokenizer's vocabulary.
    pub vocab_size: Option<usize>,
    /// `--tiktoken-pattern`: `v1` or `v2`.
    pub tiktoken_pattern: String,
    /// `--tiktoken-num-special-tokens`.
    pub tiktoken_num_special_tokens: usize,
}

impl Default for TokenizerOptions {
    fn default() -> Self {
        Self {
            tokenizer_type: TokenizerType::Gpt2Bpe,
            vocab_file: None,
            merge_file: None,
            tokenizer_model: None,
            allow_special_tokens: false,
            eod_token: None,
            vocab_size: None,
            tiktoken_pattern: "v2".into(),
            tiktoken_num_special_tokens: super::tiktoken::DEFAULT_NUM_SPECIAL_TOKENS,
        }
    }
}

/// End-of-document tokens tried, in order, when a `tokenizer.json` does not say which it uses.
const EOD_CANDIDATES: &[&str] = &[
    GPT2_EOD_TOKEN,
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eos|>",
];

/// A loaded tokenizer, shared by all workers; each worker makes its own [`TextEncoder`].
#[derive(Clone, Debug)]
pub enum TextTokenizer {
    /// Megatron's `GPT2BPETokenizer`, encoded by ferrotron's fast exact encoder.
    Gpt2 {
        /// The vocabulary and merges.
        vocab: Arc<Gpt2Vocabulary>,
        /// Whether a literal `<|endoftext|>` becomes the EOD id.
        allow_special_tokens: bool,
    },
    /// A HuggingFace `tokenizer.json`.
    HuggingFace {
        /// The tokenizer.
        tokenizer: Arc<Tokenizer>,
        /// Its end-of-document id, if one was found.
        eod: Option<u32>,
    },
    /// Megatron's `NullTokenizer`: ids written as text, `vocab_size - 1` the end of document
    /// (current Megatron-Core's default).
    Null {
        /// `--vocab-size`.
        vocab_size: u32,
    },
    /// Megatron's `TikTokenizer`.
    TikToken(Arc<TikToken>),
    /// Megatron's SentencePiece tokenizers.
    SentencePiece(Arc<SentencePiece>),
}

impl TextTokenizer {
    /// Loads the tokenizer the options describe.
    pub fn load(options: &TokenizerOptions) -> Result<Self, TokenizerError> {
        match options.tokenizer_type {
            TokenizerType::Gpt2Bpe => {
                if options.tokenizer_model.is_some() {
                    return Err(TokenizerError::Unsupported(
                        "--tokenizer-model is for HuggingFaceTokenizer; GPT2BPETokenizer takes \
                         --vocab-file and --merge-file"
                            .into(),
                    ));
                }
                let vocab = Gpt2Vocabulary::from_files(
                    options.vocab_file.as_deref(),
                    options.merge_file.as_deref(),
                )?;
                Ok(Self::Gpt2 {
                    vocab: Arc::new(vocab),
                    allow_special_tokens: options.allow_special_tokens,
                })
            }
            TokenizerType::HuggingFace => {
                let path = options.tokenizer_model.as_ref().ok_or_else(|| {
                    TokenizerError::Unsupported(
                        "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model tokenizer.json"
                            .into(),
                    )
                })?;
                if !path.is_file() {
                    return Err(TokenizerError::Io {
                        path: path.clone(),
                        cause: std::io::Error::new(
                            std::io::ErrorKind::NotFound,
                            "not a file (a local tokenizer.json is needed; nothing is downloaded)",
                        ),
                    });
                }
                let tokenizer =
                    Tokenizer::from_file(path).map_err(|e| TokenizerError::Invalid {
                        file: path.display().to_string(),
                        reason: format!("not a HuggingFace tokenizer.json: {e}"),
                    })?;
                let eod = match &options.eod_token {
                    Some(token) => Some(tokenizer.token_to_id(token).ok_or_else(|| {
                        TokenizerError::Invalid {
                            file: path.display().to_string(),
                            reason: format!("--eod-token {token:?} is not in the vocabulary"),
                        }
                    })?),
                    None => EOD_CANDIDATES.iter().find_map(|t| tokenizer.token_to_id(t)),
                };
                Ok(Self::HuggingFace {
                    tokenizer: Arc::new(tokenizer),
                    eod,
                })
            }
            TokenizerType::TikToken => {
                let path = options.tokenizer_model.as_ref().ok_or_else(|| {
                    TokenizerError::Unsupported(
                        "--tokenizer-type TikTokenizer needs --tokenizer-model (Megatron's JSON vocabulary)".into(),
                    )
                })?;
                Ok(Self::TikToken(Arc::new(TikToken::load(
                    path,
                    &options.tiktoken_pattern,
                    options
                        .vocab_size
                        .unwrap_or(super::tiktoken::DEFAULT_VOCAB_SIZE),
                    options.tiktoken_num_special_tokens,
                )?)))
            }
            TokenizerType::SentencePiece => {
                let path = options.tokenizer_model.as_ref().ok_or_else(|| {
                    TokenizerError::Unsupported(
                        "the SentencePiece tokenizer types need --tokenizer-model tokenizer.model"
                            .into(),
                    )
                })?;
                Ok(Self::SentencePiece(Arc::new(SentencePiece::load(path)?)))
            }
            TokenizerType::Null => match options.vocab_size {
                Some(n) if n >= 1 && n <= u32::MAX as usize => Ok(Self::Null {
                    vocab_size: n as u32,
                }),
                _ => Err(TokenizerError::Unsupported(
                    "--tokenizer-type NullTokenizer needs --vocab-size N (at least 1)".into(),
                )),
            },
        }
    }

    /// The embedded GPT-2 tokenizer with Megatron's legacy defaults.
    pub fn gpt2_embedded() -> Result<Self, TokenizerError> {
        Self::load(&TokenizerOptions::default())
    }

    /// Vocabulary size, added tokens included (Megatron's `tokenizer.vocab_size`); it picks
    /// the dataset dtype.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Gpt2 { vocab, .. } => vocab.vocab_size(),
            Self::HuggingFace { tokenizer, .. } => tokenizer.get_vocab_size(true),
            Self::Null { vocab_size } => *vocab_size as usize,
            Self::TikToken(t) => t.vocab_size(),
            Self::SentencePiece(t) => t.vocab_size(),
        }
    }

    /// The end-of-document id that `--append-eod` appends, if the tokenizer has one.
    pub fn eod(&self) -> Option<u32> {
        match self {
            Self::Gpt2 { vocab, .. } => Some(vocab.eod()),
            Self::HuggingFace { eod, .. } => *eod,
            Self::Null { vocab_size } => Some(vocab_size - 1),
            Self::TikToken(t) => Some(t.eod()),
            Self::SentencePiece(t) => t.eod(),
        }
    }

    /// A per-thread encoder.
    pub fn encoder(&self) -> TextEncoder {
        match self {
            Self::Gpt2 {
                vocab,
                allow_special_tokens,
            } => TextEncoder::Gpt2(Gpt2Encoder::new(vocab.clone(), *allow_special_tokens)),
            Self::HuggingFace { tokenizer, .. } => TextEncoder::HuggingFace(tokenizer.clone()),
            Self::Null { vocab_size } => TextEncoder::Null(*vocab_size),
            Self::TikToken(t) => TextEncoder::TikToken(t.clone()),
            Self::SentencePiece(t) => TextEncoder::SentencePiece(t.clone()),
        }
    }

    /// Decodes ids back to text.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        match self {
            Self::Gpt2 { vocab, .. } => vocab.decode(ids),
            Self::HuggingFace { tokenizer, .. } => tokenizer
                .decode(ids, false)
                .map_err(|e| TokenizerError::Encode(e.to_string())),
            Self::Null { .. } => Ok(ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")),
            Self::TikToken(t) => t.decode(ids),
            Self::SentencePiece(t) => t.decode(ids),
        }
    }
}

/// Encodes documents on one worker thread.
pub enum TextEncoder {
    /// The fast GPT-2 encoder with its own memo.
    Gpt2(Gpt2Encoder),
    /// A shared HuggingFace tokenizer (stateless).
    HuggingFace(Arc<Tokenizer>),
    /// NullTokenizer of this vocabulary size.
    Null(u32),
    /// A shared TikToken vocabulary (stateless).
    TikToken(Arc<TikToken>),
    /// A shared SentencePiece model (its processor is thread-safe).
    SentencePiece(Arc<SentencePiece>),
}

impl TextEncoder {
    /// Appends the ids of `text` to `out` (no EOD; the caller appends it).
    pub fn encode(&mut self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        match self {
            Self::Gpt2(encoder) => encoder.encode(text, out),
            Self::HuggingFace(tokenizer) => {
                let encoding = tokenizer
                    .encode_fast(text, true)
                    .map_err(|e| TokenizerError::Encode(e.to_string()))?;
                out.extend_from_slice(encoding.get_ids());
                Ok(())
            }
            Self::Null(vocab_size) => encode_ids(text, *vocab_size, out),
            Self::TikToken(t) => t.encode(text, out),
            Self::SentencePiece(t) => t.encode(text, out),
        }
    }
}

/// NullTokenizer's `[int(x) for x in text.split(' ')]`, each id checked against the
/// vocabulary.
fn encode_ids(text: &str, vocab_size: u32, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
    for word in text.split(' ') {
        let id: u32 = word.trim().trim_start_matches('+').parse().map_err(|_| {
            TokenizerError::Encode(format!(
                "NullTokenizer: {word:?} is not a token id (the text must be ids separated by single spaces)"
            ))
        })?;
        if id >= vocab_size {
            return Err(TokenizerError::Encode(format!(
                "NullTokenizer: id {id} is not below --vocab-size {vocab_size}"
            )));
        }
        out.push(id);
    }
    Ok(())
}

#[cfg(test)]
mod null_tokenizer_tests {
    use super::*;

    /// Megatron's `NullTokenizer`: ids as text, end of document `vocab_size - 1`; a word
    /// that is not an id, or an id outside the vocabulary, is an error naming it.
    #[test]
    fn null_tokenizer_reads_ids_and_refuses_anything_else() {
        let options = TokenizerOptions {
            tokenizer_type: "NullTokenizer".parse().unwrap(),
            vocab_size: Some(100),
            ..TokenizerOptions::default()
        };
        let tokenizer = TextTokenizer::load(&options).unwrap();
        assert_eq!((tokenizer.vocab_size(), tokenizer.eod()), (100, Some(99)));
        let mut ids = Vec::new();
        tokenizer.encoder().encode("5 17 +3 99", &mut ids).unwrap();
        assert_eq!(ids, [5, 17, 3, 99]);
        assert_eq!(tokenizer.decode(&ids).unwrap(), "5 17 3 99");
        for bad in ["5  17", "five", "100"] {
            let err = tokenizer
                .encoder()
                .encode(bad, &mut Vec::new())
                .unwrap_err();
            assert!(err.to_string().contains("NullTokenizer"), "{bad}: {err}");
        }
        let missing = TokenizerOptions {
            vocab_size: None,
            ..options
        };
        assert!(TextTokenizer::load(&missing).is_err());
    }
}
