//! Megatron-style tensor model parallelism, kept in the same pieces as Megatron-Core's
//! `tensor_parallel/` package:
//!
//! - [`comm`]: the process group and its collectives;
//! - [`mappings`]: the four region operators with their custom backward;
//! - [`layers`]: column-, row- and vocab-parallel modules;
//! - [`cross_entropy`]: the vocab-parallel cross-entropy;
//! - [`sharding`]: which part of each parameter a rank holds;
//! - [`random`]: dropout randomness that is shared or per-rank as Megatron's RNG tracker.

pub mod comm;
pub mod cross_entropy;
pub mod layers;
pub mod mappings;
pub mod random;
pub mod sharding;

pub use comm::{run_ranks, ProcessGroup, ReduceOp, TpGroup};
