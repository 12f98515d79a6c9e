//! Fused causal attention in the manner of FlashAttention: `o = dropout(softmax(scale · q kᵀ))
//! v` per head without ever storing the `[seq, seq]` scores or probabilities. The forward
//! keeps a running maximum and sum per row (the online softmax) and saves only the row's
//! log-sum-exp; the backward recomputes each probability from it.
//!
//! Tensors are `[batch · heads, seq, head_dim]` row-major; query `i` sees keys `0..=i`. Each
//! query row (forward, backward for dq) or key row (backward for dk, dv) gets the `lanes`
//! units of [`crate::rows`]: the lanes stride over the keys (or queries), each with its own
//! running statistics and a `head_dim` accumulator, combined across the lanes at the end.
//!
//! Dropout is applied to the probabilities inside the kernels with the mask of
//! [`crate::dropout`]: element `(row, j)` of the `[batch · heads · seq, seq]` probabilities
//! has index `row · seq + j`, the index the unfused dropout gives it, so fused and unfused
//! attention drop the same probabilities for the same key. The mask is re-derived in the
//! backward, never stored.
//!
//! With `D = Σ_c do_c o_c` per query row, the backward is `dṗ = do·v` (dropped and scaled as
//! the forward), `ds = p (dṗ − D)`, `dq = scale Σ_j ds k_j`, `dk = scale Σ_i ds q_i` and
//! `dv = Σ_i p̃ do_i` with `p̃` the dropped, scaled probability.

use cubecl::prelude::*;

use crate::dropout::dropout_bits;
use crate::reduce::{row_max, row_sum};
use crate::rows::row_index;

/// A dropout draw inside attention: whether an element is kept, and what it is scaled by.
#[cube]
fn kept<A: Float>(
    index: usize,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] dropout: bool,
) -> A {
    let mut factor = A::new(1.0);
    if dropout {
        let keep = dropout_bits(key_lo, key_hi, index as u32) >= threshold;
        factor = select(keep, A::cast_from(keep_scale), A::new(0.0));
    }
    factor
}

/// Query row `row` of `rows`: whether it exists, the keys it sees (none for a unit past the
/// last row, which still joins the reductions), and the first row of its head.
#[cube]
fn query_row(row: usize, rows: u32, seq: u32) -> (bool, usize, usize) {
    let s = seq as usize;
    let active = row < rows as usize;
    let mut count = 0usize;
    let mut head_row = 0usize;
    if active {
        count = row % s + 1;
        head_row = row - row % s;
    }
    (active, count, head_row)
}

/// `Σ_c a[c] · b[base + c]` over one head row.
#[cube]
fn dot_row<F: Float, A: Float>(a: &Array<A>, b: &[F], base: usize, #[comptime] head_dim: u32) -> A {
    let mut total = A::new(0.0);
    for c in 0..head_dim as usize {
        total += a[c] * A::cast_from(b[base + c]);
    }
    total
}

/// Forward: `output` and the per-row `logsumexp` of the scaled scores (what the backward
/// needs), for `rows = batch · heads · seq` query rows.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_forward<F: Float, A: Float>(
    query: &[F],
    key: &[F],
    value: &[F],
    output: &mut [F],
    logsumexp: &mut [A],
    scale: f32,
    rows: u32,
    seq: u32,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
) {
    let row = row_index();
    let lane = UNIT_POS_X as usize;
    let (s, d) = (seq as usize, head_dim as usize);
    let (active, count, head_row) = query_row(row, rows, seq);

    let mut q = Array::<A>::new(head_dim as usize);
    let mut acc = Array::<A>::new(head_dim as usize);
    let scale = A::cast_from(scale);
    for c in 0..d {
        let mut x = A::new(0.0);
        if active {
            x = A::cast_from(query[row * d + c]) * scale;
        }
        q[c] = x;
        acc[c] = A::new(0.0);
    }

    // This lane's online softmax over keys lane, lane + lanes, …
    let mut max = A::new(-3.0e38);
    let mut sum = A::new(0.0);
    let mut j = lane;
    while j < count {
        let base = (head_row + j) * d;
        let score = dot_row::<F, A>(&q, key, base, head_dim);
        let new_max = A::max(max, score);
        let correction = A::exp(max - new_max);
        let p = A::exp(score - new_max);
        sum = sum * correction + p;
        let p = p * kept::<A>(row * s + j, key_lo, key_hi, threshold, keep_scale, dropout);
        for c in 0..d {
            acc[c] = acc[c] * correction + p * A::cast_from(value[base + c]);
        }
        max = new_max;
        j += lanes as usize;
    }

    // The lanes' statistics rescaled to the row's maximum and summed.
    let row_maximum = row_max::<A>(max, lanes, rows_per_cube);
    let factor = A::exp(max - row_maximum);
    let total = row_sum::<A>(sum * factor, lanes, rows_per_cube);
    let inv = select(total > A::new(0.0), A::new(1.0) / total, A::new(0.0));
    for c in 0..d {
        let o = row_sum::<A>(acc[c] * factor, lanes, rows_per_cube);
        if active && c % lanes as usize == lane {
            output[row * d + c] = F::cast_from(o * inv);
        }
    }
    if active && lane == 0 {
        logsumexp[row] = row_maximum + A::ln(total);
    }
}

/// Backward, per query row: `delta = Σ do ⊙ o` (saved for [`flash_attention_backward_key_value`])
/// and `grad_query`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward_query<F: Float, A: Float>(
    query: &[F],
    key: &[F],
    value: &[F],
    output: &[F],
    grad_output: &[F],
    logsumexp: &[A],
    delta: &mut [A],
    grad_query: &mut [F],
    scale: f32,
    rows: u32,
    seq: u32,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
) {
    let row = row_index();
    let lane = UNIT_POS_X as usize;
    let (s, d) = (seq as usize, head_dim as usize);
    let (active, count, head_row) = query_row(row, rows, seq);
    let mut lse = A::new(0.0);
    if active {
        lse = logsumexp[row];
    }

    let scale = A::cast_from(scale);
    let mut q = Array::<A>::new(head_dim as usize);
    let mut dout = Array::<A>::new(head_dim as usize);
    let mut dq = Array::<A>::new(head_dim as usize);
    // Every lane computes the row's delta itself (head_dim products): no reduction needed.
    let mut row_delta = A::new(0.0);
    for c in 0..d {
        let mut x = A::new(0.0);
        let mut g = A::new(0.0);
        if active {
            x = A::cast_from(query[row * d + c]) * scale;
            g = A::cast_from(grad_output[row * d + c]);
            row_delta += g * A::cast_from(output[row * d + c]);
        }
        q[c] = x;
        dout[c] = g;
        dq[c] = A::new(0.0);
    }

    let mut j = lane;
    while j < count {
        let base = (head_row + j) * d;
        let p = A::exp(dot_row::<F, A>(&q, key, base, head_dim) - lse);
        let dp = dot_row::<F, A>(&dout, value, base, head_dim)
            * kept::<A>(row * s + j, key_lo, key_hi, threshold, keep_scale, dropout);
        let ds = p * (dp - row_delta);
        for c in 0..d {
            dq[c] += ds * A::cast_from(key[base + c]);
        }
        j += lanes as usize;
    }

    for c in 0..d {
        let g = row_sum::<A>(dq[c], lanes, rows_per_cube);
        if active && c % lanes as usize == lane {
            grad_query[row * d + c] = F::cast_from(g * scale);
        }
    }
    if active && lane == 0 {
        delta[row] = row_delta;
    }
}

/// Backward, per key row: `grad_key` and `grad_value`, from the queries that see the key
/// (the row's own position onwards) and their `logsumexp` and `delta`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward_key_value<F: Float, A: Float>(
    query: &[F],
    key: &[F],
    value: &[F],
    grad_output: &[F],
    logsumexp: &[A],
    delta: &[A],
    grad_key: &mut [F],
    grad_value: &mut [F],
    scale: f32,
    rows: u32,
    seq: u32,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
) {
    let row = row_index();
    let lane = UNIT_POS_X as usize;
    let (s, d) = (seq as usize, head_dim as usize);
    let active = row < rows as usize;
    // This key's position, and the queries after it: positions `first..s` of its head.
    let mut first = s;
    let mut head_row = 0usize;
    if active {
        first = row % s;
        head_row = row - row % s;
    }

    let scale = A::cast_from(scale);
    let mut k = Array::<A>::new(head_dim as usize);
    let mut v = Array::<A>::new(head_dim as usize);
    let mut dk = Array::<A>::new(head_dim as usize);
    let mut dv = Array::<A>::new(head_dim as usize);
    for c in 0..d {
        let mut kc = A::new(0.0);
        let mut vc = A::new(0.0);
        if active {
            kc = A::cast_from(key[row * d + c]) * scale;
            vc = A::cast_from(value[row * d + c]);
        }
        k[c] = kc;
        v[c] = vc;
        dk[c] = A::new(0.0);
        dv[c] = A::new(0.0);
    }

    let mut i = first + lane;
    while i < s {
        let query_row = head_row + i;
        let base = query_row * d;
        let p = A::exp(dot_row::<F, A>(&k, query, base, head_dim) - logsumexp[query_row]);
        let keep = kept::<A>(
            query_row * s + first,
            key_lo,
            key_hi,
            threshold,
            keep_scale,
            dropout,
        );
        let dp = dot_row::<F, A>(&v, grad_output, base, head_dim) * keep;
        let ds = p * (dp - delta[query_row]);
        let p_kept = p * keep;
        for c in 0..d {
            dv[c] += p_kept * A::cast_from(grad_output[base + c]);
            dk[c] += ds * A::cast_from(query[base + c]);
        }
        i += lanes as usize;
    }

    for c in 0..d {
        let gk = row_sum::<A>(dk[c], lanes, rows_per_cube);
        let gv = row_sum::<A>(dv[c], lanes, rows_per_cube);
        if active && c % lanes as usize == lane {
            grad_key[row * d + c] = F::cast_from(gk * scale);
            grad_value[row * d + c] = F::cast_from(gv);
        }
    }
}
