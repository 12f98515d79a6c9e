//! The forward: `output` and the log-sum-exp per query row.

use cubecl::prelude::*;

use super::{
    accumulate_rows_times, fill_shared, load_rows, rows_times_transposed, store_rows, tiles_at,
    Tiles,
};
use crate::attention::{cube_block, kept};
use crate::dropout::salted;

/// The row statistics the online softmax keeps in shared memory: per row its running maximum
/// and sum and this tile's correction of the running output; per row and column group the
/// group's partial maximum and sum.
#[derive(CubeType)]
struct RowStatistics<A: Float> {
    maxima: Shared<[A]>,
    sums: Shared<[A]>,
    corrections: Shared<[A]>,
    partial_maxima: Shared<[A]>,
    partial_sums: Shared<[A]>,
}

#[cube]
impl<A: Float> RowStatistics<A> {
    /// For a block of `block` rows whose keys are shared among `groups` units per row;
    /// every row's running maximum −3·10³⁸ and sum 0.
    fn new(#[comptime] block: u32, #[comptime] groups: u32) -> RowStatistics<A> {
        let (b, g) = (block as usize, groups as usize);
        let mut stats = RowStatistics::<A> {
            maxima: Shared::<[A]>::new_slice(b),
            sums: Shared::<[A]>::new_slice(b),
            corrections: Shared::<[A]>::new_slice(b),
            partial_maxima: Shared::<[A]>::new_slice(b * g),
            partial_sums: Shared::<[A]>::new_slice(b * g),
        };
        fill_shared::<A>(&mut stats.maxima, A::new(-3.0e38), b);
        fill_shared::<A>(&mut stats.sums, A::new(0.0), b);
        stats
    }
}

/// How many keys of a tile query row `r` of the block sees (0 past the head's end).
#[cube]
fn seen_keys(at: &Tiles, r: usize, #[comptime] block: u32) -> usize {
    let position = at.start + r;
    let mut seen = 0usize;
    if position < at.seq {
        seen = position + 1 - at.first;
        if seen > block as usize {
            seen = block as usize;
        }
    }
    seen
}

/// The online softmax over the plane's rows of one key tile: each row's scaled scores of the
/// keys it sees become its dropped probabilities in `probs` (zeros for the keys it does not
/// see), its running maximum and sum are updated, and its running output row is multiplied by
/// the correction for a new maximum. Each row's keys are shared among `groups` units (key `j`
/// to group `j mod groups`), whose partial maxima and sums meet in shared memory, so that a
/// plane wider than its rows keeps every unit busy (two per row on a GPU's warp of 32 with
/// tiles of 16); the running output is rescaled element by element by all the plane's units.
#[cube]
#[allow(clippy::too_many_arguments)]
fn plane_softmax<F: Float, A: Float>(
    scores: &Shared<[A]>,
    probs: &mut Shared<[F]>,
    out: &mut Shared<[A]>,
    stats: &mut RowStatistics<A>,
    plane: usize,
    at: Tiles,
    scale: A,
    draw: crate::attention::DropoutArgs,
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] head_dim: u32,
    #[comptime] groups: u32,
    #[comptime] dropout: bool,
) {
    let b = comptime!((tile * planes) as usize);
    let (t, d, g) = (tile as usize, head_dim as usize, groups as usize);
    let rows = plane * t;
    // Each group's maximum of its keys.
    let mut pair = UNIT_POS_PLANE as usize;
    while pair < t * g {
        let (r, group) = (rows + pair / g, pair % g);
        let seen = seen_keys(&at, r, comptime!(tile * planes));
        let mut max = A::new(-3.0e38);
        let mut j = group;
        while j < seen {
            max = A::max(max, scores[r * b + j] * scale);
            j += g;
        }
        stats.partial_maxima[r * g + group] = max;
        pair += PLANE_DIM as usize;
    }
    sync_cube();
    // The row's new maximum; each group's probabilities and their sum.
    pair = UNIT_POS_PLANE as usize;
    while pair < t * g {
        let (r, group) = (rows + pair / g, pair % g);
        let seen = seen_keys(&at, r, comptime!(tile * planes));
        let mut max = stats.maxima[r];
        for x in 0..g {
            max = A::max(max, stats.partial_maxima[r * g + x]);
        }
        let row = at.head_row + at.start + r;
        let mut sum = A::new(0.0);
        let mut j = group;
        while j < b {
            let p = select(
                j < seen,
                A::exp(scores[r * b + j] * scale - max),
                A::new(0.0),
            );
            sum += p;
            let keep = kept::<A>(
                row * at.seq + at.first + j,
                draw.key_lo,
                draw.key_hi,
                draw.threshold,
                draw.keep_scale,
                dropout,
            );
            probs[r * b + j] = F::cast_from(p * keep);
            j += g;
        }
        stats.partial_sums[r * g + group] = sum;
        pair += PLANE_DIM as usize;
    }
    sync_cube();
    // The row's running maximum and sum, and its correction.
    let mut i = UNIT_POS_PLANE as usize;
    while i < t {
        let r = rows + i;
        let old_max = stats.maxima[r];
        let mut max = old_max;
        let mut sum = A::new(0.0);
        for x in 0..g {
            max = A::max(max, stats.partial_maxima[r * g + x]);
            sum += stats.partial_sums[r * g + x];
        }
        let correction = A::exp(old_max - max);
        stats.maxima[r] = max;
        stats.sums[r] = stats.sums[r] * correction + sum;
        stats.corrections[r] = correction;
        i += PLANE_DIM as usize;
    }
    sync_cube();
    let mut e = UNIT_POS_PLANE as usize;
    while e < t * d {
        let r = rows + e / d;
        out[rows * d + e] *= stats.corrections[r];
        e += PLANE_DIM as usize;
    }
}

/// The block's running output rows divided by their sums (0 for a row without any), in
/// place, and their log-sum-exp into `logsumexp`, those before the head's end; by all the
/// cube's units.
#[cube]
#[allow(clippy::too_many_arguments)]
fn finish_rows<A: Float>(
    out: &mut Shared<[A]>,
    maxima: &Shared<[A]>,
    sums: &Shared<[A]>,
    logsumexp: &mut [A],
    head_row: usize,
    start: usize,
    seq: usize,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let d = head_dim as usize;
    let mut e = UNIT_POS as usize;
    while e < comptime!((block * head_dim) as usize) {
        let sum = sums[e / d];
        out[e] *= select(sum > A::new(0.0), A::new(1.0) / sum, A::new(0.0));
        e += CUBE_DIM as usize;
    }
    let rows = seq - start;
    let mut r = UNIT_POS as usize;
    while r < block as usize {
        if r < rows {
            logsumexp[head_row + start + r] = maxima[r] + A::ln(sums[r]);
        }
        r += CUBE_DIM as usize;
    }
}

/// Forward: `output` and the per-row `logsumexp` of the scaled scores, for `heads` heads
/// (batch × heads) of `seq` rows; `tile` is the matrix unit's `m = n = k` and divides
/// `head_dim`, the cube has `planes` planes, and the softmax shares each row's keys among
/// `groups` units.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn mma_attention_forward<F: Float, A: Float, N: Size>(
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
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] groups: u32,
) {
    let key_lo = salted(key_lo, salt, 0usize, dropout);
    let key_hi = salted(key_hi, salt, 1usize, dropout);
    let block = comptime!(tile * planes);
    let (s, b) = (seq as usize, block as usize);
    let (cube_active, head_row, start) = cube_block(heads, seq, block);
    let plane = (UNIT_POS / PLANE_DIM) as usize;
    let scale = A::cast_from(scale);

    let tile_len = comptime!((block * head_dim) as usize);
    let mut queries = Shared::<[F]>::new_slice(tile_len);
    let mut keys = Shared::<[F]>::new_slice(tile_len);
    let mut values = Shared::<[F]>::new_slice(tile_len);
    let mut scores = Shared::<[A]>::new_slice(comptime!((block * block) as usize));
    let mut probs = Shared::<[F]>::new_slice(comptime!((block * block) as usize));
    let mut out = Shared::<[A]>::new_slice(tile_len);
    let mut stats = RowStatistics::<A>::new(block, groups);

    fill_shared::<A>(&mut out, A::new(0.0), tile_len);
    let mut tiles = 0usize;
    if cube_active {
        load_rows::<F, N>(query, &mut queries, head_row, start, s, block, head_dim);
        // Key tiles 0 ..= this block's: the tiles above the causal diagonal are skipped.
        tiles = start / b + 1;
    }
    for t in 0..tiles {
        let first = t * b;
        load_rows::<F, N>(key, &mut keys, head_row, first, s, block, head_dim);
        load_rows::<F, N>(value, &mut values, head_row, first, s, block, head_dim);
        sync_cube();
        rows_times_transposed::<F, A>(&queries, &keys, &mut scores, plane, tile, planes, head_dim);
        sync_cube();
        let at = tiles_at(head_row, start, first, s);
        plane_softmax::<F, A>(
            &scores,
            &mut probs,
            &mut out,
            &mut stats,
            plane,
            at,
            scale,
            crate::attention::dropout_args(key_lo, key_hi, threshold, keep_scale),
            tile,
            planes,
            head_dim,
            groups,
            dropout,
        );
        sync_cube();
        accumulate_rows_times::<F, A>(&probs, &values, &mut out, plane, tile, planes, head_dim);
        sync_cube();
    }
    if cube_active {
        let (maxima, sums) = (&stats.maxima, &stats.sums);
        finish_rows::<A>(
            &mut out, maxima, sums, logsumexp, head_row, start, s, block, head_dim,
        );
    }
    sync_cube();
    if cube_active {
        store_rows::<F, A, N>(
            &out,
            A::new(1.0),
            output,
            head_row,
            start,
            s,
            block,
            head_dim,
        );
    }
}
