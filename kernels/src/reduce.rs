//! Row-wide reductions through shared memory, the building block of the row kernels: the
//! `lanes` units of one row (see [`crate::rows`]) combine their partial values.

use cubecl::prelude::*;

/// Sum of `value` over the `lanes` units of this unit's row, returned to each of them.
#[cube]
pub fn row_sum<A: Float>(value: A, #[comptime] lanes: u32, #[comptime] rows_per_cube: u32) -> A {
    row_reduce::<A>(value, lanes, rows_per_cube, false)
}

/// Maximum of `value` over the `lanes` units of this unit's row, returned to each of them.
#[cube]
pub fn row_max<A: Float>(value: A, #[comptime] lanes: u32, #[comptime] rows_per_cube: u32) -> A {
    row_reduce::<A>(value, lanes, rows_per_cube, true)
}

/// Tree reduction (sum, or max with `max`) within each row of the cube. Every unit of the
/// cube must call it (the barriers are cube-wide); each call site gets its own shared memory,
/// free again on return.
#[cube]
fn row_reduce<A: Float>(
    value: A,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] max: bool,
) -> A {
    let mut total = value;
    // One lane per row (runtimes without planes, such as cubecl-cpu): nothing to combine,
    // and no barrier to pay.
    if lanes > 1 {
        let mut scratch = Shared::<[A]>::new_slice((lanes * rows_per_cube) as usize);
        let lane = UNIT_POS_X as usize;
        let base = UNIT_POS_Y as usize * lanes as usize;
        scratch[base + lane] = value;
        sync_cube();
        // From the runtime cube size (= `lanes`): a comptime initial value would make `stride`
        // a constant the loop cannot update.
        let mut stride = (CUBE_DIM_X / 2) as usize;
        while stride > 0 {
            if lane < stride {
                let (a, b) = (scratch[base + lane], scratch[base + lane + stride]);
                if max {
                    scratch[base + lane] = A::max(a, b);
                } else {
                    scratch[base + lane] = a + b;
                }
            }
            sync_cube();
            stride /= 2;
        }
        total = scratch[base];
        sync_cube();
    }
    total
}
