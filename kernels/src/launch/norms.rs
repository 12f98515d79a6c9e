//! Launchers of the LayerNorm and RMSNorm kernels, forward and backward (the parameters'
//! gradients reduced over rows in two stages).

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::arg;
use crate::rows::cube_count;
use crate::rows::RowLaunch;
use crate::{layer_norm, rms_norm};

/// LayerNorm forward over rows of `cols`; `mean` and `rstd` (f32, `rows` each) are saved for
/// the backward.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    input: &Handle,
    gamma: &Handle,
    beta: &Handle,
    output: &Handle,
    mean: &Handle,
    rstd: &Handle,
    rows: usize,
    cols: usize,
    epsilon: f32,
) {
    if rows * cols == 0 {
        return;
    }
    let vector = launch.vector_size::<F>(client, cols);
    layer_norm::layer_norm_forward::launch::<F, f32>(
        client,
        launch.cube_count(rows),
        launch.cube_dim(),
        vector,
        arg(input, rows * cols),
        arg(gamma, cols),
        arg(beta, cols),
        arg(output, rows * cols),
        arg(mean, rows),
        arg(rstd, rows),
        epsilon,
        rows as u32,
        cols as u32,
        launch.lanes,
        launch.rows_per_cube,
        launch.plane_reduce,
    );
}

/// Rows each cube of the first dγ/dβ stage sums.
pub const PARAM_GRAD_BLOCK: usize = 64;

/// Units per cube of the first dγ/dβ stage (each strides over the columns).
pub const PARAM_GRAD_UNITS: u32 = 256;

/// LayerNorm backward: `grad_input` per row, and `grad_gamma`, `grad_beta` (`cols` each)
/// reduced over rows in two stages (blocks of [`PARAM_GRAD_BLOCK`] rows, then the blocks).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    input: &Handle,
    gamma: &Handle,
    grad_output: &Handle,
    mean: &Handle,
    rstd: &Handle,
    grad_input: &Handle,
    grad_gamma: &Handle,
    grad_beta: &Handle,
    rows: usize,
    cols: usize,
) {
    if rows * cols == 0 {
        return;
    }
    let vector = launch.vector_size::<F>(client, cols);
    layer_norm::layer_norm_backward_input::launch::<F, f32>(
        client,
        launch.cube_count(rows),
        launch.cube_dim(),
        vector,
        arg(input, rows * cols),
        arg(gamma, cols),
        arg(grad_output, rows * cols),
        arg(mean, rows),
        arg(rstd, rows),
        arg(grad_input, rows * cols),
        rows as u32,
        cols as u32,
        launch.lanes,
        launch.rows_per_cube,
        launch.plane_reduce,
    );
    let blocks = rows.div_ceil(PARAM_GRAD_BLOCK);
    let partial_gamma = client.empty(blocks * cols * 4);
    let partial_beta = client.empty(blocks * cols * 4);
    layer_norm::layer_norm_backward_params_partial::launch::<F, f32>(
        client,
        cube_count(blocks),
        CubeDim::new_1d(PARAM_GRAD_UNITS),
        vector,
        arg(input, rows * cols),
        arg(grad_output, rows * cols),
        arg(mean, rows),
        arg(rstd, rows),
        arg(&partial_gamma, blocks * cols),
        arg(&partial_beta, blocks * cols),
        rows as u32,
        cols as u32,
        PARAM_GRAD_BLOCK as u32,
        PARAM_GRAD_UNITS,
    );
    let per_cube = 64usize;
    layer_norm::layer_norm_backward_params_final::launch::<F, f32>(
        client,
        CubeCount::Static((cols / vector).div_ceil(per_cube) as u32, 1, 1),
        CubeDim::new_1d(per_cube as u32),
        vector,
        arg(&partial_gamma, blocks * cols),
        arg(&partial_beta, blocks * cols),
        arg(grad_gamma, cols),
        arg(grad_beta, cols),
        blocks as u32,
        cols as u32,
    );
}

/// RMSNorm forward over rows of `cols`; `rstd` (f32, `rows`: each row's 1/rms) is saved for
/// the backward.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_forward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    input: &Handle,
    gamma: &Handle,
    output: &Handle,
    rstd: &Handle,
    rows: usize,
    cols: usize,
    epsilon: f32,
) {
    if rows * cols == 0 {
        return;
    }
    let vector = launch.vector_size::<F>(client, cols);
    rms_norm::rms_norm_forward::launch::<F, f32>(
        client,
        launch.cube_count(rows),
        launch.cube_dim(),
        vector,
        arg(input, rows * cols),
        arg(gamma, cols),
        arg(output, rows * cols),
        arg(rstd, rows),
        epsilon,
        rows as u32,
        cols as u32,
        launch.lanes,
        launch.rows_per_cube,
        launch.plane_reduce,
    );
}

/// RMSNorm backward: `grad_input` per row, and `grad_gamma` (`cols`) reduced over rows in two
/// stages (blocks of [`PARAM_GRAD_BLOCK`] rows, then the blocks), as LayerNorm's dγ.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    input: &Handle,
    gamma: &Handle,
    grad_output: &Handle,
    rstd: &Handle,
    grad_input: &Handle,
    grad_gamma: &Handle,
    rows: usize,
    cols: usize,
) {
    if rows * cols == 0 {
        return;
    }
    let vector = launch.vector_size::<F>(client, cols);
    rms_norm::rms_norm_backward_input::launch::<F, f32>(
        client,
        launch.cube_count(rows),
        launch.cube_dim(),
        vector,
        arg(input, rows * cols),
        arg(gamma, cols),
        arg(grad_output, rows * cols),
        arg(rstd, rows),
        arg(grad_input, rows * cols),
        rows as u32,
        cols as u32,
        launch.lanes,
        launch.rows_per_cube,
        launch.plane_reduce,
    );
    let blocks = rows.div_ceil(PARAM_GRAD_BLOCK);
    let partial_gamma = client.empty(blocks * cols * 4);
    rms_norm::rms_norm_backward_gamma_partial::launch::<F, f32>(
        client,
        cube_count(blocks),
        CubeDim::new_1d(PARAM_GRAD_UNITS),
        vector,
        arg(input, rows * cols),
        arg(grad_output, rows * cols),
        arg(rstd, rows),
        arg(&partial_gamma, blocks * cols),
        rows as u32,
        cols as u32,
        PARAM_GRAD_BLOCK as u32,
        PARAM_GRAD_UNITS,
    );
    let per_cube = 64usize;
    rms_norm::rms_norm_backward_gamma_final::launch::<F, f32>(
        client,
        CubeCount::Static((cols / vector).div_ceil(per_cube) as u32, 1, 1),
        CubeDim::new_1d(per_cube as u32),
        vector,
        arg(&partial_gamma, blocks * cols),
        arg(grad_gamma, cols),
        blocks as u32,
        cols as u32,
    );
}
