//! Megatron's tokenizer flags, shared by every tool that tokenizes or decodes.

use std::path::PathBuf;

use super::{TextTokenizer, TokenizerError, TokenizerOptions};

/// `--tokenizer-type`, `--vocab-file`, `--merge-file`, `--tokenizer-model`, `--eod-token`,
/// `--allow-special-tokens`, to `#[command(flatten)]` into a tool's arguments.
#[derive(clap::Args, Clone, Debug)]
pub struct TokenizerArgs {
    /// Tokenizer: GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer,
    /// SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer, or NullTokenizer.
    #[arg(long, default_value = "GPT2BPETokenizer")]
    pub tokenizer_type: String,

    /// GPT-2 vocab.json [default: the embedded GPT-2 vocabulary].
    #[arg(long)]
    pub vocab_file: Option<PathBuf>,

    /// GPT-2 merges.txt [default: the embedded GPT-2 merges].
    #[arg(long)]
    pub merge_file: Option<PathBuf>,

    /// HuggingFace tokenizer.json (HuggingFaceTokenizer), Megatron's JSON vocabulary
    /// (TikTokenizer), or a SentencePiece tokenizer.model (the SentencePiece types).
    #[arg(long)]
    pub tokenizer_model: Option<PathBuf>,

    /// End-of-document token of a HuggingFace tokenizer [default: guessed: <|endoftext|>, </s>, ...].
    #[arg(long)]
    pub eod_token: Option<String>,

    /// Treat a literal `<|endoftext|>` in the text as the EOD token (newer Megatron), instead of
    /// plain text (Megatron's legacy GPT2BPETokenizer, the default).
    #[arg(long)]
    pub allow_special_tokens: bool,

    /// NullTokenizer's vocabulary size (its end-of-document id is N - 1), or TikTokenizer's
    /// (special tokens included) [TikTokenizer default: 131072].
    #[arg(long)]
    pub vocab_size: Option<usize>,

    /// TikTokenizer's pre-tokenization regex: v1 or v2.
    #[arg(long, default_value = "v2")]
    pub tiktoken_pattern: String,

    /// TikTokenizer's special tokens (ids 0..N; the vocabulary's ranks follow).
    #[arg(long, default_value_t = super::tiktoken::DEFAULT_NUM_SPECIAL_TOKENS)]
    pub tiktoken_num_special_tokens: usize,
}

impl TokenizerArgs {
    /// The options these flags describe.
    pub fn options(&self) -> Result<TokenizerOptions, TokenizerError> {
        Ok(TokenizerOptions {
            tokenizer_type: self.tokenizer_type.parse()?,
            vocab_file: self.vocab_file.clone(),
            merge_file: self.merge_file.clone(),
            tokenizer_model: self.tokenizer_model.clone(),
            allow_special_tokens: self.allow_special_tokens,
            eod_token: self.eod_token.clone(),
            vocab_size: self.vocab_size,
            tiktoken_pattern: self.tiktoken_pattern.clone(),
            tiktoken_num_special_tokens: self.tiktoken_num_special_tokens,
        })
    }

    /// Loads the tokenizer these flags describe.
    pub fn load(&self) -> Result<TextTokenizer, TokenizerError> {
        TextTokenizer::load(&self.options()?)
    }
}
