//! Launcher of the word embedding's gradient ([`crate::embedding`]).

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{arg, element_vector_size};
use crate::embedding;
use crate::rows::cube_count;

/// The shape of an embedding-gradient launch: `units` units per cube, each one column vector
/// of a token's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddingLaunch {
    /// Units per cube (x).
    pub units: u32,
}

impl EmbeddingLaunch {
    /// The shape for `client`'s device, or none where burn's own gradient (one unit per
    /// column walking every position) is the faster: a CPU device (no physical device, or
    /// planes of one unit), whose barriers are slow: on lavapipe the kernel lost to burn's
    /// loop at every cube size tried, the more the smaller the cube (measured:
    /// benchmarks/results/2026-11-30-h200-gpu-history.md and
    /// benchmarks/results/2026-11-27-lavapipe-cubecl-cpu-kernel-runtimes.md).
    /// On a GPU: [`Self::gpu`].
    pub fn for_client(client: &Client) -> Option<Self> {
        let properties = client.properties();
        if properties.identity.physical.is_none() || properties.hardware.plane_size_max <= 1 {
            return None;
        }
        Some(Self::gpu(client))
    }

    /// A GPU's shape: 128 units (a 345M model's rows are 128 vectors of eight bf16; a wider
    /// row takes more cubes per position), at most what a cube of `client`'s device holds.
    pub fn gpu(client: &Client) -> Self {
        let most = client.properties().hardware.max_units_per_cube.max(1);
        Self {
            units: 128u32.min(most),
        }
    }
}

/// The gradient `table` (`[rows, hidden]`, zeroed by the caller) of an embedding looked up
/// at `tokens` (`positions` i32 ids) from the lookup's gradient `grad` (`[positions,
/// hidden]`): each named row the sum of its positions' rows, in position order, in f32.
/// Ids that are negative or not below `rows` contribute nothing.
#[allow(clippy::too_many_arguments)]
pub fn embedding_gradient<F: Float + CubeElement>(
    client: &Client,
    launch: EmbeddingLaunch,
    tokens: &Handle,
    grad: &Handle,
    table: &Handle,
    positions: usize,
    rows: usize,
    hidden: usize,
) {
    if positions == 0 || hidden == 0 {
        return;
    }
    assert!(
        positions <= i32::MAX as usize && rows <= i32::MAX as usize,
        "an embedding gradient of {positions} positions and {rows} rows"
    );
    let vector = element_vector_size::<F>(client, hidden);
    let width = hidden / vector;
    let column_blocks = width.div_ceil(launch.units as usize);
    embedding::embedding_gradient::launch::<F, f32>(
        client,
        cube_count(positions * column_blocks),
        CubeDim::new_1d(launch.units),
        vector,
        arg(tokens, positions),
        arg(grad, positions * hidden),
        arg(table, rows * hidden),
        positions as u32,
        width as u32,
        rows as u32,
        column_blocks as u32,
        launch.units,
    );
}
