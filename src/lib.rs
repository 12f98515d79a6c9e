//! ferrotron: a Megatron-style GPT pretraining toolkit.
//!
//! - [`tokenizer`]: Megatron's `GPT2BPETokenizer` (a fast, exact GPT-2 encoder) and
//!   HuggingFace `tokenizer.json` tokenizers.
//! - [`data`]: Megatron's mmap indexed dataset (`.bin`/`.idx`): reader, streaming builder, merge.
//! - [`preprocess`]: the streaming, multi-threaded JSONL → indexed dataset pipeline.
//! - [`model`], [`train`]: Megatron's GPT on burn and its training loop.
//! - [`optim`]: gradient buffers, Adam (replicated or ZeRO-1), LR schedule, loss scaling and
//!   mixed precision.
//! - [`comm`]: communicators (threads, MPI) and their collectives on tensors of any dtype.
//! - [`parallel`]: Megatron's parallel state and tensor model parallelism (region mappings, parallel layers,
//!   vocab-parallel cross-entropy).

pub mod checkpoint;
pub mod comm;
pub mod data;
pub mod export;
pub mod inference;
pub mod logging;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod pipeline;
pub mod preprocess;
pub mod tokenizer;
pub mod training;
pub mod util;
