//! Pipeline parallelism: the layer stack cut into stages on different ranks, micro-batches
//! streamed through them (Megatron-Core's `pipeline_parallel/`).
//!
//! - [`schedule`]: the orders of forward and backward passes (1F1B, interleaved 1F1B);
//! - [`simulate`]: runs the orders against the stage dependencies (bubble, memory, deadlock);
//! - [`p2p`]: activations and gradients between neighbouring stages;
//! - [`executor`]: runs a rank's order with a forward-step / backward-step of the model.

pub mod executor;
pub mod p2p;
pub mod schedule;
pub mod simulate;

pub use executor::{run_schedule, ScheduleTiming, StageWork};
pub use p2p::PipelineP2p;

pub use schedule::{
    all_forward_then_backward, interleaved_one_forward_one_backward, one_forward_one_backward,
    ScheduleError, Step,
};
pub use simulate::{simulate, Simulation};
