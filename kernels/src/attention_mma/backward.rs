//! The backward: `delta = Σ do ⊙ o` and `dq` per query block, then `dk` and `dv` per key block.

use cubecl::prelude::*;

use super::{
    accumulate_rows_times, fill_shared, load_rows, rows_times_transposed, store_rows, tiles_at,
    Tiles,
};
use crate::attention::{
    cube_block, dropout_args, load_row_values, probability_and_gradient, DropoutArgs, RowStats,
};
use crate::dropout::salted;

/// `delta = Σ do ⊙ o` of each of the block's query rows (from the `grads` tile and
/// `output`, in f32) into `delta` (for the key kernel) and `deltas` (this cube's; 0 past the
/// head's end).
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_deltas<F: Float, A: Float, N: Size>(
    grads: &Shared<[F]>,
    output: &[Vector<F, N>],
    delta: &mut [A],
    deltas: &mut Shared<[A]>,
    head_row: usize,
    start: usize,
    seq: usize,
    cube_active: bool,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let n = N::value().comptime();
    let d = head_dim as usize;
    let mut i = UNIT_POS as usize;
    while i < block as usize {
        let mut row_delta = A::new(0.0);
        if cube_active && start + i < seq {
            let row = head_row + start + i;
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
/// statistics; both zero where the query does not see the key. The rows are queries
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
    at: &Tiles,
    scale: A,
    draw: &DropoutArgs,
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] by_key: bool,
    #[comptime] dropout: bool,
) -> (A, A) {
    let b = comptime!((tile * planes) as usize);
    let (r, c) = (plane * tile as usize + e / b, e % b);
    let (own, other) = (at.start + r, at.first + c);
    let mut query = r;
    let (mut position, mut key_position) = (own, other);
    if by_key {
        query = c;
        position = other;
        key_position = own;
    }
    let stats = RowStats::<A> {
        lse: lse[query],
        delta: deltas[query],
    };
    let at_element = plane * tile as usize * b + e;
    probability_and_gradient::<A>(
        scores[at_element] * scale,
        dprobs[at_element],
        stats,
        (at.head_row + position) * at.seq + key_position,
        position < at.seq && key_position <= position,
        draw.key_lo,
        draw.key_hi,
        draw.threshold,
        draw.keep_scale,
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
    at: Tiles,
    scale: A,
    draw: DropoutArgs,
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] dropout: bool,
) {
    let base = plane * comptime!((tile * tile * planes) as usize);
    let mut e = UNIT_POS_PLANE as usize;
    while e < comptime!((tile * tile * planes) as usize) {
        let (_, ds) = tile_element::<A>(
            scores, dprobs, lse, deltas, plane, e, &at, scale, &draw, tile, planes, false, dropout,
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
fn key_tiles<F: Float, A: Float>(
    scores: &Shared<[A]>,
    dprobs: &Shared<[A]>,
    lse: &Shared<[A]>,
    deltas: &Shared<[A]>,
    kept_probs: &mut Shared<[F]>,
    score_grads: &mut Shared<[F]>,
    plane: usize,
    at: Tiles,
    scale: A,
    draw: &DropoutArgs,
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] dropout: bool,
) {
    let base = plane * comptime!((tile * tile * planes) as usize);
    let mut e = UNIT_POS_PLANE as usize;
    while e < comptime!((tile * tile * planes) as usize) {
        let (p_kept, ds) = tile_element::<A>(
            scores, dprobs, lse, deltas, plane, e, &at, scale, draw, tile, planes, true, dropout,
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
    #[comptime] tile: u32,
    #[comptime] planes: u32,
) {
    let key_lo = salted(key_lo, salt, 0usize, dropout);
    let key_hi = salted(key_hi, salt, 1usize, dropout);
    let block = comptime!(tile * planes);
    let (s, b) = (seq as usize, block as usize);
    let (cube_active, head_row, start) = cube_block(heads, seq, block);
    let plane = (UNIT_POS / PLANE_DIM) as usize;
    let scale = A::cast_from(scale);

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
    let mut lse = Shared::<[A]>::new_slice(b);
    let mut deltas = Shared::<[A]>::new_slice(b);

    fill_shared::<A>(&mut acc, A::new(0.0), tile_len);
    let mut tiles = 0usize;
    if cube_active {
        load_rows::<F, N>(query, &mut queries, head_row, start, s, block, head_dim);
        load_rows::<F, N>(grad_output, &mut grads, head_row, start, s, block, head_dim);
        load_row_values::<A>(logsumexp, &mut lse, head_row, start, s, block);
        tiles = start / b + 1;
    }
    sync_cube();
    store_deltas::<F, A, N>(
        &grads,
        output,
        delta,
        &mut deltas,
        head_row,
        start,
        s,
        cube_active,
        block,
        head_dim,
    );
    for t in 0..tiles {
        let first = t * b;
        load_rows::<F, N>(key, &mut keys, head_row, first, s, block, head_dim);
        load_rows::<F, N>(value, &mut values, head_row, first, s, block, head_dim);
        sync_cube();
        rows_times_transposed::<F, A>(&queries, &keys, &mut scores, plane, tile, planes, head_dim);
        rows_times_transposed::<F, A>(&grads, &values, &mut dprobs, plane, tile, planes, head_dim);
        sync_cube();
        let at = tiles_at(head_row, start, first, s);
        query_score_grads::<F, A>(
            &scores,
            &dprobs,
            &lse,
            &deltas,
            &mut score_grads,
            plane,
            at,
            scale,
            dropout_args(key_lo, key_hi, threshold, keep_scale),
            tile,
            planes,
            dropout,
        );
        sync_cube();
        accumulate_rows_times::<F, A>(&score_grads, &keys, &mut acc, plane, tile, planes, head_dim);
        sync_cube();
    }
    if cube_active {
        store_rows::<F, A, N>(&acc, scale, grad_query, head_row, start, s, block, head_dim);
    }
}

/// Backward, per block of key rows: `grad_key = scale Σ_i ds q_i` and `grad_value = Σ_i p̃
/// do_i`, from the queries that see the keys (each key's own position onwards) and their
/// `logsumexp` and `delta`.
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
    #[comptime] tile: u32,
    #[comptime] planes: u32,
) {
    let key_lo = salted(key_lo, salt, 0usize, dropout);
    let key_hi = salted(key_hi, salt, 1usize, dropout);
    let draw = dropout_args(key_lo, key_hi, threshold, keep_scale);
    let block = comptime!(tile * planes);
    let (s, b) = (seq as usize, block as usize);
    let (cube_active, head_row, start) = cube_block(heads, seq, block);
    let plane = (UNIT_POS / PLANE_DIM) as usize;
    let scale = A::cast_from(scale);

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
    let mut lse = Shared::<[A]>::new_slice(b);
    let mut deltas = Shared::<[A]>::new_slice(b);

    fill_shared::<A>(&mut dk, A::new(0.0), tile_len);
    fill_shared::<A>(&mut dv, A::new(0.0), tile_len);
    // Query tiles from this block's own (the diagonal) to the head's last.
    let blocks = s.div_ceil(b);
    let mut first_tile = blocks;
    if cube_active {
        load_rows::<F, N>(key, &mut keys, head_row, start, s, block, head_dim);
        load_rows::<F, N>(value, &mut values, head_row, start, s, block, head_dim);
        first_tile = start / b;
    }
    for t in first_tile..blocks {
        let first = t * b;
        load_rows::<F, N>(query, &mut queries, head_row, first, s, block, head_dim);
        load_rows::<F, N>(grad_output, &mut grads, head_row, first, s, block, head_dim);
        load_row_values::<A>(logsumexp, &mut lse, head_row, first, s, block);
        load_row_values::<A>(delta, &mut deltas, head_row, first, s, block);
        sync_cube();
        rows_times_transposed::<F, A>(&keys, &queries, &mut scores, plane, tile, planes, head_dim);
        rows_times_transposed::<F, A>(&values, &grads, &mut dprobs, plane, tile, planes, head_dim);
        sync_cube();
        let at = tiles_at(head_row, start, first, s);
        key_tiles::<F, A>(
            &scores,
            &dprobs,
            &lse,
            &deltas,
            &mut kept_probs,
            &mut ds,
            plane,
            at,
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
    if cube_active {
        let unscaled = A::new(1.0);
        store_rows::<F, A, N>(&dk, scale, grad_key, head_row, start, s, block, head_dim);
        store_rows::<F, A, N>(
            &dv, unscaled, grad_value, head_row, start, s, block, head_dim,
        );
    }
}
