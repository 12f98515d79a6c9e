//! What the three fused-attention families share: [`crate::attention`] (tiles in shared
//! memory, products as multiply-adds on the ordinary float units), [`crate::attention_planes`]
//! (rows in registers, the other side passed round a plane by broadcast) and
//! [`crate::attention_mma`] (products on matrix units). They compute the same attention with
//! the same dropout bits, so whatever is not a matter of how products are formed is decided
//! here, once:
//!
//! - the kernels' scalars and prologue ([`prologue`]): which block of which head a cube takes
//!   ([`cube_rows`]) and the dropout draw it applies ([`dropout_draw`]);
//! - the mask: which keys a query sees ([`sees`]), and from it the tiles a block visits at
//!   all ([`key_tiles`], [`query_tiles`]);
//! - dropout inside attention ([`kept`]) and the probabilities the mask and the draw make of
//!   the scores ([`masked_probability`], [`masked_max`], [`probability_and_gradient`]);
//! - head rows read from the tensors with their bounds checks ([`has_row`]): into tiles of
//!   quads ([`load_quad_tile`]), into the matrix units' plain tiles ([`load_plain_tile`]),
//!   into registers ([`read_head_quad`]), and the per-row statistics ([`load_row_values`]).
//!
//! Tensors are `[batch · heads, seq, head_dim]` row-major; positions are rows within a head.

use cubecl::prelude::*;

pub(crate) use crate::dropout::RowDraw;
use crate::dropout::{row_keeps, run_offset, salted};
use crate::rows::cube_index;

/// The scalars every attention kernel takes: the scores' scale, the number of heads (batch ×
/// heads) and their length, and the dropout draw's key (before the salt), threshold, keep
/// scale and the slice of it the heads' probabilities hold (unused without dropout). One
/// launch argument, so that the families' kernels and
/// launchers name them once.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct AttentionScalars {
    /// The scores' scale (`1 / √head_dim` in a transformer).
    pub scale: f32,
    /// Batch × heads.
    pub heads: u32,
    /// Positions per head (queries and keys).
    pub seq: u32,
    /// The draw's key, low word, before the salt.
    pub key_lo: u32,
    /// The draw's key, high word, before the salt.
    pub key_hi: u32,
    /// Bits at or above it keep a probability.
    pub threshold: u32,
    /// What a kept probability is multiplied by (`1 / (1 − p)`).
    pub keep_scale: f32,
    /// The draw's slice the probabilities `[batch · heads, seq, seq]` hold: elements per run
    /// (a batch element's heads on this rank).
    pub draw_own: u32,
    /// Draw elements per row of runs (a batch element's heads on every rank; 0: the whole
    /// draw).
    pub draw_row: u32,
    /// The run's first element in its row (the rank's first head's).
    pub draw_first: u32,
    /// Heads per batch element: with documents, head `h` reads row `h / sample_heads` of the
    /// first visible keys (unused without).
    pub sample_heads: u32,
    /// With documents, positions before it see no key: a context-parallel chunk's queries
    /// are a head's rows from it on, the rows before it padding (0: every row is a query).
    pub queries_from: u32,
    /// The length of the sequence whose dropout draw the probabilities are part of: a head's
    /// own `seq`, or the whole sequence of which a context-parallel chunk's keys are the
    /// first `seq`.
    pub draw_seq: u32,
}

/// Where a cube works: the first row of its head, the head's length, the positions within the
/// head of the cube's own block and of the first row of the tile of the other side it is at
/// (keys for the forward and `dq`, queries for `dk`/`dv`), and whether the cube has a block
/// at all (the cube count may round up). With `documents` (packed documents, a sliding
/// window) also the first key each position of the head's batch element sees: `first_keys`
/// from `key_row` on, one per position (see [`sees`]).
#[derive(CubeType, Clone, Copy)]
pub(crate) struct TileRows<'a> {
    pub(crate) head: usize,
    pub(crate) head_row: usize,
    pub(crate) seq: usize,
    pub(crate) start: usize,
    pub(crate) first: usize,
    pub(crate) active: bool,
    pub(crate) first_keys: &'a [u32],
    pub(crate) key_row: usize,
    pub(crate) queries_from: usize,
    pub(crate) draw_seq: usize,
    #[cube(comptime)]
    pub(crate) documents: bool,
}

#[cube]
impl<'a> TileRows<'a> {
    /// The same cube at the tile of the other side whose first row is at `first`.
    pub(crate) fn at_tile(&self, first: usize) -> TileRows<'a> {
        TileRows::<'a> {
            head: self.head,
            head_row: self.head_row,
            seq: self.seq,
            start: self.start,
            first,
            active: self.active,
            first_keys: self.first_keys,
            key_row: self.key_row,
            queries_from: self.queries_from,
            draw_seq: self.draw_seq,
            documents: self.documents,
        }
    }
}

/// The prologue of every attention kernel: this cube's block of `block` rows, cube by cube
/// through the blocks of a head, then head by head (at its own block: `first = start`), and
/// with `documents` where its batch element's first keys are.
#[cube]
pub(crate) fn cube_rows<'a>(
    scalars: &AttentionScalars,
    first_keys: &'a [u32],
    #[comptime] block: u32,
    #[comptime] documents: bool,
) -> TileRows<'a> {
    let s = scalars.seq as usize;
    let b = block as usize;
    let blocks = s.div_ceil(b);
    let cube = cube_index();
    let head = cube / blocks;
    let start = (cube % blocks) * b;
    let mut key_row = 0usize;
    if documents {
        key_row = (head / scalars.sample_heads as usize) * s;
    }
    TileRows::<'a> {
        head,
        head_row: head * s,
        seq: s,
        start,
        first: start,
        active: head < scalars.heads as usize,
        first_keys,
        key_row,
        queries_from: scalars.queries_from as usize,
        draw_seq: scalars.draw_seq as usize,
        documents,
    }
}

/// The prologue of every attention kernel: this cube's rows ([`cube_rows`]), its dropout draw
/// ([`dropout_draw`]) and the scores' scale in the compute type `A`.
#[cube]
pub(crate) fn prologue<'a, A: Float>(
    scalars: &AttentionScalars,
    salt: &[u32],
    first_keys: &'a [u32],
    #[comptime] block: u32,
    #[comptime] dropout: bool,
    #[comptime] documents: bool,
) -> (TileRows<'a>, RowDraw, A) {
    let own = cube_rows(scalars, first_keys, block, documents);
    let draw = dropout_draw(scalars, salt, &own, dropout);
    (own, draw, A::cast_from(scalars.scale))
}

/// The first key the query at position `query` (one the head has) sees: 0, or with
/// `documents` its entry of the first keys (where its document starts, or its window).
#[cube]
fn first_key(at: &TileRows, query: usize) -> usize {
    let mut lowest = 0usize;
    if at.documents {
        lowest = at.first_keys[at.key_row + query] as usize;
    }
    lowest
}

/// Whether the query at position `query` of the head sees the key at `key`: query `i` sees
/// keys `0..=i`, from its first key on with documents, and a position past the head's end (a
/// head may end inside a block) sees none. The one rule of the mask: every family's
/// per-element masking asks it, and [`key_tiles`] and [`query_tiles`] are what it means for
/// whole tiles. The first keys must not decrease along a head and each must be at most its own
/// position (documents are contiguous and a token sees itself), which is what lets whole tiles
/// be skipped. With documents, a position before the queries' first (padding before a
/// context-parallel chunk) sees nothing.
#[cube]
pub(crate) fn sees(at: &TileRows, query: usize, key: usize) -> bool {
    let mut visible = false;
    if query < at.seq {
        visible = key <= query && key >= first_key(at, query);
        if at.documents {
            visible = visible && query >= at.queries_from;
        }
    }
    visible
}

/// The first of positions `from..` that is a query: `from`, or with documents not before the
/// queries' first ([`sees`]).
#[cube]
fn first_query_from(at: &TileRows, from: usize) -> usize {
    let mut first = from;
    if at.documents && first < at.queries_from {
        first = at.queries_from;
    }
    first
}

/// The tiles of `tile` keys (tile `t` holding keys `t · tile ..`) that the `rows` queries of
/// the cube's block see, `lo..hi`: up to the block's last query that exists, the tiles above
/// the causal diagonal skipped, and with documents those before the first key of the block's
/// first query (the smallest of the block's); none for a cube without a block.
#[cube]
pub(crate) fn key_tiles(
    at: &TileRows,
    #[comptime] rows: u32,
    #[comptime] tile: u32,
) -> (usize, usize) {
    let mut end = at.start + rows as usize;
    if end > at.seq {
        end = at.seq;
    }
    let mut lo = 0usize;
    let mut hi = 0usize;
    // A block of padding rows before a chunk's queries visits nothing.
    let first = first_query_from(at, at.start);
    if at.active && first < end {
        lo = first_key(at, first) / tile as usize;
        hi = end.div_ceil(tile as usize);
    }
    (lo, hi)
}

/// The tiles of `tile` queries that see any key of the cube's block of `rows` keys, `lo..hi`:
/// from the tile of its first key (which its own query sees) to the head's last, or with
/// documents to the tile of the last query whose first key is at most the block's last key
/// (found by bisection: the first keys do not decrease); none for a cube without a block.
#[cube]
pub(crate) fn query_tiles(
    at: &TileRows,
    #[comptime] rows: u32,
    #[comptime] tile: u32,
) -> (usize, usize) {
    let t = tile as usize;
    let mut lo = 0usize;
    let mut hi = 0usize;
    if at.active {
        // The block's keys are seen by queries from its own first on (causal), not before
        // the chunk's first query.
        let first = first_query_from(at, at.start);
        lo = first / t;
        let mut end = at.seq;
        if at.documents {
            let last_key = usize::min(at.start + rows as usize, at.seq) - 1;
            // Queries below `seeing` see up to `last_key`; none from `end` on does.
            let mut seeing = first;
            while seeing < end {
                let middle = (seeing + end) / 2;
                if first_key(at, middle) <= last_key {
                    seeing = middle + 1;
                } else {
                    end = middle;
                }
            }
        }
        hi = end.div_ceil(t);
    }
    (lo, hi)
}

/// The cube's dropout draw: the launch's key with the device's salt words applied
/// ([`salted`]; untouched without dropout), offset to where the probabilities of the cube's
/// head (`at`) lie in the draw (a head's are one run of the slice).
#[cube]
pub(crate) fn dropout_draw(
    scalars: &AttentionScalars,
    salt: &[u32],
    at: &TileRows,
    #[comptime] dropout: bool,
) -> RowDraw {
    let head_start = (at.head * at.draw_seq * at.draw_seq) as u32;
    RowDraw {
        key_lo: salted(scalars.key_lo, salt, 0usize, dropout),
        key_hi: salted(scalars.key_hi, salt, 1usize, dropout),
        threshold: scalars.threshold,
        keep_scale: scalars.keep_scale,
        offset: run_offset(
            head_start,
            scalars.draw_own,
            scalars.draw_row,
            scalars.draw_first,
        ),
    }
}

/// The dropout factor of the probability of the key at `key` for the query at `query`:
/// `keep_scale` where the draw keeps it, 0 where it drops it, 1 without dropout. The draw's
/// index is the probability's in the `[batch · heads · seq, seq]` probabilities, `row · seq +
/// key`, offset for the slice of the draw they hold, the index the unfused dropout
/// ([`crate::dropout`]) gives it, so that fused and unfused attention drop the same
/// probabilities on every tensor-parallel layout; the backward re-derives the mask, never
/// stored.
#[cube]
pub(crate) fn kept<A: Float>(
    draw: &RowDraw,
    at: &TileRows,
    query: usize,
    key: usize,
    #[comptime] dropout: bool,
) -> A {
    let mut factor = A::new(1.0);
    if dropout {
        let index = (at.head * at.draw_seq + query) * at.draw_seq + key;
        let keep = row_keeps(draw, index as u32);
        factor = select(keep, A::cast_from(draw.keep_scale), A::new(0.0));
    }
    factor
}

/// `exp(score − max)` of the query at `query` and the key at `key` where the mask lets the
/// pair through (0 where it does not), and the pair's dropout factor ([`kept`]): with `max` a
/// row's running maximum, the forward's probability before normalisation; with its
/// log-sum-exp, the backward's probability.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn masked_probability<A: Float>(
    score: A,
    max: A,
    at: &TileRows,
    query: usize,
    key: usize,
    draw: &RowDraw,
    #[comptime] dropout: bool,
) -> (A, A) {
    let p = select(sees(at, query, key), A::exp(score - max), A::new(0.0));
    (p, kept::<A>(draw, at, query, key, dropout))
}

/// A row's running maximum with `score` of the key at `key` where the mask lets the pair
/// through, `running` unchanged where it does not.
#[cube]
pub(crate) fn masked_max<A: Float>(
    running: A,
    score: A,
    at: &TileRows,
    query: usize,
    key: usize,
) -> A {
    select(sees(at, query, key), A::max(running, score), running)
}

/// The running maximum of a row before its first score: below every score, and finite, so
/// that the correction `exp(old − new)` of a row that has seen no key yet is 1, not NaN.
#[cube]
pub(crate) fn no_maximum<A: Float>() -> A {
    A::new(-3.0e38)
}

/// What a row's accumulated output is multiplied by at the end: `1 / sum`, or 0 for a row
/// that saw no key (past the head's end).
#[cube]
pub(crate) fn normaliser<A: Float>(sum: A) -> A {
    select(sum > A::new(0.0), A::new(1.0) / sum, A::new(0.0))
}

/// A row's log-sum-exp from its running maximum and sum (what the backward reads).
#[cube]
pub(crate) fn log_sum_exp<A: Float>(max: A, sum: A) -> A {
    max + A::ln(sum)
}

/// A query row's log-sum-exp and `D = Σ do ⊙ o`, what the backward needs of the forward.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct RowStats<A: Float> {
    pub(crate) lse: A,
    pub(crate) delta: A,
}

/// A query's dropped probability of a key and the gradient of their score, `(p̃, ds)`, from
/// the scaled score, `do·v` and the query's statistics; both zero where the mask hides the
/// key. One definition for every family's `dq` and `dk`/`dv` kernels, which recompute the
/// same probabilities.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn probability_and_gradient<A: Float>(
    score: A,
    dprob: A,
    stats: RowStats<A>,
    at: &TileRows,
    query: usize,
    key: usize,
    draw: &RowDraw,
    #[comptime] dropout: bool,
) -> (A, A) {
    let (p, keep) = masked_probability::<A>(score, stats.lse, at, query, key, draw, dropout);
    (p * keep, p * (dprob * keep - stats.delta))
}

/// Whether the head has a row at `position`: its last block may end inside it, and a cube
/// past the last head (the cube count may round up) has none. Every read and write of a head
/// row asks it.
#[cube]
pub(crate) fn has_row(at: &TileRows, position: usize) -> bool {
    at.active && position < at.seq
}

/// Four consecutive values of a head row: the multiply-add kernels store and read their
/// tiles and rows four at a time (vector loads), so that a product reads a quarter of the
/// shared-memory words one value at a time would, and a runtime that gathers each unit's
/// address separately (lavapipe) makes a quarter of the gathers.
pub(crate) type Quad<A> = Vector<A, Const<4>>;

/// [`Quad`]s per head row (the last one zero-padded past `head_dim`).
pub(crate) fn quads(head_dim: u32) -> usize {
    head_dim.div_ceil(4) as usize
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

/// Quad `q` of the head's row at `position`, zeros where the head has no such row
/// ([`has_row`]) and past `head_dim`.
#[cube]
pub(crate) fn read_head_quad<F: Float, A: Float, N: Size>(
    source: &[Vector<F, N>],
    at: &TileRows,
    position: usize,
    q: usize,
    #[comptime] head_dim: u32,
) -> Quad<A> {
    let mut x = Quad::<A>::broadcast(A::new(0.0));
    if has_row(at, position) {
        let start = (at.head_row + position) * head_dim as usize;
        x = read_quad::<F, A, N>(source, start, q, head_dim);
    }
    x
}

/// Rows `at.first .. at.first + block` of the head into `tile` as [`Quad`]s, row `r` from quad
/// `r · stride` (a stride past the row's quads puts the rows a warp reads at once in
/// different memory banks), zeros past the head's end and past `head_dim`: the multiply-add
/// kernels' tiles. The cube's units load consecutive quads (coalesced); every unit must take
/// part.
#[cube]
pub(crate) fn load_quad_tile<F: Float, A: Float, N: Size>(
    source: &[Vector<F, N>],
    tile: &mut Shared<[Quad<A>]>,
    at: &TileRows,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
    #[comptime] stride: usize,
) {
    let n = comptime!(quads(head_dim));
    let mut e = UNIT_POS_X as usize;
    while e < comptime!(block as usize * quads(head_dim)) {
        let (row, q) = (e / n, e % n);
        tile[row * stride + q] = read_head_quad::<F, A, N>(source, at, at.first + row, q, head_dim);
        e += CUBE_DIM_X as usize;
    }
}

/// Rows `at.first .. at.first + block` of the head into `tile` (`[block, head_dim]`,
/// row-major, in the storage type: what a matrix unit's operands are read from), zeros past
/// the head's end. The cube's units load consecutive vectors of `N` (coalesced; `N` divides
/// `head_dim`, so a vector stays in its row); every unit must take part.
#[cube]
pub(crate) fn load_plain_tile<F: Float, N: Size>(
    source: &[Vector<F, N>],
    tile: &mut Shared<[F]>,
    at: &TileRows,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let n = N::value().comptime();
    let d = head_dim as usize;
    let start = (at.head_row + at.first) * d;
    let mut x = UNIT_POS as usize * n;
    while x < comptime!((block * head_dim) as usize) {
        let mut v = Vector::<F, N>::new(F::new(0.0));
        if has_row(at, at.first + x / d) {
            v = source[(start + x) / n];
        }
        #[unroll]
        for k in 0..n {
            tile[x + k] = v.extract(k);
        }
        x += CUBE_DIM as usize * n;
    }
}

/// Entries `at.first .. at.first + block` of a per-row statistic of the head (`logsumexp`,
/// `delta`) into `tile`, zeros where the head has no such row.
#[cube]
pub(crate) fn load_row_values<A: Float>(
    source: &[A],
    tile: &mut Shared<[A]>,
    at: &TileRows,
    #[comptime] block: u32,
) {
    let mut i = UNIT_POS_X as usize;
    while i < block as usize {
        let mut x = A::new(0.0);
        if has_row(at, at.first + i) {
            x = source[at.head_row + at.first + i];
        }
        tile[i] = x;
        i += CUBE_DIM_X as usize;
    }
}

/// The tiles of `block` rows each cube of a tiled attention launch visits, written as
/// `[key tiles lo, hi, query tiles lo, hi]` per cube (the forward's and `dq`'s walk over
/// keys, the `dk`/`dv` walk over queries): what [`key_tiles`] and [`query_tiles`] give the
/// kernels, so that a test can count the tiles skipped.
#[cube(launch)]
pub fn attention_tile_ranges(
    scalars: AttentionScalars,
    first_keys: &[u32],
    ranges: &mut [u32],
    #[comptime] block: u32,
    #[comptime] documents: bool,
) {
    let own = cube_rows(&scalars, first_keys, block, documents);
    if UNIT_POS == 0 && own.active {
        let (key_lo, key_hi) = key_tiles(&own, block, block);
        let (query_lo, query_hi) = query_tiles(&own, block, block);
        let at = cube_index() * 4;
        ranges[at] = key_lo as u32;
        ranges[at + 1] = key_hi as u32;
        ranges[at + 2] = query_lo as u32;
        ranges[at + 3] = query_hi as u32;
    }
}
