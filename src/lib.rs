//! ferrotron: a Megatron-style GPT pretraining toolkit.
//!
//! - [`tokenizer`]: Megatron's `GPT2BPETokenizer` (a fast, exact GPT-2 encoder) and
//!   HuggingFace `tokenizer.json` tokenizers.
//! - [`data`]: Megatron's mmap indexed dataset (`.bin`/`.idx`): reader, streaming builder, merge.
//! - [`preprocess`]: the streaming, multi-threaded JSONL → indexed dataset pipeline.

pub mod atomic_file;
pub mod cli;
pub mod data;
pub mod model;
pub mod preprocess;
pub mod tokenizer;
pub mod train;
