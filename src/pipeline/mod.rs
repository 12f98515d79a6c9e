//! Pipeline parallelism: the layer stack cut into stages on different ranks, micro-batches
//! streamed through them. This first part is the schedules (Megatron-Core's orders of forward
//! and backward passes) and a simulator that checks them; the stage executor with p2p
//! transfers builds on them.

pub mod schedule;
pub mod simulate;

pub use schedule::{
    all_forward_then_backward, interleaved_one_forward_one_backward, one_forward_one_backward,
    ScheduleError, Step,
};
pub use simulate::{simulate, Simulation};
