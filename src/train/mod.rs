//! Training: data loading, checkpoints and the training loop (the optimizer side is in
//! [`crate::optim`], re-exported here).

pub mod checkpoint;
pub mod device;
pub mod hf_export;
pub mod hf_import;
pub mod loader;
pub mod megatron_log;
pub mod pipeline_step;
pub mod pretrain;
pub mod tensor_file;
pub mod window_eval;

pub use crate::optim::{AdamW, AdamWConfig, GradientAccumulator, LrDecayStyle, LrSchedule};
pub use pretrain::{pretrain, PretrainConfig, PretrainOutcome};
