//! Cube-wide reductions through shared memory, the building block of the row kernels.

use cubecl::prelude::*;

/// Sum of `value` over the cube's `units` units (a power of two), returned to every unit.
#[cube]
pub fn cube_sum<A: Float>(value: A, #[comptime] units: u32) -> A {
    cube_reduce::<A>(value, units, false)
}

/// Maximum of `value` over the cube's `units` units (a power of two), returned to every unit.
#[cube]
pub fn cube_max<A: Float>(value: A, #[comptime] units: u32) -> A {
    cube_reduce::<A>(value, units, true)
}

/// Tree reduction (sum, or max with `max`) over the cube; each call site gets its own
/// `units` values of shared memory, free again on return.
#[cube]
fn cube_reduce<A: Float>(value: A, #[comptime] units: u32, #[comptime] max: bool) -> A {
    let mut scratch = Shared::<[A]>::new_slice(units as usize);
    let u = UNIT_POS as usize;
    scratch[u] = value;
    sync_cube();
    // From the runtime cube size (= `units`): a comptime initial value would make `stride`
    // a constant the loop cannot update.
    let mut stride = (CUBE_DIM / 2) as usize;
    while stride > 0 {
        if u < stride {
            let (a, b) = (scratch[u], scratch[u + stride]);
            if max {
                scratch[u] = A::max(a, b);
            } else {
                scratch[u] = a + b;
            }
        }
        sync_cube();
        stride /= 2;
    }
    let total = scratch[0];
    sync_cube();
    total
}
