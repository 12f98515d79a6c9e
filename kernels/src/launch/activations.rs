//! Launchers of the element-wise activation kernels: GELU (with a bias over rows) and SwiGLU.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{arg, bias_arg, check_elements, element_vector_size, RowBias};
use crate::rows::cube_count;
use crate::{gelu, swiglu};

/// GELU forward of `len` elements plus an optional bias over rows: exact, or the tanh
/// approximation with `tanh`.
pub fn gelu_forward<F: Float + CubeElement>(
    client: &Client,
    input: &Handle,
    bias: RowBias<'_>,
    output: &Handle,
    len: usize,
    tanh: bool,
) {
    if len == 0 {
        return;
    }
    check_elements(len, "GELU");
    let (bias_arg, hidden) = bias_arg(input, bias, len);
    let vector = element_vector_size::<F>(client, hidden as usize);
    gelu::gelu_forward::launch::<F, f32>(
        client,
        cube_count((len / vector).div_ceil(gelu::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(gelu::UNITS_PER_CUBE),
        vector,
        arg(input, len),
        bias_arg,
        arg(output, len),
        len as u32,
        hidden,
        tanh,
        bias.is_some(),
    );
}

/// GELU backward: `grad_input` from the forward's input (and bias) and `grad_output`.
pub fn gelu_backward<F: Float + CubeElement>(
    client: &Client,
    input: &Handle,
    bias: RowBias<'_>,
    grad_output: &Handle,
    grad_input: &Handle,
    len: usize,
    tanh: bool,
) {
    if len == 0 {
        return;
    }
    check_elements(len, "GELU");
    let (bias_arg, hidden) = bias_arg(input, bias, len);
    let vector = element_vector_size::<F>(client, hidden as usize);
    gelu::gelu_backward::launch::<F, f32>(
        client,
        cube_count((len / vector).div_ceil(gelu::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(gelu::UNITS_PER_CUBE),
        vector,
        arg(input, len),
        bias_arg,
        arg(grad_output, len),
        arg(grad_input, len),
        len as u32,
        hidden,
        tanh,
        bias.is_some(),
    );
}

/// SwiGLU forward: `output = silu(gate) ⊙ up`, `len` elements each.
pub fn swiglu_forward<F: Float + CubeElement>(
    client: &Client,
    gate: &Handle,
    up: &Handle,
    output: &Handle,
    len: usize,
) {
    if len == 0 {
        return;
    }
    check_elements(len, "SwiGLU");
    let vector = element_vector_size::<F>(client, len);
    swiglu::swiglu_forward::launch::<F, f32>(
        client,
        cube_count((len / vector).div_ceil(swiglu::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(swiglu::UNITS_PER_CUBE),
        vector,
        arg(gate, len),
        arg(up, len),
        arg(output, len),
        len as u32,
    );
}

/// SwiGLU backward: `grad_gate` and `grad_up` from the forward's inputs and `grad_output`.
pub fn swiglu_backward<F: Float + CubeElement>(
    client: &Client,
    gate: &Handle,
    up: &Handle,
    grad_output: &Handle,
    grads: [&Handle; 2],
    len: usize,
) {
    if len == 0 {
        return;
    }
    check_elements(len, "SwiGLU");
    let [grad_gate, grad_up] = grads;
    let vector = element_vector_size::<F>(client, len);
    swiglu::swiglu_backward::launch::<F, f32>(
        client,
        cube_count((len / vector).div_ceil(swiglu::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(swiglu::UNITS_PER_CUBE),
        vector,
        arg(gate, len),
        arg(up, len),
        arg(grad_output, len),
        arg(grad_gate, len),
        arg(grad_up, len),
        len as u32,
    );
}
