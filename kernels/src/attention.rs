//! Fused causal attention in the manner of FlashAttention-2: `o = dropout(softmax(scale · q kᵀ))
//! v` per head without ever storing the `[seq, seq]` scores or probabilities. The forward
//! keeps a running maximum and sum per row (the online softmax) and saves only the row's
//! log-sum-exp; the backward recomputes each probability from it.
//!
//! Tensors are `[batch · heads, seq, head_dim]` row-major; query `i` sees keys `0..=i`.
//!
//! Why tiles: each cube takes a block of `block` consecutive rows of one head and walks the
//! other side (keys for the forward and `dq`, queries for `dk`/`dv`) in tiles of `block` rows,
//! loaded once, coalesced, into shared memory; the tiles above the causal diagonal are never
//! visited. Each of the products of a tile (`q kᵀ`, `do vᵀ`, then `p v`, `ds k`, `p̃ᵀ do`,
//! `dsᵀ q`) is shared out among the cube's `(block / 4)²` units as 4-row micro-tiles held in
//! registers, as a matmul kernel does: every value read from shared memory then feeds four
//! multiply-adds rather than one. This is the structure tensor-core (`cmma`) products slot
//! into; the products here are plain multiply-adds, which every runtime has.
//!
//! Dropout is applied to the probabilities inside the kernels with the mask of
//! [`crate::dropout`]: element `(row, j)` of the `[batch · heads · seq, seq]` probabilities
//! has index `row · seq + j`, the index the unfused dropout gives it, so fused and unfused
//! attention drop the same probabilities for the same key. The mask is re-derived in the
//! backward, never stored.
//!
//! With `D = Σ_c do_c o_c` per query row, the backward is `dṗ = do·v` (dropped and scaled as
//! the forward), `ds = p (dṗ − D)`, `dq = scale Σ_j ds k_j`, `dk = scale Σ_i ds q_i` and
//! `dv = Σ_i p̃ do_i` with `p̃` the dropped, scaled probability: one kernel per query block
//! (`dq`, and `D` for the other), one per key block (`dk`, `dv`), so that no two cubes
//! write the same gradient row (no atomics, deterministic).

use cubecl::prelude::*;

use crate::dropout::{dropout_bits, salted};
use crate::rows::cube_index;

/// Rows of a micro-tile: each unit owns 4 rows of a tile's products.
const MICRO: u32 = 4;

/// Four consecutive values of a head row: the `[block, head_dim]` tiles are stored and read
/// four at a time (vector loads), so that a product reads a quarter of the shared-memory
/// words one value at a time would, and a runtime that gathers each unit's address
/// separately (lavapipe) makes a quarter of the gathers.
pub(crate) type Quad<A> = Vector<A, Const<4>>;

/// [`Quad`]s per head row (the last one zero-padded past `head_dim`).
pub(crate) fn quads(head_dim: u32) -> usize {
    head_dim.div_ceil(4) as usize
}

/// The row stride, in [`Quad`]s, of a `[block, head_dim]` tile: one more, so that the rows a
/// warp's micro-tiles read at once (strided by a multiple of 32 words unpadded) fall in
/// different memory banks.
fn padded_quads(head_dim: u32) -> usize {
    quads(head_dim) + 1
}

/// The row stride, in [`Quad`]s, of a `[block, block]` tile (one more, as [`padded_quads`]).
fn padded_block_quads(block: u32) -> usize {
    (block / 4) as usize + 1
}

/// Quad columns a unit owns of a `[block, head_dim]` product (those past the row skipped).
fn owned_quads(block: u32, head_dim: u32) -> usize {
    quads(head_dim).div_ceil((block / MICRO) as usize)
}

/// A dropout draw inside attention: whether an element is kept, and what it is scaled by.
#[cube]
pub(crate) fn kept<A: Float>(
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

/// The block this cube covers: whether it exists (the cube count may round up), the first
/// row of its head, and the position of its first row within the head.
#[cube]
pub(crate) fn cube_block(heads: u32, seq: u32, #[comptime] block: u32) -> (bool, usize, usize) {
    let s = seq as usize;
    let b = block as usize;
    let blocks = s.div_ceil(b);
    let cube = cube_index();
    let head = cube / blocks;
    (head < heads as usize, head * s, (cube % blocks) * b)
}

/// Rows `first..first + block` of the head starting at row `head_row` (of `seq` rows of
/// `head_dim`) into `tile` as [`Quad`]s, zeros past the head's end and past `head_dim`. The
/// cube's units load consecutive quads (coalesced); every unit must take part.
#[cube]
fn load_tile<F: Float, A: Float, N: Size>(
    source: &[Vector<F, N>],
    tile: &mut Shared<[Quad<A>]>,
    head_row: usize,
    first: usize,
    seq: usize,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let d = head_dim as usize;
    let n = comptime!(quads(head_dim));
    let rows = seq - first;
    let start = (head_row + first) * d;
    let mut e = UNIT_POS_X as usize;
    while e < comptime!(block as usize * quads(head_dim)) {
        let (row, q) = (e / n, e % n);
        let mut x = Quad::<A>::broadcast(A::new(0.0));
        if row < rows {
            x = read_quad::<F, A, N>(source, start + row * d, q, head_dim);
        }
        tile[row * comptime!(padded_quads(head_dim)) + q] = x;
        e += CUBE_DIM_X as usize;
    }
}

/// Quad `q` (values `4q .. 4q + 4`) of the head row that starts at element `start` of
/// `source`, read in vectors of `N` (which divides 4 and `head_dim`), zeros past `head_dim`:
/// one load where the row allows vectors of 4, instead of four.
#[cube]
pub(crate) fn read_quad<F: Float, A: Float, N: Size>(
    source: &[Vector<F, N>],
    start: usize,
    q: usize,
    #[comptime] head_dim: u32,
) -> Quad<A> {
    let n = N::value().comptime();
    let mut x = Quad::<A>::broadcast(A::new(0.0));
    #[unroll]
    for chunk in 0..4 / n {
        let c = q * 4 + chunk * n;
        if c < head_dim as usize {
            let v = source[(start + c) / n];
            #[unroll]
            for k in 0..n {
                x.insert(chunk * n + k, A::cast_from(v.extract(k)));
            }
        }
    }
    x
}

/// [`read_quad`]'s counterpart: quad `q` of `x` into the head row at `start` of `target` (the
/// values past `head_dim` dropped).
#[cube]
pub(crate) fn write_quad<F: Float, A: Float, N: Size>(
    target: &mut [Vector<F, N>],
    start: usize,
    q: usize,
    x: Quad<A>,
    #[comptime] head_dim: u32,
) {
    let n = N::value().comptime();
    #[unroll]
    for chunk in 0..4 / n {
        let c = q * 4 + chunk * n;
        if c < head_dim as usize {
            let mut v = Vector::<F, N>::new(F::new(0.0));
            #[unroll]
            for k in 0..n {
                v.insert(k, F::cast_from(x.extract(chunk * n + k)));
            }
            target[(start + c) / n] = v;
        }
    }
}

/// `Σ` of a quad's four values.
#[cube]
pub(crate) fn quad_sum<A: Float>(x: Quad<A>) -> A {
    x.extract(0usize) + x.extract(1usize) + x.extract(2usize) + x.extract(3usize)
}

/// Entries `first..first + block` of a per-row statistic of the head at `head_row` into
/// `tile` (zeros past the head's end).
#[cube]
pub(crate) fn load_row_values<A: Float>(
    source: &[A],
    tile: &mut Shared<[A]>,
    head_row: usize,
    first: usize,
    seq: usize,
    #[comptime] block: u32,
) {
    let mut i = UNIT_POS_X as usize;
    while i < block as usize {
        let mut x = A::new(0.0);
        if first + i < seq {
            x = source[head_row + first + i];
        }
        tile[i] = x;
        i += CUBE_DIM_X as usize;
    }
}

/// The 4 × 4 micro-tile `out[r · 4 + x] = Σ_c a[(a_row + r) · d + c] · b[(b_row + x) · d + c]`
/// of the product of two row-major `[block, head_dim]` tiles, one transposed: four columns
/// at a time, a quad of products per pair of rows summed into the pair's own quad.
#[cube]
fn micro_scores<A: Float>(
    a: &Shared<[Quad<A>]>,
    a_row: usize,
    b: &Shared<[Quad<A>]>,
    b_row: usize,
    #[comptime] head_dim: u32,
    #[comptime] unroll: bool,
) -> Array<A> {
    let stride = comptime!(padded_quads(head_dim));
    let mut sums = Array::<Quad<A>>::new(16usize);
    #[unroll]
    for e in 0..16 {
        sums[e] = Quad::<A>::broadcast(A::new(0.0));
    }
    #[unroll(unroll)]
    for q in 0..comptime!(quads(head_dim)) {
        let mut lhs = Array::<Quad<A>>::new(4usize);
        let mut rhs = Array::<Quad<A>>::new(4usize);
        #[unroll]
        for r in 0..4 {
            lhs[r] = a[(a_row + r) * stride + q];
            rhs[r] = b[(b_row + r) * stride + q];
        }
        #[unroll]
        for r in 0..4 {
            #[unroll]
            for x in 0..4 {
                sums[r * 4 + x] += lhs[r] * rhs[x];
            }
        }
    }
    let mut out = Array::<A>::new(16usize);
    #[unroll]
    for e in 0..16 {
        out[e] = quad_sum::<A>(sums[e]);
    }
    out
}

/// `acc[r · w + k] += Σ_j weights[(row + r) · block + j] · rhs[j, quad_k]` over a tile: a
/// unit's 4 rows of a `[block, block] × [block, head_dim]` product, at the quad columns it
/// owns (`group`, `group + block / 4`, …: `w` of them, those past the row skipped).
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate_product<A: Float>(
    acc: &mut Array<Quad<A>>,
    weights: &Shared<[Quad<A>]>,
    row: usize,
    rhs: &Shared<[Quad<A>]>,
    group: usize,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
    #[comptime] unroll: bool,
) {
    let w = comptime!(owned_quads(block, head_dim));
    let groups = comptime!((block / MICRO) as usize);
    for jq in 0..comptime!((block / 4) as usize) {
        let mut weights_q = Array::<Quad<A>>::new(4usize);
        #[unroll]
        for r in 0..4 {
            weights_q[r] = weights[(row + r) * comptime!(padded_block_quads(block)) + jq];
        }
        #[unroll]
        for lane in 0..4 {
            let j = jq * 4 + lane;
            let mut weight = Array::<Quad<A>>::new(4usize);
            #[unroll]
            for r in 0..4 {
                weight[r] = Quad::<A>::broadcast(weights_q[r].extract(lane));
            }
            #[unroll(unroll)]
            for k in 0..w {
                let column = group + k * groups;
                if column < comptime!(quads(head_dim)) {
                    let x = rhs[j * comptime!(padded_quads(head_dim)) + column];
                    #[unroll]
                    for r in 0..4 {
                        acc[r * w + k] += weight[r] * x;
                    }
                }
            }
        }
    }
}

/// The comptime shape of the tiled kernels: rows per block and tile, the head width, and
/// whether the loops over a head row are unrolled.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct TileShape {
    block: u32,
    head_dim: u32,
    unroll: bool,
}

/// [`accumulate_product`] for a kernel of shape `tile`.
#[cube]
fn accumulate_tile<A: Float>(
    acc: &mut Array<Quad<A>>,
    weights: &Shared<[Quad<A>]>,
    row: usize,
    rhs: &Shared<[Quad<A>]>,
    group: usize,
    #[comptime] tile: TileShape,
) {
    let (block, head_dim, unroll) = comptime!((tile.block, tile.head_dim, tile.unroll));
    accumulate_product::<A>(acc, weights, row, rhs, group, block, head_dim, unroll);
}

/// A unit's accumulator: 4 rows of the quad columns it owns, zero.
#[cube]
fn zero_accumulator<A: Float>(#[comptime] block: u32, #[comptime] head_dim: u32) -> Array<Quad<A>> {
    let n = comptime!(MICRO as usize * owned_quads(block, head_dim));
    let mut acc = Array::<Quad<A>>::new(n);
    for e in 0..n {
        acc[e] = Quad::<A>::broadcast(A::new(0.0));
    }
    acc
}

/// Row `r` of a unit's accumulator (times `factor`) into row `row` of `target`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_accumulator_row<F: Float, A: Float, N: Size>(
    acc: &Array<Quad<A>>,
    r: usize,
    target: &mut [Vector<F, N>],
    row: usize,
    group: usize,
    factor: A,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let d = head_dim as usize;
    let w = comptime!(owned_quads(block, head_dim));
    let groups = comptime!((block / MICRO) as usize);
    for k in 0..w {
        let quad = acc[r * w + k] * Quad::<A>::broadcast(factor);
        write_quad::<F, A, N>(target, row * d, group + k * groups, quad, head_dim);
    }
}

/// A unit's accumulator (times `factor`) into its 4 rows of the block at `at.start`, those
/// before `at.seq`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_accumulator<F: Float, A: Float, N: Size>(
    acc: &Array<Quad<A>>,
    target: &mut [Vector<F, N>],
    at: TileRows,
    my_rows: usize,
    group: usize,
    factor: A,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    #[unroll]
    for r in 0..4 {
        let position = at.start + my_rows + r;
        if position < at.seq {
            let row = at.head_row + position;
            store_accumulator_row::<F, A, N>(acc, r, target, row, group, factor, block, head_dim);
        }
    }
}

/// Where a tile lies: the first row of the head, the first row of the cube's block and of
/// the tile (positions within the head), and the head's length.
#[derive(CubeType, Clone, Copy)]
struct TileRows {
    head_row: usize,
    start: usize,
    first: usize,
    seq: usize,
}

/// The rows of the cube's own block (a [`TileRows`] whose tile is the block).
#[cube]
fn block_rows(head_row: usize, start: usize, seq: usize) -> TileRows {
    TileRows {
        head_row,
        start,
        first: start,
        seq,
    }
}

/// The rows of a tile at `first` seen from the cube's block at `start` of the head at
/// `head_row` (a [`TileRows`]).
#[cube]
fn tile_rows(head_row: usize, start: usize, first: usize, seq: usize) -> TileRows {
    TileRows {
        head_row,
        start,
        first,
        seq,
    }
}

/// A dropout draw's kernel arguments.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct DropoutArgs {
    pub(crate) key_lo: u32,
    pub(crate) key_hi: u32,
    pub(crate) threshold: u32,
    pub(crate) keep_scale: f32,
}

/// [`DropoutArgs`] of a kernel's draw arguments.
#[cube]
pub(crate) fn dropout_args(
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
) -> DropoutArgs {
    DropoutArgs {
        key_lo,
        key_hi,
        threshold,
        keep_scale,
    }
}

/// The online softmax over one tile of scores (`probs`, `[block, block]`, replaced by the
/// dropped probabilities), one unit per query row: the row's running maximum and sum are
/// updated, and `rescale` gets the factor its running output is to be multiplied by. Query
/// `position` sees keys `first..=position`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn online_softmax_tile<A: Float>(
    probs: &mut Shared<[Quad<A>]>,
    maxima: &mut Shared<[A]>,
    sums: &mut Shared<[A]>,
    rescale: &mut Shared<[A]>,
    at: TileRows,
    draw: DropoutArgs,
    #[comptime] block: u32,
    #[comptime] dropout: bool,
) {
    let b = block as usize;
    let mut i = UNIT_POS_X as usize;
    while i < b {
        let position = at.start + i;
        let mut seen = 0usize;
        if position < at.seq {
            seen = position + 1 - at.first;
            if seen > b {
                seen = b;
            }
        }
        let stride = comptime!(padded_block_quads(block));
        let old_max = maxima[i];
        let mut max = old_max;
        for q in 0..comptime!((block / 4) as usize) {
            let scores = probs[i * stride + q];
            #[unroll]
            for lane in 0..4 {
                if q * 4 + lane < seen {
                    max = A::max(max, scores.extract(lane));
                }
            }
        }
        let correction = A::exp(old_max - max);
        let mut sum = sums[i] * correction;
        let row = at.head_row + position;
        for q in 0..comptime!((block / 4) as usize) {
            let scores = probs[i * stride + q];
            let mut kept_probs = scores;
            #[unroll]
            for lane in 0..4 {
                let j = q * 4 + lane;
                let p = select(j < seen, A::exp(scores.extract(lane) - max), A::new(0.0));
                sum += p;
                let index = row * at.seq + at.first + j;
                let keep = kept::<A>(
                    index,
                    draw.key_lo,
                    draw.key_hi,
                    draw.threshold,
                    draw.keep_scale,
                    dropout,
                );
                kept_probs.insert(lane, p * keep);
            }
            probs[i * stride + q] = kept_probs;
        }
        maxima[i] = max;
        sums[i] = sum;
        rescale[i] = correction;
        i += CUBE_DIM_X as usize;
    }
}

/// A query row's log-sum-exp and `D = Σ do ⊙ o`, what the backward needs of the forward.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct RowStats<A: Float> {
    pub(crate) lse: A,
    pub(crate) delta: A,
}

/// A query's dropped probability of a key and the gradient of their score, `(p̃, ds)`, from
/// the scaled score, `do·v` and the query's statistics; both zero where the query does not
/// see the key (`seen`). `index` is the pair's dropout index. One definition for the `dq`
/// and the `dk`/`dv` kernels, which recompute the same probabilities.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn probability_and_gradient<A: Float>(
    score: A,
    dprob: A,
    stats: RowStats<A>,
    index: usize,
    seen: bool,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] dropout: bool,
) -> (A, A) {
    let p = select(seen, A::exp(score - stats.lse), A::new(0.0));
    let keep = kept::<A>(index, key_lo, key_hi, threshold, keep_scale, dropout);
    (p * keep, p * (dprob * keep - stats.delta))
}

/// A unit's 4 × 4 micro-tile of scores, times `scale`, into its rows and quad column of the
/// `[block, block]` tile `probs`.
#[cube]
fn store_scaled_scores<A: Float>(
    probs: &mut Shared<[Quad<A>]>,
    scores: &Array<A>,
    my_rows: usize,
    column_group: usize,
    scale: A,
    #[comptime] block: u32,
) {
    #[unroll]
    for r in 0..4 {
        let mut scaled = Quad::<A>::broadcast(A::new(0.0));
        #[unroll]
        for x in 0..4usize {
            scaled.insert(x, scores[r * 4 + x] * scale);
        }
        probs[(my_rows + r) * comptime!(padded_block_quads(block)) + column_group] = scaled;
    }
}

/// The dq kernel's score gradients `ds` of its 4 × 4 micro-tile (query rows `my_rows..`,
/// keys `4 · column_group..` of the tile at `at.first`) into its rows and quad column of
/// `score_grads`, from the micro-tiles of scores and `do·v` and the rows' statistics.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_query_score_grads<A: Float>(
    score_grads: &mut Shared<[Quad<A>]>,
    scores: &Array<A>,
    dprobs: &Array<A>,
    lse: &Shared<[A]>,
    deltas: &Shared<[A]>,
    at: TileRows,
    my_rows: usize,
    column_group: usize,
    scale: A,
    draw: DropoutArgs,
    #[comptime] block: u32,
    #[comptime] dropout: bool,
) {
    #[unroll]
    for r in 0..4 {
        let i = my_rows + r;
        let mut row = Quad::<A>::broadcast(A::new(0.0));
        #[unroll]
        for x in 0..4 {
            let (e, j) = (r * 4 + x, column_group * 4 + x);
            let stats = RowStats::<A> {
                lse: lse[i],
                delta: deltas[i],
            };
            let (_, ds) = probability_and_gradient::<A>(
                scores[e] * scale,
                dprobs[e],
                stats,
                (at.head_row + at.start + i) * at.seq + at.first + j,
                at.start + i < at.seq && at.first + j <= at.start + i,
                draw.key_lo,
                draw.key_hi,
                draw.threshold,
                draw.keep_scale,
                dropout,
            );
            row.insert(x, ds);
        }
        score_grads[i * comptime!(padded_block_quads(block)) + column_group] = row;
    }
}

/// The dk/dv kernel's dropped probabilities and score gradients of its 4 × 4 micro-tile (key
/// rows `my_keys..` of the block at `at.start`, queries `4 · column_group..` of the tile at
/// `at.first`) into its rows and quad column of `kept_probs` and `score_grads` (`[key,
/// query]`), from the micro-tiles of scores and `v·do` and the queries' statistics.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_key_tiles<A: Float>(
    kept_probs: &mut Shared<[Quad<A>]>,
    score_grads: &mut Shared<[Quad<A>]>,
    scores: &Array<A>,
    dprobs: &Array<A>,
    lse: &Shared<[A]>,
    deltas: &Shared<[A]>,
    at: TileRows,
    my_keys: usize,
    column_group: usize,
    scale: A,
    draw: DropoutArgs,
    #[comptime] block: u32,
    #[comptime] dropout: bool,
) {
    #[unroll]
    for r in 0..4 {
        let j = my_keys + r;
        let key_position = at.start + j;
        let mut kept_row = Quad::<A>::broadcast(A::new(0.0));
        let mut grad_row = Quad::<A>::broadcast(A::new(0.0));
        #[unroll]
        for x in 0..4 {
            let (e, i) = (r * 4 + x, column_group * 4 + x);
            let position = at.first + i;
            let stats = RowStats::<A> {
                lse: lse[i],
                delta: deltas[i],
            };
            let (p_kept, ds) = probability_and_gradient::<A>(
                scores[e] * scale,
                dprobs[e],
                stats,
                (at.head_row + position) * at.seq + key_position,
                position < at.seq && key_position <= position,
                draw.key_lo,
                draw.key_hi,
                draw.threshold,
                draw.keep_scale,
                dropout,
            );
            kept_row.insert(x, p_kept);
            grad_row.insert(x, ds);
        }
        let row = j * comptime!(padded_block_quads(block)) + column_group;
        kept_probs[row] = kept_row;
        score_grads[row] = grad_row;
    }
}

/// `D = Σ do ⊙ o` of each of the block's query rows (from the `grads` tile and `output`)
/// into `delta` (for the dk/dv kernel) and `deltas` (this cube's); every unit takes part.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_deltas<F: Float, A: Float, N: Size>(
    grads: &Shared<[Quad<A>]>,
    output: &[Vector<F, N>],
    delta: &mut [A],
    deltas: &mut Shared<[A]>,
    at: TileRows,
    cube_active: bool,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let d = head_dim as usize;
    let mut i = UNIT_POS_X as usize;
    while cube_active && i < block as usize {
        let mut row_delta = A::new(0.0);
        if at.start + i < at.seq {
            let row = at.head_row + at.start + i;
            for q in 0..comptime!(quads(head_dim)) {
                let g = grads[i * comptime!(padded_quads(head_dim)) + q];
                let o = read_quad::<F, A, N>(output, row * d, q, head_dim);
                // (Lane by lane: the padding's zeros add nothing.)
                #[unroll]
                for lane in 0..4usize {
                    row_delta += g.extract(lane) * o.extract(lane);
                }
            }
            delta[row] = row_delta;
        }
        deltas[i] = row_delta;
        i += CUBE_DIM_X as usize;
    }
}

/// The forward's running maximum and sum of each of the block's rows, before the first tile.
#[cube]
fn reset_row_stats<A: Float>(
    maxima: &mut Shared<[A]>,
    sums: &mut Shared<[A]>,
    #[comptime] block: u32,
) {
    let mut i = UNIT_POS_X as usize;
    while i < block as usize {
        maxima[i] = A::new(-3.0e38);
        sums[i] = A::new(0.0);
        i += CUBE_DIM_X as usize;
    }
}

/// A unit's 4 accumulator rows times their rows' rescaling factors (the online softmax's
/// correction for a new maximum).
#[cube]
fn rescale_accumulator<A: Float>(
    acc: &mut Array<Quad<A>>,
    rescale: &Shared<[A]>,
    my_rows: usize,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let w = comptime!(owned_quads(block, head_dim));
    #[unroll]
    for r in 0..4 {
        let factor = Quad::<A>::broadcast(rescale[my_rows + r]);
        for k in 0..w {
            acc[r * w + k] *= factor;
        }
    }
}

/// This unit's micro-tile: its row group and its column group (each `block / 4` of them).
#[cube]
fn unit_groups(#[comptime] block: u32) -> (usize, usize) {
    let unit = UNIT_POS_X as usize;
    let groups = comptime!((block / MICRO) as usize);
    (unit / groups, unit % groups)
}

/// Forward: `output` and the per-row `logsumexp` of the scaled scores (what the backward
/// needs), for `heads` heads (batch × heads) of `seq` rows.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_forward<F: Float, A: Float, N: Size>(
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
    #[comptime] block: u32,
    #[comptime] unroll: bool,
) {
    let key_lo = salted(key_lo, salt, 0usize, dropout);
    let key_hi = salted(key_hi, salt, 1usize, dropout);
    let (s, b) = (seq as usize, block as usize);
    let tile = comptime!(TileShape {
        block,
        head_dim,
        unroll
    });
    let tile_len = comptime!(block as usize * padded_quads(head_dim));
    let (cube_active, head_row, start) = cube_block(heads, seq, block);
    let (row_group, column_group) = unit_groups(block);
    let (my_rows, my_keys) = (row_group * 4, column_group * 4);
    let scale = A::cast_from(scale);

    let mut queries = Shared::<[Quad<A>]>::new_slice(tile_len);
    let mut keys = Shared::<[Quad<A>]>::new_slice(tile_len);
    let mut values = Shared::<[Quad<A>]>::new_slice(tile_len);
    // The tile's scores, then its (dropped) probabilities, row-major `[block, block]`.
    let mut probs =
        Shared::<[Quad<A>]>::new_slice(comptime!(block as usize * padded_block_quads(block)));
    // Per query row: running maximum, running sum, and this tile's rescaling of both.
    let mut maxima = Shared::<[A]>::new_slice(block as usize);
    let mut sums = Shared::<[A]>::new_slice(block as usize);
    let mut rescale = Shared::<[A]>::new_slice(block as usize);

    let mut acc = zero_accumulator::<A>(block, head_dim);
    let mut tiles = 0usize;
    if cube_active {
        load_tile::<F, A, N>(query, &mut queries, head_row, start, s, block, head_dim);
        // Key tiles 0 ..= this block's: the tiles above the causal diagonal are skipped.
        tiles = start / b + 1;
    }
    reset_row_stats::<A>(&mut maxima, &mut sums, block);
    for t in 0..tiles {
        let first = t * b;
        load_tile::<F, A, N>(key, &mut keys, head_row, first, s, block, head_dim);
        load_tile::<F, A, N>(value, &mut values, head_row, first, s, block, head_dim);
        sync_cube();
        let scores = micro_scores::<A>(&queries, my_rows, &keys, my_keys, head_dim, unroll);
        store_scaled_scores::<A>(&mut probs, &scores, my_rows, column_group, scale, block);
        sync_cube();
        online_softmax_tile::<A>(
            &mut probs,
            &mut maxima,
            &mut sums,
            &mut rescale,
            tile_rows(head_row, start, first, s),
            dropout_args(key_lo, key_hi, threshold, keep_scale),
            block,
            dropout,
        );
        sync_cube();
        rescale_accumulator::<A>(&mut acc, &rescale, my_rows, block, head_dim);
        accumulate_tile::<A>(&mut acc, &probs, my_rows, &values, column_group, tile);
        sync_cube();
    }

    if cube_active {
        let (at, group) = (block_rows(head_row, start, s), column_group);
        store_output::<F, A, N>(&acc, &sums, output, at, my_rows, group, block, head_dim);
        let at = block_rows(head_row, start, s);
        store_logsumexp::<A>(logsumexp, &maxima, &sums, at, block);
    }
}

/// A unit's accumulator rows divided by their softmax sums (0 for a row without any) into
/// `output`, those before the head's end.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_output<F: Float, A: Float, N: Size>(
    acc: &Array<Quad<A>>,
    sums: &Shared<[A]>,
    output: &mut [Vector<F, N>],
    at: TileRows,
    my_rows: usize,
    group: usize,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    #[unroll]
    for r in 0..4 {
        let position = at.start + my_rows + r;
        if position < at.seq {
            let sum = sums[my_rows + r];
            let inv = select(sum > A::new(0.0), A::new(1.0) / sum, A::new(0.0));
            let row = at.head_row + position;
            store_accumulator_row::<F, A, N>(acc, r, output, row, group, inv, block, head_dim);
        }
    }
}

/// `log Σ exp` of each of the block's score rows (those before the head's end), from the
/// forward's running maxima and sums.
#[cube]
fn store_logsumexp<A: Float>(
    logsumexp: &mut [A],
    maxima: &Shared<[A]>,
    sums: &Shared<[A]>,
    at: TileRows,
    #[comptime] block: u32,
) {
    let mut i = UNIT_POS_X as usize;
    while i < block as usize {
        if at.start + i < at.seq {
            logsumexp[at.head_row + at.start + i] = maxima[i] + A::ln(sums[i]);
        }
        i += CUBE_DIM_X as usize;
    }
}

/// Backward, per block of query rows: `delta = Σ do ⊙ o` (saved for
/// [`flash_attention_backward_key_value`]) and `grad_query`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward_query<F: Float, A: Float, N: Size>(
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
    #[comptime] block: u32,
    #[comptime] unroll: bool,
) {
    let key_lo = salted(key_lo, salt, 0usize, dropout);
    let key_hi = salted(key_hi, salt, 1usize, dropout);
    let (s, b) = (seq as usize, block as usize);
    let tile = comptime!(TileShape {
        block,
        head_dim,
        unroll
    });
    let tile_len = comptime!(block as usize * padded_quads(head_dim));
    let (cube_active, head_row, start) = cube_block(heads, seq, block);
    let (row_group, column_group) = unit_groups(block);
    let (my_rows, my_keys) = (row_group * 4, column_group * 4);
    let scale = A::cast_from(scale);

    let mut queries = Shared::<[Quad<A>]>::new_slice(tile_len);
    let mut grads = Shared::<[Quad<A>]>::new_slice(tile_len);
    let mut keys = Shared::<[Quad<A>]>::new_slice(tile_len);
    let mut values = Shared::<[Quad<A>]>::new_slice(tile_len);
    let mut score_grads =
        Shared::<[Quad<A>]>::new_slice(comptime!(block as usize * padded_block_quads(block)));
    let mut lse = Shared::<[A]>::new_slice(block as usize);
    let mut deltas = Shared::<[A]>::new_slice(block as usize);

    let mut tiles = 0usize;
    if cube_active {
        load_tile::<F, A, N>(query, &mut queries, head_row, start, s, block, head_dim);
        load_tile::<F, A, N>(grad_output, &mut grads, head_row, start, s, block, head_dim);
        load_row_values::<A>(logsumexp, &mut lse, head_row, start, s, block);
        tiles = start / b + 1;
    }
    sync_cube();
    let at = block_rows(head_row, start, s);
    store_deltas::<F, A, N>(
        &grads,
        output,
        delta,
        &mut deltas,
        at,
        cube_active,
        block,
        head_dim,
    );

    let mut acc = zero_accumulator::<A>(block, head_dim);
    for t in 0..tiles {
        let first = t * b;
        load_tile::<F, A, N>(key, &mut keys, head_row, first, s, block, head_dim);
        load_tile::<F, A, N>(value, &mut values, head_row, first, s, block, head_dim);
        sync_cube();
        let scores = micro_scores::<A>(&queries, my_rows, &keys, my_keys, head_dim, unroll);
        let dprobs = micro_scores::<A>(&grads, my_rows, &values, my_keys, head_dim, unroll);
        store_query_score_grads::<A>(
            &mut score_grads,
            &scores,
            &dprobs,
            &lse,
            &deltas,
            tile_rows(head_row, start, first, s),
            my_rows,
            column_group,
            scale,
            dropout_args(key_lo, key_hi, threshold, keep_scale),
            block,
            dropout,
        );
        sync_cube();
        accumulate_tile::<A>(&mut acc, &score_grads, my_rows, &keys, column_group, tile);
        sync_cube();
    }

    if cube_active {
        let (at, group) = (block_rows(head_row, start, s), column_group);
        store_accumulator::<F, A, N>(&acc, grad_query, at, my_rows, group, scale, block, head_dim);
    }
}

/// Backward, per block of key rows: `grad_key` and `grad_value`, from the queries that see
/// the keys (each key's own position onwards) and their `logsumexp` and `delta`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward_key_value<F: Float, A: Float, N: Size>(
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
    #[comptime] block: u32,
    #[comptime] unroll: bool,
) {
    let key_lo = salted(key_lo, salt, 0usize, dropout);
    let key_hi = salted(key_hi, salt, 1usize, dropout);
    let (s, b) = (seq as usize, block as usize);
    let tile = comptime!(TileShape {
        block,
        head_dim,
        unroll
    });
    let tile_len = comptime!(block as usize * padded_quads(head_dim));
    let (cube_active, head_row, start) = cube_block(heads, seq, block);
    let (row_group, column_group) = unit_groups(block);
    // Rows are keys here, columns queries.
    let (my_keys, my_queries) = (row_group * 4, column_group * 4);
    let scale = A::cast_from(scale);

    let mut keys = Shared::<[Quad<A>]>::new_slice(tile_len);
    let mut values = Shared::<[Quad<A>]>::new_slice(tile_len);
    let mut queries = Shared::<[Quad<A>]>::new_slice(tile_len);
    let mut grads = Shared::<[Quad<A>]>::new_slice(tile_len);
    // `[key, query]`: the dropped probabilities and the score gradients of the tile.
    let mut kept_probs =
        Shared::<[Quad<A>]>::new_slice(comptime!(block as usize * padded_block_quads(block)));
    let mut score_grads =
        Shared::<[Quad<A>]>::new_slice(comptime!(block as usize * padded_block_quads(block)));
    let mut lse = Shared::<[A]>::new_slice(block as usize);
    let mut deltas = Shared::<[A]>::new_slice(block as usize);

    // Query tiles from this block's own (the diagonal) to the head's last.
    let blocks = s.div_ceil(b);
    let mut first_tile = blocks;
    if cube_active {
        load_tile::<F, A, N>(key, &mut keys, head_row, start, s, block, head_dim);
        load_tile::<F, A, N>(value, &mut values, head_row, start, s, block, head_dim);
        first_tile = start / b;
    }
    let mut dk = zero_accumulator::<A>(block, head_dim);
    let mut dv = zero_accumulator::<A>(block, head_dim);
    for t in first_tile..blocks {
        let first = t * b;
        load_tile::<F, A, N>(query, &mut queries, head_row, first, s, block, head_dim);
        load_tile::<F, A, N>(grad_output, &mut grads, head_row, first, s, block, head_dim);
        load_row_values::<A>(logsumexp, &mut lse, head_row, first, s, block);
        load_row_values::<A>(delta, &mut deltas, head_row, first, s, block);
        sync_cube();
        let scores = micro_scores::<A>(&keys, my_keys, &queries, my_queries, head_dim, unroll);
        let dprobs = micro_scores::<A>(&values, my_keys, &grads, my_queries, head_dim, unroll);
        store_key_tiles::<A>(
            &mut kept_probs,
            &mut score_grads,
            &scores,
            &dprobs,
            &lse,
            &deltas,
            tile_rows(head_row, start, first, s),
            my_keys,
            column_group,
            scale,
            dropout_args(key_lo, key_hi, threshold, keep_scale),
            block,
            dropout,
        );
        sync_cube();
        accumulate_tile::<A>(&mut dv, &kept_probs, my_keys, &grads, column_group, tile);
        accumulate_tile::<A>(&mut dk, &score_grads, my_keys, &queries, column_group, tile);
        sync_cube();
    }

    if cube_active {
        let (one, group) = (A::new(1.0), column_group);
        let at = block_rows(head_row, start, s);
        store_accumulator::<F, A, N>(&dk, grad_key, at, my_keys, group, scale, block, head_dim);
        let at = block_rows(head_row, start, s);
        store_accumulator::<F, A, N>(&dv, grad_value, at, my_keys, group, one, block, head_dim);
    }
}
