//! The fused attention's shapes and launch geometry, and its forward and backward launchers
//! (the tiled layout on GPUs, the plane layout on lavapipe).

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::dropout::{DropoutDraw, NO_DRAW};
use super::salt::{current_salt_buffer, drawn_salt_arg, salt_arg};
use super::{arg, element_vector_size, gcd};
use crate::attention_common::AttentionScalarsLaunch;
use crate::rows::cube_count;
use crate::{attention, attention_planes};

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

    /// One cube per block of `block` rows of each head: the launch grid of every attention
    /// kernel.
    pub(super) fn cube_count(&self, block: u32) -> CubeCount {
        cube_count(self.heads * self.seq.div_ceil(block as usize))
    }

    pub(super) fn check(&self, dropout: Option<DropoutDraw>, first_keys: Option<FirstKeys<'_>>) {
        if let Some(keys) = first_keys {
            assert!(
                keys.batch > 0 && self.heads.is_multiple_of(keys.batch),
                "first keys of {} batch elements for {} heads",
                keys.batch,
                self.heads
            );
        }
        assert!(
            self.len() <= u32::MAX as usize,
            "fused attention of more than 2³² elements: {self:?}"
        );
        if let Some(keys) = first_keys {
            assert!(
                keys.queries_from <= self.seq && keys.draw_seq >= self.seq,
                "queries from {} of {} positions, drawn over {}",
                keys.queries_from,
                self.seq,
                keys.draw_seq
            );
        }
        if let Some(draw) = dropout {
            // A head's probabilities are one run of the draw's slice (`kept` offsets them once).
            let drawn = first_keys.map_or(self.seq, |keys| keys.draw_seq);
            draw.slice
                .check_rows(self.heads * drawn * drawn, drawn * drawn);
        }
    }
}

/// The query, key and value buffers of fused attention (`[batch · heads, seq, head_dim]`),
/// and for packed documents (or a sliding window) the first key each position sees.
#[derive(Clone, Copy, Debug)]
pub struct AttentionInputs<'a> {
    /// Queries.
    pub query: &'a Handle,
    /// Keys.
    pub key: &'a Handle,
    /// Values.
    pub value: &'a Handle,
    /// The first visible keys (`None`: every query sees keys `0..=i`).
    pub first_keys: Option<FirstKeys<'a>>,
}

/// The first key each position of a batch element sees (`u32`, `[batch, seq]`): where its
/// document starts, so that packed documents do not see each other
/// (`--reset-attention-mask`) with no `seq × seq` mask anywhere. Along a row they must not
/// decrease and each must be at most its own position (documents are contiguous and a token
/// sees itself): the kernels skip whole tiles by that, and read nothing else of the mask.
/// The heads of element `b` (`[batch · heads, ..]`, `heads / batch` per element) read row `b`.
#[derive(Clone, Copy, Debug)]
pub struct FirstKeys<'a> {
    /// The `[batch, seq]` first keys.
    pub handle: &'a Handle,
    /// Batch elements (rows).
    pub batch: usize,
    /// Positions before it see no key: a context-parallel chunk's queries are the positions
    /// from it on, those before padding whose outputs are not read (0: every position).
    pub queries_from: usize,
    /// The length of the sequence whose dropout draw the probabilities are part of: `seq`, or
    /// the whole sequence of which a context-parallel chunk's keys are the first `seq`.
    pub draw_seq: usize,
}

impl<'a> FirstKeys<'a> {
    /// The first keys of `batch` elements, every position a query of the sequence itself.
    pub fn of(handle: &'a Handle, batch: usize, seq: usize) -> Self {
        Self {
            handle,
            batch,
            queries_from: 0,
            draw_seq: seq,
        }
    }
}

impl AttentionInputs<'_> {
    /// Queries, keys and values, every query seeing keys `0..=i`.
    pub fn causal<'a>(
        query: &'a Handle,
        key: &'a Handle,
        value: &'a Handle,
    ) -> AttentionInputs<'a> {
        AttentionInputs {
            query,
            key,
            value,
            first_keys: None,
        }
    }

    /// The query, key and value buffers' kernel arguments, `len` elements each.
    pub(super) fn args(&self, len: usize) -> [BufferArg; 3] {
        [self.query, self.key, self.value].map(|handle| arg(handle, len))
    }
}

/// What every attention kernel takes after its buffers but for the head width: its scalars
/// (the shape's, the scale, the draw's key, threshold, keep scale and slice, and the heads
/// per batch element), the salt's binding, the first keys' binding, whether to drop, and
/// whether there are first keys.
pub(super) fn kernel_args(
    client: &Client,
    shape: AttentionShape,
    scale: f32,
    dropout: Option<DropoutDraw>,
    first_keys: Option<FirstKeys<'_>>,
) -> (AttentionScalarsLaunch, BufferArg, BufferArg, bool, bool) {
    let d = dropout.unwrap_or(NO_DRAW);
    let (heads, seq) = (shape.heads as u32, shape.seq as u32);
    let (keys, sample_heads, queries_from, draw_seq) = match first_keys {
        Some(keys) => (
            arg(keys.handle, keys.batch * shape.seq),
            shape.heads / keys.batch,
            keys.queries_from,
            keys.draw_seq,
        ),
        // Never read: the salt's buffer lends the binding.
        None => (arg(&current_salt_buffer(client), 1), 1, 0, shape.seq),
    };
    let scalars = AttentionScalarsLaunch::new(
        scale,
        heads,
        seq,
        d.key_lo,
        d.key_hi,
        d.threshold,
        d.scale,
        d.slice.own,
        d.slice.row,
        d.slice.first,
        sample_heads as u32,
        queries_from as u32,
        draw_seq as u32,
    );
    let salt = salt_binding(client, dropout);
    (scalars, salt, keys, dropout.is_some(), first_keys.is_some())
}

/// The salt's binding of an attention launch (see [`salt_arg`]): without a draw, the salt's
/// buffer as it is (never read; the launch has no buffer handle of its own to lend), looked
/// up only then.
fn salt_binding(client: &Client, dropout: Option<DropoutDraw>) -> BufferArg {
    match dropout {
        Some(draw) => drawn_salt_arg(client, draw),
        None => salt_arg(client, None, &current_salt_buffer(client)),
    }
}

/// Launches the attention kernel `$kernel` (a path) on `$buffers` with `$geometry`, its
/// cube count, cube dimension and vector size, and the first keys `$first_keys`: after the
/// buffers every attention kernel takes the same arguments ([`kernel_args`], then the head
/// width), then its layout's own, `$layout`. For the storage type `F` of the function it is
/// called in.
macro_rules! launch_attention {
    ($kernel:path, $client:expr, $geometry:expr, $shape:expr, $scale:expr, $dropout:expr,
     $first_keys:expr; [$($buffer:expr),+ $(,)?], [$($layout:expr),* $(,)?]) => {{
        use $kernel as kernel;
        let (count, dim, vectors) = $geometry;
        let (scalars, salt, keys, drop, documents) = $crate::launch::attention::kernel_args(
            $client, $shape, $scale, $dropout, $first_keys,
        );
        kernel::launch::<F, f32>(
            $client,
            count,
            dim,
            vectors,
            $($buffer),+,
            scalars,
            salt,
            keys,
            $shape.head_dim as u32,
            drop,
            documents,
            $($layout),*
        )
    }};
}
pub(super) use launch_attention;

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
    /// compile time, worst for wide heads, for no measured gain
    /// (benchmarks/results/2026-11-27-lavapipe-cubecl-cpu-kernel-runtimes.md).
    pub unroll: bool,
    /// The plane width of the plane layout (`block` a multiple of it), or `None` for tiles.
    pub plane: Option<u32>,
    /// Whether the kernels run on the device's matrix units where it has them for the
    /// storage type ([`super::MmaAttention`]) instead of in this launch's layout.
    pub matrix_units: bool,
}

impl AttentionLaunch {
    /// The blocks tried, largest first: 64 rows (two warps) where shared memory allows.
    const BLOCKS: [u32; 4] = [64, 32, 16, 8];

    /// The widest head the plane layout is chosen for by default.
    const PLANE_HEAD_DIM: usize = 64;

    /// The largest block whose tiles fit `client`'s shared memory for heads of `head_dim`
    /// (the smallest on runtimes without planes), unrolled on devices with warp-wide planes
    /// (GPUs); on a CPU Vulkan device (lavapipe) the plane layout with two rows per unit,
    /// for heads of up to 64. The device decides; tuning it is a change to these rules,
    /// measured against the commit before it.
    pub fn for_client(client: &Client, head_dim: usize) -> Self {
        let hardware = &client.properties().hardware;
        let mut launch = Self::fitting(hardware.max_shared_memory_size, head_dim);
        launch.unroll = hardware.plane_size_max >= 32;
        // cubecl-cpu (no planes) runs a cube's units in lockstep at its barriers, so a large
        // cube is many times slower than a small one (measured:
        // benchmarks/results/2026-11-27-lavapipe-cubecl-cpu-kernel-runtimes.md).
        if hardware.plane_size_max <= 1 {
            launch.block = Self::BLOCKS[3];
        }
        // The plane kernels are unrolled over the head row, so lavapipe's compile time (once
        // per process) grows with the head: wider heads than 64 keep tiles (measured:
        // benchmarks/results/2026-11-27-lavapipe-cubecl-cpu-kernel-runtimes.md).
        let planes =
            crate::rows::vector_unit_plane(client).filter(|_| head_dim <= Self::PLANE_HEAD_DIM);
        if let Some(plane) = planes {
            launch = Self::planes(plane, 2 * plane);
        }
        launch.matrix_units = true;
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
            matrix_units: false,
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
            matrix_units: false,
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

    /// The cube count, cube dimension and vector size of a launch for `shape` stored as `F`
    /// (see [`launch_attention!`]).
    fn geometry<F: CubeElement>(
        &self,
        client: &Client,
        shape: AttentionShape,
    ) -> (CubeCount, CubeDim, usize) {
        let vectors = attention_vector_size::<F>(client, shape.head_dim);
        let dim = CubeDim::new_1d(self.units());
        (shape.cube_count(self.block), dim, vectors)
    }
}

/// The vector size the attention kernels read and write head rows in: the widest the device
/// loads in one instruction that divides `head_dim` and a quad of 4 (the tiles' unit), or 1
/// where a benchmark turned vectors off.
fn attention_vector_size<F: CubeElement>(client: &Client, head_dim: usize) -> usize {
    element_vector_size::<F>(client, gcd(head_dim, 4))
}

/// [`launch_attention!`] in `$launch`'s layout: `$tiles` in the tiled layout, `$planes` in
/// the plane layout (the two kernels take the same arguments but for the layout's own, the
/// last ones).
macro_rules! launch_in_layout {
    ($client:expr, $launch:expr, $shape:expr, $scale:expr, $dropout:expr, $first_keys:expr;
     [$($buffer:expr),+ $(,)?], $tiles:path, $planes:path) => {{
        let launch: AttentionLaunch = $launch;
        let geometry = launch.geometry::<F>($client, $shape);
        let (client, shape, scale, dropout) = ($client, $shape, $scale, $dropout);
        match launch.plane {
            None => launch_attention!(
                $tiles, client, geometry, shape, scale, dropout, $first_keys;
                [$($buffer),+], [launch.block, launch.unroll]
            ),
            Some(plane) => launch_attention!(
                $planes, client, geometry, shape, scale, dropout, $first_keys;
                [$($buffer),+], [plane, launch.block / plane]
            ),
        }
    }};
}

/// Fused causal attention forward: `output = dropout(softmax(scale · q kᵀ)) v` per head, and
/// the per-row log-sum-exp of the scaled scores (`logsumexp`, f32, one per query row) that
/// the backward needs. Nothing of size `seq × seq` is stored. On the device's matrix units
/// ([`super::mma_attention_forward`]) where `launch` allows it and the device has them.
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
    if let Some(mma) = matrix_units::<F>(client, launch, shape.head_dim) {
        return super::mma_attention_forward::<F>(
            client, mma, inputs, output, logsumexp, shape, scale, dropout,
        );
    }
    shape.check(dropout, inputs.first_keys);
    let (n, rows) = (shape.len(), shape.rows());
    let [q, k, v] = inputs.args(n);
    launch_in_layout!(
        client, launch, shape, scale, dropout, inputs.first_keys;
        [q, k, v, arg(output, n), arg(logsumexp, rows)],
        attention::flash_attention_forward,
        attention_planes::plane_attention_forward
    );
}

/// The matrix-unit launch for heads of `head_dim` stored as `F` when `launch` allows it and
/// the device has one.
fn matrix_units<F: Float>(
    client: &Client,
    launch: AttentionLaunch,
    head_dim: usize,
) -> Option<super::MmaAttention> {
    launch
        .matrix_units
        .then(|| super::MmaAttention::for_client::<F>(client, head_dim))
        .flatten()
}

/// Which kernels [`flash_attention_forward`] and [`flash_attention_backward`] run with
/// `launch` for heads of `head_dim` stored as `F` on `client`'s device, in words (for the
/// log: the same choice the launchers make).
pub fn attention_kernels_in_words<F: Float>(
    client: &Client,
    launch: AttentionLaunch,
    head_dim: usize,
) -> String {
    if let Some(mma) = matrix_units::<F>(client, launch, head_dim) {
        let t = mma.tile;
        return format!(
            "on matrix units ({t}×{t}×{t} tiles, {} query rows per cube)",
            mma.block()
        );
    }
    match launch.plane {
        Some(plane) => format!("in planes of {plane} ({} rows per cube)", launch.block),
        None => format!(
            "in shared-memory tiles ({} rows per cube{})",
            launch.block,
            if launch.unroll { ", unrolled" } else { "" }
        ),
    }
}

/// Fused causal attention backward: `[grad_query, grad_key, grad_value]` from the forward's
/// inputs, `output` and `logsumexp`, and `grad_output`; `delta` (f32, one per query row) is
/// scratch. The same `dropout` draw as the forward re-derives its mask. On the device's
/// matrix units ([`super::mma_attention_backward`]) where `launch` allows it and the device
/// has them.
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
    if let Some(mma) = matrix_units::<F>(client, launch, shape.head_dim) {
        let (o, dout, lse) = (output, grad_output, logsumexp);
        return super::mma_attention_backward::<F>(
            client, mma, inputs, o, dout, lse, grads, delta, shape, scale, dropout,
        );
    }
    shape.check(dropout, inputs.first_keys);
    let (n, rows) = (shape.len(), shape.rows());
    let [grad_query, grad_key, grad_value] = grads;
    // `delta` is written by the first kernel and read by the second (the same stream, in
    // order).
    let [q, k, v] = inputs.args(n);
    launch_in_layout!(
        client, launch, shape, scale, dropout, inputs.first_keys;
        [
            q,
            k,
            v,
            arg(output, n),
            arg(grad_output, n),
            arg(logsumexp, rows),
            arg(delta, rows),
            arg(grad_query, n),
        ],
        attention::flash_attention_backward_query,
        attention_planes::plane_attention_backward_query
    );
    let [q, k, v] = inputs.args(n);
    launch_in_layout!(
        client, launch, shape, scale, dropout, inputs.first_keys;
        [
            q,
            k,
            v,
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

/// The tiles of `block` rows each cube of a tiled launch for `shape` visits (see
/// [`crate::attention_common::attention_tile_ranges`]): `[key tiles lo, hi, query tiles lo,
/// hi]` per cube, cube by cube through a head's blocks, head by head, into `ranges` (`u32`,
/// four per cube).
pub fn attention_tile_ranges(
    client: &Client,
    shape: AttentionShape,
    first_keys: Option<FirstKeys<'_>>,
    block: u32,
    ranges: &Handle,
) {
    shape.check(None, first_keys);
    let cubes = shape.heads * shape.seq.div_ceil(block as usize);
    let (scalars, _, keys, _, documents) = kernel_args(client, shape, 1.0, None, first_keys);
    crate::attention_common::attention_tile_ranges::launch(
        client,
        shape.cube_count(block),
        CubeDim::new_1d(1),
        scalars,
        keys,
        arg(ranges, 4 * cubes),
        block,
        documents,
    );
}
