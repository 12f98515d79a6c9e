//! LayerNorm over the last dimension: forward (saving the mean and 1/σ of each row) and
//! backward (dx per row; dγ, dβ reduced over rows in two stages).

use cubecl::prelude::*;

use crate::reduce::row_sum;
use crate::rows::{cube_index, row_index, row_length};

/// `y = (x − μ) / σ · γ + β` per row of `cols`, σ = √(var + ε) with the biased variance (two
/// passes: the mean, then the squared deviations). Saves μ and 1/σ per row.
///
/// The mean sums `x − x₀` (x₀ the row's first element) rather than `x`: for rows far from
/// zero the terms stay small, so a lane that sums thousands of them sequentially (one lane
/// per row on cubecl-cpu) loses no more precision than a tree would.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward<F: Float, A: Float>(
    input: &[F],
    gamma: &[F],
    beta: &[F],
    output: &mut [F],
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
    let length = row_length(row, rows, cols);
    let u = UNIT_POS_X as usize;
    let step = lanes as usize;
    let base = row * cols as usize;
    let n = A::cast_from(cols);
    let mut shift = A::new(0.0);
    if length > 0 {
        shift = A::cast_from(input[base]);
    }

    let mut local = A::new(0.0);
    let mut j = u;
    while j < length {
        local += A::cast_from(input[base + j]) - shift;
        j += step;
    }
    let mu = shift + row_sum::<A>(local, lanes, rows_per_cube, plane_reduce) / n;

    local = A::new(0.0);
    j = u;
    while j < length {
        let d = A::cast_from(input[base + j]) - mu;
        local += d * d;
        j += step;
    }
    let var = row_sum::<A>(local, lanes, rows_per_cube, plane_reduce) / n;
    let r = A::new(1.0) / A::sqrt(var + A::cast_from(epsilon));

    j = u;
    while j < length {
        let normed = (A::cast_from(input[base + j]) - mu) * r;
        output[base + j] = F::cast_from(normed * A::cast_from(gamma[j]) + A::cast_from(beta[j]));
        j += step;
    }
    if u == 0 && length > 0 {
        mean[row] = mu;
        rstd[row] = r;
    }
}

/// dx of LayerNorm per row: `dx = r · (g − mean(g) − x̂ · mean(g ⊙ x̂))` with `g = dy ⊙ γ`,
/// `x̂ = (x − μ) · r`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_input<F: Float, A: Float>(
    input: &[F],
    gamma: &[F],
    grad_output: &[F],
    mean: &[A],
    rstd: &[A],
    grad_input: &mut [F],
    rows: u32,
    cols: u32,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) {
    let row = row_index();
    let length = row_length(row, rows, cols);
    let u = UNIT_POS_X as usize;
    let step = lanes as usize;
    let base = row * cols as usize;
    let n = A::cast_from(cols);
    let mut mu = A::new(0.0);
    let mut r = A::new(0.0);
    if length > 0 {
        mu = mean[row];
        r = rstd[row];
    }

    let mut local_g = A::new(0.0);
    let mut local_gx = A::new(0.0);
    let mut j = u;
    while j < length {
        let g = A::cast_from(grad_output[base + j]) * A::cast_from(gamma[j]);
        let x_hat = (A::cast_from(input[base + j]) - mu) * r;
        local_g += g;
        local_gx += g * x_hat;
        j += step;
    }
    let mean_g = row_sum::<A>(local_g, lanes, rows_per_cube, plane_reduce) / n;
    let mean_gx = row_sum::<A>(local_gx, lanes, rows_per_cube, plane_reduce) / n;

    j = u;
    while j < length {
        let g = A::cast_from(grad_output[base + j]) * A::cast_from(gamma[j]);
        let x_hat = (A::cast_from(input[base + j]) - mu) * r;
        grad_input[base + j] = F::cast_from(r * (g - mean_g - x_hat * mean_gx));
        j += step;
    }
}

/// Stage 1 of dγ, dβ: cube `b` sums `dy ⊙ x̂` and `dy` over rows `b·block .. (b+1)·block`
/// into `partial_gamma[b, :]`, `partial_beta[b, :]` (units stride over the columns).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_params_partial<F: Float, A: Float>(
    input: &[F],
    grad_output: &[F],
    mean: &[A],
    rstd: &[A],
    partial_gamma: &mut [A],
    partial_beta: &mut [A],
    rows: u32,
    cols: u32,
    block: u32,
    #[comptime] units: u32,
) {
    let b = cube_index();
    let (rows, cols, block) = (rows as usize, cols as usize, block as usize);
    let first = b * block;
    if first >= rows {
        terminate!();
    }
    let mut last = first + block;
    if last > rows {
        last = rows;
    }
    let mut j = UNIT_POS as usize;
    while j < cols {
        let mut dg = A::new(0.0);
        let mut db = A::new(0.0);
        let mut row = first;
        while row < last {
            let dy = A::cast_from(grad_output[row * cols + j]);
            let x_hat = (A::cast_from(input[row * cols + j]) - mean[row]) * rstd[row];
            dg += dy * x_hat;
            db += dy;
            row += 1;
        }
        partial_gamma[b * cols + j] = dg;
        partial_beta[b * cols + j] = db;
        j += units as usize;
    }
}

/// Stage 2 of dγ, dβ: column `j` (one unit each) sums the `blocks` partial rows.
#[cube(launch)]
pub fn layer_norm_backward_params_final<F: Float, A: Float>(
    partial_gamma: &[A],
    partial_beta: &[A],
    grad_gamma: &mut [F],
    grad_beta: &mut [F],
    blocks: u32,
    cols: u32,
) {
    let j = ABSOLUTE_POS;
    let cols = cols as usize;
    if j >= cols {
        terminate!();
    }
    let mut dg = A::new(0.0);
    let mut db = A::new(0.0);
    let mut b = 0usize;
    while b < blocks as usize {
        dg += partial_gamma[b * cols + j];
        db += partial_beta[b * cols + j];
        b += 1;
    }
    grad_gamma[j] = F::cast_from(dg);
    grad_beta[j] = F::cast_from(db);
}
