//! Launchers of the one-launch column sums ([`crate::columns`]): a bias's gradient, and the
//! norms' parameter gradients.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::salt::salt_arg;
use super::QkvLayout;
use super::{arg, element_vector_size, DropoutDraw};
use crate::columns::{self, GradientTransform, TransformArgsLaunch};
use crate::rows::cube_count;

/// The shape of a column-sum launch: `vectors` column vectors per cube (x) and `row_lanes`
/// units summing the rows of each (y, a power of two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColumnLaunch {
    /// Column vectors per cube.
    pub vectors: u32,
    /// Units per column vector, each summing every `row_lanes`-th row (a power of two).
    pub row_lanes: u32,
}

impl ColumnLaunch {
    /// The shape for `client`'s device. A GPU: one column vector per cube and 256 row lanes,
    /// so that a `[4096, 1024]` bf16 gradient (128 vectors of 8) spreads over 128 cubes of
    /// 256 units, each summing 16 rows, and a warp's load is 32 rows of 16 bytes (a guess
    /// until measured on a GPU). A CPU device (lavapipe, cubecl-cpu), whose barriers are slow
    /// and which has only a few cores to fill: eight column vectors per cube (lavapipe's SIMD
    /// width), each unit walking all the rows, no barrier at all. On lavapipe this shape beat
    /// wider cubes, a tree of row lanes and the GPU's shape on a `[4096, 1024]` f32 sum
    /// (measured: benchmarks/results/2026-11-27-lavapipe-cubecl-cpu-kernel-runtimes.md).
    pub fn for_client(client: &Client) -> Self {
        let properties = client.properties();
        let hardware = &properties.hardware;
        if properties.identity.physical.is_none() || hardware.plane_size_max <= 1 {
            return Self {
                vectors: 8,
                row_lanes: 1,
            };
        }
        let row_lanes = 256u32.min(hardware.max_units_per_cube.max(1));
        Self {
            vectors: 1,
            // A power of two for the tree.
            row_lanes: 1 << row_lanes.ilog2(),
        }
    }

    fn cube_dim(&self) -> CubeDim {
        CubeDim::new_2d(self.vectors, self.row_lanes)
    }
}

/// The gradient of a bias added to every row of `grad_output` (`[rows, cols]`): its column
/// sums into `grad_bias` (`cols`), in `grad_output`'s type, summed in f32.
pub fn bias_gradient<F: Float + CubeElement>(
    client: &Client,
    launch: ColumnLaunch,
    grad_output: &Handle,
    grad_bias: &Handle,
    rows: usize,
    cols: usize,
) {
    let sums = ColumnSums {
        grad_output,
        input: None,
        weighted_sums: None,
        sums: Some(grad_bias),
        transformed: None,
        rows,
        cols,
    };
    sums.launch::<F>(client, launch);
}

/// Bias-dropout-add's backward for `y` and the bias in one launch: `grad_output` (`[rows,
/// cols]`, holding the draw's slice) dropped with `draw`'s mask into `dropped` (bit for bit
/// the dropout kernel's), and its column sums into `grad_bias` (`cols`, summed in f32: those
/// of [`bias_gradient`] on `dropped`).
#[allow(clippy::too_many_arguments)]
pub fn dropped_bias_gradient<F: Float + CubeElement>(
    client: &Client,
    launch: ColumnLaunch,
    grad_output: &Handle,
    dropped: &Handle,
    grad_bias: &Handle,
    rows: usize,
    cols: usize,
    draw: DropoutDraw,
) {
    draw.slice.check_holds(rows * cols);
    let sums = ColumnSums {
        grad_output,
        input: None,
        weighted_sums: None,
        sums: Some(grad_bias),
        transformed: Some(Transformed {
            output: dropped,
            transform: Transform::Dropout(draw),
        }),
        rows,
        cols,
    };
    sums.launch::<F>(client, launch);
}

/// Bias-GELU's backward in one launch: `grad_input = grad_output · gelu'(input + bias)`
/// (`[rows, cols]`; `tanh`: the tanh form), bit for bit the GELU backward kernel's, and its
/// column sums into `grad_bias` (`cols`, summed in f32: those of [`bias_gradient`] on
/// `grad_input`).
#[allow(clippy::too_many_arguments)]
pub fn gelu_bias_gradient<F: Float + CubeElement>(
    client: &Client,
    launch: ColumnLaunch,
    input: &Handle,
    bias: &Handle,
    grad_output: &Handle,
    grad_input: &Handle,
    grad_bias: &Handle,
    rows: usize,
    cols: usize,
    tanh: bool,
) {
    let sums = ColumnSums {
        grad_output,
        input: None,
        weighted_sums: None,
        sums: Some(grad_bias),
        transformed: Some(Transformed {
            output: grad_input,
            transform: Transform::BiasGelu { input, bias, tanh },
        }),
        rows,
        cols,
    };
    sums.launch::<F>(client, launch);
}

/// The QKV projection's gradients in one launch: its rows' gradient `grad_mixed` from the
/// core's per-head gradients (bit for bit the merge kernel's, [`super::qkv_merge`]) and its
/// bias's, their column sums into `grad_bias` ([`QkvLayout::row_width`] elements, summed in
/// f32: those of [`bias_gradient`] on `grad_mixed`).
pub fn qkv_merge_bias_gradient<F: Float + CubeElement>(
    client: &Client,
    launch: ColumnLaunch,
    [grad_query, grad_key, grad_value]: [&Handle; 3],
    grad_mixed: &Handle,
    grad_bias: &Handle,
    layout: QkvLayout,
) {
    super::check_elements(layout.mixed_len(), "QKV merge");
    let sums = ColumnSums {
        grad_output: grad_query,
        input: None,
        weighted_sums: None,
        sums: Some(grad_bias),
        transformed: Some(Transformed {
            output: grad_mixed,
            transform: Transform::QkvMerge {
                grad_key,
                grad_value,
                layout,
            },
        }),
        rows: layout.batch * layout.seq,
        cols: layout.row_width(),
    };
    sums.launch::<F>(client, launch);
}

/// LayerNorm's `grad_gamma = Σ dy ⊙ x̂` and `grad_beta = Σ dy` over the rows, from the
/// forward's `mean` and `rstd` (f32, one per row).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_param_gradients<F: Float + CubeElement>(
    client: &Client,
    launch: ColumnLaunch,
    input: &Handle,
    grad_output: &Handle,
    mean: &Handle,
    rstd: &Handle,
    grad_gamma: &Handle,
    grad_beta: &Handle,
    rows: usize,
    cols: usize,
) {
    let sums = ColumnSums {
        grad_output,
        input: Some(NormInput {
            input,
            mean: Some(mean),
            rstd,
        }),
        weighted_sums: Some(grad_gamma),
        sums: Some(grad_beta),
        transformed: None,
        rows,
        cols,
    };
    sums.launch::<F>(client, launch);
}

/// RMSNorm's `grad_gamma = Σ dy ⊙ x · r` over the rows, from the forward's `rstd` (f32, one
/// per row).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_gamma_gradient<F: Float + CubeElement>(
    client: &Client,
    launch: ColumnLaunch,
    input: &Handle,
    grad_output: &Handle,
    rstd: &Handle,
    grad_gamma: &Handle,
    rows: usize,
    cols: usize,
) {
    let sums = ColumnSums {
        grad_output,
        input: Some(NormInput {
            input,
            mean: None,
            rstd,
        }),
        weighted_sums: Some(grad_gamma),
        sums: None,
        transformed: None,
        rows,
        cols,
    };
    sums.launch::<F>(client, launch);
}

/// A norm's input and its per-row statistics (no `mean` for RMSNorm).
struct NormInput<'a> {
    input: &'a Handle,
    mean: Option<&'a Handle>,
    rstd: &'a Handle,
}

/// What is done to the gradient before it is summed (and stored).
enum Transform<'a> {
    /// Dropped with this draw (the gradient holding its slice).
    Dropout(DropoutDraw),
    /// Multiplied by GELU's slope at `input + bias`.
    BiasGelu {
        input: &'a Handle,
        bias: &'a Handle,
        tanh: bool,
    },
    /// Formed from the core's per-head gradients (the launch's `grad_output` the queries').
    QkvMerge {
        grad_key: &'a Handle,
        grad_value: &'a Handle,
        layout: QkvLayout,
    },
}

impl Transform<'_> {
    fn kind(transform: Option<&Self>) -> GradientTransform {
        match transform {
            None => GradientTransform::None,
            Some(Transform::Dropout(_)) => GradientTransform::Dropout,
            Some(Transform::BiasGelu { tanh: false, .. }) => GradientTransform::BiasGelu,
            Some(Transform::BiasGelu { tanh: true, .. }) => GradientTransform::BiasGeluTanh,
            Some(Transform::QkvMerge { .. }) => GradientTransform::QkvMerge,
        }
    }

    /// The kernel's scalars for this transform (in vectors of `vector`).
    fn args(transform: Option<&Self>, vector: usize) -> TransformArgsLaunch {
        let draw = match transform {
            Some(Transform::Dropout(draw)) => *draw,
            _ => super::dropout::NO_DRAW,
        };
        let slice = draw.slice;
        let layout = match transform {
            Some(Transform::QkvMerge { layout, .. }) => *layout,
            _ => QkvLayout {
                batch: 0,
                seq: 1,
                groups: 1,
                per_group: 1,
                head_dim: vector,
            },
        };
        TransformArgsLaunch::new(
            draw.key_lo,
            draw.key_hi,
            draw.threshold,
            draw.scale,
            slice.own,
            slice.row,
            slice.first,
            slice.is_whole(),
            layout.seq as u32,
            layout.heads() as u32,
            layout.per_group as u32,
            (layout.head_dim / vector) as u32,
        )
    }
}

/// Where the transformed gradient goes, and the transform.
struct Transformed<'a> {
    output: &'a Handle,
    transform: Transform<'a>,
}

/// One [`columns::column_sums`] launch: the sums asked for are the outputs given.
struct ColumnSums<'a> {
    grad_output: &'a Handle,
    input: Option<NormInput<'a>>,
    weighted_sums: Option<&'a Handle>,
    sums: Option<&'a Handle>,
    transformed: Option<Transformed<'a>>,
    rows: usize,
    cols: usize,
}

impl ColumnSums<'_> {
    fn launch<F: Float + CubeElement>(&self, client: &Client, launch: ColumnLaunch) {
        let (rows, cols) = (self.rows, self.cols);
        if rows * cols == 0 {
            return;
        }
        let transform = self.transformed.as_ref().map(|t| &t.transform);
        // The merge's vectors stay within a head.
        let vector = match transform {
            Some(Transform::QkvMerge { layout, .. }) => {
                element_vector_size::<F>(client, layout.head_dim)
            }
            _ => element_vector_size::<F>(client, cols),
        };
        let width = cols / vector;
        let bindings = self.bindings(client, vector);
        let [grad, x, mean, rstd, bias, key, value, weighted, sums, transformed] =
            bindings.each(vector);
        let draw = match transform {
            Some(Transform::Dropout(draw)) => Some(*draw),
            _ => None,
        };
        columns::column_sums::launch::<F, f32>(
            client,
            cube_count(width.div_ceil(launch.vectors as usize)),
            launch.cube_dim(),
            vector,
            grad,
            x,
            mean,
            rstd,
            bias,
            key,
            value,
            weighted,
            sums,
            transformed,
            salt_arg(client, draw, self.grad_output),
            rows as u32,
            cols as u32,
            Transform::args(transform, vector),
            self.weighted_sums.is_some(),
            self.input.as_ref().is_some_and(|i| i.mean.is_some()),
            self.sums.is_some(),
            Transform::kind(transform),
            launch.vectors,
            launch.row_lanes,
        );
    }

    /// Every buffer the kernel binds, with its length in elements. Arguments the launch does
    /// not ask for are never read or written: an input's place is taken by the gradient (bound
    /// read-only twice, as the element-wise kernels' missing bias), an output's by a
    /// one-vector buffer of its own (wgpu refuses a buffer bound both ways in one dispatch).
    fn bindings(&self, client: &Client, vector: usize) -> Bindings<'_> {
        let (rows, cols) = (self.rows, self.cols);
        let len = rows * cols;
        let norm = self.input.as_ref();
        let transform = self.transformed.as_ref().map(|t| &t.transform);
        let unread = (self.grad_output, vector);
        let (mut x, mut bias, mut key, mut value) = (None, None, None, None);
        let mut grad = (self.grad_output, len);
        match transform {
            Some(Transform::BiasGelu { input, bias: b, .. }) => {
                (x, bias) = (Some((*input, len)), Some((*b, cols)));
            }
            Some(Transform::QkvMerge {
                grad_key,
                grad_value,
                layout,
            }) => {
                let head_len = layout.head_len();
                grad = (self.grad_output, head_len);
                (key, value) = (Some((*grad_key, head_len)), Some((*grad_value, head_len)));
            }
            _ => {}
        }
        assert!(
            norm.is_none() || x.is_none(),
            "column sums of a norm's and GELU's gradients at once"
        );
        let x = x.or(norm.map(|i| (i.input, len)));
        let outputs = [
            self.weighted_sums.map(|h| (h, cols)),
            self.sums.map(|h| (h, cols)),
            self.transformed.as_ref().map(|t| (t.output, len)),
        ];
        let stand_in = outputs
            .iter()
            .any(Option::is_none)
            .then(|| client.empty(4 * vector));
        Bindings {
            read: [
                grad,
                x.unwrap_or(unread),
                norm.and_then(|i| i.mean).map_or(unread, |m| (m, rows)),
                norm.map_or(unread, |i| (i.rstd, rows)),
                bias.unwrap_or(unread),
                key.unwrap_or(unread),
                value.unwrap_or(unread),
            ],
            written: outputs,
            stand_in,
        }
    }
}

/// The buffers of one [`columns::column_sums`] launch: the inputs, the outputs (`None`: not
/// asked for, bound to `stand_in`).
struct Bindings<'a> {
    read: [(&'a Handle, usize); 7],
    written: [Option<(&'a Handle, usize)>; 3],
    stand_in: Option<Handle>,
}

impl Bindings<'_> {
    /// The kernel's buffer arguments, in its order.
    fn each(&self, vector: usize) -> [BufferArg; 10] {
        let stand_in = || {
            (
                self.stand_in.as_ref().expect("made for a missing output"),
                vector,
            )
        };
        let read = self.read;
        let written = self.written.map(|b| b.unwrap_or_else(stand_in));
        let all = [
            read[0], read[1], read[2], read[3], read[4], read[5], read[6], written[0], written[1],
            written[2],
        ];
        all.map(|(handle, len)| arg(handle, len))
    }
}
