//! The launch shape and launchers of the fused attention on matrix units
//! ([`crate::attention_mma`]), and when a device gets them.

use cubecl::features::MmaConfig;
use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::attention::{launch_attention, AttentionInputs, AttentionShape};
use super::dropout::DropoutDraw;
use super::{arg, element_vector_size};
use crate::attention_mma;

/// The launch shape of [`mma_attention_forward`] and [`mma_attention_backward`]: `planes`
/// planes of `plane` units per cube, each plane owning `tile` rows, the matrix unit's
/// `tile × tile × tile` products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaAttention {
    /// The matrix unit's `m = n = k` (16 on NVIDIA's tensor cores, 8 on Mesa's lavapipe).
    pub tile: u32,
    /// Planes per cube: the block of query rows (and of keys per tile) is `planes · tile`.
    pub planes: u32,
    /// Units per plane.
    pub plane: u32,
    /// Units sharing a query row's keys in the forward's softmax: a plane's units over its
    /// rows (`plane / tile`, at least 1), so that none idles.
    pub groups: u32,
}

impl MmaAttention {
    /// The tiles tried, largest first.
    const TILES: [u32; 2] = [16, 8];
    /// Planes per cube tried, most first (64 query rows of 16 on a GPU).
    const PLANES: [u32; 3] = [4, 2, 1];

    /// The launch for heads of `head_dim` stored as `F`, if `client`'s device multiplies `F`
    /// into f32 on matrix units in square tiles that divide `head_dim`, has planes of a
    /// fixed width, and has the shared memory for one plane at least; `None` otherwise (the
    /// tiled or plane kernels then run).
    pub fn for_client<F: Float>(client: &Client, head_dim: usize) -> Option<Self> {
        let properties = client.properties();
        let hardware = &properties.hardware;
        let plane = hardware.plane_size_max;
        if plane == 0 || hardware.plane_size_min != plane {
            return None;
        }
        let storage = F::elem_type_native();
        let accumulator = ElemType::Float(FloatKind::F32);
        let tile = Self::TILES.into_iter().find(|&t| {
            head_dim.is_multiple_of(t as usize)
                && properties.features.matmul.cmma.contains(&MmaConfig {
                    a_type: storage,
                    b_type: storage,
                    cd_type: accumulator,
                    m: t,
                    n: t,
                    k: t,
                })
        })?;
        let storage_bytes = storage.size();
        Self::PLANES
            .into_iter()
            .map(|planes| Self {
                tile,
                planes,
                plane,
                groups: (plane / tile).max(1),
            })
            .find(|launch| {
                launch.shared_bytes(head_dim, storage_bytes) <= hardware.max_shared_memory_size
            })
    }

    /// Query rows per cube (and keys per tile).
    pub fn block(&self) -> u32 {
        self.tile * self.planes
    }

    /// Shared memory of the largest of the kernels, the key kernel's: four `block ×
    /// head_dim` tiles of the storage type (keys, values, queries, output gradients), two
    /// `block × block` products in f32 and two in the storage type, two running `block ×
    /// head_dim` rows in f32 and two f32 row statistics.
    pub fn shared_bytes(&self, head_dim: usize, storage_bytes: usize) -> usize {
        let b = self.block() as usize;
        4 * b * head_dim * storage_bytes
            + 2 * b * b * (4 + storage_bytes)
            + 2 * 4 * b * head_dim
            + 2 * 4 * b
    }

    fn check(&self, shape: AttentionShape) {
        assert!(
            shape.head_dim.is_multiple_of(self.tile as usize),
            "attention heads of {} on matrix tiles of {}",
            shape.head_dim,
            self.tile
        );
    }

    /// The cube count, cube dimension and vector size of a launch for `shape` stored as `F`
    /// (see [`launch_attention!`]): head rows in the widest vectors that divide them, which
    /// the plain tiles of the matrix units take whole (a vector stays in its row).
    fn geometry<F: CubeElement>(
        &self,
        client: &Client,
        shape: AttentionShape,
    ) -> (CubeCount, CubeDim, usize) {
        let vectors = element_vector_size::<F>(client, shape.head_dim);
        let dim = CubeDim::new_1d(self.planes * self.plane);
        (shape.cube_count(self.block()), dim, vectors)
    }
}

/// Fused causal attention forward on matrix units: what
/// [`super::flash_attention_forward`] computes (`output`, and the f32 `logsumexp` per query
/// row the backward reads), with `launch` from [`MmaAttention::for_client`] for `F`.
#[allow(clippy::too_many_arguments)]
pub fn mma_attention_forward<F: Float + CubeElement>(
    client: &Client,
    launch: MmaAttention,
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
    launch.check(shape);
    shape.check(dropout, inputs.first_keys);
    let (n, rows) = (shape.len(), shape.rows());
    let [q, k, v] = inputs.args(n);
    launch_attention!(
        attention_mma::mma_attention_forward,
        client, launch.geometry::<F>(client, shape), shape, scale, dropout, inputs.first_keys;
        [q, k, v, arg(output, n), arg(logsumexp, rows)],
        [launch.tile, launch.planes, launch.groups]
    );
}

/// Fused causal attention backward on matrix units: what [`super::flash_attention_backward`]
/// computes (`[grad_query, grad_key, grad_value]`; `delta`, f32 per query row, is scratch),
/// with `launch` from [`MmaAttention::for_client`] for `F`.
#[allow(clippy::too_many_arguments)]
pub fn mma_attention_backward<F: Float + CubeElement>(
    client: &Client,
    launch: MmaAttention,
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
    launch.check(shape);
    shape.check(dropout, inputs.first_keys);
    let (n, rows) = (shape.len(), shape.rows());
    let [grad_query, grad_key, grad_value] = grads;
    // `delta` is written by the first kernel and read by the second (the same stream, in
    // order).
    let [q, k, v] = inputs.args(n);
    launch_attention!(
        attention_mma::mma_attention_backward_query,
        client, launch.geometry::<F>(client, shape), shape, scale, dropout, inputs.first_keys;
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
        [launch.tile, launch.planes]
    );
    let [q, k, v] = inputs.args(n);
    launch_attention!(
        attention_mma::mma_attention_backward_key_value,
        client, launch.geometry::<F>(client, shape), shape, scale, dropout, inputs.first_keys;
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
        [launch.tile, launch.planes]
    );
}
