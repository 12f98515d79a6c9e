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
    cube_block, dropout_args, kept, probability_and_gradient, quad_sum, quads, read_quad,
    write_quad, DropoutArgs, Quad, RowStats,
};
use crate::dropout::salted;

/// Row `row` of a `[rows, head_dim]` tensor as [`Quad`]s into `target` from quad `at` (zeros
/// past `head_dim`, and all zeros where `active` is false).
#[cube]
fn load_row<F: Float, A: Float, N: Size>(
    source: &[Vector<F, N>],
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
        if active {
            x = read_quad::<F, A, N>(source, row * d, q, head_dim);
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
fn store_row<F: Float, A: Float, N: Size>(
    acc: &Array<Quad<A>>,
    at: usize,
    factor: A,
    target: &mut [Vector<F, N>],
    row: usize,
    active: bool,
    #[comptime] head_dim: u32,
) {
    let d = head_dim as usize;
    if active {
        #[unroll]
        for q in 0..comptime!(quads(head_dim)) {
            let x = acc[at + q] * Quad::<A>::broadcast(factor);
            write_quad::<F, A, N>(target, row * d, q, x, head_dim);
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

/// The comptime shape of the plane layout: heads of `head_dim`, planes of `plane` units,
/// `rows` rows per unit.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct PlaneShape {
    head_dim: u32,
    plane: u32,
    rows: u32,
}

impl PlaneShape {
    /// Quads of a head row.
    fn n(&self) -> usize {
        quads(self.head_dim)
    }

    /// Units of a plane.
    fn p(&self) -> usize {
        self.plane as usize
    }

    /// Rows per unit.
    fn r(&self) -> usize {
        self.rows as usize
    }

    /// Quads of a unit's rows.
    fn unit_quads(&self) -> usize {
        self.r() * self.n()
    }
}

/// Where a cube's block lies: the first row of its head, the block's first position within
/// the head, the head's length, and whether the cube has a block at all (the cube count may
/// round up).
#[derive(CubeType, Clone, Copy)]
struct Block {
    head_row: usize,
    start: usize,
    seq: usize,
    active: bool,
}

/// This cube's [`Block`] of `plane · rows` rows.
#[cube]
fn this_block(heads: u32, seq: u32, #[comptime] shape: PlaneShape) -> Block {
    let (active, head_row, start) = cube_block(heads, seq, comptime!(shape.plane * shape.rows));
    Block {
        head_row,
        start,
        seq: seq as usize,
        active,
    }
}

/// The position within its head of row `r` of this unit's rows of the block (rows
/// `start + r · plane + unit`: a plane's units take consecutive rows).
#[cube]
fn unit_position(block: &Block, r: usize, #[comptime] shape: PlaneShape) -> usize {
    block.start + r * comptime!(shape.p()) + UNIT_POS_X as usize
}

/// This unit's rows of the block in registers, one after the other (zeros past the head's
/// end).
#[cube]
fn load_unit_rows<F: Float, A: Float, N: Size>(
    source: &[Vector<F, N>],
    block: &Block,
    #[comptime] shape: PlaneShape,
) -> Array<Quad<A>> {
    let mut out = zeros::<A>(comptime!(shape.unit_quads()));
    #[unroll]
    for r in 0..comptime!(shape.r()) {
        let position = unit_position(block, r, shape);
        let active = block.active && position < block.seq;
        let at = r * comptime!(shape.n());
        let row = block.head_row + position;
        load_row::<F, A, N>(source, row, active, &mut out, at, comptime!(shape.head_dim));
    }
    out
}

/// This unit's rows of `acc` (times `factor`) into the block's rows of `target`, those before
/// the head's end.
#[cube]
fn store_unit_rows<F: Float, A: Float, N: Size>(
    acc: &Array<Quad<A>>,
    factor: A,
    target: &mut [Vector<F, N>],
    block: &Block,
    #[comptime] shape: PlaneShape,
) {
    #[unroll]
    for r in 0..comptime!(shape.r()) {
        let position = unit_position(block, r, shape);
        let active = block.active && position < block.seq;
        let (at, row) = (r * comptime!(shape.n()), block.head_row + position);
        store_row::<F, A, N>(
            acc,
            at,
            factor,
            target,
            row,
            active,
            comptime!(shape.head_dim),
        );
    }
}

/// `Σ_c mine[r, c] · theirs_j[c]` for each of the unit's rows `r`, where `theirs_j` is the
/// `theirs` row of the plane's unit `j` (broadcast, a quad at a time).
#[cube]
fn dots_with_unit<A: Float>(
    mine: &Array<Quad<A>>,
    theirs: &Array<Quad<A>>,
    #[comptime] j: u32,
    #[comptime] shape: PlaneShape,
) -> Array<A> {
    let (n, r_count) = (comptime!(shape.n()), comptime!(shape.r()));
    let mut sums = zeros::<A>(r_count);
    #[unroll]
    for c in 0..n {
        let theirs_c = plane_broadcast(theirs[c], j);
        #[unroll]
        for r in 0..r_count {
            sums[r] += mine[r * n + c] * theirs_c;
        }
    }
    let mut out = Array::<A>::new(r_count);
    #[unroll]
    for r in 0..r_count {
        out[r] = quad_sum::<A>(sums[r]);
    }
    out
}

/// `acc[r] += weights[r · stride + offset] · theirs_j` for each of the unit's rows `r`, where
/// `theirs_j` is the `theirs` row of the plane's unit `j` (broadcast).
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate_from_unit<A: Float>(
    acc: &mut Array<Quad<A>>,
    weights: &Array<A>,
    offset: usize,
    theirs: &Array<Quad<A>>,
    #[comptime] j: u32,
    #[comptime] stride: usize,
    #[comptime] shape: PlaneShape,
) {
    let n = comptime!(shape.n());
    #[unroll]
    for c in 0..n {
        let theirs_c = plane_broadcast(theirs[c], j);
        #[unroll]
        for r in 0..comptime!(shape.r()) {
            acc[r * n + c] += Quad::<A>::broadcast(weights[r * stride + offset]) * theirs_c;
        }
    }
}

/// The online softmax over one tile of the unit's rows' scores (`probs`, `[rows, plane]`,
/// replaced by the dropped probabilities): each row's running maximum and sum updated and
/// its accumulator rescaled. The row at `position` sees keys `first..=position`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn online_softmax_rows<A: Float>(
    probs: &mut Array<A>,
    maxima: &mut Array<A>,
    sums: &mut Array<A>,
    acc: &mut Array<Quad<A>>,
    block: &Block,
    first: usize,
    draw: DropoutArgs,
    #[comptime] dropout: bool,
    #[comptime] shape: PlaneShape,
) {
    let (n, p) = (comptime!(shape.n()), comptime!(shape.p()));
    #[unroll]
    for r in 0..comptime!(shape.r()) {
        let position = unit_position(block, r, shape);
        let mut max = maxima[r];
        #[unroll]
        for j in 0..p {
            max = select(first + j <= position, A::max(max, probs[r * p + j]), max);
        }
        let correction = A::exp(maxima[r] - max);
        let mut sum = sums[r] * correction;
        #[unroll]
        for j in 0..p {
            let e = A::exp(probs[r * p + j] - max);
            let e = select(first + j <= position, e, A::new(0.0));
            sum += e;
            let index = (block.head_row + position) * block.seq + first + j;
            let keep = kept::<A>(
                index,
                draw.key_lo,
                draw.key_hi,
                draw.threshold,
                draw.keep_scale,
                dropout,
            );
            probs[r * p + j] = e * keep;
        }
        maxima[r] = max;
        sums[r] = sum;
        #[unroll]
        for c in 0..n {
            acc[r * n + c] *= Quad::<A>::broadcast(correction);
        }
    }
}

/// Each of the unit's output rows divided by its sum, and its log-sum-exp into `logsumexp`.
#[cube]
fn finish_rows<A: Float>(
    acc: &mut Array<Quad<A>>,
    maxima: &Array<A>,
    sums: &Array<A>,
    logsumexp: &mut [A],
    block: &Block,
    #[comptime] shape: PlaneShape,
) {
    let n = comptime!(shape.n());
    #[unroll]
    for r in 0..comptime!(shape.r()) {
        let position = unit_position(block, r, shape);
        let sum = sums[r];
        let inv = select(sum > A::new(0.0), A::new(1.0) / sum, A::new(0.0));
        #[unroll]
        for c in 0..n {
            acc[r * n + c] *= Quad::<A>::broadcast(inv);
        }
        if block.active && position < block.seq {
            logsumexp[block.head_row + position] = maxima[r] + A::ln(sum);
        }
    }
}

/// Forward: `output` and the per-row `logsumexp`, as
/// [`crate::attention::flash_attention_forward`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn plane_attention_forward<F: Float, A: Float, N: Size>(
    query: &[Vector<F, N>],
    key: &[Vector<F, N>],
    value: &[Vector<F, N>],
    output: &mut [Vector<F, N>],
    logsumexp: &mut [A],
    scale: f32,
    heads: u32,
    seq: u32,
    salt: &[u32],
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] plane: u32,
    #[comptime] rows: u32,
) {
    let key_lo = salted(key_lo, salt, 0usize, dropout);
    let key_hi = salted(key_hi, salt, 1usize, dropout);
    let shape = comptime!(PlaneShape {
        head_dim,
        plane,
        rows
    });
    let (n, p, r_count) = (
        comptime!(shape.n()),
        comptime!(shape.p()),
        comptime!(shape.r()),
    );
    let block = this_block(heads, seq, shape);
    let (s, scale) = (block.seq, A::cast_from(scale));

    let q = load_unit_rows::<F, A, N>(query, &block, shape);
    let mut acc = zeros::<A>(comptime!(shape.unit_quads()));
    let (mut maxima, mut sums) = (Array::<A>::new(r_count), Array::<A>::new(r_count));
    #[unroll]
    for r in 0..r_count {
        maxima[r] = A::new(-3.0e38);
        sums[r] = A::new(0.0);
    }
    let (mut k, mut v) = (zeros::<A>(n), zeros::<A>(n));
    let mut probs = Array::<A>::new(comptime!(shape.r() * shape.p()));
    // Key tiles up to this block's last row: those above the causal diagonal are skipped.
    for t in 0..tiles_to(block.start + p * r_count, s, block.active, plane) {
        let (first, key_row) = (t * p, t * p + UNIT_POS_X as usize);
        let (row, active) = (block.head_row + key_row, key_row < s);
        load_row::<F, A, N>(key, row, active, &mut k, 0usize, head_dim);
        load_row::<F, A, N>(value, row, active, &mut v, 0usize, head_dim);
        #[unroll]
        for j in 0..p {
            let scores = dots_with_unit::<A>(&q, &k, comptime!(j as u32), shape);
            #[unroll]
            for r in 0..r_count {
                probs[r * p + j] = scores[r] * scale;
            }
        }
        let draw = dropout_args(key_lo, key_hi, threshold, keep_scale);
        let (m, sm) = (&mut maxima, &mut sums);
        online_softmax_rows::<A>(
            &mut probs, m, sm, &mut acc, &block, first, draw, dropout, shape,
        );
        #[unroll]
        for j in 0..p {
            accumulate_from_unit::<A>(&mut acc, &probs, j, &v, comptime!(j as u32), p, shape);
        }
    }
    finish_rows::<A>(&mut acc, &maxima, &sums, logsumexp, &block, shape);
    store_unit_rows::<F, A, N>(&acc, A::new(1.0), output, &block, shape);
}

/// `D = Σ do ⊙ o` of each of the unit's query rows (`grads` in registers, `output` read) into
/// `deltas` and, for the key kernel, `delta`; the rows' log-sum-exp into `lse`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn query_row_stats<F: Float, A: Float, N: Size>(
    grads: &Array<Quad<A>>,
    output: &[Vector<F, N>],
    logsumexp: &[A],
    delta: &mut [A],
    lse: &mut Array<A>,
    deltas: &mut Array<A>,
    block: &Block,
    #[comptime] shape: PlaneShape,
) {
    let n = comptime!(shape.n());
    let mut o = zeros::<A>(n);
    #[unroll]
    for r in 0..comptime!(shape.r()) {
        let position = unit_position(block, r, shape);
        let (row, active) = (
            block.head_row + position,
            block.active && position < block.seq,
        );
        load_row::<F, A, N>(
            output,
            row,
            active,
            &mut o,
            0usize,
            comptime!(shape.head_dim),
        );
        let mut dot = Quad::<A>::broadcast(A::new(0.0));
        #[unroll]
        for c in 0..n {
            dot += grads[r * n + c] * o[c];
        }
        deltas[r] = quad_sum::<A>(dot);
        lse[r] = A::new(0.0);
        if active {
            lse[r] = logsumexp[row];
            delta[row] = deltas[r];
        }
    }
}

/// Backward, per block of query rows: `delta = Σ do ⊙ o` (saved for
/// [`plane_attention_backward_key_value`]) and `grad_query`, as
/// [`crate::attention::flash_attention_backward_query`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn plane_attention_backward_query<F: Float, A: Float, N: Size>(
    query: &[Vector<F, N>],
    key: &[Vector<F, N>],
    value: &[Vector<F, N>],
    output: &[Vector<F, N>],
    grad_output: &[Vector<F, N>],
    logsumexp: &[A],
    delta: &mut [A],
    grad_query: &mut [Vector<F, N>],
    scale: f32,
    heads: u32,
    seq: u32,
    salt: &[u32],
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] plane: u32,
    #[comptime] rows: u32,
) {
    let key_lo = salted(key_lo, salt, 0usize, dropout);
    let key_hi = salted(key_hi, salt, 1usize, dropout);
    let shape = comptime!(PlaneShape {
        head_dim,
        plane,
        rows
    });
    let (n, p, r_count) = (
        comptime!(shape.n()),
        comptime!(shape.p()),
        comptime!(shape.r()),
    );
    let block = this_block(heads, seq, shape);
    let (s, scale) = (block.seq, A::cast_from(scale));

    let q = load_unit_rows::<F, A, N>(query, &block, shape);
    let g = load_unit_rows::<F, A, N>(grad_output, &block, shape);
    let (mut lse, mut deltas) = (Array::<A>::new(r_count), Array::<A>::new(r_count));
    let stats = (&mut lse, &mut deltas);
    query_row_stats::<F, A, N>(
        &g, output, logsumexp, delta, stats.0, stats.1, &block, shape,
    );
    let mut dq = zeros::<A>(comptime!(shape.unit_quads()));
    let (mut k, mut v) = (zeros::<A>(n), zeros::<A>(n));
    for t in 0..tiles_to(block.start + p * r_count, s, block.active, plane) {
        let (first, key_row) = (t * p, t * p + UNIT_POS_X as usize);
        let (row, active) = (block.head_row + key_row, key_row < s);
        load_row::<F, A, N>(key, row, active, &mut k, 0usize, head_dim);
        load_row::<F, A, N>(value, row, active, &mut v, 0usize, head_dim);
        #[unroll]
        for j in 0..p {
            let scores = dots_with_unit::<A>(&q, &k, comptime!(j as u32), shape);
            let dprobs = dots_with_unit::<A>(&g, &v, comptime!(j as u32), shape);
            let mut ds = Array::<A>::new(r_count);
            #[unroll]
            for r in 0..r_count {
                let position = unit_position(&block, r, shape);
                let stats = RowStats::<A> {
                    lse: lse[r],
                    delta: deltas[r],
                };
                let (_, grad) = probability_and_gradient::<A>(
                    scores[r] * scale,
                    dprobs[r],
                    stats,
                    (block.head_row + position) * s + first + j,
                    position < s && first + j <= position,
                    key_lo,
                    key_hi,
                    threshold,
                    keep_scale,
                    dropout,
                );
                ds[r] = grad;
            }
            let unit = comptime!(j as u32);
            accumulate_from_unit::<A>(&mut dq, &ds, 0usize, &k, unit, 1usize, shape);
        }
    }
    store_unit_rows::<F, A, N>(&dq, scale, grad_query, &block, shape);
}

/// Backward, per block of key rows: `grad_key` and `grad_value`, as
/// [`crate::attention::flash_attention_backward_key_value`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn plane_attention_backward_key_value<F: Float, A: Float, N: Size>(
    query: &[Vector<F, N>],
    key: &[Vector<F, N>],
    value: &[Vector<F, N>],
    grad_output: &[Vector<F, N>],
    logsumexp: &[A],
    delta: &[A],
    grad_key: &mut [Vector<F, N>],
    grad_value: &mut [Vector<F, N>],
    scale: f32,
    heads: u32,
    seq: u32,
    salt: &[u32],
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] plane: u32,
    #[comptime] rows: u32,
) {
    let key_lo = salted(key_lo, salt, 0usize, dropout);
    let key_hi = salted(key_hi, salt, 1usize, dropout);
    let shape = comptime!(PlaneShape {
        head_dim,
        plane,
        rows
    });
    let (n, p, r_count) = (
        comptime!(shape.n()),
        comptime!(shape.p()),
        comptime!(shape.r()),
    );
    let block = this_block(heads, seq, shape);
    let (s, scale) = (block.seq, A::cast_from(scale));

    let k = load_unit_rows::<F, A, N>(key, &block, shape);
    let v = load_unit_rows::<F, A, N>(value, &block, shape);
    let mut dk = zeros::<A>(comptime!(shape.unit_quads()));
    let mut dv = zeros::<A>(comptime!(shape.unit_quads()));
    let (mut q, mut g) = (zeros::<A>(n), zeros::<A>(n));
    // Query tiles from this block's first key (the diagonal) to the head's last.
    for t in block.start / p..tiles_to(s, s, block.active, plane) {
        let (first, query_row) = (t * p, t * p + UNIT_POS_X as usize);
        let (row, active) = (block.head_row + query_row, query_row < s);
        load_row::<F, A, N>(query, row, active, &mut q, 0usize, head_dim);
        load_row::<F, A, N>(grad_output, row, active, &mut g, 0usize, head_dim);
        let (mut lse, mut row_delta) = (A::new(0.0), A::new(0.0));
        if active {
            lse = logsumexp[row];
            row_delta = delta[row];
        }
        #[unroll]
        for i in 0..p {
            let unit = comptime!(i as u32);
            let (lse_i, delta_i) = (plane_broadcast(lse, unit), plane_broadcast(row_delta, unit));
            let scores = dots_with_unit::<A>(&k, &q, unit, shape);
            let dprobs = dots_with_unit::<A>(&v, &g, unit, shape);
            let position = first + i;
            let (mut kept_probs, mut ds) = (Array::<A>::new(r_count), Array::<A>::new(r_count));
            #[unroll]
            for r in 0..r_count {
                let key_position = unit_position(&block, r, shape);
                let stats = RowStats::<A> {
                    lse: lse_i,
                    delta: delta_i,
                };
                let (kept_prob, grad) = probability_and_gradient::<A>(
                    scores[r] * scale,
                    dprobs[r],
                    stats,
                    (block.head_row + position) * s + key_position,
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
            accumulate_from_unit::<A>(&mut dv, &kept_probs, 0usize, &g, unit, 1usize, shape);
            accumulate_from_unit::<A>(&mut dk, &ds, 0usize, &q, unit, 1usize, shape);
        }
    }
    store_unit_rows::<F, A, N>(&dk, scale, grad_key, &block, shape);
    store_unit_rows::<F, A, N>(&dv, A::new(1.0), grad_value, &block, shape);
}
