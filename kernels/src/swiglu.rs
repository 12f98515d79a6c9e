//! SwiGLU's activation, `silu(gate) ⊙ up` with `silu(g) = g · σ(g)`, element-wise: the
//! forward reads both halves once and writes the product (composed of tensor ops it is three
//! kernels and two intermediate tensors), and the backward gives both gradients in one pass:
//! `d_up = dy · silu(g)`, `d_gate = dy · u · σ(g) · (1 + g · (1 − σ(g)))`.
//! Computed in `A` (f32) whatever the storage type.

use cubecl::prelude::*;

use crate::rows::cube_index;
use crate::vectors::spread;

/// Units per cube.
pub const UNITS_PER_CUBE: u32 = 256;

/// The logistic function `1 / (1 + e^(−x))` in each lane (0 where `e^(−x)` overflows, 1
/// where it vanishes).
#[cube]
fn sigmoid<A: Float, N: Size>(x: Vector<A, N>) -> Vector<A, N> {
    spread::<A, N>(1.0) / (spread::<A, N>(1.0) + Vector::exp(spread::<A, N>(0.0) - x))
}

/// `output[i] = silu(gate[i]) · up[i]` for the `len` elements, in vectors of `N` (which
/// divides `len`).
#[cube(launch)]
pub fn swiglu_forward<F: Float, A: Float, N: Size>(
    gate: &[Vector<F, N>],
    up: &[Vector<F, N>],
    output: &mut [Vector<F, N>],
    len: u32,
) {
    let i = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if i < len as usize / N::value() {
        let g = Vector::<A, N>::cast_from(gate[i]);
        let silu = g * sigmoid::<A, N>(g);
        output[i] = Vector::cast_from(silu * Vector::<A, N>::cast_from(up[i]));
    }
}

/// The gradients of `gate` and `up` for `grad_output` (`len` each, in vectors of `N`).
#[cube(launch)]
pub fn swiglu_backward<F: Float, A: Float, N: Size>(
    gate: &[Vector<F, N>],
    up: &[Vector<F, N>],
    grad_output: &[Vector<F, N>],
    grad_gate: &mut [Vector<F, N>],
    grad_up: &mut [Vector<F, N>],
    len: u32,
) {
    let i = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if i < len as usize / N::value() {
        let g = Vector::<A, N>::cast_from(gate[i]);
        let u = Vector::<A, N>::cast_from(up[i]);
        let dy = Vector::<A, N>::cast_from(grad_output[i]);
        let s = sigmoid::<A, N>(g);
        let one = spread::<A, N>(1.0);
        grad_up[i] = Vector::cast_from(dy * (g * s));
        grad_gate[i] = Vector::cast_from(dy * u * s * (one + g * (one - s)));
    }
}
