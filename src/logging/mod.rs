//! What a run writes for people to watch: TensorBoard event files (Megatron's
//! `--tensorboard-dir`), loss plots, and memory (measured and estimated before training).

pub mod loss_plot;
pub mod megatron_log;
pub mod memory;
pub mod memory_estimate;
pub mod metrics;
pub mod tensorboard;
