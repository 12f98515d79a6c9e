//! Megatron's parallel building blocks (`tensor_parallel/layers.py`).

mod column_parallel_linear;
mod row_parallel_linear;
mod vocab_parallel_embedding;
mod weight_matmul;

pub use column_parallel_linear::ColumnParallelLinear;
pub use row_parallel_linear::RowParallelLinear;
pub use vocab_parallel_embedding::VocabParallelEmbedding;
pub use weight_matmul::weight_matmul;
