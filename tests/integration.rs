//! The integration tests, one module per file beside this one, in one test binary.
//!
//! Why one binary: each test binary is compiled and linked on its own against the whole
//! dependency graph (burn, CubeCL, wgpu), which CI on two cores pays for every binary; and
//! libtest shares two test threads across every test of a binary, where separate binaries each
//! end with a tail that keeps one thread idle (docs/testing.md, "One test binary").
//!
//! Run one file's tests by its module: `cargo test --test integration llama::`. A test that
//! needs a process of its own (a CubeCL device, a process-wide default, MPI ranks) starts this
//! binary again for itself alone (`common::own_process`, `common::mpi`).

mod common;

mod blended_dataset;
mod context_parallel;
mod data_parallel;
mod export_and_evaluate;
mod floors;
mod fused_kernels;
mod generate;
mod golden;
mod gpt_dataset;
mod indexed_dataset;
mod inspect_tools;
mod layout_fuzz;
mod llama;
mod mixed_precision;
mod model_gradients;
mod model_reference;
mod nccl;
mod packed_documents;
mod pipeline_parallel;
mod preprocess_input;
mod pretrain;
mod sliding_window;
mod step_capture;
mod tensor_parallel;
mod tokenizer_exact;
mod training;
