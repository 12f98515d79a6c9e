//! Fused causal attention for CPU SIMD runtimes (lavapipe): the same math, dropout bits and
//! outputs as [`crate::attention`], laid out for a device whose plane is its vector unit.
//!
//! Why a second layout: lavapipe runs a plane's units as the lanes of one vector register,
//! and reads shared memory at a per-unit address one lane at a time (a loop over the lanes
//! for each value), while a plane broadcast is one register shuffle. The tiled kernels read
//! a shared value for every two or four multiply-adds; here nothing is read from shared
//! memory at all. A cube is one plane of `plane` units; each unit holds `rows` query (or key)
//! rows of the block in registers, and the other side's tile — `plane` rows, one per unit,
//! loaded straight from the tensor — reaches every unit by broadcast, one quad at a time.

use cubecl::prelude::*;

use crate::attention::{
    cube_block, kept, probability_and_gradient, quad_sum, quads, Quad, RowStats,
};

/// Row `row` of a `[rows, head_dim]` tensor as [`Quad`]s into `target` from quad `at` (zeros
/// past `head_dim`, and all zeros where `active` is false).
#[cube]
fn load_row<F: Float, A: Float>(
    source: &[F],
    row: usize,
    active: bool,
    target: &mut Array<Quad<A>>,
    at: usize,
    #[comptime] head_dim: u32,
) {
    let d = head_dim as usize;
    #[unroll]
    for q in 0..comptime!(quads(head_dim)) {
        let mut x = Quad::<A>::broadcast(A::new(0.0));
        #[unroll]
        for lane in 0..4usize {
            if active && q * 4 + lane < d {
                x.insert(lane, A::cast_from(source[row * d + q * 4 + lane]));
            }
        }
        target[at + q] = x;
    }
}

/// `count` quads of zeros.
#[cube]
fn zeros<A: Float>(#[comptime] count: usize) -> Array<Quad<A>> {
    let mut out = Array::<Quad<A>>::new(count);
    #[unroll]
    for e in 0..count {
        out[e] = Quad::<A>::broadcast(A::new(0.0));
    }
    out
}

/// Quads `at..` of `acc` (one row), times `factor`, into row `row` of `target` where `active`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_row<F: Float, A: Float>(
    acc: &Array<Quad<A>>,
    at: usize,
    factor: A,
    target: &mut [F],
    row: usize,
    active: bool,
    #[comptime] head_dim: u32,
) {
    let d = head_dim as usize;
    if active {
        #[unroll]
        for q in 0..comptime!(quads(head_dim)) {
            let x = acc[at + q] * Quad::<A>::broadcast(factor);
            #[unroll]
            for lane in 0..4usize {
                if q * 4 + lane < d {
                    target[row * d + q * 4 + lane] = F::cast_from(x.extract(lane));
                }
            }
        }
    }
}

/// The number of tiles of `plane` rows that hold rows `0..end` of a head of `seq` (none for
/// a cube past the last head).
#[cube]
fn tiles_to(end: usize, seq: usize, cube_active: bool, #[comptime] plane: u32) -> usize {
    let mut last = end;
    if last > seq {
        last = seq;
    }
    let mut tiles = 0usize;
    if cube_active {
        tiles = last.div_ceil(plane as usize);
    }
    tiles
}

/// Forward: `output` and the per-row `logsumexp`, as [`crate::attention::flash_attention_forward`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn plane_attention_forward<F: Float, A: Float>(
    query: &[F],
    key: &[F],
    value: &[F],
    output: &mut [F],
    logsumexp: &mut [A],
    scale: f32,
    heads: u32,
    seq: u32,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] plane: u32,
    #[comptime] rows: u32,
) {
    let s = seq as usize;
    let n = comptime!(quads(head_dim));
    let p = comptime!(plane as usize);
    let r_count = comptime!(rows as usize);
    let (cube_active, head_row, start) = cube_block(heads, seq, comptime!(plane * rows));
    let lane = UNIT_POS_X as usize;
    let scale = A::cast_from(scale);

    let mut q = zeros::<A>(comptime!(rows as usize * quads(head_dim)));
    #[unroll]
    for r in 0..r_count {
        let position = start + r * p + lane;
        load_row::<F, A>(
            query,
            head_row + position,
            cube_active && position < s,
            &mut q,
            r * n,
            head_dim,
        );
    }
    let mut acc = zeros::<A>(comptime!(rows as usize * quads(head_dim)));
    let mut maxima = Array::<A>::new(r_count);
    let mut sums = Array::<A>::new(r_count);
    #[unroll]
    for r in 0..r_count {
        maxima[r] = A::new(-3.0e38);
        sums[r] = A::new(0.0);
    }
    let tiles = tiles_to(start + p * r_count, s, cube_active, plane);
    let mut k = zeros::<A>(n);
    let mut v = zeros::<A>(n);
    let mut probs = Array::<A>::new(comptime!(rows as usize * plane as usize));
    for t in 0..tiles {
        let first = t * p;
        let key_row = first + lane;
        load_row::<F, A>(
            key,
            head_row + key_row,
            key_row < s,
            &mut k,
            0usize,
            head_dim,
        );
        load_row::<F, A>(
            value,
            head_row + key_row,
            key_row < s,
            &mut v,
            0usize,
            head_dim,
        );
        #[unroll]
        for j in 0..p {
            let mut dots = zeros::<A>(r_count);
            #[unroll]
            for c in 0..n {
                let kq = plane_broadcast(k[c], comptime!(j as u32));
                #[unroll]
                for r in 0..r_count {
                    dots[r] += q[r * n + c] * kq;
                }
            }
            #[unroll]
            for r in 0..r_count {
                probs[r * p + j] = quad_sum::<A>(dots[r]) * scale;
            }
        }
        #[unroll]
        for r in 0..r_count {
            let position = start + r * p + lane;
            let mut max = maxima[r];
            #[unroll]
            for j in 0..p {
                max = select(first + j <= position, A::max(max, probs[r * p + j]), max);
            }
            let correction = A::exp(maxima[r] - max);
            let mut sum = sums[r] * correction;
            #[unroll]
            for j in 0..p {
                let e = select(
                    first + j <= position,
                    A::exp(probs[r * p + j] - max),
                    A::new(0.0),
                );
                sum += e;
                let index = (head_row + position) * s + first + j;
                probs[r * p + j] =
                    e * kept::<A>(index, key_lo, key_hi, threshold, keep_scale, dropout);
            }
            maxima[r] = max;
            sums[r] = sum;
            #[unroll]
            for c in 0..n {
                acc[r * n + c] *= Quad::<A>::broadcast(correction);
            }
        }
        #[unroll]
        for j in 0..p {
            #[unroll]
            for c in 0..n {
                let vq = plane_broadcast(v[c], comptime!(j as u32));
                #[unroll]
                for r in 0..r_count {
                    acc[r * n + c] += Quad::<A>::broadcast(probs[r * p + j]) * vq;
                }
            }
        }
    }
    #[unroll]
    for r in 0..r_count {
        let position = start + r * p + lane;
        let active = cube_active && position < s;
        let sum = sums[r];
        let inv = select(sum > A::new(0.0), A::new(1.0) / sum, A::new(0.0));
        store_row::<F, A>(
            &acc,
            r * n,
            inv,
            output,
            head_row + position,
            active,
            head_dim,
        );
        if active {
            logsumexp[head_row + position] = maxima[r] + A::ln(sum);
        }
    }
}

/// Backward, per block of query rows: `delta = Σ do ⊙ o` (saved for
/// [`plane_attention_backward_key_value`]) and `grad_query`, as
/// [`crate::attention::flash_attention_backward_query`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn plane_attention_backward_query<F: Float, A: Float>(
    query: &[F],
    key: &[F],
    value: &[F],
    output: &[F],
    grad_output: &[F],
    logsumexp: &[A],
    delta: &mut [A],
    grad_query: &mut [F],
    scale: f32,
    heads: u32,
    seq: u32,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] plane: u32,
    #[comptime] rows: u32,
) {
    let s = seq as usize;
    let (n, p, r_count) = (
        comptime!(quads(head_dim)),
        comptime!(plane as usize),
        comptime!(rows as usize),
    );
    let (cube_active, head_row, start) = cube_block(heads, seq, comptime!(plane * rows));
    let lane = UNIT_POS_X as usize;
    let scale = A::cast_from(scale);

    let mut q = zeros::<A>(comptime!(rows as usize * quads(head_dim)));
    let mut g = zeros::<A>(comptime!(rows as usize * quads(head_dim)));
    let mut o = zeros::<A>(n);
    let mut lse = Array::<A>::new(r_count);
    let mut deltas = Array::<A>::new(r_count);
    #[unroll]
    for r in 0..r_count {
        let position = start + r * p + lane;
        let (row, active) = (head_row + position, cube_active && position < s);
        load_row::<F, A>(query, row, active, &mut q, r * n, head_dim);
        load_row::<F, A>(grad_output, row, active, &mut g, r * n, head_dim);
        load_row::<F, A>(output, row, active, &mut o, 0usize, head_dim);
        let mut dot = Quad::<A>::broadcast(A::new(0.0));
        #[unroll]
        for c in 0..n {
            dot += g[r * n + c] * o[c];
        }
        deltas[r] = quad_sum::<A>(dot);
        lse[r] = A::new(0.0);
        if active {
            lse[r] = logsumexp[row];
            delta[row] = deltas[r];
        }
    }
    let tiles = tiles_to(start + p * r_count, s, cube_active, plane);
    let mut dq = zeros::<A>(comptime!(rows as usize * quads(head_dim)));
    let mut k = zeros::<A>(n);
    let mut v = zeros::<A>(n);
    for t in 0..tiles {
        let first = t * p;
        let key_row = first + lane;
        load_row::<F, A>(
            key,
            head_row + key_row,
            key_row < s,
            &mut k,
            0usize,
            head_dim,
        );
        load_row::<F, A>(
            value,
            head_row + key_row,
            key_row < s,
            &mut v,
            0usize,
            head_dim,
        );
        #[unroll]
        for j in 0..p {
            let (mut scores, mut dprobs) = (zeros::<A>(r_count), zeros::<A>(r_count));
            #[unroll]
            for c in 0..n {
                let kq = plane_broadcast(k[c], comptime!(j as u32));
                let vq = plane_broadcast(v[c], comptime!(j as u32));
                #[unroll]
                for r in 0..r_count {
                    scores[r] += q[r * n + c] * kq;
                    dprobs[r] += g[r * n + c] * vq;
                }
            }
            let mut ds = Array::<A>::new(r_count);
            #[unroll]
            for r in 0..r_count {
                let position = start + r * p + lane;
                let stats = RowStats::<A> {
                    lse: lse[r],
                    delta: deltas[r],
                };
                let (_, grad) = probability_and_gradient::<A>(
                    quad_sum::<A>(scores[r]) * scale,
                    quad_sum::<A>(dprobs[r]),
                    stats,
                    (head_row + position) * s + first + j,
                    position < s && first + j <= position,
                    key_lo,
                    key_hi,
                    threshold,
                    keep_scale,
                    dropout,
                );
                ds[r] = grad;
            }
            #[unroll]
            for c in 0..n {
                let kq = plane_broadcast(k[c], comptime!(j as u32));
                #[unroll]
                for r in 0..r_count {
                    dq[r * n + c] += Quad::<A>::broadcast(ds[r]) * kq;
                }
            }
        }
    }
    #[unroll]
    for r in 0..r_count {
        let position = start + r * p + lane;
        let active = cube_active && position < s;
        store_row::<F, A>(
            &dq,
            r * n,
            scale,
            grad_query,
            head_row + position,
            active,
            head_dim,
        );
    }
}

/// Backward, per block of key rows: `grad_key` and `grad_value`, as
/// [`crate::attention::flash_attention_backward_key_value`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn plane_attention_backward_key_value<F: Float, A: Float>(
    query: &[F],
    key: &[F],
    value: &[F],
    grad_output: &[F],
    logsumexp: &[A],
    delta: &[A],
    grad_key: &mut [F],
    grad_value: &mut [F],
    scale: f32,
    heads: u32,
    seq: u32,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] plane: u32,
    #[comptime] rows: u32,
) {
    let s = seq as usize;
    let (n, p, r_count) = (
        comptime!(quads(head_dim)),
        comptime!(plane as usize),
        comptime!(rows as usize),
    );
    let (cube_active, head_row, start) = cube_block(heads, seq, comptime!(plane * rows));
    let lane = UNIT_POS_X as usize;
    let scale = A::cast_from(scale);

    let mut k = zeros::<A>(comptime!(rows as usize * quads(head_dim)));
    let mut v = zeros::<A>(comptime!(rows as usize * quads(head_dim)));
    #[unroll]
    for r in 0..r_count {
        let position = start + r * p + lane;
        let (row, active) = (head_row + position, cube_active && position < s);
        load_row::<F, A>(key, row, active, &mut k, r * n, head_dim);
        load_row::<F, A>(value, row, active, &mut v, r * n, head_dim);
    }
    let mut dk = zeros::<A>(comptime!(rows as usize * quads(head_dim)));
    let mut dv = zeros::<A>(comptime!(rows as usize * quads(head_dim)));
    let mut q = zeros::<A>(n);
    let mut g = zeros::<A>(n);
    // Query tiles from this block's first key (the diagonal) to the head's last.
    let tiles = tiles_to(s, s, cube_active, plane);
    for t in start / p..tiles {
        let first = t * p;
        let query_row = first + lane;
        let active = query_row < s;
        load_row::<F, A>(
            query,
            head_row + query_row,
            active,
            &mut q,
            0usize,
            head_dim,
        );
        load_row::<F, A>(
            grad_output,
            head_row + query_row,
            active,
            &mut g,
            0usize,
            head_dim,
        );
        let (mut lse, mut row_delta) = (A::new(0.0), A::new(0.0));
        if active {
            lse = logsumexp[head_row + query_row];
            row_delta = delta[head_row + query_row];
        }
        #[unroll]
        for i in 0..p {
            let lse_i = plane_broadcast(lse, comptime!(i as u32));
            let delta_i = plane_broadcast(row_delta, comptime!(i as u32));
            let (mut scores, mut dprobs) = (zeros::<A>(r_count), zeros::<A>(r_count));
            #[unroll]
            for c in 0..n {
                let qq = plane_broadcast(q[c], comptime!(i as u32));
                let gq = plane_broadcast(g[c], comptime!(i as u32));
                #[unroll]
                for r in 0..r_count {
                    scores[r] += k[r * n + c] * qq;
                    dprobs[r] += v[r * n + c] * gq;
                }
            }
            let position = first + i;
            let (mut kept_probs, mut ds) = (Array::<A>::new(r_count), Array::<A>::new(r_count));
            #[unroll]
            for r in 0..r_count {
                let key_position = start + r * p + lane;
                let stats = RowStats::<A> {
                    lse: lse_i,
                    delta: delta_i,
                };
                let (kept_prob, grad) = probability_and_gradient::<A>(
                    quad_sum::<A>(scores[r]) * scale,
                    quad_sum::<A>(dprobs[r]),
                    stats,
                    (head_row + position) * s + key_position,
                    position < s && key_position <= position,
                    key_lo,
                    key_hi,
                    threshold,
                    keep_scale,
                    dropout,
                );
                kept_probs[r] = kept_prob;
                ds[r] = grad;
            }
            #[unroll]
            for c in 0..n {
                let qq = plane_broadcast(q[c], comptime!(i as u32));
                let gq = plane_broadcast(g[c], comptime!(i as u32));
                #[unroll]
                for r in 0..r_count {
                    dv[r * n + c] += Quad::<A>::broadcast(kept_probs[r]) * gq;
                    dk[r * n + c] += Quad::<A>::broadcast(ds[r]) * qq;
                }
            }
        }
    }
    #[unroll]
    for r in 0..r_count {
        let position = start + r * p + lane;
        let (row, active) = (head_row + position, cube_active && position < s);
        store_row::<F, A>(&dk, r * n, scale, grad_key, row, active, head_dim);
        store_row::<F, A>(&dv, r * n, A::new(1.0), grad_value, row, active, head_dim);
    }
}
