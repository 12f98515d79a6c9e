//! The global gradient norm and Megatron's clipping coefficient over a flat f32 gradient
//! buffer, in two launches and an order fixed by the buffer's length (and the width of the
//! vectors the device loads).
//!
//! Why: composed of tensor ops, squares, a two-stage fixed-order sum (three reductions and an
//! addition), a square root and the coefficient `min(1, max_norm / (norm + 1e-6))` (five more
//! element-wise launches on one number) are eleven launches a step. Here the first kernel
//! gives each block of [`BLOCK`] elements its sum of squares, the second sums the blocks and
//! writes the norm and the coefficient, which the Adam kernel reads on the device.

use cubecl::prelude::*;

use crate::reduce::{row_sum, row_vector_sum};
use crate::rows::cube_index;

/// Elements per block of the first kernel.
pub const BLOCK: usize = 1 << 14;

/// `partials[c] = Σ grads[i]²` over block `c` (`i` in `c · BLOCK .. min((c + 1) · BLOCK,
/// len)`): one cube of `lanes` units per block, unit `u` summing the vectors of `N` elements
/// `u, u + lanes, …` of it lane by lane, then its lanes, then a fixed tree.
#[cube(launch)]
pub fn block_sums_of_squares<N: Size>(
    grads: &[Vector<f32, N>],
    partials: &mut [f32],
    len: u32,
    #[comptime] lanes: u32,
) {
    let block = cube_index();
    let start = block * (BLOCK / N::value());
    let mut end = start + BLOCK / N::value();
    if end > len as usize / N::value() {
        end = len as usize / N::value();
    }
    let mut squares = Vector::<f32, N>::new(0.0f32);
    let mut i = start + UNIT_POS_X as usize;
    while i < end {
        squares += grads[i] * grads[i];
        i += lanes as usize;
    }
    let sum = row_vector_sum::<f32, N>(squares, lanes, 1u32, false);
    if UNIT_POS_X == 0 {
        partials[block] = sum;
    }
}

/// `norm[0] = √(Σ partials)` over `blocks` partial sums (one cube of `lanes` units, a fixed
/// order), and `clip[0] = min(1, max_norm / (norm + 1e-6))` (Megatron's
/// `clip_grad_norm_fp32`), or 1 when `max_norm` is 0 (no clipping).
#[cube(launch)]
pub fn norm_and_clip(
    partials: &[f32],
    norm: &mut [f32],
    clip: &mut [f32],
    blocks: u32,
    max_norm: f32,
    #[comptime] lanes: u32,
) {
    let mut sum = 0.0f32;
    let mut i = UNIT_POS_X as usize;
    while i < blocks as usize {
        sum += partials[i];
        i += lanes as usize;
    }
    let sum = row_sum::<f32>(sum, lanes, 1u32, false);
    if UNIT_POS_X == 0 {
        let total = f32::sqrt(sum);
        norm[0] = total;
        let mut coefficient = 1.0f32;
        if max_norm > 0.0 {
            let limited = max_norm / (total + 1.0e-6);
            if limited < 1.0 {
                coefficient = limited;
            }
        }
        clip[0] = coefficient;
    }
}
