//! Tokenizers: Megatron's `GPT2BPETokenizer` (fast and exact) and HuggingFace `tokenizer.json`.

pub mod byte_level;
pub mod cli;
pub mod gpt2_encoder;
pub mod gpt2_split;
pub mod gpt2_vocabulary;
pub mod sentencepiece;
pub mod text_tokenizer;
pub mod tiktoken;

use std::path::PathBuf;

pub use cli::TokenizerArgs;
pub use gpt2_encoder::Gpt2Encoder;
pub use gpt2_split::Gpt2PreTokens;
pub use gpt2_vocabulary::{Gpt2Vocabulary, GPT2_EOD_TOKEN};
pub use text_tokenizer::{TextEncoder, TextTokenizer, TokenizerOptions, TokenizerType};

/// What can go wrong loading a tokenizer or encoding with it.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer file could not be read.
    #[error("cannot read {}: {cause}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: std::io::Error,
    },
    /// A tokenizer file was read but is not what it should be.
    #[error("{file}: {reason}")]
    Invalid {
        /// The file (and line, where known).
        file: String,
        /// What was expected.
        reason: String,
    },
    /// A flag combination or tokenizer type that cannot work.
    #[error("{0}")]
    Unsupported(String),
    /// An id outside the vocabulary was asked to be decoded.
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    UnknownId {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The underlying `tokenizers` library failed.
    #[error("tokenizer failed: {0}")]
    Encode(String),
}
