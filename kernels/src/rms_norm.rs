//! RMSNorm over the last dimension: forward (saving 1/rms of each row) and backward (dx per
//! row; dγ reduced over rows in two stages, as LayerNorm's dγ).
//!
//! With `r = 1 / √(mean(x²) + ε)` and `x̂ = x · r`, the forward is `y = x̂ ⊙ γ` and the
//! backward `dx = r · (g − x̂ · mean(g ⊙ x̂))` with `g = dy ⊙ γ`, `dγ = Σ_rows dy ⊙ x̂`.

use cubecl::prelude::*;

use crate::reduce::row_sum;
use crate::rows::{cube_index, row_index, row_length};

/// `y = x · r · γ` per row of `cols`, `r = 1 / √(mean(x²) + ε)` (one pass for the mean of
/// the squares: no cancellation, unlike a variance). Saves `r` per row.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_forward<F: Float, A: Float>(
    input: &[F],
    gamma: &[F],
    output: &mut [F],
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

    let mut local = A::new(0.0);
    let mut j = u;
    while j < length {
        let x = A::cast_from(input[base + j]);
        local += x * x;
        j += step;
    }
    let mean_square = row_sum::<A>(local, lanes, rows_per_cube, plane_reduce) / n;
    let r = A::new(1.0) / A::sqrt(mean_square + A::cast_from(epsilon));

    j = u;
    while j < length {
        let normed = A::cast_from(input[base + j]) * r;
        output[base + j] = F::cast_from(normed * A::cast_from(gamma[j]));
        j += step;
    }
    if u == 0 && length > 0 {
        rstd[row] = r;
    }
}

/// dx of RMSNorm per row: `dx = r · (g − x̂ · mean(g ⊙ x̂))` with `g = dy ⊙ γ`, `x̂ = x · r`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward_input<F: Float, A: Float>(
    input: &[F],
    gamma: &[F],
    grad_output: &[F],
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
    let mut r = A::new(0.0);
    if length > 0 {
        r = rstd[row];
    }

    let mut local = A::new(0.0);
    let mut j = u;
    while j < length {
        let g = A::cast_from(grad_output[base + j]) * A::cast_from(gamma[j]);
        let x_hat = A::cast_from(input[base + j]) * r;
        local += g * x_hat;
        j += step;
    }
    let mean_gx = row_sum::<A>(local, lanes, rows_per_cube, plane_reduce) / n;

    j = u;
    while j < length {
        let g = A::cast_from(grad_output[base + j]) * A::cast_from(gamma[j]);
        let x_hat = A::cast_from(input[base + j]) * r;
        grad_input[base + j] = F::cast_from(r * (g - x_hat * mean_gx));
        j += step;
    }
}

/// Stage 1 of dγ: cube `b` sums `dy ⊙ x̂` over rows `b·block .. (b+1)·block` into
/// `partial_gamma[b, :]` (units stride over the columns).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward_gamma_partial<F: Float, A: Float>(
    input: &[F],
    grad_output: &[F],
    rstd: &[A],
    partial_gamma: &mut [A],
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
        let mut row = first;
        while row < last {
            let dy = A::cast_from(grad_output[row * cols + j]);
            let x_hat = A::cast_from(input[row * cols + j]) * rstd[row];
            dg += dy * x_hat;
            row += 1;
        }
        partial_gamma[b * cols + j] = dg;
        j += units as usize;
    }
}

/// Stage 2 of dγ: column `j` (one unit each) sums the `blocks` partial rows.
#[cube(launch)]
pub fn rms_norm_backward_gamma_final<F: Float, A: Float>(
    partial_gamma: &[A],
    grad_gamma: &mut [F],
    blocks: u32,
    cols: u32,
) {
    let j = ABSOLUTE_POS;
    let cols = cols as usize;
    if j >= cols {
        terminate!();
    }
    let mut dg = A::new(0.0);
    let mut b = 0usize;
    while b < blocks as usize {
        dg += partial_gamma[b * cols + j];
        b += 1;
    }
    grad_gamma[j] = F::cast_from(dg);
}
