//! Training: Megatron's optimizer, learning-rate schedule, data loading, checkpoints and the
//! training loop.

pub mod checkpoint;
pub mod device;
pub mod distributed_optimizer;
pub mod hf_export;
pub mod hf_import;
pub mod loader;
pub mod lr_schedule;
pub mod megatron_log;
pub mod optimizer;
pub mod pretrain;
pub mod tensor_file;
pub mod window_eval;

pub use lr_schedule::{LrDecayStyle, LrSchedule};
pub use optimizer::{AdamW, AdamWConfig, GradientAccumulator};
pub use pretrain::{pretrain, PretrainConfig, PretrainOutcome};
