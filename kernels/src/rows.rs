//! How rows map onto cubes: each row is handled by `lanes` units (a power of two, along x),
//! and a cube holds `rows_per_cube` such rows (along y).
//!
//! Why several narrow rows per cube rather than one wide cube per row: a row is reduced
//! through shared memory with a barrier per tree level, so the fewer lanes a row has, the
//! fewer barriers it pays; and a cube of several rows still gives a GPU enough units per
//! cube. A row gets one plane (32 lanes on NVIDIA: a warp per row, as Megatron's softmax
//! kernel). On lavapipe (CPU Vulkan, planes of 8), where barriers are expensive, the causal
//! softmax forward ran faster the fewer lanes a row had, fastest at 8 (measured:
//! benchmarks/results/2026-11-27-lavapipe-fused-kernels.md). Where a row's lanes are exactly
//! one plane and the device runs plane operations, the row is reduced by one of them instead
//! of the tree ([`RowLaunch::plane_reduce`]): no shared memory and no barrier, which made the
//! same forward faster again (same file).

use cubecl::prelude::*;

use std::sync::atomic::{AtomicBool, Ordering};

/// The linear index of this cube (cube counts are 2-D when there are more cubes than one
/// dimension holds).
#[cube]
pub fn cube_index() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// The row this unit works on (may be past the last row in the last cube).
#[cube]
pub fn row_index() -> usize {
    cube_index() * CUBE_DIM_Y as usize + UNIT_POS_Y as usize
}

/// The columns this unit's row has: `cols`, or none for a unit past the last row (which must
/// still take part in its cube's reductions, so it cannot simply stop).
#[cube]
pub fn row_length(row: usize, rows: u32, cols: u32) -> usize {
    let mut n = cols as usize;
    if row >= rows as usize {
        n = 0;
    }
    n
}

/// A norm's input gradient `dx` (computed in `A`) stored as `F`; with `join`, plus the
/// gradient the same input has from the residual add that also reads it (`residual_grad` at
/// `index`), which autodiff would otherwise add in a launch of its own. `dx` is rounded to `F`
/// before the sum, so in half precision the result has the bits of that separate add
/// (`round(round(dx) + r)`: f32 holds the sum of two halves exactly enough that rounding it
/// again is rounding once). In f32 the conversion is nothing, and a compiler that fuses dx's
/// last multiply with the add (cubecl-cpu's LLVM does) skips dx's rounding: within half an
/// ulp of dx of the separate add.
#[cube]
pub fn joined_with_residual<F: Float, A: Float, N: Size>(
    dx: Vector<A, N>,
    residual_grad: &[Vector<F, N>],
    index: usize,
    #[comptime] join: bool,
) -> Vector<F, N> {
    let dx = Vector::<F, N>::cast_from(dx);
    if join {
        let sum = Vector::<A, N>::cast_from(dx) + Vector::<A, N>::cast_from(residual_grad[index]);
        Vector::<F, N>::cast_from(sum)
    } else {
        dx
    }
}
/// The shape of a row kernel's launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLaunch {
    /// Units per row (a power of two).
    pub lanes: u32,
    /// Rows per cube.
    pub rows_per_cube: u32,
    /// Whether a row's lanes are exactly one plane, so that a row is reduced by a plane
    /// operation (warp shuffles on a GPU, one vector reduction on lavapipe) rather than a
    /// tree through shared memory with a barrier per level.
    pub plane_reduce: bool,
    /// Whether a unit loads and stores a row in vectors (the widest the device loads in one
    /// instruction that divides the row, [`Self::vector_size`]) rather than one element at a
    /// time: a warp's load of bf16 moves 512 bytes instead of 64, and on lavapipe a vector is
    /// one load per SIMD lane instead of one per element.
    pub vectorized: bool,
    /// Whether a softmax row short enough for its units to hold is read once into registers
    /// (`crate::softmax::held_vectors`) rather than in each pass.
    pub held_in_registers: bool,
}

impl RowLaunch {
    /// Units per cube: four 32-wide warps on a GPU.
    pub const UNITS_PER_CUBE: u32 = 128;

    /// The launch shape for `client`'s device: a row per plane (warp, subgroup) of at most
    /// 32 lanes, and enough rows for [`Self::UNITS_PER_CUBE`] units per cube. That is 32
    /// lanes on NVIDIA (Megatron's warp per row), 8 on lavapipe (its SIMD width), and 1 on
    /// cubecl-cpu, which has no planes and whose barriers are slow.
    ///
    /// Where the device's planes have one width that a row's lanes fill and plane operations
    /// run ([`plane_width`]), rows are reduced with them.
    pub fn for_client(client: &Client) -> Self {
        let launch = Self::for_plane_size(client.properties().hardware.plane_size_max);
        Self {
            plane_reduce: launch.lanes > 1 && plane_width(client) == Some(launch.lanes),
            vectorized: vectors_on(),
            held_in_registers: true,
            ..launch
        }
    }

    /// The launch shape for a device whose widest plane has `plane_size` units.
    pub fn for_plane_size(plane_size: u32) -> Self {
        let lanes = plane_size.clamp(1, 32).next_power_of_two();
        Self {
            lanes,
            rows_per_cube: Self::UNITS_PER_CUBE / lanes,
            plane_reduce: false,
            vectorized: false,
            held_in_registers: false,
        }
    }

    /// The vector size of a row of `cols` elements of `F`: with [`Self::vectorized`], the
    /// widest vector `client` loads in one instruction that divides `cols`, else 1.
    pub fn vector_size<F: CubeElement>(&self, client: &Client, cols: usize) -> usize {
        if self.vectorized {
            widest_vector::<F>(client, cols)
        } else {
            1
        }
    }

    /// The cube dimensions: `lanes` × `rows_per_cube`.
    pub fn cube_dim(&self) -> CubeDim {
        CubeDim::new_2d(self.lanes, self.rows_per_cube)
    }

    /// Enough cubes for `rows` rows, spread over two dimensions when one does not hold them.
    pub fn cube_count(&self, rows: usize) -> CubeCount {
        cube_count(rows.div_ceil(self.rows_per_cube as usize))
    }
}

/// Whether kernels load in vectors: on unless a benchmark turns it off to measure the one
/// element per load it replaced (`benchmarks/kernel_runtimes.rs`, in the same process). A
/// process-wide setting rather than a launch field because the element-wise launchers take
/// no launch shape.
static VECTORS: AtomicBool = AtomicBool::new(true);

/// Whether kernels load in vectors ([`RowLaunch::vectorized`] and the element-wise
/// kernels): on unless [`set_vectors_on`] turned it off.
pub fn vectors_on() -> bool {
    VECTORS.load(Ordering::Relaxed)
}

/// Overrides [`vectors_on`] for the launches that follow (the benchmark's switch between its
/// two modes in one process).
pub fn set_vectors_on(on: bool) {
    VECTORS.store(on, Ordering::Relaxed);
}

/// The widest vector of `F` that `client` loads in one instruction and that divides `len`
/// (1 where none does).
pub fn widest_vector<F: CubeElement>(client: &Client, len: usize) -> usize {
    client
        .io_optimized_vector_sizes(size_of::<F>())
        .find(|v| len.is_multiple_of(*v))
        .unwrap_or(1)
}

/// The width of `client`'s planes where it is fixed and plane operations run there: a device
/// that advertises them, or a CPU device (wgpu on a CPU Vulkan driver: lavapipe), whose planes
/// are its vector unit and for which CubeCL does not advertise plane operations though it runs
/// them, a register shuffle or reduction each (the kernel tests check them there). `None`
/// elsewhere, a GPU whose plane width varies included.
pub fn plane_width(client: &Client) -> Option<u32> {
    let properties = client.properties();
    let hardware = &properties.hardware;
    let fixed = hardware.plane_size_min == hardware.plane_size_max;
    let usable = advertises_plane_ops(client) || properties.identity.physical.is_none();
    (fixed && hardware.plane_size_min > 1 && usable).then_some(hardware.plane_size_min)
}

/// The plane width of `client` where its planes are a CPU's vector unit: planes of one width
/// (more than one unit) on a device that is no card, for which CubeCL advertises no plane
/// operations (wgpu on lavapipe). `None` elsewhere.
pub fn vector_unit_plane(client: &Client) -> Option<u32> {
    plane_width(client).filter(|_| !advertises_plane_ops(client))
}

fn advertises_plane_ops(client: &Client) -> bool {
    client
        .properties()
        .features
        .plane
        .contains(cubecl::ir::features::Plane::Ops)
}

/// The most cubes one dimension of a cube count holds (WebGPU's and Vulkan's guaranteed
/// minimum; CUDA's y and z limit).
pub const MAX_CUBES_PER_DIMENSION: usize = 65_535;

/// `cubes` cubes, spread over two dimensions when there are more than one holds.
pub fn cube_count(cubes: usize) -> CubeCount {
    let x = cubes.clamp(1, MAX_CUBES_PER_DIMENSION);
    CubeCount::Static(x as u32, cubes.div_ceil(x).max(1) as u32, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_gets_one_plane_of_at_most_32_lanes_and_a_cube_128_units() {
        for (plane, lanes) in [
            (0, 1),
            (1, 1),
            (4, 4),
            (8, 8),
            (12, 16),
            (32, 32),
            (64, 32),
            (128, 32),
        ] {
            let launch = RowLaunch::for_plane_size(plane);
            assert_eq!(launch.lanes, lanes, "plane size {plane}");
            assert_eq!(
                launch.lanes * launch.rows_per_cube,
                RowLaunch::UNITS_PER_CUBE
            );
        }
    }

    #[test]
    fn cube_counts_cover_every_row_and_stay_within_one_dimension_s_limit() {
        let launch = RowLaunch::for_plane_size(32);
        for rows in [1usize, 3, 4, 5, 262_140, 262_141, 1_000_003] {
            let CubeCount::Static(x, y, z) = launch.cube_count(rows) else {
                panic!("static count expected");
            };
            assert!(x as usize <= MAX_CUBES_PER_DIMENSION && z == 1);
            let cubes = (x * y) as usize;
            assert!(cubes * launch.rows_per_cube as usize >= rows, "{rows} rows");
            assert!(
                cubes < rows.div_ceil(4) + x as usize,
                "{rows} rows: {cubes} cubes"
            );
        }
    }
}
