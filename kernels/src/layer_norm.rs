//! LayerNorm over the last dimension: forward (saving the mean and 1/σ of each row) and
//! backward (dx per row; dγ, dβ reduced over rows in two stages).

use cubecl::prelude::*;

use crate::reduce::{column_sum, row_vector_sum};
use crate::rows::{cube_index, row_index, row_length};

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
/// `x̂ = (x − μ) · r`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_input<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    gamma: &[Vector<F, N>],
    grad_output: &[Vector<F, N>],
    mean: &[A],
    rstd: &[A],
    grad_input: &mut [Vector<F, N>],
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
        grad_input[base + j] = Vector::<F, N>::cast_from(rs * (g - mean_gs - x_hat * mean_gxs));
        j += step;
    }
}

/// Stage 1 of dγ, dβ: cube `b` sums `dy ⊙ x̂` and `dy` over rows `b·block .. (b+1)·block`
/// into `partial_gamma[b, :]`, `partial_beta[b, :]` (units stride over the columns, a vector
/// of `N` columns each).
///
/// Four rows at a time into four accumulators each: on an H200 the one-row loop was bound by
/// the latency of each row's loads (≈ 34 µs for `[4096, 1024]` bf16, whose bytes take ≈ 3),
/// and four independent rows keep four loads in flight. The accumulators are added in a fixed
/// order, so the sums do not change from run to run.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_params_partial<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    grad_output: &[Vector<F, N>],
    mean: &[A],
    rstd: &[A],
    partial_gamma: &mut [Vector<A, N>],
    partial_beta: &mut [Vector<A, N>],
    rows: u32,
    cols: u32,
    block: u32,
    #[comptime] units: u32,
) {
    let b = cube_index();
    let (rows, width, block) = (rows as usize, cols as usize / N::value(), block as usize);
    let first = b * block;
    if first >= rows {
        terminate!();
    }
    let mut last = first + block;
    if last > rows {
        last = rows;
    }
    let mut j = UNIT_POS as usize;
    while j < width {
        let zero = Vector::<A, N>::new(A::new(0.0));
        let (mut dg0, mut dg1, mut dg2, mut dg3) = (zero, zero, zero, zero);
        let (mut db0, mut db1, mut db2, mut db3) = (zero, zero, zero, zero);
        let mut row = first;
        while row + 4 <= last {
            let dy0 = Vector::<A, N>::cast_from(grad_output[row * width + j]);
            let dy1 = Vector::<A, N>::cast_from(grad_output[(row + 1) * width + j]);
            let dy2 = Vector::<A, N>::cast_from(grad_output[(row + 2) * width + j]);
            let dy3 = Vector::<A, N>::cast_from(grad_output[(row + 3) * width + j]);
            dg0 += dy0 * normalized::<F, A, N>(input, mean, rstd, row, width, j);
            dg1 += dy1 * normalized::<F, A, N>(input, mean, rstd, row + 1, width, j);
            dg2 += dy2 * normalized::<F, A, N>(input, mean, rstd, row + 2, width, j);
            dg3 += dy3 * normalized::<F, A, N>(input, mean, rstd, row + 3, width, j);
            db0 += dy0;
            db1 += dy1;
            db2 += dy2;
            db3 += dy3;
            row += 4;
        }
        while row < last {
            let dy = Vector::<A, N>::cast_from(grad_output[row * width + j]);
            dg0 += dy * normalized::<F, A, N>(input, mean, rstd, row, width, j);
            db0 += dy;
            row += 1;
        }
        partial_gamma[b * width + j] = (dg0 + dg1) + (dg2 + dg3);
        partial_beta[b * width + j] = (db0 + db1) + (db2 + db3);
        j += units as usize;
    }
}

/// `x̂ = (x − μ) · r` of row `row`'s column vector `j`.
#[cube]
fn normalized<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    mean: &[A],
    rstd: &[A],
    row: usize,
    width: usize,
    j: usize,
) -> Vector<A, N> {
    (Vector::<A, N>::cast_from(input[row * width + j]) - Vector::<A, N>::new(mean[row]))
        * Vector::<A, N>::new(rstd[row])
}

/// Stage 2 of dγ, dβ: column vector `j` (one unit each) sums the `blocks` partial rows, four
/// at a time into four accumulators added in a fixed order (as stage 1, for the loads'
/// latency).
#[cube(launch)]
pub fn layer_norm_backward_params_final<F: Float, A: Float, N: Size>(
    partial_gamma: &[Vector<A, N>],
    partial_beta: &[Vector<A, N>],
    grad_gamma: &mut [Vector<F, N>],
    grad_beta: &mut [Vector<F, N>],
    blocks: u32,
    cols: u32,
) {
    let j = ABSOLUTE_POS;
    let width = cols as usize / N::value();
    if j >= width {
        terminate!();
    }
    grad_gamma[j] =
        Vector::<F, N>::cast_from(column_sum::<A, N>(partial_gamma, blocks as usize, width, j));
    grad_beta[j] =
        Vector::<F, N>::cast_from(column_sum::<A, N>(partial_beta, blocks as usize, width, j));
}
