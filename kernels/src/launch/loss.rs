//! Launchers of the loss kernels: the cross-entropy of logits against labels, and the loss's
//! masked mean.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{arg, check_elements};
use crate::rows::cube_count;
use crate::rows::RowLaunch;
use crate::{cross_entropy, masked_mean};

/// Cross-entropy forward over `rows` rows of `cols` logits against `targets` (i32, one per
/// row; a row counts its target only where `inside`, f32, is non-zero): `loss` and
/// `logsumexp` (f32, `rows` each).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_forward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    logits: &Handle,
    targets: &Handle,
    inside: &Handle,
    loss: &Handle,
    logsumexp: &Handle,
    rows: usize,
    cols: usize,
) {
    if rows * cols == 0 {
        return;
    }
    cross_entropy::cross_entropy_forward::launch::<F, f32>(
        client,
        launch.cube_count(rows),
        launch.cube_dim(),
        launch.vector_size::<F>(client, cols),
        arg(logits, rows * cols),
        arg(targets, rows),
        arg(inside, rows),
        arg(loss, rows),
        arg(logsumexp, rows),
        rows as u32,
        cols as u32,
        launch.lanes,
        launch.rows_per_cube,
        launch.plane_reduce,
    );
}

/// Cross-entropy backward: `grad_logits = (softmax − one-hot(targets)) · grad_loss` per row,
/// the softmax recomputed from the forward's `logsumexp`.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    logits: &Handle,
    targets: &Handle,
    inside: &Handle,
    logsumexp: &Handle,
    grad_loss: &Handle,
    grad_logits: &Handle,
    rows: usize,
    cols: usize,
) {
    if rows * cols == 0 {
        return;
    }
    cross_entropy::cross_entropy_backward::launch::<F, f32>(
        client,
        launch.cube_count(rows),
        launch.cube_dim(),
        launch.vector_size::<F>(client, cols),
        arg(logits, rows * cols),
        arg(targets, rows),
        arg(inside, rows),
        arg(logsumexp, rows),
        arg(grad_loss, rows),
        arg(grad_logits, rows * cols),
        rows as u32,
        cols as u32,
        launch.lanes,
    );
}

/// `[mean, count] = [Σ value · mask / Σ mask, Σ mask]` over `len` f32 elements, each a
/// one-element buffer, in one cube of `launch.lanes` units (an order fixed by `len` and the
/// launch).
pub fn masked_mean_forward(
    client: &Client,
    launch: RowLaunch,
    values: &Handle,
    mask: &Handle,
    [mean, count]: [&Handle; 2],
    len: usize,
) {
    check_elements(len, "a masked mean");
    masked_mean::masked_mean_forward::launch(
        client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(launch.lanes),
        arg(values, len.max(1)),
        arg(mask, len.max(1)),
        arg(mean, 1),
        arg(count, 1),
        len as u32,
        launch.lanes,
    );
}

/// The values' gradient `mask · grad / count` of [`masked_mean_forward`] (`grad` and `count`
/// one element each).
pub fn masked_mean_backward(
    client: &Client,
    mask: &Handle,
    count: &Handle,
    grad: &Handle,
    grad_values: &Handle,
    len: usize,
) {
    if len == 0 {
        return;
    }
    check_elements(len, "a masked mean");
    masked_mean::masked_mean_backward::launch(
        client,
        cube_count(len.div_ceil(masked_mean::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(masked_mean::UNITS_PER_CUBE),
        arg(mask, len),
        arg(count, 1),
        arg(grad, 1),
        arg(grad_values, len),
        len as u32,
    );
}
