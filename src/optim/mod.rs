//! The optimizer side of a training step, as Megatron-Core's `optimizer/` package: gradient
//! buffers and their data-parallel reduction (overlapped with the backward pass or not), one
//! optimizer interface served by Adam replicated or sharded over data-parallel ranks, the
//! mixed-precision optimizer around it (fp32 main weights behind a half-precision model, loss
//! scaling), and the learning-rate schedule.

pub mod adamw;
pub mod background_reduce;
pub mod distributed;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod flat_adam;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod fused_adam;
pub mod grad_buffer;
pub mod grad_scaler;
pub mod mixed_precision;
pub mod mixed_precision_optimizer;
pub mod optimizer;
pub mod param_scheduler;

pub use adamw::{AdamW, AdamWConfig, NamedMoments};
pub use background_reduce::BackgroundAllReduce;
pub use distributed::DistributedAdamW;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub use flat_adam::FlatAdamW;
pub use grad_buffer::{GradNorm, GradientAccumulator};
pub use grad_scaler::{DynamicGradScaler, GradScaler, GradScalerState};
pub use mixed_precision::{cast_parameters, Precision};
pub use mixed_precision_optimizer::{MixedPrecisionOptimizer, StepResult};
pub use optimizer::{Optimizer, OptimizerSetup, ReplicatedAdamW, ShardedAdamW};
pub use param_scheduler::{
    LearningRates, LrDecayStyle, LrSchedule, WeightDecayIncrStyle, WeightDecaySchedule,
    WsdDecayStyle,
};
