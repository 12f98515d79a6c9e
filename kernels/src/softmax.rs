//! Megatron's fused softmaxes: `y = softmax(scale · x)` over the last dimension with masked
//! positions excluded, and the backward `dx = scale · y ⊙ (dy − Σ dy ⊙ y)`.
//!
//! Rows map onto cubes as [`crate::rows`] says; the lanes of a row stride over it, so any
//! row length works (Megatron's kernels stop at 4096). Masked positions get exactly 0 and
//! fully masked rows are all 0 (Megatron's fill of −10000 gives the same zeros in f32 except
//! for fully masked rows, which it leaves uniform).
//!
//! The forward can also write the attention dropout of its output: `dropout(y)` as the
//! dropout kernel computes it from the stored `y` (the same bits), without that kernel's
//! launch and its pass reading `y` back.
//!
//! A row short enough for its units to hold it ([`held_vectors`]: GPT-2's 1024 keys in bf16
//! are four vectors of eight per unit of a 32-lane warp) is read once into registers, as
//! Megatron's warp-per-row softmax does; a longer row is read again in each pass (the
//! forward's maximum, sum and output; the backward's dot product and output, and, forming
//! the probabilities again, their maximum and sum too), each pass a loop whose loads wait on
//! each other. Either way the same expressions in the same order, so the same bits.

use cubecl::prelude::*;

mod held;

pub use held::{held_vectors, MOST_HELD};

use held::{held_row_softmax, held_softmax_backward};

use crate::dropout::{row_draw, row_dropout, DrawScalars, RowDraw};
use crate::reduce::{row_vector_max, row_vector_sum};
use crate::rows::{row_index, row_length};
use crate::vectors::positions;

/// How many keys query `query` of `[.., sq, sk]` scores sees under the causal mask: keys
/// `j ≤ query + sk − sq` (Megatron's upper-triangular mask).
#[cube]
fn causal_limit(query: usize, sq: usize, sk: usize) -> usize {
    query + 1 + sk - sq
}

/// Which elements of the vector at index `j` of a row are kept: those before
/// `causal_limit` and, with `use_mask`, where the mask is 0.
#[cube]
fn kept<N: Size>(
    mask: &[Vector<u32, N>],
    mask_base: usize,
    j: usize,
    causal_limit: usize,
    #[comptime] use_mask: bool,
) -> Vector<bool, N> {
    let mut keep = positions::<N>(j).less_than(&Vector::<u32, N>::new(causal_limit as u32));
    if use_mask {
        keep = keep.vec_and(mask[mask_base + j].equal(&Vector::<u32, N>::new(0u32)));
    }
    keep
}

/// What a softmax row's probabilities are formed from: `scale`, the row's maximum of
/// `scale · x` over its kept keys and `1 / Σ exp(scale · x − max)` (0 for a row with none),
/// each in every lane of a vector.
#[derive(CubeType, Clone, Copy)]
struct RowStatistics<A: Float, N: Size> {
    scale: Vector<A, N>,
    maxes: Vector<A, N>,
    inverse_sum: Vector<A, N>,
}

/// The [`RowStatistics`] of the kept keys of a row's first `seen` vectors (`base` and
/// `mask_base` count vectors): a pass for the maximum, a pass for the sum.
#[cube]
#[allow(clippy::too_many_arguments)]
fn row_statistics<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    mask: &[Vector<u32, N>],
    base: usize,
    mask_base: usize,
    causal_limit: usize,
    seen: usize,
    scale: f32,
    #[comptime] use_mask: bool,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) -> RowStatistics<A, N> {
    let scale = Vector::<A, N>::new(A::cast_from(scale));
    let (lowest, zero) = (
        Vector::<A, N>::new(A::new(-3.0e38)),
        Vector::<A, N>::new(A::new(0.0)),
    );
    let mut local_max = lowest;
    let mut j = UNIT_POS_X as usize;
    while j < seen {
        let keep = kept::<N>(mask, mask_base, j, causal_limit, use_mask);
        let x = scale * Vector::<A, N>::cast_from(input[base + j]);
        local_max = max(local_max, select_many(keep, x, lowest));
        j += lanes as usize;
    }
    let max = row_vector_max::<A, N>(local_max, lanes, rows_per_cube, plane_reduce);
    let maxes = Vector::<A, N>::new(max);
    let mut local_sum = zero;
    j = UNIT_POS_X as usize;
    while j < seen {
        let keep = kept::<N>(mask, mask_base, j, causal_limit, use_mask);
        let e = Vector::exp(scale * Vector::<A, N>::cast_from(input[base + j]) - maxes);
        local_sum += select_many(keep, e, zero);
        j += lanes as usize;
    }
    let sum = row_vector_sum::<A, N>(local_sum, lanes, rows_per_cube, plane_reduce);
    RowStatistics::<A, N> {
        scale,
        maxes,
        inverse_sum: Vector::<A, N>::new(select(sum > A::new(0.0), A::new(1.0) / sum, A::new(0.0))),
    }
}

/// The probabilities of the row's vector `j`, stored as `F` (0 at the keys not kept), from
/// the row's `statistics`: the one expression every softmax here writes, so that a kernel
/// forming them again gets the forward's bits.
#[cube]
#[allow(clippy::too_many_arguments)]
fn probability<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    mask: &[Vector<u32, N>],
    base: usize,
    mask_base: usize,
    j: usize,
    causal_limit: usize,
    statistics: &RowStatistics<A, N>,
    #[comptime] use_mask: bool,
) -> Vector<F, N> {
    let keep = kept::<N>(mask, mask_base, j, causal_limit, use_mask);
    probability_of::<F, A, N>(Vector::<A, N>::cast_from(input[base + j]), keep, statistics)
}

/// The probabilities of a vector `x` of the row's input (in `A`) where `keep` says (0
/// elsewhere), stored as `F`: [`probability`]'s expression, for a row read or held.
#[cube]
fn probability_of<F: Float, A: Float, N: Size>(
    x: Vector<A, N>,
    keep: Vector<bool, N>,
    statistics: &RowStatistics<A, N>,
) -> Vector<F, N> {
    let e = Vector::exp(statistics.scale * x - statistics.maxes);
    Vector::<F, N>::cast_from(select_many(
        keep,
        e * statistics.inverse_sum,
        Vector::<A, N>::new(A::new(0.0)),
    ))
}

/// What a softmax forward row needs besides its buffers: the draw along it, where the row and its mask row start (`base`, `mask_base`, in
/// vectors), the keys it sees (`limit`), the scores' scale and the row's vectors (`width`, 0
/// past the last row).
#[derive(CubeType, Clone, Copy)]
struct ForwardArgs {
    draw: RowDraw,
    base: usize,
    mask_base: usize,
    limit: usize,
    scale: f32,
    width: usize,
}

/// Softmax of one row of `sk` (`width` vectors of `N`) over the columns `j` where `keep(j)`;
/// writes `output` and, with `drop`, its dropout by the row's draw into `dropped` (without
/// `keep_output` only `dropped` is written; see [`ForwardArgs`]). The
/// vectors wholly past the causal limit are written as zeros without reading the input: half
/// a causal softmax's reads and exponentials.
#[cube]
#[allow(clippy::too_many_arguments)]
fn masked_row_softmax<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    output: &mut [Vector<F, N>],
    dropped: &mut [Vector<F, N>],
    mask: &[Vector<u32, N>],
    args: ForwardArgs,
    #[comptime] use_mask: bool,
    #[comptime] drop: bool,
    #[comptime] keep_output: bool,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) {
    let (base, mask_base, causal_limit, scale, width) = (
        args.base,
        args.mask_base,
        args.limit,
        args.scale,
        args.width,
    );
    let step = lanes as usize;
    // The vectors holding a key before the causal limit: those after it are never read.
    let seen = min(width, causal_limit.div_ceil(N::value()));
    let statistics = row_statistics::<F, A, N>(
        input,
        mask,
        base,
        mask_base,
        causal_limit,
        seen,
        scale,
        use_mask,
        lanes,
        rows_per_cube,
        plane_reduce,
    );
    let mut j = UNIT_POS_X as usize;
    while j < seen {
        let y = probability::<F, A, N>(
            input,
            mask,
            base,
            mask_base,
            j,
            causal_limit,
            &statistics,
            use_mask,
        );
        if keep_output {
            output[base + j] = y;
        }
        if drop {
            // As the dropout kernel computes it from the stored `y`.
            dropped[base + j] = row_dropout::<F, N>(y, base + j, &args.draw);
        }
        j += step;
    }
    // Past the causal limit: zeros, as the loop above would write (and drop) them.
    let none = Vector::<F, N>::new(F::new(0.0));
    while j < width {
        if keep_output {
            output[base + j] = none;
        }
        if drop {
            dropped[base + j] = none;
        }
        j += step;
    }
}

/// Softmax forward of `input` `[batch, heads, sq, sk]` (flattened to `rows = batch · heads ·
/// sq` rows of `sk`) into `output`, in vectors of `N` (which divides `sk`).
///
/// With `causal`, query `i` sees keys `j ≤ i + (sk − sq)` (Megatron's upper-triangular mask);
/// with `padded`, `mask` `[batch, 1, sq, sk]` hides keys where it is non-zero (Megatron's
/// padding mask; one mask row serves all heads). A kernel without `padded` never reads
/// `mask` (its launcher binds any buffer there). With `drop`, `dropped` gets the dropout of
/// `output` by `draw` (salted by `salt`; the tensor holds the draw's slice: a tensor-parallel
/// rank's heads); without, it is never written. Without `keep_output` (and with
/// `drop`) only `dropped` is written: the probabilities a selectively recomputed attention
/// core does not keep. With `held` (a power of two, [`held_vectors`]), each unit holds that
/// many vectors of its row in registers, read once.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn masked_softmax_forward<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    mask: &[Vector<u32, N>],
    output: &mut [Vector<F, N>],
    dropped: &mut [Vector<F, N>],
    salt: &[u32],
    draw: DrawScalars,
    scale: f32,
    rows: u32,
    heads: u32,
    sq: u32,
    sk: u32,
    #[comptime] causal: bool,
    #[comptime] padded: bool,
    #[comptime] drop: bool,
    #[comptime] keep_output: bool,
    #[comptime] lanes: u32,
    #[comptime] held: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) {
    let row = row_index();
    let width = sk as usize / N::value();
    let length = row_length(row, rows, width as u32);
    let (sq, sk) = (sq as usize, sk as usize);
    let query = row % sq;
    let mut limit = sk;
    if causal {
        limit = causal_limit(query, sq, sk);
    }
    let batch = row / (sq * heads as usize);
    let args = ForwardArgs {
        draw: row_draw(&draw, salt, (row * sk) as u32, drop),
        base: row * width,
        mask_base: (batch * sq + query) * width,
        limit,
        scale,
        width: length,
    };
    if comptime![held > 0] {
        held_row_softmax::<F, A, N>(
            input,
            output,
            dropped,
            mask,
            args,
            padded,
            drop,
            keep_output,
            lanes,
            comptime!(held as usize),
            rows_per_cube,
            plane_reduce,
        );
    } else {
        masked_row_softmax::<F, A, N>(
            input,
            output,
            dropped,
            mask,
            args,
            padded,
            drop,
            keep_output,
            lanes,
            rows_per_cube,
            plane_reduce,
        );
    }
}

/// The gradient reaching the softmax's output at the vector `at`: `grad_output` there, or
/// with `drop`, the dropout backward of it (what the dropout kernel makes of it, in `F`, the
/// row's draw).
#[cube]
fn output_grad<F: Float, N: Size>(
    grad_output: &[Vector<F, N>],
    at: usize,
    draw: &RowDraw,
    #[comptime] drop: bool,
) -> Vector<F, N> {
    let mut dy = grad_output[at];
    if drop {
        dy = row_dropout::<F, N>(dy, at, draw);
    }
    dy
}

/// No [`RowStatistics`]: what a backward reading the stored probabilities passes where a
/// backward forming them passes the row's.
#[cube]
fn no_statistics<A: Float, N: Size>() -> RowStatistics<A, N> {
    let zero = Vector::<A, N>::new(A::new(0.0));
    RowStatistics::<A, N> {
        scale: zero,
        maxes: zero,
        inverse_sum: zero,
    }
}

/// Softmax backward for both masks: `dx = scale · y ⊙ (dy − Σ_j dy ⊙ y)` per row of `sk`
/// (masked positions have `y = 0`, so they get 0). `input` is the softmax's output `y` or,
/// with `formed` (causal rows only), its input, the scores: `y` is then formed again in the
/// kernel as the forward forms it ([`row_statistics`], [`probability`]: its bits), where a
/// selectively recomputed attention core would otherwise run the forward kernel in its
/// backward, writing `y` (`[b, heads, s, s]`) for this one to read back: one launch and two
/// passes over the largest tensor of a layer. `mask` is never read (the launcher binds
/// `input` there).
///
/// With `causal` (rows of `[.., sq, sk]` scores, query `i` seeing keys `j ≤ i + sk − sq`) the
/// vectors wholly after a row's last key get 0 without `y` or `dy` being read: half the reads
/// of a causal softmax's backward. With `drop`, `grad_output` is the gradient of the dropped
/// output (by `draw`, salted by `salt`), taken back through the dropout on the way in: the mask is
/// drawn in both passes over the row instead of a dropout kernel's pass writing `dy` and this
/// one reading it. With `keep_probabilities` it also writes `probabilities`, what the `p v`
/// product's gradient reads: `dropout(y)` with `drop` (the forward's dropped probabilities,
/// bit for bit: the forward then need not keep them, half the memory a composed attention
/// core holds per layer), `y` without. Otherwise `probabilities` is never written. With
/// `held` (a power of two, [`held_vectors`]), each unit holds that many vectors of its row
/// (the input, and the output's gradient) in registers, read once.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn softmax_backward<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    mask: &[Vector<u32, N>],
    grad_output: &[Vector<F, N>],
    grad_input: &mut [Vector<F, N>],
    probabilities: &mut [Vector<F, N>],
    salt: &[u32],
    draw: DrawScalars,
    scale: f32,
    rows: u32,
    sq: u32,
    sk: u32,
    #[comptime] causal: bool,
    #[comptime] drop: bool,
    #[comptime] formed: bool,
    #[comptime] keep_probabilities: bool,
    #[comptime] lanes: u32,
    #[comptime] held: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) {
    let row = row_index();
    let width = sk as usize / N::value();
    let length = row_length(row, rows, width as u32);
    let base = row * width;
    // A causal row's keys after the query have y = 0: neither read nor summed.
    let mut limit = sk as usize;
    if causal {
        limit = causal_limit(row % sq as usize, sq as usize, sk as usize);
    }
    let args = BackwardArgs {
        draw: row_draw(&draw, salt, (row * sk as usize) as u32, drop),
        scale,
        base,
        limit,
        seen: min(length, limit.div_ceil(N::value())),
        length,
    };
    if comptime![held > 0] {
        held_softmax_backward::<F, A, N>(
            input,
            mask,
            grad_output,
            grad_input,
            probabilities,
            args,
            drop,
            formed,
            keep_probabilities,
            lanes,
            comptime!(held as usize),
            rows_per_cube,
            plane_reduce,
        );
    } else {
        streamed_softmax_backward::<F, A, N>(
            input,
            mask,
            grad_output,
            grad_input,
            probabilities,
            args,
            drop,
            formed,
            keep_probabilities,
            lanes,
            rows_per_cube,
            plane_reduce,
        );
    }
}

/// What a softmax backward row needs besides its buffers: the draw along it, the scale, where
/// the row starts (`base`, in vectors), the keys it sees (`limit`), the vectors holding them
/// (`seen`) and the row's vectors (`length`, 0 past the last row).
#[derive(CubeType, Clone, Copy)]
struct BackwardArgs {
    draw: RowDraw,
    scale: f32,
    base: usize,
    limit: usize,
    seen: usize,
    length: usize,
}

/// The softmax backward of one row, read in each pass (see [`softmax_backward`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn streamed_softmax_backward<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    mask: &[Vector<u32, N>],
    grad_output: &[Vector<F, N>],
    grad_input: &mut [Vector<F, N>],
    probabilities: &mut [Vector<F, N>],
    args: BackwardArgs,
    #[comptime] drop: bool,
    #[comptime] formed: bool,
    #[comptime] keep_probabilities: bool,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) {
    let step = lanes as usize;
    let draw = args.draw;
    let (base, limit, seen, length, scale) =
        (args.base, args.limit, args.seen, args.length, args.scale);
    let statistics = if formed {
        row_statistics::<F, A, N>(
            input,
            mask,
            base,
            0usize,
            limit,
            seen,
            scale,
            false,
            lanes,
            rows_per_cube,
            plane_reduce,
        )
    } else {
        no_statistics::<A, N>()
    };
    let mut local = Vector::<A, N>::new(A::new(0.0));
    let mut j = UNIT_POS_X as usize;
    while j < seen {
        let y = probability_at::<F, A, N>(input, mask, base, j, limit, &statistics, formed);
        let dy = output_grad::<F, N>(grad_output, base + j, &draw, drop);
        local += Vector::<A, N>::cast_from(dy) * Vector::<A, N>::cast_from(y);
        j += step;
    }
    let dot = Vector::<A, N>::new(row_vector_sum::<A, N>(
        local,
        lanes,
        rows_per_cube,
        plane_reduce,
    ));
    let scale = Vector::<A, N>::new(A::cast_from(scale));
    j = UNIT_POS_X as usize;
    while j < seen {
        let stored = probability_at::<F, A, N>(input, mask, base, j, limit, &statistics, formed);
        let y = Vector::<A, N>::cast_from(stored);
        let dy = output_grad::<F, N>(grad_output, base + j, &draw, drop);
        let dy = Vector::<A, N>::cast_from(dy);
        grad_input[base + j] = Vector::<F, N>::cast_from(scale * y * (dy - dot));
        if keep_probabilities {
            probabilities[base + j] = kept_probabilities::<F, N>(stored, base + j, &draw, drop);
        }
        j += step;
    }
    let none = Vector::<F, N>::new(F::new(0.0));
    while j < length {
        grad_input[base + j] = none;
        if keep_probabilities {
            probabilities[base + j] = none;
        }
        j += step;
    }
}

/// What the backward writes for the `p v` product's gradient at vector `at`: the stored
/// probabilities `y`, dropped as the forward dropped them with `drop`.
#[cube]
fn kept_probabilities<F: Float, N: Size>(
    stored: Vector<F, N>,
    at: usize,
    draw: &RowDraw,
    #[comptime] drop: bool,
) -> Vector<F, N> {
    let mut y = stored;
    if drop {
        // As the forward drew it from the same stored `y`.
        y = row_dropout::<F, N>(stored, at, draw);
    }
    y
}

/// The probabilities of a row's vector `j` as the forward stored them: read from `input` (the
/// stored output), or with `formed` formed from `input` (the scores) and the row's
/// `statistics`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn probability_at<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    mask: &[Vector<u32, N>],
    base: usize,
    j: usize,
    causal_limit: usize,
    statistics: &RowStatistics<A, N>,
    #[comptime] formed: bool,
) -> Vector<F, N> {
    if formed {
        probability::<F, A, N>(
            input,
            mask,
            base,
            0usize,
            j,
            causal_limit,
            statistics,
            false,
        )
    } else {
        input[base + j]
    }
}
