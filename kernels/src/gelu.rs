//! GELU, element-wise, one kernel each way. Composed of tensor ops the exact form
//! `0.5 · x · (1 + erf(x / √2))` is five kernels forward and about twice that backward; here
//! the forward reads `x` once and writes `y`, and the backward reads `x` and `dy` once and
//! writes `dx`:
//! - exact (Megatron's default): `y = x · Φ(x)`, `dy/dx = Φ(x) + x · φ(x)`, with
//!   `Φ(x) = (1 + erf(x / √2)) / 2` and `φ(x) = e^(−x²/2) / √(2π)`;
//! - tanh (`--openai-gelu`): `y = x · (1 + tanh u) / 2`, `u = √(2/π) · (x + 0.044715 x³)`,
//!   `dy/dx = (1 + tanh u) / 2 + x · (1 − tanh² u) / 2 · √(2/π) · (1 + 3 · 0.044715 x²)`,
//!   computed through the logistic of `2u` (the same function, accurate in the tails).
//!
//! Computed in `A` (f32) whatever the storage type. With a bias (Megatron's bias-GELU fusion,
//! the column-parallel layer's bias added here instead of in a launch of its own) the input is
//! `x + bias[i % hidden]`, added in the storage type as the composed add rounds it.

use cubecl::prelude::*;

use crate::rows::cube_index;
use crate::vectors::spread;

/// Units per cube.
pub const UNITS_PER_CUBE: u32 = 256;

/// `1 / √2`.
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1 / √(2π)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
/// `√(2/π)`.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic coefficient of the tanh approximation.
const CUBIC: f32 = 0.044_715;

/// `(y, dy/dx)` at each lane of `x`.
#[cube]
pub(crate) fn gelu_and_slope<A: Float, N: Size>(
    x: Vector<A, N>,
    #[comptime] tanh: bool,
) -> (Vector<A, N>, Vector<A, N>) {
    let half = spread::<A, N>(0.5);
    let one = spread::<A, N>(1.0);
    if comptime![tanh] {
        // (1 + tanh u) / 2 is the logistic of 2u, which stays accurate where tanh u rounds
        // to ±1; (1 − tanh² u) / 2 = 2 · s · (1 − s).
        let u = spread::<A, N>(SQRT_2_OVER_PI) * (x + spread::<A, N>(CUBIC) * x * x * x);
        let s = one / (one + Vector::exp(spread::<A, N>(-2.0) * u));
        let du = spread::<A, N>(SQRT_2_OVER_PI) * (one + spread::<A, N>(3.0 * CUBIC) * x * x);
        (x * s, s + spread::<A, N>(2.0) * x * s * (one - s) * du)
    } else {
        let cdf = half * (one + Vector::erf(x * spread::<A, N>(FRAC_1_SQRT_2)));
        let pdf = spread::<A, N>(FRAC_1_SQRT_2PI) * Vector::exp(spread::<A, N>(0.0) - half * x * x);
        (x * cdf, cdf + x * pdf)
    }
}

/// Vector `i`'s GELU input: `input[i]`, plus `bias[i % width]` with `has_bias` (`width`
/// vectors of bias per row).
#[cube]
fn biased<F: Float, N: Size>(
    input: &[Vector<F, N>],
    bias: &[Vector<F, N>],
    i: usize,
    width: usize,
    #[comptime] has_bias: bool,
) -> Vector<F, N> {
    let mut x = input[i];
    if has_bias {
        x += bias[i % width];
    }
    x
}

/// `output[i] = gelu(input[i] (+ bias[i % hidden]))` for the `len` elements, in vectors of
/// `N` (which divides `len` and `hidden`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gelu_forward<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    bias: &[Vector<F, N>],
    output: &mut [Vector<F, N>],
    len: u32,
    hidden: u32,
    #[comptime] tanh: bool,
    #[comptime] has_bias: bool,
) {
    let i = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if i < len as usize / N::value() {
        let x = biased::<F, N>(input, bias, i, hidden as usize / N::value(), has_bias);
        let (y, _) = gelu_and_slope::<A, N>(Vector::cast_from(x), tanh);
        output[i] = Vector::cast_from(y);
    }
}

/// `grad_input[i] = grad_output[i] · gelu'(input[i] (+ bias[i % hidden]))` for the `len`
/// elements, in vectors of `N`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gelu_backward<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    bias: &[Vector<F, N>],
    grad_output: &[Vector<F, N>],
    grad_input: &mut [Vector<F, N>],
    len: u32,
    hidden: u32,
    #[comptime] tanh: bool,
    #[comptime] has_bias: bool,
) {
    let i = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if i < len as usize / N::value() {
        let x = biased::<F, N>(input, bias, i, hidden as usize / N::value(), has_bias);
        let (_, slope) = gelu_and_slope::<A, N>(Vector::cast_from(x), tanh);
        grad_input[i] = Vector::cast_from(Vector::<A, N>::cast_from(grad_output[i]) * slope);
    }
}
