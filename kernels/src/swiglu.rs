//! SwiGLU's activation, `silu(gate) ⊙ up` with `silu(g) = g · σ(g)`, element-wise: the
//! forward reads both halves once and writes the product (composed of tensor ops it is three
//! kernels and two intermediate tensors), and the backward gives both gradients in one pass:
//! `d_up = dy · silu(g)`, `d_gate = dy · u · σ(g) · (1 + g · (1 − σ(g)))`.
//! Computed in `A` (f32) whatever the storage type.

use cubecl::prelude::*;

use crate::rows::cube_index;

/// Units per cube.
pub const UNITS_PER_CUBE: u32 = 256;

/// The logistic function `1 / (1 + e^(−x))` (0 where `e^(−x)` overflows, 1 where it
/// vanishes).
#[cube]
fn sigmoid<A: Float>(x: A) -> A {
    A::new(1.0) / (A::new(1.0) + A::exp(A::new(0.0) - x))
}

/// `output[i] = silu(gate[i]) · up[i]` for `i < len`.
#[cube(launch)]
pub fn swiglu_forward<F: Float, A: Float>(gate: &[F], up: &[F], output: &mut [F], len: u32) {
    let i = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if i < len as usize {
        let g = A::cast_from(gate[i]);
        let silu = g * sigmoid::<A>(g);
        output[i] = F::cast_from(silu * A::cast_from(up[i]));
    }
}

/// The gradients of `gate` and `up` for `grad_output` (`len` each).
#[cube(launch)]
pub fn swiglu_backward<F: Float, A: Float>(
    gate: &[F],
    up: &[F],
    grad_output: &[F],
    grad_gate: &mut [F],
    grad_up: &mut [F],
    len: u32,
) {
    let i = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if i < len as usize {
        let g = A::cast_from(gate[i]);
        let u = A::cast_from(up[i]);
        let dy = A::cast_from(grad_output[i]);
        let s = sigmoid::<A>(g);
        grad_up[i] = F::cast_from(dy * (g * s));
        grad_gate[i] = F::cast_from(dy * u * s * (A::new(1.0) + g * (A::new(1.0) - s)));
    }
}
