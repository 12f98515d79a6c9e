//! Dropout with counter-based masks: element `i` of a draw keyed `(key_lo, key_hi)` is kept
//! when [`dropout_bits`]`(key, i) ≥ threshold` (`threshold = p · 2³²`) and then scaled by
//! `1 / (1 − p)`. The mask is a pure function of the key and the element index, so it is
//! generated where the tensor lives, never stored (the backward re-derives it from the same
//! key), and equals the host's (`ferrotron::parallel::random`, the same function in plain
//! Rust) bit for bit. Only 32-bit integer operations: WGSL has no 64-bit integers.

use cubecl::prelude::*;

use crate::rows::cube_index;

/// Murmur3's 32-bit finaliser: a bijection of `u32` that mixes every input bit into every
/// output bit.
#[cube]
pub fn fmix32(h: u32) -> u32 {
    let mut h = h;
    h ^= h >> 16;
    h *= 0x85eb_ca6b;
    h ^= h >> 13;
    h *= 0xc2b2_ae35;
    h ^= h >> 16;
    h
}

/// The random bits of element `index` of the draw keyed `(key_lo, key_hi)`.
#[cube]
pub fn dropout_bits(key_lo: u32, key_hi: u32, index: u32) -> u32 {
    fmix32((fmix32(index ^ key_lo) + key_hi) ^ 0x9e37_79b9)
}

/// One word of a draw's key: the constant the launch carries, XOR the same word of the salt
/// of the micro-batch it runs for (`salt`, two words in device memory, low first), so that a
/// captured graph replays with the masks of whatever micro-batch's salt is written into that
/// buffer between replays. Without `drop` the salt is not read (its binding may be any buffer).
#[cube]
pub fn salted(key: u32, salt: &[u32], #[comptime] word: usize, #[comptime] drop: bool) -> u32 {
    let mut k = key;
    if drop {
        k = key ^ salt[word];
    }
    k
}

/// The draw index of element `i` of a tensor holding the slice `(own, row, first)` of the
/// draw: `(i / own) · row + first + i % own`; with `whole` (the tensor is all of the draw) it
/// is `i`, compiled without the slice's arithmetic. An integer division by a runtime value
/// costs a GPU twenty-odd instructions, two of them more than the hash itself; on cubecl-cpu
/// the lanes of a whole draw compile to SIMD code.
#[cube]
fn draw_index(i: u32, own: u32, row: u32, first: u32, #[comptime] whole: bool) -> u32 {
    if whole {
        i
    } else {
        (i / own) * row + first + i % own
    }
}

/// Which elements of the vector at index `vector` (elements `vector · N + k`) of a tensor
/// holding the slice `(own, row, first)` of the draw keyed `(key_lo, key_hi)` (or, with
/// `whole`, all of it) are kept: those whose bits are at least `threshold`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn vector_kept<N: Size>(
    vector: usize,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    own: u32,
    row: u32,
    first: u32,
    #[comptime] whole: bool,
) -> Vector<bool, N> {
    let mut keep = Vector::<bool, N>::new(false);
    let at = (vector * N::value()) as u32;
    #[unroll]
    for k in 0..N::value() {
        let index = draw_index(at + k as u32, own, row, first, whole);
        keep.insert(k, dropout_bits(key_lo, key_hi, index) >= threshold);
    }
    keep
}

/// `x` with the elements `keep` says are kept multiplied by `scale` and the others 0, in `F`:
/// what every dropout here stores.
#[cube]
fn apply_mask<F: Float, N: Size>(
    keep: Vector<bool, N>,
    x: Vector<F, N>,
    scale: f32,
) -> Vector<F, N> {
    select_many(
        keep,
        x * Vector::new(F::cast_from(scale)),
        Vector::new(F::new(0.0)),
    )
}

/// What to add to an element's index in a tensor holding the slice `(own, row, first)` of a
/// draw ([`dropout`]'s) to get its draw index, for the elements of the run of `own` that holds
/// the element at `start` (0 for a whole draw, `row = 0`). Kernels whose rows never straddle
/// two runs (the attention probabilities, a tensor-parallel rank's heads of them) compute it
/// once per row instead of dividing per element: `i` is draw element `(i / own) · row + first
/// + i % own`, which is `i` plus this for every `i` of the run.
#[cube]
pub(crate) fn run_offset(start: u32, own: u32, row: u32, first: u32) -> u32 {
    let mut offset = 0u32;
    if row > 0 {
        offset = (start / own) * (row - own) + first;
    }
    offset
}

/// A draw as a kernel applies it along one row of a tensor (a softmax row, an attention
/// head's probabilities): its key with the salt applied ([`salted`]), the threshold below which
/// an element's bits drop it, what a kept element is multiplied by, and what the row's element
/// indices are offset by in the draw ([`run_offset`]; 0 for a tensor that is the whole draw).
#[derive(CubeType, Clone, Copy)]
pub(crate) struct RowDraw {
    pub(crate) key_lo: u32,
    pub(crate) key_hi: u32,
    pub(crate) threshold: u32,
    pub(crate) keep_scale: f32,
    pub(crate) offset: u32,
}

/// A draw as a launch passes it to the kernels that apply it along rows (the softmax's): its
/// key before the salt, threshold and keep scale, and the slice `(own, row, first)` of the
/// draw the tensor holds ([`dropout`]'s; `row = 0` for the whole draw).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct DrawScalars {
    /// The key's low word, before the salt.
    pub key_lo: u32,
    /// The key's high word, before the salt.
    pub key_hi: u32,
    /// Bits below it drop an element.
    pub threshold: u32,
    /// What a kept element is multiplied by.
    pub keep_scale: f32,
    /// Elements per run of the slice.
    pub own: u32,
    /// Draw elements per row of runs (0: the whole draw).
    pub row: u32,
    /// The first run's first element in its row.
    pub first: u32,
}

/// The draw `scalars` as it applies along the row whose first element is at `start`: its key
/// salted by `salt` (with `drop`; without, the salt is not read), offset for the slice.
#[cube]
pub(crate) fn row_draw(
    scalars: &DrawScalars,
    salt: &[u32],
    start: u32,
    #[comptime] drop: bool,
) -> RowDraw {
    RowDraw {
        key_lo: salted(scalars.key_lo, salt, 0usize, drop),
        key_hi: salted(scalars.key_hi, salt, 1usize, drop),
        threshold: scalars.threshold,
        keep_scale: scalars.keep_scale,
        offset: run_offset(start, scalars.own, scalars.row, scalars.first),
    }
}

/// Whether `draw` keeps the element at `index` of its row's tensor.
#[cube]
pub(crate) fn row_keeps(draw: &RowDraw, index: u32) -> bool {
    dropout_bits(draw.key_lo, draw.key_hi, index + draw.offset) >= draw.threshold
}

/// The dropout of `x`, the vector at index `vector` of a row's tensor, by `draw`: what the
/// dropout kernel stores there, for kernels that apply it on the way (the softmax's).
#[cube]
pub(crate) fn row_dropout<F: Float, N: Size>(
    x: Vector<F, N>,
    vector: usize,
    draw: &RowDraw,
) -> Vector<F, N> {
    let mut keep = Vector::<bool, N>::new(false);
    let at = (vector * N::value()) as u32;
    #[unroll]
    for k in 0..N::value() {
        keep.insert(k, row_keeps(draw, at + k as u32));
    }
    apply_mask::<F, N>(keep, x, draw.keep_scale)
}

/// The dropout of `x`, the vector at index `vector` of a tensor holding the slice `(own, row,
/// first)` of the draw keyed `(key_lo, key_hi)` (or, with `whole`, all of it): what the
/// dropout kernel stores there, for kernels that drop a gradient on the way (the bias
/// gradient's column sums).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn sliced_dropout<F: Float, N: Size>(
    x: Vector<F, N>,
    vector: usize,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    scale: f32,
    own: u32,
    row: u32,
    first: u32,
    #[comptime] whole: bool,
) -> Vector<F, N> {
    let keep = vector_kept::<N>(vector, key_lo, key_hi, threshold, own, row, first, whole);
    apply_mask::<F, N>(keep, x, scale)
}

/// Units per cube of the element-wise kernels.
pub const UNITS_PER_CUBE: u32 = 256;

/// `output[i] = input[i] · scale` where element `i` is kept, 0 where dropped, for
/// `i < len`: dropout's forward, and with the same key its backward (dropout is linear). The
/// key is `(key_lo, key_hi)` salted by `salt` ([`salted`]).
/// Elements go in vectors of `N` (which divides `len`).
///
/// The tensor may be a slice of the draw (a sequence-parallel rank's chunk of the whole
/// sequence): element `i` takes the bits of draw element `(i / own) · row + first + i % own`,
/// i.e. runs of `own` elements starting at `first` in rows of `row`. A whole tensor is
/// `own = len`, `row = 0`, `first = 0`, and is compiled with `whole`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn dropout<F: Float, N: Size>(
    input: &[Vector<F, N>],
    output: &mut [Vector<F, N>],
    salt: &[u32],
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    scale: f32,
    len: u32,
    own: u32,
    row: u32,
    first: u32,
    #[comptime] whole: bool,
) {
    let i = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if i < len as usize / N::value() {
        let (lo, hi) = (
            salted(key_lo, salt, 0usize, true),
            salted(key_hi, salt, 1usize, true),
        );
        let keep = vector_kept::<N>(i, lo, hi, threshold, own, row, first, whole);
        output[i] = apply_mask::<F, N>(keep, input[i], scale);
    }
}

/// `output[i] = residual[i] + dropout(input[i] + bias[i % hidden])`: Megatron's fused
/// bias-dropout-add, where the row-parallel layers' bias add, the dropout and the residual add
/// are three launches composed. Dropout as [`dropout`]'s (the same bits for the same draw and
/// slice); without `drop` (no draw: inference, probability 0) nothing is dropped, and
/// without `has_bias` the bias is not read. The additions and the product are those of the
/// composed ops, in their order. Elements go in vectors of `N` (which divides `hidden`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn bias_dropout_add<F: Float, N: Size>(
    residual: &[Vector<F, N>],
    input: &[Vector<F, N>],
    bias: &[Vector<F, N>],
    output: &mut [Vector<F, N>],
    salt: &[u32],
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    scale: f32,
    len: u32,
    hidden: u32,
    own: u32,
    row: u32,
    first: u32,
    #[comptime] has_bias: bool,
    #[comptime] drop: bool,
    #[comptime] whole: bool,
) {
    let i = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if i < len as usize / N::value() {
        let mut y = input[i];
        if has_bias {
            y += bias[i % (hidden as usize / N::value())];
        }
        if drop {
            let (lo, hi) = (
                salted(key_lo, salt, 0usize, true),
                salted(key_hi, salt, 1usize, true),
            );
            let keep = vector_kept::<N>(i, lo, hi, threshold, own, row, first, whole);
            y = apply_mask::<F, N>(keep, y, scale);
        }
        output[i] = residual[i] + y;
    }
}
