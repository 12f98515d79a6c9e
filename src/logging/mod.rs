//! What a run writes for people to watch: TensorBoard event files (Megatron's
//! `--tensorboard-dir`) and loss plots.

pub mod loss_plot;
pub mod memory;
pub mod tensorboard;
