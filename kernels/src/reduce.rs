//! Row-wide reductions (a plane operation, or a tree through shared memory), the building
//! block of the row kernels: the `lanes` units of one row (see [`crate::rows`]) combine their
//! partial values, each unit's vector of them folded first where the row is loaded in vectors.

use cubecl::prelude::*;

use crate::vectors::{largest, total};

/// Sum of `value` over the `lanes` units of this unit's row, returned to each of them.
#[cube]
pub fn row_sum<A: Float>(
    value: A,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) -> A {
    row_reduce::<A>(value, lanes, rows_per_cube, plane_reduce, false)
}

/// Maximum of `value` over the `lanes` units of this unit's row, returned to each of them.
#[cube]
pub fn row_max<A: Float>(
    value: A,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) -> A {
    row_reduce::<A>(value, lanes, rows_per_cube, plane_reduce, true)
}

/// Sum of the lanes of `value` over the `lanes` units of this unit's row (a row loaded in
/// vectors: each unit's vector of partial sums folded first), returned to each of them.
#[cube]
pub fn row_vector_sum<A: Float, N: Size>(
    value: Vector<A, N>,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) -> A {
    row_sum::<A>(total::<A, N>(value), lanes, rows_per_cube, plane_reduce)
}

/// Maximum of the lanes of `value` over the `lanes` units of this unit's row.
#[cube]
pub fn row_vector_max<A: Float, N: Size>(
    value: Vector<A, N>,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
) -> A {
    row_max::<A>(largest::<A, N>(value), lanes, rows_per_cube, plane_reduce)
}

/// Reduction (sum, or max with `max`) within each row of the cube: one plane operation where
/// a row is one plane (`plane_reduce`, [`crate::rows::RowLaunch`]), else a tree through shared
/// memory. Every unit of the cube must call it (the barriers are cube-wide, the plane
/// operations plane-wide); each call site gets its own shared memory, free again on return.
#[cube]
fn row_reduce<A: Float>(
    value: A,
    #[comptime] lanes: u32,
    #[comptime] rows_per_cube: u32,
    #[comptime] plane_reduce: bool,
    #[comptime] max: bool,
) -> A {
    let mut total = value;
    if plane_reduce {
        if max {
            total = plane_max(value);
        } else {
            total = plane_sum(value);
        }
    } else if lanes > 1 {
        // (One lane per row, on runtimes without planes such as cubecl-cpu: nothing to
        // combine, and no barrier to pay.)
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
