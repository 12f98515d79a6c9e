//! The forward: `output` and the log-sum-exp per query row.

use cubecl::prelude::*;

use super::{accumulate_rows_times, fill_shared, rows_times_transposed, store_rows};
use crate::attention_common::{
    has_row, key_tiles, load_plain_tile, log_sum_exp, masked_max, masked_probability, no_maximum,
    normaliser, prologue, AttentionScalars, RowDraw, TileRows,
};

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
    /// every row's running maximum [`no_maximum`] and sum 0.
    fn new(#[comptime] block: u32, #[comptime] groups: u32) -> RowStatistics<A> {
        let (b, g) = (block as usize, groups as usize);
        let mut stats = RowStatistics::<A> {
            maxima: Shared::<[A]>::new_slice(b),
            sums: Shared::<[A]>::new_slice(b),
            corrections: Shared::<[A]>::new_slice(b),
            partial_maxima: Shared::<[A]>::new_slice(b * g),
            partial_sums: Shared::<[A]>::new_slice(b * g),
        };
        fill_shared::<A>(&mut stats.maxima, no_maximum::<A>(), b);
        fill_shared::<A>(&mut stats.sums, A::new(0.0), b);
        stats
    }
}

/// The online softmax over the plane's rows of one key tile: each row's scaled scores of the
/// keys the mask lets it see become its dropped probabilities in `probs` (zeros for the
/// others), its running maximum and sum are updated, and its running output row is
/// multiplied by the correction for a new maximum. Each row's keys are shared among `groups`
/// units (key `j` to group `j mod groups`), whose partial maxima and sums meet in shared
/// memory, so that a plane wider than its rows keeps every unit busy (two per row on a GPU's
/// warp of 32 with tiles of 16); the running output is rescaled element by element by all
/// the plane's units.
#[cube]
#[allow(clippy::too_many_arguments)]
fn plane_softmax<F: Float, A: Float>(
    scores: &Shared<[A]>,
    probs: &mut Shared<[F]>,
    out: &mut Shared<[A]>,
    stats: &mut RowStatistics<A>,
    plane: usize,
    at: &TileRows,
    scale: A,
    draw: &RowDraw,
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
        let query = at.start + r;
        let mut max = no_maximum::<A>();
        let mut j = group;
        while j < b {
            let score = scores[r * b + j] * scale;
            max = masked_max::<A>(max, score, at, query, at.first + j);
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
        let query = at.start + r;
        let mut max = stats.maxima[r];
        for x in 0..g {
            max = A::max(max, stats.partial_maxima[r * g + x]);
        }
        let mut sum = A::new(0.0);
        let mut j = group;
        while j < b {
            let score = scores[r * b + j] * scale;
            let key = at.first + j;
            let (p, keep) = masked_probability::<A>(score, max, at, query, key, draw, dropout);
            sum += p;
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

/// The block's running output rows normalised by their sums ([`normaliser`]), in place, and
/// their log-sum-exp into `logsumexp`, those the head has; by all the cube's units.
#[cube]
fn finish_rows<A: Float>(
    out: &mut Shared<[A]>,
    stats: &RowStatistics<A>,
    logsumexp: &mut [A],
    own: &TileRows,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let d = head_dim as usize;
    let mut e = UNIT_POS as usize;
    while e < comptime!((block * head_dim) as usize) {
        out[e] *= normaliser::<A>(stats.sums[e / d]);
        e += CUBE_DIM as usize;
    }
    let mut r = UNIT_POS as usize;
    while r < block as usize {
        if has_row(own, own.start + r) {
            let lse = log_sum_exp::<A>(stats.maxima[r], stats.sums[r]);
            logsumexp[own.head_row + own.start + r] = lse;
        }
        r += CUBE_DIM as usize;
    }
}

/// Forward: `output` and the per-row `logsumexp` of the scaled scores, for `scalars.heads`
/// heads (batch × heads) of `scalars.seq` rows; `tile` is the matrix unit's `m = n = k` and
/// divides `head_dim`, the cube has `planes` planes, and the softmax shares each row's keys
/// among `groups` units.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn mma_attention_forward<F: Float, A: Float, N: Size>(
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
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] groups: u32,
) {
    let block = comptime!(tile * planes);
    let (own, draw, scale) = prologue::<A>(&scalars, salt, first_keys, block, dropout, documents);
    let plane = (UNIT_POS / PLANE_DIM) as usize;

    let tile_len = comptime!((block * head_dim) as usize);
    let mut queries = Shared::<[F]>::new_slice(tile_len);
    let mut keys = Shared::<[F]>::new_slice(tile_len);
    let mut values = Shared::<[F]>::new_slice(tile_len);
    let mut scores = Shared::<[A]>::new_slice(comptime!((block * block) as usize));
    let mut probs = Shared::<[F]>::new_slice(comptime!((block * block) as usize));
    let mut out = Shared::<[A]>::new_slice(tile_len);
    let mut stats = RowStatistics::<A>::new(block, groups);

    fill_shared::<A>(&mut out, A::new(0.0), tile_len);
    load_plain_tile::<F, N>(query, &mut queries, &own, block, head_dim);
    let (first_tile, end_tile) = key_tiles(&own, block, block);
    for t in first_tile..end_tile {
        let at = own.at_tile(t * block as usize);
        load_plain_tile::<F, N>(key, &mut keys, &at, block, head_dim);
        load_plain_tile::<F, N>(value, &mut values, &at, block, head_dim);
        sync_cube();
        rows_times_transposed::<F, A>(&queries, &keys, &mut scores, plane, tile, planes, head_dim);
        sync_cube();
        plane_softmax::<F, A>(
            &scores, &mut probs, &mut out, &mut stats, plane, &at, scale, &draw, tile, planes,
            head_dim, groups, dropout,
        );
        sync_cube();
        accumulate_rows_times::<F, A>(&probs, &values, &mut out, plane, tile, planes, head_dim);
        sync_cube();
    }
    finish_rows::<A>(&mut out, &stats, logsumexp, &own, block, head_dim);
    sync_cube();
    store_rows::<F, A, N>(&out, A::new(1.0), output, &own, block, head_dim);
}
