//! What a run writes for people to watch: TensorBoard event files (Megatron's
//! `--tensorboard-dir`).

pub mod tensorboard;
