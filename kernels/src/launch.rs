//! Host-side launchers: cube shapes and argument plumbing for each kernel, on contiguous
//! buffers of a CubeCL [`Client`] (any runtime). Accumulation is always f32.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::rows::cube_count;
pub use crate::rows::RowLaunch;
use crate::{
    adam, attention, attention_planes, cross_entropy, dropout, gelu, grad_norm, heads, layer_norm,
    masked_mean, rms_norm, rotary, softmax, stream_order, swiglu,
};

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

/// `output = softmax(scale · input)` with `mask` (Megatron's fused forward) and, with
/// `dropout = Some((draw, dropped))`, the attention dropout of `output` by `draw` (the whole
/// tensor's draw) into `dropped` in the same kernel: bit for bit what [`dropout_slice`] makes
/// of `output`, without that launch and its pass reading `output` back.
#[allow(clippy::too_many_arguments)]
pub fn softmax_forward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    input: &Handle,
    mask: SoftmaxMask<'_>,
    output: &Handle,
    dropout: Option<(DropoutDraw, &Handle)>,
    shape: ScoresShape,
    scale: f32,
) {
    if shape.is_empty() {
        return;
    }
    check_elements(shape.len(), "a softmax");
    if matches!(mask, SoftmaxMask::Causal) {
        assert!(
            shape.sq <= shape.sk,
            "causal softmax needs sq ≤ sk, got {shape:?}"
        );
    }
    let (mask, padded) = match mask {
        // The causal kernel never reads `mask`: bind the input's buffer in its place rather
        // than uploading a dummy on every call.
        SoftmaxMask::Causal => (arg(input, 1), false),
        SoftmaxMask::Padding(m) => (arg(m, shape.batch * shape.sq * shape.sk), true),
    };
    // Without a draw `dropped` is never written: the output's buffer stands in.
    let (draw, dropped) = dropout.unwrap_or((NO_DRAW, output));
    softmax::masked_softmax_forward::launch::<F, f32>(
        client,
        launch.cube_count(shape.rows()),
        launch.cube_dim(),
        launch.vector_size::<F>(client, shape.sk),
        arg(input, shape.len()),
        mask,
        arg(output, shape.len()),
        arg(dropped, shape.len()),
        draw.key_lo,
        draw.key_hi,
        draw.threshold,
        draw.scale,
        scale,
        shape.rows() as u32,
        shape.heads as u32,
        shape.sq as u32,
        shape.sk as u32,
        !padded,
        padded,
        dropout.is_some(),
        launch.lanes,
        launch.rows_per_cube,
        launch.plane_reduce,
    );
}

/// `grad_input = scale · y ⊙ (dy − Σ dy ⊙ y)` per row of `sk` (both softmaxes' backward).
/// With `dropout`, `grad_output` is the gradient of the dropped output, taken back through
/// the dropout by that draw in the same kernel: bit for bit [`dropout_slice`] then this.
#[allow(clippy::too_many_arguments)]
pub fn softmax_backward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    output: &Handle,
    grad_output: &Handle,
    grad_input: &Handle,
    rows: usize,
    sk: usize,
    scale: f32,
    dropout: Option<DropoutDraw>,
) {
    if rows * sk == 0 {
        return;
    }
    check_elements(rows * sk, "a softmax");
    let draw = dropout.unwrap_or(NO_DRAW);
    softmax::softmax_backward::launch::<F, f32>(
        client,
        launch.cube_count(rows),
        launch.cube_dim(),
        launch.vector_size::<F>(client, sk),
        arg(output, rows * sk),
        arg(grad_output, rows * sk),
        arg(grad_input, rows * sk),
        draw.key_lo,
        draw.key_hi,
        draw.threshold,
        draw.scale,
        scale,
        rows as u32,
        sk as u32,
        dropout.is_some(),
        launch.lanes,
        launch.rows_per_cube,
        launch.plane_reduce,
    );
}

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

/// Element-wise launches index with 32 bits.
fn check_elements(len: usize, what: &str) {
    assert!(len <= u32::MAX as usize, "{what} of more than 2³² elements");
}

/// The vector size of an element-wise kernel over rows of `hidden` elements of `F` (a bias's
/// rows, or the whole tensor): the widest vector `client` loads in one instruction that
/// divides `hidden`, or 1 with `FERROTRON_ROW_VECTORS=0` (as [`RowLaunch::vectorized`]).
fn element_vector_size<F: CubeElement>(client: &Client, hidden: usize) -> usize {
    if crate::rows::vectors_on() {
        crate::rows::widest_vector::<F>(client, hidden)
    } else {
        1
    }
}

/// The greatest common divisor of `a` and `b` (`gcd(0, b) = b`).
fn gcd(a: usize, b: usize) -> usize {
    if a == 0 {
        b
    } else {
        gcd(b % a, a)
    }
}

/// A bias broadcast over rows: the buffer and the row length (`hidden` elements).
pub type RowBias<'a> = Option<(&'a Handle, usize)>;

/// The bias argument of an element-wise kernel over `len` elements: the bias, or (never read)
/// the input in its place; and the row length (the whole tensor without a bias).
fn bias_arg(input: &Handle, bias: RowBias<'_>, len: usize) -> (BufferArg, u32) {
    match bias {
        Some((b, hidden)) => {
            assert!(
                hidden > 0 && len.is_multiple_of(hidden),
                "{len} elements in rows of {hidden}"
            );
            (arg(b, hidden), hidden as u32)
        }
        None => (arg(input, 1), len as u32),
    }
}

/// GELU forward of `len` elements plus an optional bias over rows: exact, or the tanh
/// approximation with `tanh`.
pub fn gelu_forward<F: Float + CubeElement>(
    client: &Client,
    input: &Handle,
    bias: RowBias<'_>,
    output: &Handle,
    len: usize,
    tanh: bool,
) {
    if len == 0 {
        return;
    }
    check_elements(len, "GELU");
    let (bias_arg, hidden) = bias_arg(input, bias, len);
    let vector = element_vector_size::<F>(client, hidden as usize);
    gelu::gelu_forward::launch::<F, f32>(
        client,
        cube_count((len / vector).div_ceil(gelu::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(gelu::UNITS_PER_CUBE),
        vector,
        arg(input, len),
        bias_arg,
        arg(output, len),
        len as u32,
        hidden,
        tanh,
        bias.is_some(),
    );
}

/// GELU backward: `grad_input` from the forward's input (and bias) and `grad_output`.
pub fn gelu_backward<F: Float + CubeElement>(
    client: &Client,
    input: &Handle,
    bias: RowBias<'_>,
    grad_output: &Handle,
    grad_input: &Handle,
    len: usize,
    tanh: bool,
) {
    if len == 0 {
        return;
    }
    check_elements(len, "GELU");
    let (bias_arg, hidden) = bias_arg(input, bias, len);
    let vector = element_vector_size::<F>(client, hidden as usize);
    gelu::gelu_backward::launch::<F, f32>(
        client,
        cube_count((len / vector).div_ceil(gelu::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(gelu::UNITS_PER_CUBE),
        vector,
        arg(input, len),
        bias_arg,
        arg(grad_output, len),
        arg(grad_input, len),
        len as u32,
        hidden,
        tanh,
        bias.is_some(),
    );
}

/// Blocks of [`grad_norm_and_clip`]'s scratch for a buffer of `len` elements.
pub fn grad_norm_blocks(len: usize) -> usize {
    len.div_ceil(grad_norm::BLOCK).max(1)
}

/// The L2 norm of `len` f32 gradients into `norm` and the clipping coefficient `min(1,
/// max_norm / (norm + 1e-6))` into `clip` (1 when `max_norm` is 0), through `partials`
/// ([`grad_norm_blocks`] elements): two launches, an order fixed by `len` and the launch.
pub fn grad_norm_and_clip(
    client: &Client,
    launch: RowLaunch,
    grads: &Handle,
    partials: &Handle,
    [norm, clip]: [&Handle; 2],
    len: usize,
    max_norm: f32,
) {
    check_elements(len, "a gradient norm");
    let blocks = grad_norm_blocks(len);
    grad_norm::block_sums_of_squares::launch(
        client,
        cube_count(blocks),
        CubeDim::new_1d(launch.lanes),
        element_vector_size::<f32>(client, len.max(1)),
        arg(grads, len.max(1)),
        arg(partials, blocks),
        len as u32,
        launch.lanes,
    );
    grad_norm::norm_and_clip::launch(
        client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(launch.lanes),
        arg(partials, blocks),
        arg(norm, 1),
        arg(clip, 1),
        blocks as u32,
        max_norm,
        launch.lanes,
    );
}

/// `output = residual + dropout(input + bias)` of `len` elements, the bias (`hidden`
/// elements, broadcast over rows) optional, the draw optional (none: nothing dropped), the
/// tensors holding `slice` of the draw ([`dropout_slice`]'s).
#[allow(clippy::too_many_arguments)]
pub fn bias_dropout_add<F: Float + CubeElement>(
    client: &Client,
    [residual, input]: [&Handle; 2],
    bias: Option<&Handle>,
    output: &Handle,
    len: usize,
    hidden: usize,
    draw: Option<DropoutDraw>,
    slice: DrawSlice,
) {
    if len == 0 {
        return;
    }
    let rows = len.div_ceil(slice.own as usize) as u64;
    assert!(
        len <= u32::MAX as usize && rows * u64::from(slice.row.max(slice.own)) <= 1 << 32,
        "dropout of a draw of more than 2³² elements"
    );
    assert!(
        hidden > 0 && len.is_multiple_of(hidden),
        "{len} elements in rows of {hidden}"
    );
    let d = draw.unwrap_or(NO_DRAW);
    let vector = element_vector_size::<F>(client, hidden);
    dropout::bias_dropout_add::launch::<F>(
        client,
        cube_count((len / vector).div_ceil(dropout::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(dropout::UNITS_PER_CUBE),
        vector,
        arg(residual, len),
        arg(input, len),
        // Without a bias the kernel never reads it: bind the input in its place.
        bias.map_or_else(|| arg(input, 1), |b| arg(b, hidden)),
        arg(output, len),
        d.key_lo,
        d.key_hi,
        d.threshold,
        d.scale,
        len as u32,
        hidden as u32,
        slice.own,
        slice.row,
        slice.first,
        bias.is_some(),
        draw.is_some(),
        slice.is_whole(),
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

/// The layout of a fused QKV projection's output `[batch, seq, groups · (per_group + 2) ·
/// head_dim]` and of the per-head tensors `[batch, groups · per_group, seq, head_dim]` it is
/// split into ([`heads`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QkvLayout {
    /// Batch.
    pub batch: usize,
    /// Positions.
    pub seq: usize,
    /// Key/value heads (query groups).
    pub groups: usize,
    /// Query heads per group.
    pub per_group: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl QkvLayout {
    /// Query heads.
    pub fn heads(&self) -> usize {
        self.groups * self.per_group
    }

    /// Elements of one per-head tensor.
    pub fn head_len(&self) -> usize {
        self.batch * self.heads() * self.seq * self.head_dim
    }

    /// Elements of the mixed rows.
    pub fn mixed_len(&self) -> usize {
        self.batch * self.seq * self.groups * (self.per_group + 2) * self.head_dim
    }
}

/// Queries, keys and values (`[query, key, value]`, each [`QkvLayout::head_len`]) from the
/// fused projection's `mixed` rows, keys and values repeated per query head.
pub fn qkv_split<F: Float + CubeElement>(
    client: &Client,
    mixed: &Handle,
    [query, key, value]: [&Handle; 3],
    layout: QkvLayout,
) {
    let len = layout.head_len();
    if len == 0 {
        return;
    }
    check_elements(layout.mixed_len(), "QKV split");
    let vector = element_vector_size::<F>(client, layout.head_dim);
    heads::qkv_split::launch::<F>(
        client,
        cube_count((len / vector).div_ceil(heads::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(heads::UNITS_PER_CUBE),
        vector,
        arg(mixed, layout.mixed_len()),
        arg(query, len),
        arg(key, len),
        arg(value, len),
        (len / vector) as u32,
        layout.seq as u32,
        layout.heads() as u32,
        layout.per_group as u32,
        (layout.head_dim / vector) as u32,
    );
}

/// The gradient of [`qkv_split`]'s `mixed` rows from its outputs' gradients (a group's
/// repeated keys and values summed).
pub fn qkv_merge<F: Float + CubeElement>(
    client: &Client,
    [grad_query, grad_key, grad_value]: [&Handle; 3],
    grad_mixed: &Handle,
    layout: QkvLayout,
) {
    let (len, head_len) = (layout.mixed_len(), layout.head_len());
    if len == 0 {
        return;
    }
    check_elements(len, "QKV merge");
    let vector = element_vector_size::<F>(client, layout.head_dim);
    heads::qkv_merge::launch::<F, f32>(
        client,
        cube_count((len / vector).div_ceil(heads::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(heads::UNITS_PER_CUBE),
        vector,
        arg(grad_query, head_len),
        arg(grad_key, head_len),
        arg(grad_value, head_len),
        arg(grad_mixed, len),
        (len / vector) as u32,
        layout.seq as u32,
        layout.heads() as u32,
        layout.per_group as u32,
        (layout.head_dim / vector) as u32,
    );
}

/// SwiGLU forward: `output = silu(gate) ⊙ up`, `len` elements each.
pub fn swiglu_forward<F: Float + CubeElement>(
    client: &Client,
    gate: &Handle,
    up: &Handle,
    output: &Handle,
    len: usize,
) {
    if len == 0 {
        return;
    }
    check_elements(len, "SwiGLU");
    let vector = element_vector_size::<F>(client, len);
    swiglu::swiglu_forward::launch::<F, f32>(
        client,
        cube_count((len / vector).div_ceil(swiglu::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(swiglu::UNITS_PER_CUBE),
        vector,
        arg(gate, len),
        arg(up, len),
        arg(output, len),
        len as u32,
    );
}

/// SwiGLU backward: `grad_gate` and `grad_up` from the forward's inputs and `grad_output`.
pub fn swiglu_backward<F: Float + CubeElement>(
    client: &Client,
    gate: &Handle,
    up: &Handle,
    grad_output: &Handle,
    grads: [&Handle; 2],
    len: usize,
) {
    if len == 0 {
        return;
    }
    check_elements(len, "SwiGLU");
    let [grad_gate, grad_up] = grads;
    let vector = element_vector_size::<F>(client, len);
    swiglu::swiglu_backward::launch::<F, f32>(
        client,
        cube_count((len / vector).div_ceil(swiglu::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(swiglu::UNITS_PER_CUBE),
        vector,
        arg(gate, len),
        arg(up, len),
        arg(grad_output, len),
        arg(grad_gate, len),
        arg(grad_up, len),
        len as u32,
    );
}

/// The angles of a rotary embedding and how its pairs are laid out.
#[derive(Clone, Copy, Debug)]
pub struct RotaryTables<'a> {
    /// `cos` of each angle (f32, `[positions, rotary_dim / 2]`: a row per position, a column
    /// per rotated pair).
    pub cos: &'a Handle,
    /// `sin` of each angle, laid out as `cos`.
    pub sin: &'a Handle,
    /// Positions (rows) the tables hold.
    pub positions: usize,
    /// Channels of each head that are rotated (even, at most the head's width; the rest are
    /// copied).
    pub rotary_dim: usize,
    /// Pairs `(2i, 2i + 1)` instead of `(i, i + rotary_dim / 2)`.
    pub interleaved: bool,
}

/// Rotary embedding of `input` (`[batch · heads, seq, head_dim]`, as [`AttentionShape`]):
/// sequence position `s` turned by the angles of table row `offset + s`, or with `inverse`
/// turned back (the backward, on the output's gradient).
pub fn rotary_embedding<F: Float + CubeElement>(
    client: &Client,
    input: &Handle,
    output: &Handle,
    shape: AttentionShape,
    tables: RotaryTables<'_>,
    offset: usize,
    inverse: bool,
) {
    if shape.is_empty() {
        return;
    }
    let r = tables.rotary_dim;
    assert!(
        r > 0 && r.is_multiple_of(2) && r <= shape.head_dim,
        "rotary embedding of {r} channels of heads {} wide",
        shape.head_dim
    );
    assert!(
        offset + shape.seq <= tables.positions,
        "rotary tables of {} positions for positions {offset}..{}",
        tables.positions,
        offset + shape.seq
    );
    let len = shape.len();
    check_elements(len, "a rotary embedding");
    let angles = tables.positions * r / 2;
    // A vector stays within one half of a head's rotated channels (interleaved pairs would
    // need their lanes swapped: one element per unit there).
    let vector = if tables.interleaved {
        1
    } else {
        element_vector_size::<F>(client, gcd(r / 2, shape.head_dim))
    };
    rotary::rotary_embedding::launch::<F, f32>(
        client,
        cube_count((len / vector).div_ceil(rotary::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(rotary::UNITS_PER_CUBE),
        vector,
        arg(input, len),
        arg(tables.cos, angles),
        arg(tables.sin, angles),
        arg(output, len),
        (len / vector) as u32,
        shape.seq as u32,
        shape.head_dim as u32,
        r as u32,
        offset as u32,
        tables.interleaved,
        inverse,
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
        let rows = RowLaunch::for_client(client);
        softmax_forward::<F>(client, rows, h, SoftmaxMask::Causal, h, None, shape, 1.0);
        softmax_backward::<F>(client, rows, h, h, h, 1, 1, 1.0, None);
        layer_norm_forward::<F>(client, rows, h, h, h, h, h, h, 1, 1, 1e-5);
        layer_norm_backward::<F>(client, rows, h, h, h, h, h, h, h, h, 1, 1);
        rms_norm_forward::<F>(client, rows, h, h, h, h, 1, 1, 1e-5);
        rms_norm_backward::<F>(client, rows, h, h, h, h, h, h, 1, 1);
        swiglu_forward::<F>(client, h, h, h, 1);
        swiglu_backward::<F>(client, h, h, h, [h, h], 1);
        for tanh in [false, true] {
            gelu_forward::<F>(client, h, None, h, 1, tanh);
            gelu_backward::<F>(client, h, None, h, h, 1, tanh);
        }
        let heads = AttentionShape {
            heads: 1,
            seq: 1,
            head_dim: 1,
        };
        let (q, o) = (
            AttentionInputs {
                query: h,
                key: h,
                value: h,
            },
            h,
        );
        let tiles = AttentionLaunch::for_client(client, 1);
        flash_attention_forward::<F>(client, tiles, q, o, h, heads, 1.0, None);
        flash_attention_backward::<F>(client, tiles, q, o, h, h, [h, h, h], h, heads, 1.0, None);
        let tables = RotaryTables {
            cos: h,
            sin: h,
            positions: 1,
            rotary_dim: 2,
            interleaved: false,
        };
        let rotary_shape = AttentionShape {
            head_dim: 2,
            ..heads
        };
        rotary_embedding::<F>(client, h, h, rotary_shape, tables, 0, false);
    }
    all::<half::f16>(client, h);
    all::<half::bf16>(client, h);
}

/// A dropout draw: its key and the drop probability, as the kernel takes them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutDraw {
    /// Low 32 bits of the draw's key.
    pub key_lo: u32,
    /// High 32 bits of the draw's key.
    pub key_hi: u32,
    /// Elements whose bits are below this are dropped (`p · 2³²`).
    pub threshold: u32,
    /// What kept elements are multiplied by (`1 / (1 − p)`).
    pub scale: f32,
}

/// The scalars a kernel without a draw is given (it never reads them).
const NO_DRAW: DropoutDraw = DropoutDraw {
    key_lo: 0,
    key_hi: 0,
    threshold: 0,
    scale: 1.0,
};

/// Which elements of a draw a tensor holds: runs of `own` elements starting at `first` in
/// rows of `row` (a sequence-parallel rank's chunk of the whole sequence's mask), or all of
/// it ([`DrawSlice::whole`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrawSlice {
    /// Elements per run.
    pub own: u32,
    /// Draw elements per row (0 for a whole tensor: one run).
    pub row: u32,
    /// The run's first element within its row.
    pub first: u32,
}

impl DrawSlice {
    /// A tensor of `len` elements that is the whole draw.
    pub fn whole(len: usize) -> Self {
        Self {
            own: len.clamp(1, u32::MAX as usize) as u32,
            row: 0,
            first: 0,
        }
    }

    /// Whether the tensor is the whole draw from its start (element `i` is draw element `i`;
    /// the kernels compile that case without the slice's arithmetic).
    pub fn is_whole(&self) -> bool {
        self.row == 0 && self.first == 0
    }

    /// Chunk `rank` of `parts` equal chunks along dimension 1 of the draw's tensor, a chunk
    /// holding `own` elements of each row (its part of dimension 1 times the dimensions after
    /// it).
    pub fn chunk(own: usize, parts: usize, rank: usize) -> Self {
        assert!(
            own * parts <= u32::MAX as usize,
            "a draw of more than 2³² elements"
        );
        Self {
            own: own.max(1) as u32,
            row: (own * parts) as u32,
            first: (own * rank) as u32,
        }
    }
}

/// `output = input ⊙ mask` of `len` elements for `draw` (dropout's forward, and its
/// backward on the output's gradient with the same draw).
pub fn dropout<F: Float + CubeElement>(
    client: &Client,
    input: &Handle,
    output: &Handle,
    len: usize,
    draw: DropoutDraw,
) {
    dropout_slice::<F>(client, input, output, len, draw, DrawSlice::whole(len));
}

/// [`dropout`] of a tensor that holds `slice` of the draw.
pub fn dropout_slice<F: Float + CubeElement>(
    client: &Client,
    input: &Handle,
    output: &Handle,
    len: usize,
    draw: DropoutDraw,
    slice: DrawSlice,
) {
    if len == 0 {
        return;
    }
    let rows = len.div_ceil(slice.own as usize) as u64;
    assert!(
        len <= u32::MAX as usize && rows * u64::from(slice.row.max(slice.own)) <= 1 << 32,
        "dropout of a draw of more than 2³² elements"
    );
    let vector = element_vector_size::<F>(client, len);
    dropout::dropout::launch::<F>(
        client,
        cube_count((len / vector).div_ceil(dropout::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(dropout::UNITS_PER_CUBE),
        vector,
        arg(input, len),
        arg(output, len),
        draw.key_lo,
        draw.key_hi,
        draw.threshold,
        draw.scale,
        len as u32,
        slice.own,
        slice.row,
        slice.first,
        slice.is_whole(),
    );
}

/// The shape of fused attention's `[batch · heads, seq, head_dim]` tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Batch × heads.
    pub heads: usize,
    /// Sequence length (queries and keys).
    pub seq: usize,
    /// Width of a head.
    pub head_dim: usize,
}

impl AttentionShape {
    /// Query (or key) rows in all.
    pub fn rows(&self) -> usize {
        self.heads * self.seq
    }

    /// Elements of one of q, k, v, o.
    pub fn len(&self) -> usize {
        self.rows() * self.head_dim
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn check(&self, dropout: Option<DropoutDraw>) {
        assert!(
            self.len() <= u32::MAX as usize,
            "fused attention of more than 2³² elements: {self:?}"
        );
        if dropout.is_some() {
            assert!(
                self.rows() as u128 * self.seq as u128 <= u32::MAX as u128,
                "dropout inside attention indexes the probabilities with 32 bits: {self:?}"
            );
        }
    }
}

/// The query, key and value buffers of fused attention (`[batch · heads, seq, head_dim]`).
#[derive(Clone, Copy, Debug)]
pub struct AttentionInputs<'a> {
    /// Queries.
    pub query: &'a Handle,
    /// Keys.
    pub key: &'a Handle,
    /// Values.
    pub value: &'a Handle,
}

/// Dropout's kernel arguments for an optional draw: key, threshold, scale, and whether to
/// drop at all.
fn draw_args(dropout: Option<DropoutDraw>) -> (u32, u32, u32, f32, bool) {
    match dropout {
        Some(d) => (d.key_lo, d.key_hi, d.threshold, d.scale, true),
        None => (0, 0, 0, 1.0, false),
    }
}

/// The launch shape of fused attention: `block` rows of one head per cube. With tiles
/// ([`attention`], GPUs and cubecl-cpu) one unit per 4 × 4 micro-tile, walking the other side
/// in tiles of `block` rows kept in shared memory; with planes ([`attention_planes`], lavapipe)
/// one plane per cube, each unit holding `block / plane` rows, the other side's rows passed
/// round the plane by broadcast.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionLaunch {
    /// Rows per cube (and, with tiles, per tile).
    pub block: u32,
    /// Whether the tiled kernels' loops over a head row are unrolled, which keeps a unit's
    /// rows in registers on a GPU. Not on CPU runtimes: there it multiplies the shader
    /// compile time (≈ 21 s for a 128-wide head on lavapipe) for no measured gain.
    pub unroll: bool,
    /// The plane width of the plane layout (`block` a multiple of it), or `None` for tiles.
    pub plane: Option<u32>,
}

impl AttentionLaunch {
    /// The blocks tried, largest first: 64 rows (two warps) where shared memory allows.
    const BLOCKS: [u32; 4] = [64, 32, 16, 8];

    /// The widest head the plane layout is chosen for by default.
    const PLANE_HEAD_DIM: usize = 64;

    /// The largest block whose tiles fit `client`'s shared memory for heads of `head_dim`
    /// (the smallest on runtimes without planes), unrolled on devices with warp-wide planes
    /// (GPUs); on a CPU Vulkan device (lavapipe) the plane layout with two rows per unit,
    /// for heads of up to 64.
    /// `FERROTRON_ATTENTION_BLOCK` (8, 16, 32 or 64), `FERROTRON_ATTENTION_UNROLL` (0 or 1)
    /// and `FERROTRON_ATTENTION_LAYOUT` (`tiles` or `planes`) override them, for tuning a
    /// device.
    pub fn for_client(client: &Client, head_dim: usize) -> Self {
        let hardware = &client.properties().hardware;
        let mut launch = Self::fitting(hardware.max_shared_memory_size, head_dim);
        launch.unroll = hardware.plane_size_max >= 32;
        // cubecl-cpu (no planes) runs a cube's units in lockstep at its barriers: 256 units
        // took it 14 s for one position, 4 units 0.4 s.
        if hardware.plane_size_max <= 1 {
            launch.block = Self::BLOCKS[3];
        }
        let vector_unit = crate::rows::vector_unit_plane(client);
        let env = |name: &str| std::env::var(name).ok();
        let number = |name: &str| env(name).and_then(|v| v.parse::<u32>().ok());
        // The plane kernels are unrolled over the head row: lavapipe compiles them in ≈ 22 s
        // for heads of 64 (once per process) and ≈ 70 s for 128, so wider heads keep tiles.
        let planes = match env("FERROTRON_ATTENTION_LAYOUT").as_deref() {
            Some("tiles") => None,
            Some("planes") => Some(hardware.plane_size_min.max(1)),
            _ => vector_unit.filter(|_| head_dim <= Self::PLANE_HEAD_DIM),
        };
        if let Some(plane) = planes {
            launch = Self::planes(plane, 2 * plane);
        }
        if let Some(block) =
            number("FERROTRON_ATTENTION_BLOCK").filter(|b| Self::BLOCKS.contains(b))
        {
            // The plane layout's block is whole planes.
            let plane = launch.plane.unwrap_or(1);
            launch.block = (block / plane).max(1) * plane;
        }
        if let Some(unroll) = number("FERROTRON_ATTENTION_UNROLL") {
            launch.unroll = unroll != 0;
        }
        launch
    }

    /// The plane layout: one plane of `plane` units per cube of `block` rows.
    pub fn planes(plane: u32, block: u32) -> Self {
        assert!(
            plane > 0 && block.is_multiple_of(plane),
            "attention block of {block} rows in planes of {plane}"
        );
        Self {
            block,
            unroll: false,
            plane: Some(plane),
        }
    }

    /// The largest block whose tiles take at most `shared_bytes` for heads of `head_dim`
    /// (the smallest block where none does: the launch then fails with the runtime's error),
    /// not unrolled.
    pub fn fitting(shared_bytes: usize, head_dim: usize) -> Self {
        let plain = |block| Self {
            block,
            unroll: false,
            plane: None,
        };
        Self::BLOCKS
            .map(plain)
            .into_iter()
            .find(|launch| launch.shared_bytes(head_dim) <= shared_bytes)
            .unwrap_or(plain(Self::BLOCKS[3]))
    }

    /// Shared memory of the largest of the kernels (the key kernel's, f32 tiles): four
    /// `block × head_dim` tiles and two `block × block` ones (rows of quads, padded by one
    /// quad) and two row statistics.
    pub fn shared_bytes(&self, head_dim: usize) -> usize {
        let b = self.block as usize;
        let row = 4 * (head_dim.div_ceil(4) + 1);
        4 * (4 * b * row + 2 * b * (b + 4) + 2 * b)
    }

    /// Units per cube: one per 4 × 4 micro-tile of a `block × block` tile, or one plane.
    pub fn units(&self) -> u32 {
        match self.plane {
            Some(plane) => plane,
            None => (self.block / 4) * (self.block / 4),
        }
    }

    fn cube_dim(&self) -> CubeDim {
        CubeDim::new_1d(self.units())
    }

    fn cube_count(&self, shape: AttentionShape) -> CubeCount {
        cube_count(shape.heads * shape.seq.div_ceil(self.block as usize))
    }
}

/// Launches an attention kernel on `$buffers`, with the shape's, scale's and dropout draw's
/// scalars after them: `$tiles` in the tiled layout, `$planes` in the plane layout (the two
/// kernels take the same arguments but for the layout's own, the last ones).
/// The vector size the attention kernels read and write head rows in: the widest the device
/// loads in one instruction that divides `head_dim` and a quad of 4 (the tiles' unit), or 1
/// with `FERROTRON_ROW_VECTORS=0`.
fn attention_vector_size<F: CubeElement>(client: &Client, head_dim: usize) -> usize {
    element_vector_size::<F>(client, gcd(head_dim, 4))
}

macro_rules! launch_attention {
    ($client:expr, $launch:expr, $shape:expr, $scale:expr, $dropout:expr;
     [$($buffer:expr),+ $(,)?], $tiles:path, $planes:path) => {{
        let (key_lo, key_hi, threshold, keep_scale, drop) = draw_args($dropout);
        macro_rules! with_layout {
            ($kernel:path, $first:expr, $second:expr) => {{
                use $kernel as kernel;
                kernel::launch::<F, f32>(
                    $client,
                    $launch.cube_count($shape),
                    $launch.cube_dim(),
                    attention_vector_size::<F>($client, $shape.head_dim),
                    $($buffer),+,
                    $scale,
                    $shape.heads as u32,
                    $shape.seq as u32,
                    key_lo,
                    key_hi,
                    threshold,
                    keep_scale,
                    $shape.head_dim as u32,
                    drop,
                    $first,
                    $second,
                )
            }};
        }
        match $launch.plane {
            None => with_layout!($tiles, $launch.block, $launch.unroll),
            Some(plane) => with_layout!($planes, plane, $launch.block / plane),
        }
    }};
}

/// Fused causal attention forward: `output = dropout(softmax(scale · q kᵀ)) v` per head, and
/// the per-row log-sum-exp of the scaled scores (`logsumexp`, f32, one per query row) that
/// the backward needs. Nothing of size `seq × seq` is stored.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_forward<F: Float + CubeElement>(
    client: &Client,
    launch: AttentionLaunch,
    inputs: AttentionInputs<'_>,
    output: &Handle,
    logsumexp: &Handle,
    shape: AttentionShape,
    scale: f32,
    dropout: Option<DropoutDraw>,
) {
    if shape.is_empty() {
        return;
    }
    shape.check(dropout);
    let (n, rows) = (shape.len(), shape.rows());
    let (q, k, v) = (inputs.query, inputs.key, inputs.value);
    launch_attention!(
        client, launch, shape, scale, dropout;
        [arg(q, n), arg(k, n), arg(v, n), arg(output, n), arg(logsumexp, rows)],
        attention::flash_attention_forward,
        attention_planes::plane_attention_forward
    );
}

/// Fused causal attention backward: `[grad_query, grad_key, grad_value]` from the forward's
/// inputs, `output` and `logsumexp`, and `grad_output`; `delta` (f32, one per query row) is
/// scratch. The same `dropout` draw as the forward re-derives its mask.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward<F: Float + CubeElement>(
    client: &Client,
    launch: AttentionLaunch,
    inputs: AttentionInputs<'_>,
    output: &Handle,
    grad_output: &Handle,
    logsumexp: &Handle,
    grads: [&Handle; 3],
    delta: &Handle,
    shape: AttentionShape,
    scale: f32,
    dropout: Option<DropoutDraw>,
) {
    if shape.is_empty() {
        return;
    }
    shape.check(dropout);
    let (n, rows) = (shape.len(), shape.rows());
    let [grad_query, grad_key, grad_value] = grads;
    let (q, k, v) = (inputs.query, inputs.key, inputs.value);
    // `delta` is written by the first kernel and read by the second (the same stream, in
    // order).
    launch_attention!(
        client, launch, shape, scale, dropout;
        [
            arg(q, n),
            arg(k, n),
            arg(v, n),
            arg(output, n),
            arg(grad_output, n),
            arg(logsumexp, rows),
            arg(delta, rows),
            arg(grad_query, n),
        ],
        attention::flash_attention_backward_query,
        attention_planes::plane_attention_backward_query
    );
    launch_attention!(
        client, launch, shape, scale, dropout;
        [
            arg(q, n),
            arg(k, n),
            arg(v, n),
            arg(grad_output, n),
            arg(logsumexp, rows),
            arg(delta, rows),
            arg(grad_key, n),
            arg(grad_value, n),
        ],
        attention::flash_attention_backward_key_value,
        attention_planes::plane_attention_backward_key_value
    );
}

/// The scalars of one Adam step, rounded once to f32 from the optimizer's f64 values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamScalars {
    /// β₁.
    pub beta1: f32,
    /// 1 − β₁.
    pub one_minus_beta1: f32,
    /// β₂.
    pub beta2: f32,
    /// 1 − β₂.
    pub one_minus_beta2: f32,
    /// Bias correction of the first moment, 1 − β₁ᵗ.
    pub correction1: f32,
    /// Bias correction of the second moment, 1 − β₂ᵗ.
    pub correction2: f32,
    /// ε.
    pub eps: f32,
    /// What the parameter is multiplied by before the update: 1 − lr · weight decay.
    pub keep: f32,
    /// Learning rate.
    pub lr: f32,
}

/// One Adam step of a parameter of `len` elements: `output` (`3 · len`) gets the new
/// parameter, first moment and second moment end to end; `moments` is `None` on the first
/// step.
pub fn adam_step<F: Float + CubeElement>(
    client: &Client,
    param: &Handle,
    grad: &Handle,
    moments: Option<(&Handle, &Handle)>,
    output: &Handle,
    len: usize,
    scalars: AdamScalars,
) {
    if len == 0 {
        return;
    }
    assert!(
        3 * len <= u32::MAX as usize,
        "an Adam step of more than 2³² / 3 elements"
    );
    // Without moments the kernel never reads them: bind the gradient in their place.
    let (m, v) = moments.unwrap_or((grad, grad));
    let s = scalars;
    let vector = element_vector_size::<F>(client, len);
    adam::adam_step::launch::<F>(
        client,
        cube_count((len / vector).div_ceil(adam::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(adam::UNITS_PER_CUBE),
        vector,
        arg(param, len),
        arg(grad, len),
        arg(m, len),
        arg(v, len),
        arg(output, 3 * len),
        s.beta1,
        s.one_minus_beta1,
        s.beta2,
        s.one_minus_beta2,
        s.correction1,
        s.correction2,
        s.eps,
        s.keep,
        s.lr,
        len as u32,
        moments.is_none(),
    );
}

/// One in-place Adam step of the elements `start .. start + len` of flat buffers of `total`
/// elements (`param`, `m`, `v` overwritten), the gradient multiplied by the one-element
/// `clip` first.
#[allow(clippy::too_many_arguments)]
pub fn adam_step_in_place<F: Float + CubeElement>(
    client: &Client,
    param: &Handle,
    grad: &Handle,
    (m, v): (&Handle, &Handle),
    clip: &Handle,
    total: usize,
    (start, len): (usize, usize),
    scalars: AdamScalars,
) {
    if len == 0 {
        return;
    }
    assert!(
        start + len <= total && total <= u32::MAX as usize,
        "a flat Adam step of elements {start}..{} in a buffer of {total}",
        start + len
    );
    let s = scalars;
    // A vector that divides both ends of the range (a whole parameter group).
    let vector = element_vector_size::<F>(client, gcd(start, len));
    adam::adam_step_in_place::launch::<F>(
        client,
        cube_count((len / vector).div_ceil(adam::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(adam::UNITS_PER_CUBE),
        vector,
        arg(param, total),
        arg(grad, total),
        arg(m, total),
        arg(v, total),
        arg(clip, 1),
        s.beta1,
        s.one_minus_beta1,
        s.beta2,
        s.one_minus_beta2,
        s.correction1,
        s.correction2,
        s.eps,
        s.keep,
        s.lr,
        start as u32,
        len as u32,
    );
}

/// One source of [`copy_at_offsets`]: `len` elements of `source` to `offset..offset + len`.
#[derive(Clone, Copy, Debug)]
pub struct CopyPiece<'a> {
    /// The elements to copy (at least `len`).
    pub source: &'a Handle,
    /// Where they go in the destination.
    pub offset: usize,
    /// How many.
    pub len: usize,
}

/// Copies every piece into its place in `destination` (`total` elements), four pieces per
/// launch ([`adam::copy_at_offsets`]); the pieces must not overlap. The pieces hold `I`, the
/// destination `O`, and every element is multiplied by `scale` in f32 on the way (exact for
/// `scale` 1): a half-precision model's gradients go into the fp32 buffer, fp16's loss scale
/// can come off in the same pass.
pub fn copy_at_offsets<I: Float + CubeElement, O: Float + CubeElement>(
    client: &Client,
    pieces: &[CopyPiece<'_>],
    destination: &Handle,
    total: usize,
    scale: f32,
) {
    assert!(
        total <= u32::MAX as usize,
        "a flat buffer of {total} elements"
    );
    for piece in pieces {
        assert!(
            piece.offset + piece.len <= total,
            "a copy to elements {}..{} of a buffer of {total}",
            piece.offset,
            piece.offset + piece.len
        );
    }
    for group in pieces.chunks(adam::COPY_SOURCES) {
        if group.iter().all(|p| p.len == 0) {
            continue;
        }
        let units = adam::UNITS_PER_CUBE as usize;
        // An unused slot binds the first source with length 0.
        let slot = |k: usize| {
            group
                .get(k)
                .copied()
                .unwrap_or(CopyPiece { len: 0, ..group[0] })
        };
        let [a, b, c, d] = [slot(0), slot(1), slot(2), slot(3)];
        // A vector that divides every piece's offset and length.
        let common = group.iter().fold(0, |g, p| gcd(gcd(g, p.offset), p.len));
        // Both sides' vectors: the narrower of the widest each dtype moves in one load.
        let v =
            element_vector_size::<I>(client, common).min(element_vector_size::<O>(client, common));
        let cubes: usize = group.iter().map(|p| (p.len / v).div_ceil(units)).sum();
        adam::copy_at_offsets::launch::<I, O>(
            client,
            cube_count(cubes),
            CubeDim::new_1d(adam::UNITS_PER_CUBE),
            v,
            arg(a.source, a.len),
            arg(b.source, b.len),
            arg(c.source, c.len),
            arg(d.source, d.len),
            arg(destination, total),
            (a.offset / v) as u32,
            (b.offset / v) as u32,
            (c.offset / v) as u32,
            (d.offset / v) as u32,
            (a.len / v) as u32,
            (b.len / v) as u32,
            (c.len / v) as u32,
            (d.len / v) as u32,
            scale,
        );
    }
}

/// Raises the counter `slot` of `flags` (a buffer of two `u32`) to `value` once the work
/// queued before on `client`'s stream has run ([`stream_order::signal`]).
pub fn signal(client: &Client, flags: &Handle, slot: u32, value: u32) {
    assert!(slot < 2, "two counters");
    stream_order::signal::launch(
        client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        arg(flags, 2),
        slot,
        value,
    );
}

/// Holds `client`'s stream until the counter `slot` of `flags` reaches `value`
/// ([`stream_order::wait_for`]); `written` (`len` elements of `F`) is the buffer the other
/// stream fills.
pub fn wait_for<F: Float + CubeElement>(
    client: &Client,
    flags: &Handle,
    slot: u32,
    value: u32,
    written: &Handle,
    len: usize,
) {
    assert!(slot < 2, "two counters");
    stream_order::wait_for::launch::<F>(
        client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        arg(flags, 2),
        slot,
        value,
        arg(written, len.max(1)),
    );
}
