//! The fused QKV projection's row layout, and the launchers splitting the rows into heads and
//! merging the heads' gradients back, and moving the core's output between heads and rows.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{arg, bias_arg, check_elements, element_vector_size};
use crate::heads;
use crate::rows::cube_count;

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

    /// Elements of one mixed row (and of the projection's bias).
    pub fn row_width(&self) -> usize {
        self.groups * (self.per_group + 2) * self.head_dim
    }

    /// Elements of the mixed rows.
    pub fn mixed_len(&self) -> usize {
        self.batch * self.seq * self.row_width()
    }
}

/// Queries, keys and values (`[query, key, value]`, each [`QkvLayout::head_len`]) from the
/// fused projection's `mixed` rows, keys and values repeated per query head; with `bias`
/// ([`QkvLayout::row_width`] elements) the projection's bias added to them.
pub fn qkv_split<F: Float + CubeElement>(
    client: &Client,
    mixed: &Handle,
    bias: Option<&Handle>,
    [query, key, value]: [&Handle; 3],
    layout: QkvLayout,
) {
    let len = layout.head_len();
    if len == 0 {
        return;
    }
    check_elements(layout.mixed_len(), "QKV split");
    let vector = element_vector_size::<F>(client, layout.head_dim);
    let (bias_arg, _) = bias_arg(
        mixed,
        bias.map(|b| (b, layout.row_width())),
        layout.mixed_len(),
    );
    heads::qkv_split::launch::<F>(
        client,
        cube_count((len / vector).div_ceil(heads::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(heads::UNITS_PER_CUBE),
        vector,
        arg(mixed, layout.mixed_len()),
        bias_arg,
        arg(query, len),
        arg(key, len),
        arg(value, len),
        (len / vector) as u32,
        layout.seq as u32,
        layout.heads() as u32,
        layout.per_group as u32,
        (layout.head_dim / vector) as u32,
        bias.is_some(),
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

/// The core's output `heads` `[batch, heads, seq, head_dim]` as `rows` `[batch, seq, heads ·
/// head_dim]` (the output projection's input).
pub fn heads_to_rows<F: Float + CubeElement>(
    client: &Client,
    heads: &Handle,
    rows: &Handle,
    layout: QkvLayout,
) {
    swap_heads_and_positions::<F>(client, heads, rows, layout, layout.heads(), layout.seq);
}

/// The inverse of [`heads_to_rows`]: the output projection's input gradient `rows` as the
/// core's per-head `heads`.
pub fn rows_to_heads<F: Float + CubeElement>(
    client: &Client,
    rows: &Handle,
    heads: &Handle,
    layout: QkvLayout,
) {
    swap_heads_and_positions::<F>(client, rows, heads, layout, layout.seq, layout.heads());
}

/// `input` `[batch, outer, inner, head_dim]` into `output` `[batch, inner, outer, head_dim]`.
fn swap_heads_and_positions<F: Float + CubeElement>(
    client: &Client,
    input: &Handle,
    output: &Handle,
    layout: QkvLayout,
    outer: usize,
    inner: usize,
) {
    let len = layout.head_len();
    if len == 0 {
        return;
    }
    check_elements(len, "heads and rows");
    let vector = element_vector_size::<F>(client, layout.head_dim);
    heads::swap_heads_and_positions::launch::<F>(
        client,
        cube_count((len / vector).div_ceil(heads::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(heads::UNITS_PER_CUBE),
        vector,
        arg(input, len),
        arg(output, len),
        (len / vector) as u32,
        outer as u32,
        inner as u32,
        (layout.head_dim / vector) as u32,
    );
}
