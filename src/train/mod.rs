//! Training: Megatron's optimizer, learning-rate schedule and training loop.

pub mod lr_schedule;
pub mod optimizer;

pub use lr_schedule::{LrDecayStyle, LrSchedule};
pub use optimizer::{AdamW, AdamWConfig, GradientAccumulator};
