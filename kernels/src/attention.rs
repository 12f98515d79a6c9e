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
//! The prologue, the mask, the dropout inside (the mask of [`crate::dropout`], re-derived in
//! the backward, never stored) and the tile loads are every attention family's
//! ([`crate::attention_common`]); what is this family's own is how the products are formed.
//!
//! With `D = Σ_c do_c o_c` per query row, the backward is `dṗ = do·v` (dropped and scaled as
//! the forward), `ds = p (dṗ − D)`, `dq = scale Σ_j ds k_j`, `dk = scale Σ_i ds q_i` and
//! `dv = Σ_i p̃ do_i` with `p̃` the dropped, scaled probability: one kernel per query block
//! (`dq`, and `D` for the other), one per key block (`dk`, `dv`), so that no two cubes
//! write the same gradient row (no atomics, deterministic).

use cubecl::prelude::*;

use crate::attention_common::{
    has_row, key_tiles, load_quad_tile, load_row_values, log_sum_exp, masked_max,
    masked_probability, no_maximum, normaliser, probability_and_gradient, prologue, quad_sum,
    quads, query_tiles, read_quad, write_quad, AttentionScalars, Quad, RowDraw, RowStats, TileRows,
};

/// Rows of a micro-tile: each unit owns 4 rows of a tile's products.
const MICRO: u32 = 4;

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

impl TileShape {
    fn new(block: u32, head_dim: u32, unroll: bool) -> Self {
        Self {
            block,
            head_dim,
            unroll,
        }
    }

    /// Quads of a `[block, head_dim]` tile, rows padded ([`padded_quads`]).
    fn rows_len(&self) -> usize {
        self.block as usize * padded_quads(self.head_dim)
    }

    /// Quads of a `[block, block]` tile, rows padded ([`padded_block_quads`]).
    fn square_len(&self) -> usize {
        self.block as usize * padded_block_quads(self.block)
    }
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

/// A unit's accumulator (times `factor`) into its 4 rows of the cube's block, those the head
/// has.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_accumulator<F: Float, A: Float, N: Size>(
    acc: &Array<Quad<A>>,
    target: &mut [Vector<F, N>],
    own: &TileRows,
    my_rows: usize,
    group: usize,
    factor: A,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    #[unroll]
    for r in 0..4 {
        let position = own.start + my_rows + r;
        if has_row(own, position) {
            let row = own.head_row + position;
            store_accumulator_row::<F, A, N>(acc, r, target, row, group, factor, block, head_dim);
        }
    }
}

/// Rows `at.first ..` of a head into one of this layout's `[block, head_dim]` tiles
/// ([`load_quad_tile`], rows padded as [`padded_quads`]).
#[cube]
fn load_tile<F: Float, A: Float, N: Size>(
    source: &[Vector<F, N>],
    tile: &mut Shared<[Quad<A>]>,
    at: &TileRows,
    #[comptime] shape: TileShape,
) {
    let (block, head_dim) = comptime!((shape.block, shape.head_dim));
    let stride = comptime!(padded_quads(head_dim));
    load_quad_tile::<F, A, N>(source, tile, at, block, head_dim, stride);
}

/// The online softmax over one tile of scores (`probs`, `[block, block]`, replaced by the
/// dropped probabilities), one unit per query row: the row's running maximum and sum are
/// updated over the keys the mask lets it see, and `rescale` gets the factor its running
/// output is to be multiplied by.
#[cube]
#[allow(clippy::too_many_arguments)]
fn online_softmax_tile<A: Float>(
    probs: &mut Shared<[Quad<A>]>,
    maxima: &mut Shared<[A]>,
    sums: &mut Shared<[A]>,
    rescale: &mut Shared<[A]>,
    at: &TileRows,
    draw: &RowDraw,
    #[comptime] block: u32,
    #[comptime] dropout: bool,
) {
    let stride = comptime!(padded_block_quads(block));
    let mut i = UNIT_POS_X as usize;
    while i < block as usize {
        let query = at.start + i;
        let old_max = maxima[i];
        let mut max = old_max;
        for q in 0..comptime!((block / 4) as usize) {
            let scores = probs[i * stride + q];
            #[unroll]
            for lane in 0..4 {
                let key = at.first + q * 4 + lane;
                max = masked_max::<A>(max, scores.extract(lane), at, query, key);
            }
        }
        let correction = A::exp(old_max - max);
        let mut sum = sums[i] * correction;
        for q in 0..comptime!((block / 4) as usize) {
            let scores = probs[i * stride + q];
            let mut kept_probs = scores;
            #[unroll]
            for lane in 0..4 {
                let key = at.first + q * 4 + lane;
                let score = scores.extract(lane);
                let (p, keep) = masked_probability::<A>(score, max, at, query, key, draw, dropout);
                sum += p;
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
    at: &TileRows,
    my_rows: usize,
    column_group: usize,
    scale: A,
    draw: &RowDraw,
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
            let (query, key) = (at.start + i, at.first + j);
            let score = scores[e] * scale;
            let (_, ds) = probability_and_gradient::<A>(
                score, dprobs[e], stats, at, query, key, draw, dropout,
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
    at: &TileRows,
    my_keys: usize,
    column_group: usize,
    scale: A,
    draw: &RowDraw,
    #[comptime] block: u32,
    #[comptime] dropout: bool,
) {
    #[unroll]
    for r in 0..4 {
        let j = my_keys + r;
        let key = at.start + j;
        let mut kept_row = Quad::<A>::broadcast(A::new(0.0));
        let mut grad_row = Quad::<A>::broadcast(A::new(0.0));
        #[unroll]
        for x in 0..4 {
            let (e, i) = (r * 4 + x, column_group * 4 + x);
            let stats = RowStats::<A> {
                lse: lse[i],
                delta: deltas[i],
            };
            let score = scores[e] * scale;
            let (p_kept, ds) = probability_and_gradient::<A>(
                score,
                dprobs[e],
                stats,
                at,
                at.first + i,
                key,
                draw,
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
/// into `delta` (for the dk/dv kernel) and `deltas` (this cube's; 0 where the head has no
/// row); every unit takes part.
#[cube]
fn store_deltas<F: Float, A: Float, N: Size>(
    grads: &Shared<[Quad<A>]>,
    output: &[Vector<F, N>],
    delta: &mut [A],
    deltas: &mut Shared<[A]>,
    own: &TileRows,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let d = head_dim as usize;
    let mut i = UNIT_POS_X as usize;
    while i < block as usize {
        let mut row_delta = A::new(0.0);
        if has_row(own, own.start + i) {
            let row = own.head_row + own.start + i;
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
        maxima[i] = no_maximum::<A>();
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
/// needs), for `scalars.heads` heads (batch × heads) of `scalars.seq` rows.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_forward<F: Float, A: Float, N: Size>(
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
    #[comptime] block: u32,
    #[comptime] unroll: bool,
) {
    let (own, draw, scale) = prologue::<A>(&scalars, salt, first_keys, block, dropout, documents);
    let tile = comptime!(TileShape::new(block, head_dim, unroll));
    let (row_group, column_group) = unit_groups(block);
    let (my_rows, my_keys) = (row_group * 4, column_group * 4);

    let mut queries = Shared::<[Quad<A>]>::new_slice(comptime!(tile.rows_len()));
    let mut keys = Shared::<[Quad<A>]>::new_slice(comptime!(tile.rows_len()));
    let mut values = Shared::<[Quad<A>]>::new_slice(comptime!(tile.rows_len()));
    // The tile's scores, then its (dropped) probabilities, row-major `[block, block]`.
    let mut probs = Shared::<[Quad<A>]>::new_slice(comptime!(tile.square_len()));
    // Per query row: running maximum, running sum, and this tile's rescaling of both.
    let mut maxima = Shared::<[A]>::new_slice(block as usize);
    let mut sums = Shared::<[A]>::new_slice(block as usize);
    let mut rescale = Shared::<[A]>::new_slice(block as usize);

    let mut acc = zero_accumulator::<A>(block, head_dim);
    load_tile::<F, A, N>(query, &mut queries, &own, tile);
    reset_row_stats::<A>(&mut maxima, &mut sums, block);
    let (first_tile, end_tile) = key_tiles(&own, block, block);
    for t in first_tile..end_tile {
        let at = own.at_tile(t * block as usize);
        load_tile::<F, A, N>(key, &mut keys, &at, tile);
        load_tile::<F, A, N>(value, &mut values, &at, tile);
        sync_cube();
        let scores = micro_scores::<A>(&queries, my_rows, &keys, my_keys, head_dim, unroll);
        store_scaled_scores::<A>(&mut probs, &scores, my_rows, column_group, scale, block);
        sync_cube();
        let (m, sm, rs) = (&mut maxima, &mut sums, &mut rescale);
        online_softmax_tile::<A>(&mut probs, m, sm, rs, &at, &draw, block, dropout);
        sync_cube();
        rescale_accumulator::<A>(&mut acc, &rescale, my_rows, block, head_dim);
        accumulate_tile::<A>(&mut acc, &probs, my_rows, &values, column_group, tile);
        sync_cube();
    }

    let group = column_group;
    store_output::<F, A, N>(&acc, &sums, output, &own, my_rows, group, block, head_dim);
    store_logsumexp::<A>(logsumexp, &maxima, &sums, &own, block);
}

/// A unit's accumulator rows normalised by their softmax sums ([`normaliser`]) into
/// `output`, those the head has.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_output<F: Float, A: Float, N: Size>(
    acc: &Array<Quad<A>>,
    sums: &Shared<[A]>,
    output: &mut [Vector<F, N>],
    own: &TileRows,
    my_rows: usize,
    group: usize,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    #[unroll]
    for r in 0..4 {
        let position = own.start + my_rows + r;
        if has_row(own, position) {
            let inv = normaliser::<A>(sums[my_rows + r]);
            let row = own.head_row + position;
            store_accumulator_row::<F, A, N>(acc, r, output, row, group, inv, block, head_dim);
        }
    }
}

/// The log-sum-exp of each of the block's score rows (those the head has), from the
/// forward's running maxima and sums.
#[cube]
fn store_logsumexp<A: Float>(
    logsumexp: &mut [A],
    maxima: &Shared<[A]>,
    sums: &Shared<[A]>,
    own: &TileRows,
    #[comptime] block: u32,
) {
    let mut i = UNIT_POS_X as usize;
    while i < block as usize {
        if has_row(own, own.start + i) {
            logsumexp[own.head_row + own.start + i] = log_sum_exp::<A>(maxima[i], sums[i]);
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
    scalars: AttentionScalars,
    salt: &[u32],
    first_keys: &[u32],
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] documents: bool,
    #[comptime] block: u32,
    #[comptime] unroll: bool,
) {
    let (own, draw, scale) = prologue::<A>(&scalars, salt, first_keys, block, dropout, documents);
    let tile = comptime!(TileShape::new(block, head_dim, unroll));
    let (row_group, column_group) = unit_groups(block);
    let (my_rows, my_keys) = (row_group * 4, column_group * 4);

    let mut queries = Shared::<[Quad<A>]>::new_slice(comptime!(tile.rows_len()));
    let mut grads = Shared::<[Quad<A>]>::new_slice(comptime!(tile.rows_len()));
    let mut keys = Shared::<[Quad<A>]>::new_slice(comptime!(tile.rows_len()));
    let mut values = Shared::<[Quad<A>]>::new_slice(comptime!(tile.rows_len()));
    let mut score_grads = Shared::<[Quad<A>]>::new_slice(comptime!(tile.square_len()));
    let mut lse = Shared::<[A]>::new_slice(block as usize);
    let mut deltas = Shared::<[A]>::new_slice(block as usize);

    load_tile::<F, A, N>(query, &mut queries, &own, tile);
    load_tile::<F, A, N>(grad_output, &mut grads, &own, tile);
    load_row_values::<A>(logsumexp, &mut lse, &own, block);
    sync_cube();
    store_deltas::<F, A, N>(&grads, output, delta, &mut deltas, &own, block, head_dim);

    let mut acc = zero_accumulator::<A>(block, head_dim);
    let (first_tile, end_tile) = key_tiles(&own, block, block);
    for t in first_tile..end_tile {
        let at = own.at_tile(t * block as usize);
        load_tile::<F, A, N>(key, &mut keys, &at, tile);
        load_tile::<F, A, N>(value, &mut values, &at, tile);
        sync_cube();
        let scores = micro_scores::<A>(&queries, my_rows, &keys, my_keys, head_dim, unroll);
        let dprobs = micro_scores::<A>(&grads, my_rows, &values, my_keys, head_dim, unroll);
        store_query_score_grads::<A>(
            &mut score_grads,
            &scores,
            &dprobs,
            &lse,
            &deltas,
            &at,
            my_rows,
            column_group,
            scale,
            &draw,
            block,
            dropout,
        );
        sync_cube();
        accumulate_tile::<A>(&mut acc, &score_grads, my_rows, &keys, column_group, tile);
        sync_cube();
    }

    let group = column_group;
    store_accumulator::<F, A, N>(
        &acc, grad_query, &own, my_rows, group, scale, block, head_dim,
    );
}

/// Backward, per block of key rows: `grad_key` and `grad_value`, from the queries that see
/// the keys and their `logsumexp` and `delta`.
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
    scalars: AttentionScalars,
    salt: &[u32],
    first_keys: &[u32],
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
    #[comptime] documents: bool,
    #[comptime] block: u32,
    #[comptime] unroll: bool,
) {
    let (own, draw, scale) = prologue::<A>(&scalars, salt, first_keys, block, dropout, documents);
    let tile = comptime!(TileShape::new(block, head_dim, unroll));
    let (row_group, column_group) = unit_groups(block);
    // Rows are keys here, columns queries.
    let (my_keys, my_queries) = (row_group * 4, column_group * 4);

    let mut keys = Shared::<[Quad<A>]>::new_slice(comptime!(tile.rows_len()));
    let mut values = Shared::<[Quad<A>]>::new_slice(comptime!(tile.rows_len()));
    let mut queries = Shared::<[Quad<A>]>::new_slice(comptime!(tile.rows_len()));
    let mut grads = Shared::<[Quad<A>]>::new_slice(comptime!(tile.rows_len()));
    // `[key, query]`: the dropped probabilities and the score gradients of the tile.
    let mut kept_probs = Shared::<[Quad<A>]>::new_slice(comptime!(tile.square_len()));
    let mut score_grads = Shared::<[Quad<A>]>::new_slice(comptime!(tile.square_len()));
    let mut lse = Shared::<[A]>::new_slice(block as usize);
    let mut deltas = Shared::<[A]>::new_slice(block as usize);

    load_tile::<F, A, N>(key, &mut keys, &own, tile);
    load_tile::<F, A, N>(value, &mut values, &own, tile);
    let mut dk = zero_accumulator::<A>(block, head_dim);
    let mut dv = zero_accumulator::<A>(block, head_dim);
    let (first_tile, end_tile) = query_tiles(&own, block, block);
    for t in first_tile..end_tile {
        let at = own.at_tile(t * block as usize);
        load_tile::<F, A, N>(query, &mut queries, &at, tile);
        load_tile::<F, A, N>(grad_output, &mut grads, &at, tile);
        load_row_values::<A>(logsumexp, &mut lse, &at, block);
        load_row_values::<A>(delta, &mut deltas, &at, block);
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
            &at,
            my_keys,
            column_group,
            scale,
            &draw,
            block,
            dropout,
        );
        sync_cube();
        accumulate_tile::<A>(&mut dv, &kept_probs, my_keys, &grads, column_group, tile);
        accumulate_tile::<A>(&mut dk, &score_grads, my_keys, &queries, column_group, tile);
        sync_cube();
    }

    let (one, group) = (A::new(1.0), column_group);
    store_accumulator::<F, A, N>(&dk, grad_key, &own, my_keys, group, scale, block, head_dim);
    store_accumulator::<F, A, N>(&dv, grad_value, &own, my_keys, group, one, block, head_dim);
}
