//! The training loop, in Megatron-Core's shape: [`pretrain`] sets up each rank
//! ([`setup`]) and loops over [`train_step`], which runs the schedule's forward and backward
//! passes ([`forward_backward`], one path for every pipeline layout), finalises the gradients
//! ([`finalize_grads`]) and steps the optimizer; [`evaluate`] gives the validation and test
//! losses. [`config`] holds the run's configuration and its batch arithmetic;
//! [`architecture_args`] the model-architecture flags the tools share.

pub mod architecture_args;
pub mod batch_size_schedule;
pub mod buffer_limits;
pub mod config;
pub mod evaluate;
pub mod finalize_grads;
pub mod forward_backward;
pub mod layer_pattern;
pub mod layout_fuzz;
pub mod megatron_command_line;
pub mod megatron_flags;
pub mod param_stats;
pub mod pretrain;
pub mod pretrain_args;
pub mod schedule_args;
pub mod setup;
pub mod step_graph;
pub mod train_step;

pub use crate::optim::{
    AdamW, AdamWConfig, GradientAccumulator, LrDecayStyle, LrSchedule, WeightDecayIncrStyle,
    WeightDecaySchedule, WsdDecayStyle,
};
pub use architecture_args::ArchitectureArgs;
pub use batch_size_schedule::BatchSizeSchedule;
pub use config::{BatchPlan, LogOptions, ParallelConfig, PretrainConfig, DEFAULT_DDP_BUCKET_SIZE};
pub use pretrain::{pretrain, pretrain_on, PretrainOutcome, ScheduledValues};
pub use schedule_args::{ResolvedSchedule, ScheduleArgs};
