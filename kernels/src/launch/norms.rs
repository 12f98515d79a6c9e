//! Launchers of the LayerNorm and RMSNorm kernels, forward and backward (the parameters'
//! gradients are column sums over the rows, one launch: [`super::columns`]).

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{arg, layer_norm_param_gradients, rms_norm_gamma_gradient, ColumnLaunch};
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

/// LayerNorm backward: `grad_input` per row (plus `residual_grad`, when given, in the same
/// launch: [`crate::rows::joined_with_residual`]), and `grad_gamma`, `grad_beta` (`cols` each)
/// summed over the rows in one launch ([`layer_norm_param_gradients`]): two launches in all.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    input: &Handle,
    gamma: &Handle,
    grad_output: &Handle,
    mean: &Handle,
    rstd: &Handle,
    residual_grad: Option<&Handle>,
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
        arg(residual_grad.unwrap_or(grad_output), rows * cols),
        arg(grad_input, rows * cols),
        rows as u32,
        cols as u32,
        launch.lanes,
        launch.rows_per_cube,
        launch.plane_reduce,
        residual_grad.is_some(),
    );
    layer_norm_param_gradients::<F>(
        client,
        ColumnLaunch::for_client(client),
        input,
        grad_output,
        mean,
        rstd,
        grad_gamma,
        grad_beta,
        rows,
        cols,
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

/// RMSNorm backward: `grad_input` per row (plus `residual_grad`, when given, in the same
/// launch), and `grad_gamma` (`cols`) summed over the rows in one launch
/// ([`rms_norm_gamma_gradient`]), as LayerNorm's dγ.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    input: &Handle,
    gamma: &Handle,
    grad_output: &Handle,
    rstd: &Handle,
    residual_grad: Option<&Handle>,
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
        arg(residual_grad.unwrap_or(grad_output), rows * cols),
        arg(grad_input, rows * cols),
        rows as u32,
        cols as u32,
        launch.lanes,
        launch.rows_per_cube,
        launch.plane_reduce,
        residual_grad.is_some(),
    );
    rms_norm_gamma_gradient::<F>(
        client,
        ColumnLaunch::for_client(client),
        input,
        grad_output,
        rstd,
        grad_gamma,
        rows,
        cols,
    );
}
