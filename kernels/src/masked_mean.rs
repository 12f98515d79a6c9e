//! Megatron's loss reduction, the masked mean `Σ value · mask / Σ mask`, one kernel each way.
//!
//! Why: composed of tensor ops it is a product, two sums (each two stages to keep its order
//! fixed, see `fixed_order_sum` in ferrotron) and a division forward, and six launches
//! backward. Here one cube reads both rows once, in an order fixed by their length alone
//! (run-to-run identical bits, unlike a sum with float atomics), and the backward writes
//! `mask · g / Σ mask` in one pass. f32 throughout (the losses are f32).

use cubecl::prelude::*;

use crate::reduce::row_sum;

/// `mean[0] = Σ value · mask / Σ mask` and `count[0] = Σ mask` over `len` elements: one
/// cube of `lanes` units, unit `u` summing elements `u, u + lanes, …`, then a fixed tree.
#[cube(launch)]
pub fn masked_mean_forward(
    values: &[f32],
    mask: &[f32],
    mean: &mut [f32],
    count: &mut [f32],
    len: u32,
    #[comptime] lanes: u32,
) {
    let mut weighted = 0.0f32;
    let mut masked = 0.0f32;
    let mut j = UNIT_POS_X as usize;
    while j < len as usize {
        weighted += values[j] * mask[j];
        masked += mask[j];
        j += lanes as usize;
    }
    let weighted = row_sum::<f32>(weighted, lanes, 1u32, false);
    let masked = row_sum::<f32>(masked, lanes, 1u32, false);
    if UNIT_POS_X == 0 {
        mean[0] = weighted / masked;
        count[0] = masked;
    }
}

/// `grad_values[i] = mask[i] · grad[0] / count[0]` for `i < len`.
#[cube(launch)]
pub fn masked_mean_backward(
    mask: &[f32],
    count: &[f32],
    grad: &[f32],
    grad_values: &mut [f32],
    len: u32,
) {
    let i = crate::rows::cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if i < len as usize {
        grad_values[i] = mask[i] * (grad[0] / count[0]);
    }
}

/// Units per cube of the backward.
pub const UNITS_PER_CUBE: u32 = 256;
