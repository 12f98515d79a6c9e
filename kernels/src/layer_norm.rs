//! LayerNorm over the last dimension: forward (saving the mean and 1/σ of each row) and
//! backward (dx per row; dγ, dβ are column sums over the rows, [`crate::columns`]).

use cubecl::prelude::*;

use crate::reduce::row_vector_sum;
use crate::rows::{joined_with_residual, row_index, row_length};

/// `y = (x − μ) / σ · γ + β` per row of `cols`, σ = √(var + ε) with the biased variance (two
/// passes: the mean, then the squared deviations). Saves μ and 1/σ per row.
///
/// The mean sums `x − x₀` (x₀ the row's first element) rather than `x`: for rows far from
/// zero the terms stay small, so a lane that sums thousands of them sequentially (one lane
/// per row on cubecl-cpu) loses no more precision than a tree would.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    gamma: &[Vector<F, N>],
    beta: &[Vector<F, N>],
    output: &mut [Vector<F, N>],
    mean: &mut [A],
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
    let mut shift = A::new(0.0);
    if length > 0 {
        shift = A::cast_from(input[base].extract(0usize));
    }
    let shifts = Vector::<A, N>::new(shift);

    let mut local = Vector::<A, N>::new(A::new(0.0));
    let mut j = u;
    while j < length {
        local += Vector::<A, N>::cast_from(input[base + j]) - shifts;
        j += step;
    }
    let mu = shift + row_vector_sum::<A, N>(local, lanes, rows_per_cube, plane_reduce) / n;
    let mus = Vector::<A, N>::new(mu);

    local = Vector::<A, N>::new(A::new(0.0));
    j = u;
    while j < length {
        let d = Vector::<A, N>::cast_from(input[base + j]) - mus;
        local += d * d;
        j += step;
    }
    let var = row_vector_sum::<A, N>(local, lanes, rows_per_cube, plane_reduce) / n;
    let r = A::new(1.0) / A::sqrt(var + A::cast_from(epsilon));
    let rs = Vector::<A, N>::new(r);

    j = u;
    while j < length {
        let normed = (Vector::<A, N>::cast_from(input[base + j]) - mus) * rs;
        output[base + j] = Vector::<F, N>::cast_from(
            normed * Vector::<A, N>::cast_from(gamma[j]) + Vector::<A, N>::cast_from(beta[j]),
        );
        j += step;
    }
    if u == 0 && length > 0 {
        mean[row] = mu;
        rstd[row] = r;
    }
}

/// dx of LayerNorm per row: `dx = r · (g − mean(g) − x̂ · mean(g ⊙ x̂))` with `g = dy ⊙ γ`,
/// `x̂ = (x − μ) · r`; with `join`, plus `residual_grad` (the gradient the input has from the
/// residual add that also reads it: [`joined_with_residual`]).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_input<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    gamma: &[Vector<F, N>],
    grad_output: &[Vector<F, N>],
    mean: &[A],
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
    let mut mu = A::new(0.0);
    let mut r = A::new(0.0);
    if length > 0 {
        mu = mean[row];
        r = rstd[row];
    }
    let (mus, rs) = (Vector::<A, N>::new(mu), Vector::<A, N>::new(r));

    let mut local_g = Vector::<A, N>::new(A::new(0.0));
    let mut local_gx = Vector::<A, N>::new(A::new(0.0));
    let mut j = u;
    while j < length {
        let g =
            Vector::<A, N>::cast_from(grad_output[base + j]) * Vector::<A, N>::cast_from(gamma[j]);
        let x_hat = (Vector::<A, N>::cast_from(input[base + j]) - mus) * rs;
        local_g += g;
        local_gx += g * x_hat;
        j += step;
    }
    let mean_g = row_vector_sum::<A, N>(local_g, lanes, rows_per_cube, plane_reduce) / n;
    let mean_gx = row_vector_sum::<A, N>(local_gx, lanes, rows_per_cube, plane_reduce) / n;
    let (mean_gs, mean_gxs) = (Vector::<A, N>::new(mean_g), Vector::<A, N>::new(mean_gx));

    j = u;
    while j < length {
        let g =
            Vector::<A, N>::cast_from(grad_output[base + j]) * Vector::<A, N>::cast_from(gamma[j]);
        let x_hat = (Vector::<A, N>::cast_from(input[base + j]) - mus) * rs;
        let dx = rs * (g - mean_gs - x_hat * mean_gxs);
        grad_input[base + j] = joined_with_residual::<F, A, N>(dx, residual_grad, base + j, join);
        j += step;
    }
}
