//! RMSNorm over the last dimension: forward (saving 1/rms of each row) and backward (dx per
//! row; dγ a column sum over the rows, [`crate::columns`]).
//!
//! With `r = 1 / √(mean(x²) + ε)` and `x̂ = x · r`, the forward is `y = x̂ ⊙ γ` and the
//! backward `dx = r · (g − x̂ · mean(g ⊙ x̂))` with `g = dy ⊙ γ`, `dγ = Σ_rows dy ⊙ x̂`.

use cubecl::prelude::*;

use crate::reduce::row_vector_sum;
use crate::rows::{joined_with_residual, row_index, row_length};

/// `y = x · r · γ` per row of `cols`, `r = 1 / √(mean(x²) + ε)` (one pass for the mean of
/// the squares: no cancellation, unlike a variance). Saves `r` per row.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_forward<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    gamma: &[Vector<F, N>],
    output: &mut [Vector<F, N>],
    rstd: &mut [A],
    epsilon: f32,
    rows: u32,
    cols: u32,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) {
    let row = row_index();
    let width = cols as usize / N::value();
    let length = row_length(row, rows, width as u32);
    let u = UNIT_POS_X as usize;
    let step = lanes as usize;
    let base = row * width;
    let n = A::cast_from(cols);

    let mut local = Vector::<A, N>::new(A::new(0.0));
    let mut j = u;
    while j < length {
        let x = Vector::<A, N>::cast_from(input[base + j]);
        local += x * x;
        j += step;
    }
    let mean_square = row_vector_sum::<A, N>(local, lanes, rows_per_cube, plane_reduce) / n;
    let r = A::new(1.0) / A::sqrt(mean_square + A::cast_from(epsilon));
    let rs = Vector::<A, N>::new(r);

    j = u;
    while j < length {
        let normed = Vector::<A, N>::cast_from(input[base + j]) * rs;
        output[base + j] = Vector::<F, N>::cast_from(normed * Vector::<A, N>::cast_from(gamma[j]));
        j += step;
    }
    if u == 0 && length > 0 {
        rstd[row] = r;
    }
}

/// dx of RMSNorm per row: `dx = r · (g − x̂ · mean(g ⊙ x̂))` with `g = dy ⊙ γ`, `x̂ = x · r`;
/// with `join`, plus `residual_grad` ([`joined_with_residual`]).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward_input<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    gamma: &[Vector<F, N>],
    grad_output: &[Vector<F, N>],
    rstd: &[A],
    residual_grad: &[Vector<F, N>],
    grad_input: &mut [Vector<F, N>],
    rows: u32,
    cols: u32,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
    #[comptime] join: bool,
) {
    let row = row_index();
    let width = cols as usize / N::value();
    let length = row_length(row, rows, width as u32);
    let u = UNIT_POS_X as usize;
    let step = lanes as usize;
    let base = row * width;
    let n = A::cast_from(cols);
    let mut r = A::new(0.0);
    if length > 0 {
        r = rstd[row];
    }
    let rs = Vector::<A, N>::new(r);

    let mut local = Vector::<A, N>::new(A::new(0.0));
    let mut j = u;
    while j < length {
        let g =
            Vector::<A, N>::cast_from(grad_output[base + j]) * Vector::<A, N>::cast_from(gamma[j]);
        let x_hat = Vector::<A, N>::cast_from(input[base + j]) * rs;
        local += g * x_hat;
        j += step;
    }
    let mean_gx = row_vector_sum::<A, N>(local, lanes, rows_per_cube, plane_reduce) / n;
    let mean_gxs = Vector::<A, N>::new(mean_gx);

    j = u;
    while j < length {
        let g =
            Vector::<A, N>::cast_from(grad_output[base + j]) * Vector::<A, N>::cast_from(gamma[j]);
        let x_hat = Vector::<A, N>::cast_from(input[base + j]) * rs;
        let dx = rs * (g - x_hat * mean_gxs);
        grad_input[base + j] = joined_with_residual::<F, A, N>(dx, residual_grad, base + j, join);
        j += step;
    }
}
