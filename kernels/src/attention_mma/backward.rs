//! The backward: `delta = Σ do ⊙ o` and `dq` per query block, then `dk` and `dv` per key block.

use cubecl::prelude::*;

use super::{accumulate_rows_times, fill_shared, rows_times_transposed, store_rows};
use crate::attention_common::{
    has_row, key_tiles, load_plain_tile, load_row_values, probability_and_gradient, prologue,
    query_tiles, AttentionScalars, RowDraw, RowStats, TileRows,
};

/// `delta = Σ do ⊙ o` of each of the block's query rows (from the `grads` tile and
/// `output`, in f32) into `delta` (for the key kernel) and `deltas` (this cube's; 0 where
/// the head has no row).
#[cube]
fn store_deltas<F: Float, A: Float, N: Size>(
    grads: &Shared<[F]>,
    output: &[Vector<F, N>],
    delta: &mut [A],
    deltas: &mut Shared<[A]>,
    own: &TileRows,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let n = N::value().comptime();
    let d = head_dim as usize;
    let mut i = UNIT_POS as usize;
    while i < block as usize {
        let mut row_delta = A::new(0.0);
        if has_row(own, own.start + i) {
            let row = own.head_row + own.start + i;
            for c in 0..comptime!(head_dim as usize / n) {
                let o = output[(row * d) / n + c];
                #[unroll]
                for k in 0..n {
                    let g = A::cast_from(grads[i * d + c * n + k]);
                    row_delta += g * A::cast_from(o.extract(k));
                }
            }
            delta[row] = row_delta;
        }
        deltas[i] = row_delta;
        i += CUBE_DIM as usize;
    }
}

/// The dropped probability and the score gradient `(p̃, ds)` of element `e` of the plane's
/// rows of a `[block, block]` tile, from the unscaled score, `do·v` and the query's
/// statistics; both zero where the mask hides the key from the query. The rows are queries
/// (`start + r`) and the columns keys (`first + c`) in the dq kernel, the other way round
/// with `by_key` (the dk/dv kernel).
#[cube]
#[allow(clippy::too_many_arguments)]
fn tile_element<A: Float>(
    scores: &Shared<[A]>,
    dprobs: &Shared<[A]>,
    lse: &Shared<[A]>,
    deltas: &Shared<[A]>,
    plane: usize,
    e: usize,
    at: &TileRows,
    scale: A,
    draw: &RowDraw,
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] by_key: bool,
    #[comptime] dropout: bool,
) -> (A, A) {
    let b = comptime!((tile * planes) as usize);
    let (r, c) = (plane * tile as usize + e / b, e % b);
    let (own, other) = (at.start + r, at.first + c);
    let mut query_row = r;
    let (mut query, mut key) = (own, other);
    if by_key {
        query_row = c;
        query = other;
        key = own;
    }
    let stats = RowStats::<A> {
        lse: lse[query_row],
        delta: deltas[query_row],
    };
    let at_element = plane * tile as usize * b + e;
    let score = scores[at_element] * scale;
    probability_and_gradient::<A>(
        score,
        dprobs[at_element],
        stats,
        at,
        query,
        key,
        draw,
        dropout,
    )
}

/// The dq kernel's score gradients of the plane's rows (queries) into `score_grads` (the
/// storage type), element by element over all the plane's units.
#[cube]
#[allow(clippy::too_many_arguments)]
fn query_score_grads<F: Float, A: Float>(
    scores: &Shared<[A]>,
    dprobs: &Shared<[A]>,
    lse: &Shared<[A]>,
    deltas: &Shared<[A]>,
    score_grads: &mut Shared<[F]>,
    plane: usize,
    at: &TileRows,
    scale: A,
    draw: &RowDraw,
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] dropout: bool,
) {
    let base = plane * comptime!((tile * tile * planes) as usize);
    let mut e = UNIT_POS_PLANE as usize;
    while e < comptime!((tile * tile * planes) as usize) {
        let (_, ds) = tile_element::<A>(
            scores, dprobs, lse, deltas, plane, e, at, scale, draw, tile, planes, false, dropout,
        );
        score_grads[base + e] = F::cast_from(ds);
        e += PLANE_DIM as usize;
    }
}

/// The dk/dv kernel's dropped probabilities and score gradients of the plane's rows (keys;
/// `[key, query]`) into `kept_probs` and `score_grads` (the storage type), element by element
/// over all the plane's units.
#[cube]
#[allow(clippy::too_many_arguments)]
fn key_score_grads<F: Float, A: Float>(
    scores: &Shared<[A]>,
    dprobs: &Shared<[A]>,
    lse: &Shared<[A]>,
    deltas: &Shared<[A]>,
    kept_probs: &mut Shared<[F]>,
    score_grads: &mut Shared<[F]>,
    plane: usize,
    at: &TileRows,
    scale: A,
    draw: &RowDraw,
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] dropout: bool,
) {
    let base = plane * comptime!((tile * tile * planes) as usize);
    let mut e = UNIT_POS_PLANE as usize;
    while e < comptime!((tile * tile * planes) as usize) {
        let (p_kept, ds) = tile_element::<A>(
            scores, dprobs, lse, deltas, plane, e, at, scale, draw, tile, planes, true, dropout,
        );
        kept_probs[base + e] = F::cast_from(p_kept);
        score_grads[base + e] = F::cast_from(ds);
        e += PLANE_DIM as usize;
    }
}

/// Backward, per block of query rows: `delta = Σ do ⊙ o` (saved for
/// [`mma_attention_backward_key_value`]) and `grad_query = scale Σ_j ds k_j`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn mma_attention_backward_query<F: Float, A: Float, N: Size>(
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
    #[comptime] tile: u32,
    #[comptime] planes: u32,
) {
    let block = comptime!(tile * planes);
    let (own, draw, scale) = prologue::<A>(&scalars, salt, first_keys, block, dropout, documents);
    let plane = (UNIT_POS / PLANE_DIM) as usize;

    let tile_len = comptime!((block * head_dim) as usize);
    let square = comptime!((block * block) as usize);
    let mut queries = Shared::<[F]>::new_slice(tile_len);
    let mut grads = Shared::<[F]>::new_slice(tile_len);
    let mut keys = Shared::<[F]>::new_slice(tile_len);
    let mut values = Shared::<[F]>::new_slice(tile_len);
    let mut scores = Shared::<[A]>::new_slice(square);
    let mut dprobs = Shared::<[A]>::new_slice(square);
    let mut score_grads = Shared::<[F]>::new_slice(square);
    let mut acc = Shared::<[A]>::new_slice(tile_len);
    let mut lse = Shared::<[A]>::new_slice(block as usize);
    let mut deltas = Shared::<[A]>::new_slice(block as usize);

    fill_shared::<A>(&mut acc, A::new(0.0), tile_len);
    load_plain_tile::<F, N>(query, &mut queries, &own, block, head_dim);
    load_plain_tile::<F, N>(grad_output, &mut grads, &own, block, head_dim);
    load_row_values::<A>(logsumexp, &mut lse, &own, block);
    sync_cube();
    store_deltas::<F, A, N>(&grads, output, delta, &mut deltas, &own, block, head_dim);
    let (first_tile, end_tile) = key_tiles(&own, block, block);
    for t in first_tile..end_tile {
        let at = own.at_tile(t * block as usize);
        load_plain_tile::<F, N>(key, &mut keys, &at, block, head_dim);
        load_plain_tile::<F, N>(value, &mut values, &at, block, head_dim);
        sync_cube();
        rows_times_transposed::<F, A>(&queries, &keys, &mut scores, plane, tile, planes, head_dim);
        rows_times_transposed::<F, A>(&grads, &values, &mut dprobs, plane, tile, planes, head_dim);
        sync_cube();
        query_score_grads::<F, A>(
            &scores,
            &dprobs,
            &lse,
            &deltas,
            &mut score_grads,
            plane,
            &at,
            scale,
            &draw,
            tile,
            planes,
            dropout,
        );
        sync_cube();
        accumulate_rows_times::<F, A>(&score_grads, &keys, &mut acc, plane, tile, planes, head_dim);
        sync_cube();
    }
    store_rows::<F, A, N>(&acc, scale, grad_query, &own, block, head_dim);
}

/// Backward, per block of key rows: `grad_key = scale Σ_i ds q_i` and `grad_value = Σ_i p̃
/// do_i`, from the queries that see the keys and their `logsumexp` and `delta`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn mma_attention_backward_key_value<F: Float, A: Float, N: Size>(
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
    #[comptime] tile: u32,
    #[comptime] planes: u32,
) {
    let block = comptime!(tile * planes);
    let (own, draw, scale) = prologue::<A>(&scalars, salt, first_keys, block, dropout, documents);
    let plane = (UNIT_POS / PLANE_DIM) as usize;

    let tile_len = comptime!((block * head_dim) as usize);
    let square = comptime!((block * block) as usize);
    let mut keys = Shared::<[F]>::new_slice(tile_len);
    let mut values = Shared::<[F]>::new_slice(tile_len);
    let mut queries = Shared::<[F]>::new_slice(tile_len);
    let mut grads = Shared::<[F]>::new_slice(tile_len);
    // `[key, query]`: `k qᵀ`, `v doᵀ`, then the dropped probabilities and score gradients.
    let mut scores = Shared::<[A]>::new_slice(square);
    let mut dprobs = Shared::<[A]>::new_slice(square);
    let mut kept_probs = Shared::<[F]>::new_slice(square);
    let mut ds = Shared::<[F]>::new_slice(square);
    let mut dk = Shared::<[A]>::new_slice(tile_len);
    let mut dv = Shared::<[A]>::new_slice(tile_len);
    let mut lse = Shared::<[A]>::new_slice(block as usize);
    let mut deltas = Shared::<[A]>::new_slice(block as usize);

    fill_shared::<A>(&mut dk, A::new(0.0), tile_len);
    fill_shared::<A>(&mut dv, A::new(0.0), tile_len);
    load_plain_tile::<F, N>(key, &mut keys, &own, block, head_dim);
    load_plain_tile::<F, N>(value, &mut values, &own, block, head_dim);
    let (first_tile, end_tile) = query_tiles(&own, block, block);
    for t in first_tile..end_tile {
        let at = own.at_tile(t * block as usize);
        load_plain_tile::<F, N>(query, &mut queries, &at, block, head_dim);
        load_plain_tile::<F, N>(grad_output, &mut grads, &at, block, head_dim);
        load_row_values::<A>(logsumexp, &mut lse, &at, block);
        load_row_values::<A>(delta, &mut deltas, &at, block);
        sync_cube();
        rows_times_transposed::<F, A>(&keys, &queries, &mut scores, plane, tile, planes, head_dim);
        rows_times_transposed::<F, A>(&values, &grads, &mut dprobs, plane, tile, planes, head_dim);
        sync_cube();
        key_score_grads::<F, A>(
            &scores,
            &dprobs,
            &lse,
            &deltas,
            &mut kept_probs,
            &mut ds,
            plane,
            &at,
            scale,
            &draw,
            tile,
            planes,
            dropout,
        );
        sync_cube();
        accumulate_rows_times::<F, A>(&kept_probs, &grads, &mut dv, plane, tile, planes, head_dim);
        accumulate_rows_times::<F, A>(&ds, &queries, &mut dk, plane, tile, planes, head_dim);
        sync_cube();
    }
    let unscaled = A::new(1.0);
    store_rows::<F, A, N>(&dk, scale, grad_key, &own, block, head_dim);
    store_rows::<F, A, N>(&dv, unscaled, grad_value, &own, block, head_dim);
}
