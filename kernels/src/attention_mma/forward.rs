//! The forward: `output` and the log-sum-exp per query row.

use cubecl::prelude::*;

use super::{accumulate_rows_times, fill_shared, load_rows, rows_times_transposed};
use crate::attention::{cube_block, kept};
use crate::dropout::salted;

/// Where a key tile sits: the head's first row, the query block's first position, the tile's
/// first key, the sequence length.
#[derive(CubeType, Clone, Copy)]
struct KeyTile {
    head_row: usize,
    start: usize,
    first: usize,
    seq: usize,
}

/// The online softmax over the plane's rows of one key tile, one unit per row: each row's
/// scaled scores of the keys it sees become its dropped probabilities in `probs` (zeros for
/// the keys it does not see), its running maximum and sum are updated, and its running
/// output row is multiplied by the correction for a new maximum. The same arithmetic as the
/// tiled kernel's online softmax.
#[cube]
#[allow(clippy::too_many_arguments)]
fn plane_softmax<F: Float, A: Float>(
    scores: &Shared<[A]>,
    probs: &mut Shared<[F]>,
    out: &mut Shared<[A]>,
    maxima: &mut Shared<[A]>,
    sums: &mut Shared<[A]>,
    plane: usize,
    at: KeyTile,
    scale: A,
    draw: crate::attention::DropoutArgs,
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] head_dim: u32,
    #[comptime] dropout: bool,
) {
    let b = comptime!((tile * planes) as usize);
    let d = head_dim as usize;
    let mut i = UNIT_POS_PLANE as usize;
    while i < tile as usize {
        let r = plane * tile as usize + i;
        let position = at.start + r;
        let mut seen = 0usize;
        if position < at.seq {
            seen = position + 1 - at.first;
            if seen > b {
                seen = b;
            }
        }
        let old_max = maxima[r];
        let mut max = old_max;
        for j in 0..seen {
            max = A::max(max, scores[r * b + j] * scale);
        }
        let correction = A::exp(old_max - max);
        let mut sum = sums[r] * correction;
        let row = at.head_row + position;
        for j in 0..b {
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
        }
        maxima[r] = max;
        sums[r] = sum;
        for c in 0..d {
            out[r * d + c] *= correction;
        }
        i += PLANE_DIM as usize;
    }
}

/// The block's output rows (the running output over the row's sum; 0 for a row without any)
/// and log-sum-exp, those before the head's end, by all the cube's units.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_block<F: Float, A: Float>(
    out: &Shared<[A]>,
    maxima: &Shared<[A]>,
    sums: &Shared<[A]>,
    output: &mut [F],
    logsumexp: &mut [A],
    head_row: usize,
    start: usize,
    seq: usize,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let d = head_dim as usize;
    let rows = seq - start;
    let mut e = UNIT_POS as usize;
    while e < comptime!((block * head_dim) as usize) {
        let r = e / d;
        if r < rows {
            let sum = sums[r];
            let inv = select(sum > A::new(0.0), A::new(1.0) / sum, A::new(0.0));
            output[(head_row + start) * d + e] = F::cast_from(out[e] * inv);
        }
        e += CUBE_DIM as usize;
    }
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
/// `head_dim`, and the cube has `planes` planes.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn mma_attention_forward<F: Float, A: Float>(
    query: &[F],
    key: &[F],
    value: &[F],
    output: &mut [F],
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
    let mut maxima = Shared::<[A]>::new_slice(b);
    let mut sums = Shared::<[A]>::new_slice(b);

    fill_shared::<A>(&mut out, A::new(0.0), tile_len);
    fill_shared::<A>(&mut maxima, A::new(-3.0e38), b);
    fill_shared::<A>(&mut sums, A::new(0.0), b);
    let mut tiles = 0usize;
    if cube_active {
        load_rows::<F>(query, &mut queries, head_row, start, s, block, head_dim);
        // Key tiles 0 ..= this block's: the tiles above the causal diagonal are skipped.
        tiles = start / b + 1;
    }
    for t in 0..tiles {
        let first = t * b;
        load_rows::<F>(key, &mut keys, head_row, first, s, block, head_dim);
        load_rows::<F>(value, &mut values, head_row, first, s, block, head_dim);
        sync_cube();
        rows_times_transposed::<F, A>(&queries, &keys, &mut scores, plane, tile, planes, head_dim);
        sync_cube();
        let at = KeyTile {
            head_row,
            start,
            first,
            seq: s,
        };
        plane_softmax::<F, A>(
            &scores,
            &mut probs,
            &mut out,
            &mut maxima,
            &mut sums,
            plane,
            at,
            scale,
            crate::attention::dropout_args(key_lo, key_hi, threshold, keep_scale),
            tile,
            planes,
            head_dim,
            dropout,
        );
        sync_cube();
        accumulate_rows_times::<F, A>(&probs, &values, &mut out, plane, tile, planes, head_dim);
        sync_cube();
    }
    if cube_active {
        store_block::<F, A>(
            &out, &maxima, &sums, output, logsumexp, head_row, start, s, block, head_dim,
        );
    }
}
