//! Megatron-style model parallelism, kept in the same pieces as Megatron-Core's
//! `tensor_parallel/` package and its `parallel_state`:
//!
//! - [`state`]: the world cut into tensor-, context-, data- and pipeline-parallel groups;
//! - [`context`]: context parallelism's load-balanced split of each sequence;
//! - [`mappings`]: the four region operators with their custom backward;
//! - [`layers`]: column-, row- and vocab-parallel modules;
//! - [`cross_entropy`]: the vocab-parallel cross-entropy;
//! - [`embedding_lookup`]: the embedding's lookup, its gradient one kernel on CubeCL devices;
//! - [`sharding`]: which part of each parameter a rank holds;
//! - [`random`]: dropout randomness that is shared or per-rank as Megatron's RNG tracker.
//!
//! The collectives themselves are in [`crate::comm`].

pub mod context;
pub mod cross_entropy;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cross_entropy_kernels;
pub mod embedding_lookup;
pub mod holdings;
pub mod layers;
pub mod mappings;
pub mod random;
pub mod sharding;
pub mod state;
