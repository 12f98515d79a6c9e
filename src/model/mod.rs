//! Megatron's GPT on burn: pre-norm transformer blocks and a padded vocabulary, in GPT-2's
//! form (LayerNorm, learned positions, GELU, tied output layer) or the Llama family's (RMSNorm,
//! rotary embeddings, SwiGLU, grouped-query attention, untied output layer), as Megatron-Core's
//! `GPTModel` builds either from its flags.
//!
//! burn 0.22 picks the backend at run time from the [`burn::tensor::Device`] (Flex on CPU,
//! wgpu, CUDA; autodiff is a property of the device), so the model is written once, without a
//! backend type parameter, and runs wherever its device is.

pub mod architecture;
pub mod attention;
pub mod attention_backend;
pub mod config;
pub mod documents;
pub mod dropout;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod fused;
pub mod gpt;
pub mod kernel_plan;
pub mod kv_cache;
pub mod loss;
pub mod mlp;
pub mod named_parameters;
pub mod norm;
pub mod ops;
pub mod recompute;
pub mod rotary;
pub mod stage;
pub mod transformer_block;
pub mod vocab;

pub use architecture::{Normalization, PositionEmbedding, RopeScaling, YarnScaling};
pub use config::GptConfig;
pub use documents::Documents;
pub use gpt::Gpt;
pub use kv_cache::KvCache;
pub use loss::{lm_loss, parallel_lm_loss};
pub use recompute::Recompute;
pub use stage::StageLayers;
pub use vocab::padded_vocab_size;
