//! Cross-entropy of rows of logits against a target column, one kernel each way (Megatron's
//! `vocab_parallel_cross_entropy` on one rank, and `--cross-entropy-loss-fusion`).
//!
//! Why: composed of tensor ops, the loss and its gradient are about thirty launches, most of
//! them a full pass over `[tokens, vocabulary]` (the largest activation of a GPT: `tokens ×
//! vocabulary × 4` bytes in f32). Here the forward reads each row twice (its maximum, then
//! its sum of exponentials) and writes two numbers per row; the backward reads each row once
//! and writes its gradient `(softmax − one-hot) · dloss`, recomputing the softmax from the
//! saved log-sum-exp instead of storing it.
//!
//! Rows map onto cubes as [`crate::rows`] says.

use cubecl::prelude::*;

use crate::reduce::{row_vector_max, row_vector_sum};
use crate::rows::{row_index, row_length};
use crate::vectors::positions;

/// Per row `r` of `cols` logits: `logsumexp[r] = log Σ_j exp(x_rj)` and
/// `loss[r] = logsumexp[r] − x_r,target[r]`. A row whose `inside[r]` is 0 (its target lies in
/// another rank's vocabulary shard), or whose target is outside `0..cols`, adds no target
/// term. The logits are read in vectors of `N` (which divides `cols`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_forward<F: Float, A: Float, N: Size>(
    logits: &[Vector<F, N>],
    targets: &[i32],
    inside: &[A],
    loss: &mut [A],
    logsumexp: &mut [A],
    rows: u32,
    cols: u32,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) {
    let row = row_index();
    let width = cols as usize / N::value();
    let length = row_length(row, rows, width as u32);
    let base = row * width;
    let step = lanes as usize;

    let mut local_max = Vector::<A, N>::new(A::new(-3.0e38));
    let mut j = UNIT_POS_X as usize;
    while j < length {
        local_max = max(local_max, Vector::<A, N>::cast_from(logits[base + j]));
        j += step;
    }
    let max = row_vector_max::<A, N>(local_max, lanes, rows_per_cube, plane_reduce);
    let maxes = Vector::<A, N>::new(max);

    let mut local_sum = Vector::<A, N>::new(A::new(0.0));
    j = UNIT_POS_X as usize;
    while j < length {
        local_sum += Vector::exp(Vector::<A, N>::cast_from(logits[base + j]) - maxes);
        j += step;
    }
    let sum = row_vector_sum::<A, N>(local_sum, lanes, rows_per_cube, plane_reduce);

    if UNIT_POS_X == 0 && length > 0 {
        let lse = max + A::ln(sum);
        let target = targets[row];
        let mut picked = A::new(0.0);
        if inside[row] > A::new(0.0) && target >= 0 && (target as u32) < cols {
            let at = target as usize;
            let vector = logits[base + at / N::value()];
            picked = A::cast_from(vector.extract_dynamic(at % N::value()));
        }
        loss[row] = lse - picked;
        logsumexp[row] = lse;
    }
}

/// `grad_logits[r, j] = (exp(x_rj − logsumexp[r]) − [j = target[r]] · inside[r]) · grad_loss[r]`:
/// with the log-sum-exp over the whole vocabulary, a shard's rows need no communication.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward<F: Float, A: Float, N: Size>(
    logits: &[Vector<F, N>],
    targets: &[i32],
    inside: &[A],
    logsumexp: &[A],
    grad_loss: &[A],
    grad_logits: &mut [Vector<F, N>],
    rows: u32,
    cols: u32,
    #[comptime] lanes: u32,
) {
    let row = row_index();
    let width = cols as usize / N::value();
    let length = row_length(row, rows, width as u32);
    if length > 0 {
        let base = row * width;
        let lse = Vector::<A, N>::new(logsumexp[row]);
        let g = Vector::<A, N>::new(grad_loss[row]);
        let mut target = targets[row];
        if inside[row] <= A::new(0.0) {
            target = -1;
        }
        // (A target of −1 wraps to a position no column has.)
        let targets = Vector::<u32, N>::new(target as u32);
        let (one, zero) = (
            Vector::<A, N>::new(A::new(1.0)),
            Vector::<A, N>::new(A::new(0.0)),
        );
        let mut j = UNIT_POS_X as usize;
        while j < length {
            let p = Vector::exp(Vector::<A, N>::cast_from(logits[base + j]) - lse);
            let hit = select_many(positions::<N>(j).equal(&targets), one, zero);
            grad_logits[base + j] = Vector::<F, N>::cast_from((p - hit) * g);
            j += lanes as usize;
        }
    }
}
