//! Host-side launchers: cube shapes and argument plumbing for each kernel, on contiguous
//! buffers of a CubeCL [`Client`] (any runtime). Accumulation is always f32.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::{layer_norm, softmax};

/// Units per cube for rows of `cols` elements: a power of two from 32 to 256, about four
/// elements per unit.
pub fn units_for(cols: usize) -> u32 {
    (cols.div_ceil(4).clamp(32, 256) as u32).next_power_of_two()
}

/// One cube per row, spread over two dimensions when there are more rows than one holds.
pub fn cube_count(rows: usize) -> CubeCount {
    const MAX_X: usize = 65_535;
    let x = rows.clamp(1, MAX_X);
    CubeCount::Static(x as u32, rows.div_ceil(x).max(1) as u32, 1)
}

fn arg(handle: &Handle, len: usize) -> BufferArg {
    // SAFETY: every launcher sizes its buffers from the same shape it passes to the kernel,
    // and the kernels index within `len`.
    unsafe { BufferArg::from_raw_parts(handle.clone(), len) }
}

/// The shape of an attention-score tensor `[batch, heads, sq, sk]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScoresShape {
    /// Batch.
    pub batch: usize,
    /// Heads.
    pub heads: usize,
    /// Query positions.
    pub sq: usize,
    /// Key positions.
    pub sk: usize,
}

impl ScoresShape {
    /// Rows of `sk`.
    pub fn rows(&self) -> usize {
        self.batch * self.heads * self.sq
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.rows() * self.sk
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which positions a softmax hides.
#[derive(Clone, Copy, Debug)]
pub enum SoftmaxMask<'a> {
    /// Keys after the query (`ScaledUpperTriangMaskedSoftmax`).
    Causal,
    /// Keys where the `[batch, 1, sq, sk]` u32 mask is non-zero (`ScaledMaskedSoftmax`).
    Padding(&'a Handle),
}

/// `output = softmax(scale · input)` with `mask` (Megatron's fused forward).
pub fn softmax_forward<F: Float + CubeElement>(
    client: &Client,
    input: &Handle,
    mask: SoftmaxMask<'_>,
    output: &Handle,
    shape: ScoresShape,
    scale: f32,
) {
    if shape.is_empty() {
        return;
    }
    if matches!(mask, SoftmaxMask::Causal) {
        assert!(
            shape.sq <= shape.sk,
            "causal softmax needs sq ≤ sk, got {shape:?}"
        );
    }
    let units = units_for(shape.sk);
    let (mask_arg, causal, padded) = match mask {
        SoftmaxMask::Causal => (
            arg(&client.create_from_slice(u32::as_bytes(&[0])), 1),
            true,
            false,
        ),
        SoftmaxMask::Padding(m) => (arg(m, shape.batch * shape.sq * shape.sk), false, true),
    };
    softmax::masked_softmax_forward::launch::<F, f32>(
        client,
        cube_count(shape.rows()),
        CubeDim::new_1d(units),
        arg(input, shape.len()),
        mask_arg,
        arg(output, shape.len()),
        scale,
        shape.rows() as u32,
        shape.heads as u32,
        shape.sq as u32,
        shape.sk as u32,
        causal,
        padded,
        units,
    );
}

/// `grad_input = scale · y ⊙ (dy − Σ dy ⊙ y)` per row of `sk` (both softmaxes' backward).
pub fn softmax_backward<F: Float + CubeElement>(
    client: &Client,
    output: &Handle,
    grad_output: &Handle,
    grad_input: &Handle,
    rows: usize,
    sk: usize,
    scale: f32,
) {
    if rows * sk == 0 {
        return;
    }
    let units = units_for(sk);
    softmax::softmax_backward::launch::<F, f32>(
        client,
        cube_count(rows),
        CubeDim::new_1d(units),
        arg(output, rows * sk),
        arg(grad_output, rows * sk),
        arg(grad_input, rows * sk),
        scale,
        rows as u32,
        sk as u32,
        units,
    );
}

/// LayerNorm forward over rows of `cols`; `mean` and `rstd` (f32, `rows` each) are saved for
/// the backward.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward<F: Float + CubeElement>(
    client: &Client,
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
    let units = units_for(cols);
    layer_norm::layer_norm_forward::launch::<F, f32>(
        client,
        cube_count(rows),
        CubeDim::new_1d(units),
        arg(input, rows * cols),
        arg(gamma, cols),
        arg(beta, cols),
        arg(output, rows * cols),
        arg(mean, rows),
        arg(rstd, rows),
        epsilon,
        rows as u32,
        cols as u32,
        units,
    );
}

/// Rows each cube of the first dγ/dβ stage sums.
pub const PARAM_GRAD_BLOCK: usize = 64;

/// LayerNorm backward: `grad_input` per row, and `grad_gamma`, `grad_beta` (`cols` each)
/// reduced over rows in two stages (blocks of [`PARAM_GRAD_BLOCK`] rows, then the blocks).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward<F: Float + CubeElement>(
    client: &Client,
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
    let units = units_for(cols);
    layer_norm::layer_norm_backward_input::launch::<F, f32>(
        client,
        cube_count(rows),
        CubeDim::new_1d(units),
        arg(input, rows * cols),
        arg(gamma, cols),
        arg(grad_output, rows * cols),
        arg(mean, rows),
        arg(rstd, rows),
        arg(grad_input, rows * cols),
        rows as u32,
        cols as u32,
        units,
    );
    let blocks = rows.div_ceil(PARAM_GRAD_BLOCK);
    let partial_gamma = client.empty(blocks * cols * 4);
    let partial_beta = client.empty(blocks * cols * 4);
    layer_norm::layer_norm_backward_params_partial::launch::<F, f32>(
        client,
        cube_count(blocks),
        CubeDim::new_1d(units),
        arg(input, rows * cols),
        arg(grad_output, rows * cols),
        arg(mean, rows),
        arg(rstd, rows),
        arg(&partial_gamma, blocks * cols),
        arg(&partial_beta, blocks * cols),
        rows as u32,
        cols as u32,
        PARAM_GRAD_BLOCK as u32,
        units,
    );
    let per_cube = 64usize;
    layer_norm::layer_norm_backward_params_final::launch::<F, f32>(
        client,
        CubeCount::Static(cols.div_ceil(per_cube) as u32, 1, 1),
        CubeDim::new_1d(per_cube as u32),
        arg(&partial_gamma, blocks * cols),
        arg(&partial_beta, blocks * cols),
        arg(grad_gamma, cols),
        arg(grad_beta, cols),
        blocks as u32,
        cols as u32,
    );
}

/// Half-precision storage must keep compiling: every launcher instantiated for f16 and bf16
/// (whether a device runs them depends on its shader features).
#[allow(dead_code)]
fn half_precision_instantiates(client: &Client, h: &Handle) {
    fn all<F: Float + CubeElement>(client: &Client, h: &Handle) {
        let shape = ScoresShape {
            batch: 1,
            heads: 1,
            sq: 1,
            sk: 1,
        };
        softmax_forward::<F>(client, h, SoftmaxMask::Causal, h, shape, 1.0);
        softmax_backward::<F>(client, h, h, h, 1, 1, 1.0);
        layer_norm_forward::<F>(client, h, h, h, h, h, h, 1, 1, 1e-5);
        layer_norm_backward::<F>(client, h, h, h, h, h, h, h, h, 1, 1);
    }
    all::<half::f16>(client, h);
    all::<half::bf16>(client, h);
}
