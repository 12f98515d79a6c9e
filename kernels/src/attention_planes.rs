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
//! The prologue, the mask, the dropout and the row reads are every attention family's
//! ([`crate::attention_common`]).

use cubecl::prelude::*;

use crate::attention_common::{
    has_row, key_tiles, log_sum_exp, masked_max, masked_probability, no_maximum, normaliser,
    probability_and_gradient, prologue, quad_sum, quads, query_tiles, read_head_quad, write_quad,
    AttentionScalars, Quad, RowDraw, RowStats, TileRows,
};

/// The head's row at `position` as [`Quad`]s into `target` from quad `at`, zeros where the
/// head has no such row ([`read_head_quad`]).
#[cube]
fn load_row<F: Float, A: Float, N: Size>(
    source: &[Vector<F, N>],
    own: &TileRows,
    position: usize,
    target: &mut Array<Quad<A>>,
    at: usize,
    #[comptime] head_dim: u32,
) {
    #[unroll]
    for q in 0..comptime!(quads(head_dim)) {
        target[at + q] = read_head_quad::<F, A, N>(source, own, position, q, head_dim);
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

/// Quads `at..` of `acc` (one row), times `factor`, into the head's row at `position` of
/// `target`, where the head has it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_row<F: Float, A: Float, N: Size>(
    acc: &Array<Quad<A>>,
    at: usize,
    factor: A,
    target: &mut [Vector<F, N>],
    own: &TileRows,
    position: usize,
    #[comptime] head_dim: u32,
) {
    let d = head_dim as usize;
    if has_row(own, position) {
        let row = own.head_row + position;
        #[unroll]
        for q in 0..comptime!(quads(head_dim)) {
            let x = acc[at + q] * Quad::<A>::broadcast(factor);
            write_quad::<F, A, N>(target, row * d, q, x, head_dim);
        }
    }
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
    fn new(head_dim: u32, plane: u32, rows: u32) -> Self {
        Self {
            head_dim,
            plane,
            rows,
        }
    }

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

    /// Rows of a cube's block.
    fn block(&self) -> u32 {
        self.plane * self.rows
    }
}

/// The position within its head of row `r` of this unit's rows of the block (rows
/// `start + r · plane + unit`: a plane's units take consecutive rows).
#[cube]
fn unit_position(own: &TileRows, r: usize, #[comptime] shape: PlaneShape) -> usize {
    own.start + r * comptime!(shape.p()) + UNIT_POS_X as usize
}

/// This unit's rows of the block in registers, one after the other (zeros where the head has
/// no such row).
#[cube]
fn load_unit_rows<F: Float, A: Float, N: Size>(
    source: &[Vector<F, N>],
    own: &TileRows,
    #[comptime] shape: PlaneShape,
) -> Array<Quad<A>> {
    let mut out = zeros::<A>(comptime!(shape.unit_quads()));
    #[unroll]
    for r in 0..comptime!(shape.r()) {
        let position = unit_position(own, r, shape);
        let at = r * comptime!(shape.n());
        load_row::<F, A, N>(
            source,
            own,
            position,
            &mut out,
            at,
            comptime!(shape.head_dim),
        );
    }
    out
}

/// This unit's rows of `acc` (times `factor`) into the block's rows of `target`, those the
/// head has.
#[cube]
fn store_unit_rows<F: Float, A: Float, N: Size>(
    acc: &Array<Quad<A>>,
    factor: A,
    target: &mut [Vector<F, N>],
    own: &TileRows,
    #[comptime] shape: PlaneShape,
) {
    #[unroll]
    for r in 0..comptime!(shape.r()) {
        let position = unit_position(own, r, shape);
        let at = r * comptime!(shape.n());
        let head_dim = comptime!(shape.head_dim);
        store_row::<F, A, N>(acc, at, factor, target, own, position, head_dim);
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
/// replaced by the dropped probabilities): each row's running maximum and sum updated over
/// the keys the mask lets it see and its accumulator rescaled.
#[cube]
#[allow(clippy::too_many_arguments)]
fn online_softmax_rows<A: Float>(
    probs: &mut Array<A>,
    maxima: &mut Array<A>,
    sums: &mut Array<A>,
    acc: &mut Array<Quad<A>>,
    at: &TileRows,
    draw: &RowDraw,
    #[comptime] dropout: bool,
    #[comptime] shape: PlaneShape,
) {
    let (n, p) = (comptime!(shape.n()), comptime!(shape.p()));
    #[unroll]
    for r in 0..comptime!(shape.r()) {
        let query = unit_position(at, r, shape);
        let mut max = maxima[r];
        #[unroll]
        for j in 0..p {
            max = masked_max::<A>(max, probs[r * p + j], at, query, at.first + j);
        }
        let correction = A::exp(maxima[r] - max);
        let mut sum = sums[r] * correction;
        #[unroll]
        for j in 0..p {
            let score = probs[r * p + j];
            let key = at.first + j;
            let (e, keep) = masked_probability::<A>(score, max, at, query, key, draw, dropout);
            sum += e;
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

/// Each of the unit's output rows normalised by its sum ([`normaliser`]), and its log-sum-exp
/// into `logsumexp`.
#[cube]
fn finish_rows<A: Float>(
    acc: &mut Array<Quad<A>>,
    maxima: &Array<A>,
    sums: &Array<A>,
    logsumexp: &mut [A],
    own: &TileRows,
    #[comptime] shape: PlaneShape,
) {
    let n = comptime!(shape.n());
    #[unroll]
    for r in 0..comptime!(shape.r()) {
        let position = unit_position(own, r, shape);
        let sum = sums[r];
        let inv = normaliser::<A>(sum);
        #[unroll]
        for c in 0..n {
            acc[r * n + c] *= Quad::<A>::broadcast(inv);
        }
        if has_row(own, position) {
            logsumexp[own.head_row + position] = log_sum_exp::<A>(maxima[r], sum);
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
    scalars: AttentionScalars,
    salt: &[u32],
    first_keys: &[u32],
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] documents: bool,
    #[comptime] plane: u32,
    #[comptime] rows: u32,
) {
    let shape = comptime!(PlaneShape::new(head_dim, plane, rows));
    let (own, draw, scale) = prologue::<A>(
        &scalars,
        salt,
        first_keys,
        comptime!(shape.block()),
        dropout,
        documents,
    );
    let (n, p, r_count) = comptime!((shape.n(), shape.p(), shape.r()));

    let q = load_unit_rows::<F, A, N>(query, &own, shape);
    let mut acc = zeros::<A>(comptime!(shape.unit_quads()));
    let (mut maxima, mut sums) = (Array::<A>::new(r_count), Array::<A>::new(r_count));
    #[unroll]
    for r in 0..r_count {
        maxima[r] = no_maximum::<A>();
        sums[r] = A::new(0.0);
    }
    let (mut k, mut v) = (zeros::<A>(n), zeros::<A>(n));
    let mut probs = Array::<A>::new(comptime!(shape.r() * shape.p()));
    let (first_tile, end_tile) = key_tiles(&own, comptime!(shape.block()), plane);
    for t in first_tile..end_tile {
        let at = own.at_tile(t * p);
        let key_position = at.first + UNIT_POS_X as usize;
        load_row::<F, A, N>(key, &at, key_position, &mut k, 0usize, head_dim);
        load_row::<F, A, N>(value, &at, key_position, &mut v, 0usize, head_dim);
        #[unroll]
        for j in 0..p {
            let scores = dots_with_unit::<A>(&q, &k, comptime!(j as u32), shape);
            #[unroll]
            for r in 0..r_count {
                probs[r * p + j] = scores[r] * scale;
            }
        }
        let (m, sm) = (&mut maxima, &mut sums);
        online_softmax_rows::<A>(&mut probs, m, sm, &mut acc, &at, &draw, dropout, shape);
        #[unroll]
        for j in 0..p {
            accumulate_from_unit::<A>(&mut acc, &probs, j, &v, comptime!(j as u32), p, shape);
        }
    }
    finish_rows::<A>(&mut acc, &maxima, &sums, logsumexp, &own, shape);
    store_unit_rows::<F, A, N>(&acc, A::new(1.0), output, &own, shape);
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
    own: &TileRows,
    #[comptime] shape: PlaneShape,
) {
    let n = comptime!(shape.n());
    let head_dim = comptime!(shape.head_dim);
    let mut o = zeros::<A>(n);
    #[unroll]
    for r in 0..comptime!(shape.r()) {
        let position = unit_position(own, r, shape);
        load_row::<F, A, N>(output, own, position, &mut o, 0usize, head_dim);
        let mut dot = Quad::<A>::broadcast(A::new(0.0));
        #[unroll]
        for c in 0..n {
            dot += grads[r * n + c] * o[c];
        }
        deltas[r] = quad_sum::<A>(dot);
        lse[r] = A::new(0.0);
        if has_row(own, position) {
            let row = own.head_row + position;
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
    scalars: AttentionScalars,
    salt: &[u32],
    first_keys: &[u32],
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] documents: bool,
    #[comptime] plane: u32,
    #[comptime] rows: u32,
) {
    let shape = comptime!(PlaneShape::new(head_dim, plane, rows));
    let (own, draw, scale) = prologue::<A>(
        &scalars,
        salt,
        first_keys,
        comptime!(shape.block()),
        dropout,
        documents,
    );
    let (n, p, r_count) = comptime!((shape.n(), shape.p(), shape.r()));

    let q = load_unit_rows::<F, A, N>(query, &own, shape);
    let g = load_unit_rows::<F, A, N>(grad_output, &own, shape);
    let (mut lse, mut deltas) = (Array::<A>::new(r_count), Array::<A>::new(r_count));
    let stats = (&mut lse, &mut deltas);
    query_row_stats::<F, A, N>(&g, output, logsumexp, delta, stats.0, stats.1, &own, shape);
    let mut dq = zeros::<A>(comptime!(shape.unit_quads()));
    let (mut k, mut v) = (zeros::<A>(n), zeros::<A>(n));
    let (first_tile, end_tile) = key_tiles(&own, comptime!(shape.block()), plane);
    for t in first_tile..end_tile {
        let at = own.at_tile(t * p);
        let key_position = at.first + UNIT_POS_X as usize;
        load_row::<F, A, N>(key, &at, key_position, &mut k, 0usize, head_dim);
        load_row::<F, A, N>(value, &at, key_position, &mut v, 0usize, head_dim);
        #[unroll]
        for j in 0..p {
            let scores = dots_with_unit::<A>(&q, &k, comptime!(j as u32), shape);
            let dprobs = dots_with_unit::<A>(&g, &v, comptime!(j as u32), shape);
            let mut ds = Array::<A>::new(r_count);
            #[unroll]
            for r in 0..r_count {
                let stats = RowStats::<A> {
                    lse: lse[r],
                    delta: deltas[r],
                };
                let (query, key) = (unit_position(&at, r, shape), at.first + j);
                let score = scores[r] * scale;
                let (_, grad) = probability_and_gradient::<A>(
                    score, dprobs[r], stats, &at, query, key, &draw, dropout,
                );
                ds[r] = grad;
            }
            let unit = comptime!(j as u32);
            accumulate_from_unit::<A>(&mut dq, &ds, 0usize, &k, unit, 1usize, shape);
        }
    }
    store_unit_rows::<F, A, N>(&dq, scale, grad_query, &own, shape);
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
    scalars: AttentionScalars,
    salt: &[u32],
    first_keys: &[u32],
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] documents: bool,
    #[comptime] plane: u32,
    #[comptime] rows: u32,
) {
    let shape = comptime!(PlaneShape::new(head_dim, plane, rows));
    let (own, draw, scale) = prologue::<A>(
        &scalars,
        salt,
        first_keys,
        comptime!(shape.block()),
        dropout,
        documents,
    );
    let (n, p, r_count) = comptime!((shape.n(), shape.p(), shape.r()));

    let k = load_unit_rows::<F, A, N>(key, &own, shape);
    let v = load_unit_rows::<F, A, N>(value, &own, shape);
    let mut dk = zeros::<A>(comptime!(shape.unit_quads()));
    let mut dv = zeros::<A>(comptime!(shape.unit_quads()));
    let (mut q, mut g) = (zeros::<A>(n), zeros::<A>(n));
    let (first_tile, end_tile) = query_tiles(&own, comptime!(shape.block()), plane);
    for t in first_tile..end_tile {
        let at = own.at_tile(t * p);
        let query_position = at.first + UNIT_POS_X as usize;
        load_row::<F, A, N>(query, &at, query_position, &mut q, 0usize, head_dim);
        load_row::<F, A, N>(grad_output, &at, query_position, &mut g, 0usize, head_dim);
        let (mut lse, mut row_delta) = (A::new(0.0), A::new(0.0));
        if has_row(&at, query_position) {
            lse = logsumexp[at.head_row + query_position];
            row_delta = delta[at.head_row + query_position];
        }
        #[unroll]
        for i in 0..p {
            let unit = comptime!(i as u32);
            let (lse_i, delta_i) = (plane_broadcast(lse, unit), plane_broadcast(row_delta, unit));
            let scores = dots_with_unit::<A>(&k, &q, unit, shape);
            let dprobs = dots_with_unit::<A>(&v, &g, unit, shape);
            let (mut kept_probs, mut ds) = (Array::<A>::new(r_count), Array::<A>::new(r_count));
            #[unroll]
            for r in 0..r_count {
                let stats = RowStats::<A> {
                    lse: lse_i,
                    delta: delta_i,
                };
                let (query, key) = (at.first + i, unit_position(&at, r, shape));
                let score = scores[r] * scale;
                let (kept_prob, grad) = probability_and_gradient::<A>(
                    score, dprobs[r], stats, &at, query, key, &draw, dropout,
                );
                kept_probs[r] = kept_prob;
                ds[r] = grad;
            }
            accumulate_from_unit::<A>(&mut dv, &kept_probs, 0usize, &g, unit, 1usize, shape);
            accumulate_from_unit::<A>(&mut dk, &ds, 0usize, &q, unit, 1usize, shape);
        }
    }
    store_unit_rows::<F, A, N>(&dk, scale, grad_key, &own, shape);
    store_unit_rows::<F, A, N>(&dv, A::new(1.0), grad_value, &own, shape);
}
