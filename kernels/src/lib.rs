//! ferrotron's fused CubeCL kernels.
//!
//! This crate will hold the scaled (causal-)masked softmax and layernorm kernels that the model
//! uses through a burn backend extension. It is part of the workspace from the start so that
//! the layout is fixed; the kernels themselves arrive with the kernel work.
