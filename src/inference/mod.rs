//! Using a trained model: the KV-cached decoding loop and its sampling rules, and scoring
//! (dataset windows, Megatron's zero-shot tasks, harness log-likelihoods), and the HTTP server.

pub mod batch_generate;
pub mod beam_search;
pub mod detokenizer;
pub mod generate;
pub mod lambada;
pub mod load;
pub mod loglikelihood;
pub mod next_token_scores;
pub mod no_repeat_ngram;
pub mod sampling;
pub mod server;
pub mod stop_strings;
pub mod wikitext;
pub mod window_eval;

pub use generate::{generate, GenerateOptions, Generation};
pub use sampling::{Sampler, SamplingConfig};
