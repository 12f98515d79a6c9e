//! Softmax rows held in registers: where a row's units can hold it ([`held_vectors`]), each
//! reads its vectors of the row once and runs the kernel's passes over registers, as
//! Megatron's warp-per-row softmax does. The same expressions as the rows read in each pass
//! (the parent module), in the same order, so the same bits.

use cubecl::prelude::*;

use super::{
    kept, kept_probabilities, no_statistics, output_grad, probability_of, BackwardArgs,
    ForwardArgs, RowStatistics,
};
use crate::dropout::row_dropout;
use crate::reduce::{row_vector_max, row_vector_sum};

/// The most vectors of a row one unit holds in registers ([`held_vectors`]). Eight vectors of
/// eight bf16 are 64 f32 registers for the input and as many for the backward's gradient.
pub const MOST_HELD: usize = 8;

/// How many vectors of a row of `width` vectors each of its `lanes` units holds in registers:
/// enough for the row rounded up to a power of two (one kernel per power, not per row length),
/// or 0 where that is more than [`MOST_HELD`] (the row is read in each pass instead).
pub fn held_vectors(width: usize, lanes: u32) -> u32 {
    let per_unit = width
        .div_ceil(lanes.max(1) as usize)
        .max(1)
        .next_power_of_two();
    if per_unit <= MOST_HELD {
        per_unit as u32
    } else {
        0
    }
}

/// This unit's `count` vectors of a row (vector `lane + k · lanes` at `held[k]`), the input at
/// `base` cast to `A`; zeros at and past `seen`, which are not read.
#[cube]
fn load_held<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    base: usize,
    seen: usize,
    #[comptime] lanes: u32,
    #[comptime] count: usize,
) -> Array<Vector<A, N>> {
    let mut held = Array::<Vector<A, N>>::new(count);
    #[unroll]
    for k in 0..count {
        let j = UNIT_POS_X as usize + k * lanes as usize;
        let mut x = Vector::<A, N>::new(A::new(0.0));
        if j < seen {
            x = Vector::<A, N>::cast_from(input[base + j]);
        }
        held[k] = x;
    }
    held
}

/// [`row_statistics`](super::row_statistics) of a row this unit holds ([`load_held`]): the same
/// expressions in the same order, from registers.
#[cube]
#[allow(clippy::too_many_arguments)]
fn held_statistics<A: Float, N: Size>(
    held: &Array<Vector<A, N>>,
    mask: &[Vector<u32, N>],
    mask_base: usize,
    causal_limit: usize,
    seen: usize,
    scale: f32,
    #[comptime] use_mask: bool,
    #[comptime] lanes: u32,
    #[comptime] count: usize,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) -> RowStatistics<A, N> {
    let scale = Vector::<A, N>::new(A::cast_from(scale));
    let (lowest, zero) = (
        Vector::<A, N>::new(A::new(-3.0e38)),
        Vector::<A, N>::new(A::new(0.0)),
    );
    let mut local_max = lowest;
    #[unroll]
    for k in 0..count {
        let j = UNIT_POS_X as usize + k * lanes as usize;
        if j < seen {
            let keep = kept::<N>(mask, mask_base, j, causal_limit, use_mask);
            local_max = max(local_max, select_many(keep, scale * held[k], lowest));
        }
    }
    let max = row_vector_max::<A, N>(local_max, lanes, rows_per_cube, plane_reduce);
    let maxes = Vector::<A, N>::new(max);
    let mut local_sum = zero;
    #[unroll]
    for k in 0..count {
        let j = UNIT_POS_X as usize + k * lanes as usize;
        if j < seen {
            let keep = kept::<N>(mask, mask_base, j, causal_limit, use_mask);
            let e = Vector::exp(scale * held[k] - maxes);
            local_sum += select_many(keep, e, zero);
        }
    }
    let sum = row_vector_sum::<A, N>(local_sum, lanes, rows_per_cube, plane_reduce);
    RowStatistics::<A, N> {
        scale,
        maxes,
        inverse_sum: Vector::<A, N>::new(select(sum > A::new(0.0), A::new(1.0) / sum, A::new(0.0))),
    }
}

/// [`masked_row_softmax`](super::masked_row_softmax) for a row this unit holds `held` vectors of
/// ([`held_vectors`]): the row read once, the same results.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn held_row_softmax<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    output: &mut [Vector<F, N>],
    dropped: &mut [Vector<F, N>],
    mask: &[Vector<u32, N>],
    args: ForwardArgs,
    #[comptime] use_mask: bool,
    #[comptime] drop: bool,
    #[comptime] keep_output: bool,
    #[comptime] lanes: u32,
    #[comptime] held: usize,
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
    let seen = min(width, causal_limit.div_ceil(N::value()));
    let x = load_held::<F, A, N>(input, base, seen, lanes, held);
    let statistics = held_statistics::<A, N>(
        &x,
        mask,
        mask_base,
        causal_limit,
        seen,
        scale,
        use_mask,
        lanes,
        held,
        rows_per_cube,
        plane_reduce,
    );
    let none = Vector::<F, N>::new(F::new(0.0));
    #[unroll]
    for k in 0..held {
        let j = UNIT_POS_X as usize + k * lanes as usize;
        if j < width {
            // Past the causal limit: zeros, as the streaming kernel writes (and drops) them.
            let mut y = none;
            let mut y_dropped = none;
            if j < seen {
                let keep = kept::<N>(mask, mask_base, j, causal_limit, use_mask);
                y = probability_of::<F, A, N>(x[k], keep, &statistics);
                if drop {
                    y_dropped = row_dropout::<F, N>(y, base + j, &args.draw);
                }
            }
            if keep_output {
                output[base + j] = y;
            }
            if drop {
                dropped[base + j] = y_dropped;
            }
        }
    }
}

/// The softmax backward of one row this unit holds `held` vectors of ([`held_vectors`]): the
/// input (the probabilities, or with `formed` the scores) and the output's gradient read once
/// into registers, then [`streamed_softmax_backward`](super::streamed_softmax_backward)'s
/// expressions in its order.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn held_softmax_backward<F: Float, A: Float, N: Size>(
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
    #[comptime] held: usize,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) {
    let draw = args.draw;
    let (base, limit, seen, length) = (args.base, args.limit, args.seen, args.length);
    let x = load_held::<F, A, N>(input, base, seen, lanes, held);
    let statistics = if formed {
        held_statistics::<A, N>(
            &x,
            mask,
            0usize,
            limit,
            seen,
            args.scale,
            false,
            lanes,
            held,
            rows_per_cube,
            plane_reduce,
        )
    } else {
        no_statistics::<A, N>()
    };
    let zero = Vector::<A, N>::new(A::new(0.0));
    let mut dys = Array::<Vector<A, N>>::new(held);
    let mut local = zero;
    #[unroll]
    for k in 0..held {
        let j = UNIT_POS_X as usize + k * lanes as usize;
        let mut dy = zero;
        if j < seen {
            let y = held_probability::<F, A, N>(x[k], mask, j, limit, &statistics, formed);
            let g = output_grad::<F, N>(grad_output, base + j, &draw, drop);
            dy = Vector::<A, N>::cast_from(g);
            local += dy * Vector::<A, N>::cast_from(y);
        }
        dys[k] = dy;
    }
    let dot = Vector::<A, N>::new(row_vector_sum::<A, N>(
        local,
        lanes,
        rows_per_cube,
        plane_reduce,
    ));
    let scale = Vector::<A, N>::new(A::cast_from(args.scale));
    let none = Vector::<F, N>::new(F::new(0.0));
    #[unroll]
    for k in 0..held {
        let j = UNIT_POS_X as usize + k * lanes as usize;
        if j < seen {
            let stored = held_probability::<F, A, N>(x[k], mask, j, limit, &statistics, formed);
            let y = Vector::<A, N>::cast_from(stored);
            grad_input[base + j] = Vector::<F, N>::cast_from(scale * y * (dys[k] - dot));
            if keep_probabilities {
                probabilities[base + j] = kept_probabilities::<F, N>(stored, base + j, &draw, drop);
            }
        } else if j < length {
            grad_input[base + j] = none;
            if keep_probabilities {
                probabilities[base + j] = none;
            }
        }
    }
}

/// [`probability_at`](super::probability_at) of a vector this unit holds (`x`: the input at vector
/// `j`, in `A`).
#[cube]
fn held_probability<F: Float, A: Float, N: Size>(
    x: Vector<A, N>,
    mask: &[Vector<u32, N>],
    j: usize,
    causal_limit: usize,
    statistics: &RowStatistics<A, N>,
    #[comptime] formed: bool,
) -> Vector<F, N> {
    if formed {
        let keep = kept::<N>(mask, 0usize, j, causal_limit, false);
        probability_of::<F, A, N>(x, keep, statistics)
    } else {
        Vector::<F, N>::cast_from(x)
    }
}
