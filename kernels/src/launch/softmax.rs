//! Launchers of the softmax kernels (causal or padding-masked scores, forward and backward).

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::dropout::{DropoutDraw, NO_DRAW};
use super::salt::salt_arg;
use super::{arg, check_elements};
use crate::rows::RowLaunch;
use crate::softmax;

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
/// `dropout = Some((draw, dropped))`, the attention dropout of `output` by `draw` (`output`
/// holding its slice: the whole draw, or a tensor-parallel rank's heads) into `dropped` in the
/// same kernel: bit for bit what [`dropout`](super::dropout()) makes of `output`, without that
/// launch and its pass reading `output` back.
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
    let outputs = match dropout {
        Some((draw, dropped)) => Outputs::Both(output, draw, dropped),
        None => Outputs::Probabilities(output),
    };
    launch_forward::<F>(client, launch, input, mask, outputs, shape, scale);
}

/// Only the dropout of [`softmax_forward`]'s output, causal, into `dropped`: the same bits,
/// without writing the probabilities (half the kernel's writes). For an attention core that
/// forms them again in its backward and keeps neither.
pub fn causal_softmax_dropped<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    input: &Handle,
    dropped: &Handle,
    draw: DropoutDraw,
    shape: ScoresShape,
    scale: f32,
) {
    let outputs = Outputs::Dropped(draw, dropped);
    launch_forward::<F>(
        client,
        launch,
        input,
        SoftmaxMask::Causal,
        outputs,
        shape,
        scale,
    );
}

/// What a softmax forward writes.
#[derive(Clone, Copy)]
enum Outputs<'a> {
    /// The probabilities.
    Probabilities(&'a Handle),
    /// The probabilities, and their dropout by the draw.
    Both(&'a Handle, DropoutDraw, &'a Handle),
    /// Only the probabilities' dropout by the draw.
    Dropped(DropoutDraw, &'a Handle),
}

fn launch_forward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    input: &Handle,
    mask: SoftmaxMask<'_>,
    outputs: Outputs<'_>,
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
    // A buffer the kernel never writes is bound to the other one's.
    let (output, draw, dropped, drop, keep_output) = match outputs {
        Outputs::Probabilities(y) => (y, NO_DRAW, y, false, true),
        Outputs::Both(y, draw, d) => (y, draw, d, true, true),
        Outputs::Dropped(draw, d) => (d, draw, d, true, false),
    };
    if drop {
        draw.slice.check_rows(shape.len(), shape.sk);
    }
    let vector = launch.vector_size::<F>(client, shape.sk);
    softmax::masked_softmax_forward::launch::<F, f32>(
        client,
        launch.cube_count(shape.rows()),
        launch.cube_dim(),
        vector,
        arg(input, shape.len()),
        mask,
        arg(output, shape.len()),
        arg(dropped, shape.len()),
        salt_arg(client, drop.then_some(draw), input),
        draw.scalars(),
        scale,
        shape.rows() as u32,
        shape.heads as u32,
        shape.sq as u32,
        shape.sk as u32,
        !padded,
        padded,
        drop,
        keep_output,
        launch.lanes,
        held(launch, shape.sk / vector),
        launch.rows_per_cube,
        launch.plane_reduce,
    );
}

/// `grad_input = scale · y ⊙ (dy − Σ dy ⊙ y)` per row of `shape.sk` (both softmaxes'
/// backward). With `causal`, `output` is a causal softmax's: each row's keys after its query
/// (zeros there) are not read, and their gradient is 0. With `dropout`, `grad_output` is the
/// gradient of the dropped output, taken back through the dropout by that draw in the same
/// kernel: bit for bit [`dropout`](super::dropout()) then this. With `redropped` as well, the dropout of
/// `output` by that draw goes into it: the forward's dropped probabilities, bit for bit
/// ([`softmax_forward`]'s), formed again where the `p v` product's gradient needs them
/// instead of kept from the forward.
#[allow(clippy::too_many_arguments)]
pub fn softmax_backward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    output: &Handle,
    grad_output: &Handle,
    grad_input: &Handle,
    shape: ScoresShape,
    causal: bool,
    scale: f32,
    dropout: Option<DropoutDraw>,
    redropped: Option<&Handle>,
) {
    assert!(
        dropout.is_some() || redropped.is_none(),
        "the dropped probabilities need the forward's draw"
    );
    let y = Source::Output(output);
    launch_backward::<F>(
        client,
        launch,
        y,
        grad_output,
        grad_input,
        redropped,
        shape,
        causal,
        scale,
        dropout,
    );
}

/// The backward of a causal softmax from its input `scores` (`[batch, heads, sq, sk]`):
/// `grad_input` as [`softmax_backward`] computes it from [`softmax_forward`]'s output, and
/// `probabilities` what the `p v` product's gradient reads, `dropout(y)` by `dropout`'s draw
/// (`grad_output` then being the dropped output's gradient) or `y` without one, all bit for
/// bit those two kernels' results, from one kernel that forms `y` again instead of reading it.
#[allow(clippy::too_many_arguments)]
pub fn softmax_backward_from_scores<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    scores: &Handle,
    grad_output: &Handle,
    grad_input: &Handle,
    probabilities: &Handle,
    shape: ScoresShape,
    scale: f32,
    dropout: Option<DropoutDraw>,
) {
    let (y, kept) = (Source::Scores(scores), Some(probabilities));
    launch_backward::<F>(
        client,
        launch,
        y,
        grad_output,
        grad_input,
        kept,
        shape,
        true,
        scale,
        dropout,
    );
}

/// Where the softmax backward kernel takes the probabilities from.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// The forward's stored output.
    Output(&'a Handle),
    /// The forward's input, the scores: formed again in the kernel.
    Scores(&'a Handle),
}

#[allow(clippy::too_many_arguments)]
fn launch_backward<F: Float + CubeElement>(
    client: &Client,
    launch: RowLaunch,
    y: Source<'_>,
    grad_output: &Handle,
    grad_input: &Handle,
    probabilities: Option<&Handle>,
    shape: ScoresShape,
    causal: bool,
    scale: f32,
    dropout: Option<DropoutDraw>,
) {
    if shape.is_empty() {
        return;
    }
    let (rows, sk, len) = (shape.rows(), shape.sk, shape.len());
    check_elements(len, "a softmax");
    if causal {
        assert!(
            shape.sq <= shape.sk,
            "causal softmax needs sq ≤ sk, got {shape:?}"
        );
    }
    let (input, formed) = match y {
        Source::Output(h) => (h, false),
        Source::Scores(h) => (h, true),
    };
    let draw = dropout.unwrap_or(NO_DRAW);
    draw.slice.check_rows(len, sk);
    let vector = launch.vector_size::<F>(client, sk);
    softmax::softmax_backward::launch::<F, f32>(
        client,
        launch.cube_count(rows),
        launch.cube_dim(),
        vector,
        arg(input, len),
        // Never read (the probabilities need no mask): the input's buffer in its place.
        arg(input, 1),
        arg(grad_output, len),
        arg(grad_input, len),
        // Never written without `probabilities`: bound to the gradient's buffer in its place.
        arg(probabilities.unwrap_or(grad_input), len),
        salt_arg(client, dropout, input),
        draw.scalars(),
        scale,
        rows as u32,
        shape.sq as u32,
        sk as u32,
        causal,
        dropout.is_some(),
        formed,
        probabilities.is_some(),
        launch.lanes,
        held(launch, sk / vector),
        launch.rows_per_cube,
        launch.plane_reduce,
    );
}

/// The vectors each unit of `launch` holds of a row of `width` vectors (0: the row is read in
/// each pass), as the kernels' `held`.
fn held(launch: RowLaunch, width: usize) -> u32 {
    if launch.held_in_registers {
        softmax::held_vectors(width, launch.lanes)
    } else {
        0
    }
}
