//! Text generation from a trained model: sampling rules and the KV-cached decoding loop.

pub mod generate;
pub mod sampling;
pub mod window_eval;

pub use generate::{generate, GenerateOptions};
pub use sampling::{Sampler, SamplingConfig};
