//! Megatron's fused softmaxes: `y = softmax(scale · x)` over the last dimension with masked
//! positions excluded, and the backward `dx = scale · y ⊙ (dy − Σ dy ⊙ y)`.
//!
//! Rows map onto cubes as [`crate::rows`] says; the lanes of a row stride over it, so any
//! row length works (Megatron's kernels stop at 4096). Masked positions get exactly 0 and
//! fully masked rows are all 0 (Megatron's fill of −10000 gives the same zeros in f32 except
//! for fully masked rows, which it leaves uniform).

use cubecl::prelude::*;

use crate::reduce::{row_max, row_sum};
use crate::rows::{row_index, row_length};

/// Softmax of one row of `sk` over the columns `j` where `keep(j)`; writes `output`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn masked_row_softmax<F: Float, A: Float>(
    input: &[F],
    output: &mut [F],
    mask: &[u32],
    base: usize,
    mask_base: usize,
    causal_limit: usize,
    scale: f32,
    sk: usize,
    #[comptime] use_mask: bool,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) {
    let u = UNIT_POS_X as usize;
    let step = lanes as usize;
    let scale = A::cast_from(scale);

    let mut local_max = A::new(-3.0e38);
    let mut j = u;
    while j < sk {
        let mut keep = j < causal_limit;
        if use_mask {
            keep = keep && mask[mask_base + j] == 0;
        }
        if keep {
            local_max = A::max(local_max, scale * A::cast_from(input[base + j]));
        }
        j += step;
    }
    let max = row_max::<A>(local_max, lanes, rows_per_cube, plane_reduce);

    let mut local_sum = A::new(0.0);
    j = u;
    while j < sk {
        let mut keep = j < causal_limit;
        if use_mask {
            keep = keep && mask[mask_base + j] == 0;
        }
        if keep {
            local_sum += A::exp(scale * A::cast_from(input[base + j]) - max);
        }
        j += step;
    }
    let sum = row_sum::<A>(local_sum, lanes, rows_per_cube, plane_reduce);
    let inv = select(sum > A::new(0.0), A::new(1.0) / sum, A::new(0.0));

    j = u;
    while j < sk {
        let mut keep = j < causal_limit;
        if use_mask {
            keep = keep && mask[mask_base + j] == 0;
        }
        let mut y = A::new(0.0);
        if keep {
            y = A::exp(scale * A::cast_from(input[base + j]) - max) * inv;
        }
        output[base + j] = F::cast_from(y);
        j += step;
    }
}

/// Softmax forward of `input` `[batch, heads, sq, sk]` (flattened to `rows = batch · heads ·
/// sq` rows of `sk`) into `output`.
///
/// With `causal`, query `i` sees keys `j ≤ i + (sk − sq)` (Megatron's upper-triangular mask);
/// with `padded`, `mask` `[batch, 1, sq, sk]` hides keys where it is non-zero (Megatron's
/// padding mask; one mask row serves all heads). A kernel without `padded` never reads
/// `mask` (its launcher binds any buffer there).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn masked_softmax_forward<F: Float, A: Float>(
    input: &[F],
    mask: &[u32],
    output: &mut [F],
    scale: f32,
    rows: u32,
    heads: u32,
    sq: u32,
    sk: u32,
    #[comptime] causal: bool,
    #[comptime] padded: bool,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) {
    let row = row_index();
    let length = row_length(row, rows, sk);
    let (sq, sk) = (sq as usize, sk as usize);
    let query = row % sq;
    let mut limit = length;
    if causal && length > 0 {
        limit = query + 1 + sk - sq;
    }
    let batch = row / (sq * heads as usize);
    masked_row_softmax::<F, A>(
        input,
        output,
        mask,
        row * sk,
        (batch * sq + query) * sk,
        limit,
        scale,
        length,
        padded,
        lanes,
        rows_per_cube,
        plane_reduce,
    );
}

/// Softmax backward for both masks: `dx = scale · y ⊙ (dy − Σ_j dy ⊙ y)` per row of `sk`
/// (masked positions have `y = 0`, so they get 0).
#[cube(launch)]
pub fn softmax_backward<F: Float, A: Float>(
    output: &[F],
    grad_output: &[F],
    grad_input: &mut [F],
    scale: f32,
    rows: u32,
    sk: u32,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) {
    let row = row_index();
    let length = row_length(row, rows, sk);
    let u = UNIT_POS_X as usize;
    let step = lanes as usize;
    let base = row * sk as usize;
    let mut local = A::new(0.0);
    let mut j = u;
    while j < length {
        local += A::cast_from(grad_output[base + j]) * A::cast_from(output[base + j]);
        j += step;
    }
    let dot = row_sum::<A>(local, lanes, rows_per_cube, plane_reduce);
    let scale = A::cast_from(scale);
    j = u;
    while j < length {
        let y = A::cast_from(output[base + j]);
        let dy = A::cast_from(grad_output[base + j]);
        grad_input[base + j] = F::cast_from(scale * y * (dy - dot));
        j += step;
    }
}
