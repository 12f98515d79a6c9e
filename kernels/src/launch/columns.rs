//! Launchers of the one-launch column sums ([`crate::columns`]): a bias's gradient, and the
//! norms' parameter gradients.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::salt::salt_arg;
use super::{arg, element_vector_size, DrawSlice, DropoutDraw};
use crate::columns::{self, ColumnDrawLaunch, GradientTransform};
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
    /// width), each unit walking all the rows, no barrier at all. On lavapipe a
    /// `[4096, 1024]` f32 sum took 1.9 ms so, 3.7 with 64 vectors per cube, 4.9 with a tree of
    /// eight row lanes and 15 with the GPU's shape.
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
/// cols]`, holding `slice` of the draw) dropped with `draw`'s mask into `dropped` (bit for bit
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
    slice: DrawSlice,
) {
    slice.check_holds(rows * cols);
    let sums = ColumnSums {
        grad_output,
        input: None,
        weighted_sums: None,
        sums: Some(grad_bias),
        transformed: Some(Transformed {
            output: dropped,
            transform: Transform::Dropout { draw, slice },
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
    /// Dropped with this draw, the gradient holding this slice of it.
    Dropout { draw: DropoutDraw, slice: DrawSlice },
    /// Multiplied by GELU's slope at `input + bias`.
    BiasGelu {
        input: &'a Handle,
        bias: &'a Handle,
        tanh: bool,
    },
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
        let vector = element_vector_size::<F>(client, cols);
        let width = cols / vector;
        // Arguments the launch does not ask for are never read or written. An input's place is
        // taken by the gradient (bound read-only twice, as the element-wise kernels' missing
        // bias), an output's by a one-vector buffer of its own (wgpu refuses a buffer bound
        // both ways in one dispatch).
        let unread = self.grad_output;
        let unwritten =
            (self.weighted_sums.is_none() || self.sums.is_none() || self.transformed.is_none())
                .then(|| client.empty(4 * vector));
        let stand_in = || {
            (
                unwritten.as_ref().expect("made for a missing output"),
                vector,
            )
        };
        let norm = self.input.as_ref();
        let transformed = self.transformed.as_ref();
        let transform = transformed.map(|t| &t.transform);
        let (gelu_input, gelu_bias) = match transform {
            Some(Transform::BiasGelu { input, bias, .. }) => (Some(*input), Some(*bias)),
            _ => (None, None),
        };
        assert!(
            norm.is_none() || gelu_input.is_none(),
            "column sums of a norm's and GELU's gradients at once"
        );
        let x = norm
            .map(|i| i.input)
            .or(gelu_input)
            .map_or((unread, vector), |x| (x, rows * cols));
        let mean = norm
            .and_then(|i| i.mean)
            .map_or((unread, vector), |m| (m, rows));
        let rstd = norm.map_or((unread, vector), |i| (i.rstd, rows));
        let bias = gelu_bias.map_or((unread, vector), |b| (b, cols));
        let weighted = self.weighted_sums.map_or_else(stand_in, |w| (w, cols));
        let sums = self.sums.map_or_else(stand_in, |s| (s, cols));
        let transformed_to = transformed.map_or_else(stand_in, |t| (t.output, rows * cols));
        let (draw, slice) = match transform {
            Some(Transform::Dropout { draw, slice }) => (Some(*draw), *slice),
            _ => (None, DrawSlice::whole(rows * cols)),
        };
        let key = draw.unwrap_or(super::dropout::NO_DRAW);
        let kind = match transform {
            None => GradientTransform::None,
            Some(Transform::Dropout { .. }) => GradientTransform::Dropout,
            Some(Transform::BiasGelu { tanh: false, .. }) => GradientTransform::BiasGelu,
            Some(Transform::BiasGelu { tanh: true, .. }) => GradientTransform::BiasGeluTanh,
        };
        columns::column_sums::launch::<F, f32>(
            client,
            cube_count(width.div_ceil(launch.vectors as usize)),
            launch.cube_dim(),
            vector,
            arg(self.grad_output, rows * cols),
            arg(x.0, x.1),
            arg(mean.0, mean.1),
            arg(rstd.0, rstd.1),
            arg(bias.0, bias.1),
            arg(weighted.0, weighted.1),
            arg(sums.0, sums.1),
            arg(transformed_to.0, transformed_to.1),
            salt_arg(client, draw, self.grad_output),
            rows as u32,
            cols as u32,
            ColumnDrawLaunch::new(
                key.key_lo,
                key.key_hi,
                key.threshold,
                key.scale,
                slice.own,
                slice.row,
                slice.first,
                slice.is_whole(),
            ),
            self.weighted_sums.is_some(),
            norm.is_some_and(|i| i.mean.is_some()),
            self.sums.is_some(),
            kind,
            launch.vectors,
            launch.row_lanes,
        );
    }
}
