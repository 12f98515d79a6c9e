//! Sums over the rows of a `[rows, cols]` tensor, per column, in one launch: a bias's
//! gradient (`Σ dy`), LayerNorm's dγ and dβ (`Σ dy ⊙ x̂`, `Σ dy`), RMSNorm's dγ
//! (`Σ dy ⊙ x · r`). A bias's gradient can form the gradient it sums on the way (dropped,
//! through GELU's slope, or merged from the attention core's heads) and store it: the op
//! before the bias and the bias's sums are then one launch (see [`GradientTransform`]).
//!
//! Why one launch with a strip of columns per cube: on a GPU the bias gradients through burn's
//! `sum_dim` (several per layer) and LayerNorm's two dγ/dβ stages each took many times what
//! the bytes of the gradient need (measured: benchmarks/results/2026-11-27-h200-device-order.md
//! and benchmarks/results/2026-11-30-h200-gpu-history.md). Both designs left most of the GPU
//! idle: `sum_dim` along the rows gives a column to one unit, which walks every row; the
//! second LayerNorm stage did the same over the partial rows with four cubes. Here a cube owns
//! `vectors` column vectors and has `row_lanes` units for each (along y), each summing every
//! `row_lanes`-th row four rows at a time (four loads in flight); the lanes' sums are then
//! added in a tree through shared memory. The order of every addition is fixed by the launch
//! shape, so the sums do not change from run to run.

use cubecl::prelude::*;

use crate::dropout::{salted as salted_key, sliced_dropout};
use crate::gelu::gelu_and_slope;
use crate::heads::merged_gradient;
use crate::rows::cube_index;

/// Column sums over all `rows` rows (see the module docs). Cube `c` owns column vectors
/// `c·vectors .. (c+1)·vectors` (x), and its `row_lanes` units per vector (y, a power of two)
/// start at rows `0 .. row_lanes`. With `weighted_terms`, `Σ dy ⊙ x̂` goes to `weighted_sums`,
/// `x̂ = (x − μ) · r` (`centered`: LayerNorm) or `x · r` (RMSNorm); with `plain_terms`, `Σ dy`
/// goes to `sums`.
///
/// The gradient of a bias added before an element-wise op is the op's input gradient summed
/// over the rows, and the layer's product needs that input gradient too: `transform` makes
/// both in one launch and one read of `dy` where they were two of each. With
/// [`GradientTransform::Dropout`], `dy` is first dropped with the mask of the draw keyed
/// `(key_lo, key_hi)` salted by `salt` (`grad_output` holding the slice `(own, row, first)` of
/// it, or with `whole` all of it: bias-dropout-add's backward); with
/// [`GradientTransform::BiasGelu`] it is multiplied by GELU's slope at `input + bias`
/// (bias-GELU's backward; `tanh`: the tanh form); with [`GradientTransform::QkvMerge`] `dy`
/// is not read but formed from the attention core's per-head gradients (`grad_output` the
/// queries', `grad_key`, `grad_value`) as the merge kernel forms it (the QKV projection's
/// bias, added by the core's split). Either way the result is stored to `transformed`,
/// rounded as the element-wise kernel rounds it, and summed as stored.
/// Arguments a launch does not ask for are neither read nor written.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn column_sums<F: Float, A: Float, N: Size>(
    grad_output: &[Vector<F, N>],
    input: &[Vector<F, N>],
    mean: &[A],
    rstd: &[A],
    bias: &[Vector<F, N>],
    grad_key: &[Vector<F, N>],
    grad_value: &[Vector<F, N>],
    weighted_sums: &mut [Vector<F, N>],
    sums: &mut [Vector<F, N>],
    transformed: &mut [Vector<F, N>],
    salt: &[u32],
    rows: u32,
    cols: u32,
    args: TransformArgs,
    #[comptime] weighted_terms: bool,
    #[comptime] centered: bool,
    #[comptime] plain_terms: bool,
    #[comptime] transform: GradientTransform,
    #[comptime] vectors: u32,
    #[comptime] row_lanes: u32,
) {
    let width = cols as usize / N::value();
    let x = UNIT_POS_X as usize;
    let j = cube_index() * vectors as usize + x;
    let lane = UNIT_POS_Y as usize;
    let zero = Vector::<A, N>::new(A::new(0.0));
    let mut weighted = zero;
    let mut plain = zero;
    if j < width {
        let args = salted(&args, salt, transform == GradientTransform::Dropout);
        let (unit_weighted, unit_plain) = unit_partial_sums::<F, A, N>(
            grad_output,
            input,
            mean,
            rstd,
            bias,
            grad_key,
            grad_value,
            transformed,
            &args,
            rows as usize,
            width,
            j,
            weighted_terms,
            centered,
            plain_terms,
            transform,
            row_lanes,
        );
        weighted = unit_weighted;
        plain = unit_plain;
    }
    weighted = cube_sum::<A, N>(weighted, weighted_terms, vectors, row_lanes);
    plain = cube_sum::<A, N>(plain, plain_terms, vectors, row_lanes);
    if j < width && lane == 0 {
        store_sum::<F, A, N>(weighted_sums, j, weighted, weighted_terms);
        store_sum::<F, A, N>(sums, j, plain, plain_terms);
    }
}

/// This unit's sums over its rows of column vector `j` (every `row_lanes`-th row from its
/// lane's): `(Σ dy ⊙ x̂, Σ dy)`, each where the launch asks for it (zero otherwise). Four
/// partial sums of each kind, one per row of a four-row step (four loads in flight), added
/// pairwise at the end; rows past the last step go to the first: a fixed order.
#[cube]
#[allow(clippy::too_many_arguments)]
fn unit_partial_sums<F: Float, A: Float, N: Size>(
    grad_output: &[Vector<F, N>],
    input: &[Vector<F, N>],
    mean: &[A],
    rstd: &[A],
    bias: &[Vector<F, N>],
    grad_key: &[Vector<F, N>],
    grad_value: &[Vector<F, N>],
    transformed: &mut [Vector<F, N>],
    args: &TransformArgs,
    rows: usize,
    width: usize,
    j: usize,
    #[comptime] weighted_terms: bool,
    #[comptime] centered: bool,
    #[comptime] plain_terms: bool,
    #[comptime] transform: GradientTransform,
    #[comptime] row_lanes: u32,
) -> (Vector<A, N>, Vector<A, N>) {
    let zero = Vector::<A, N>::new(A::new(0.0));
    let step = row_lanes as usize;
    let mut w = Array::<Vector<A, N>>::new(4usize);
    let mut s = Array::<Vector<A, N>>::new(4usize);
    #[unroll]
    for k in 0..4usize {
        w[k] = zero;
        s[k] = zero;
    }
    let mut row = UNIT_POS_Y as usize;
    while row + 3 * step < rows {
        let mut dy = Array::<Vector<A, N>>::new(4usize);
        #[unroll]
        for k in 0..4usize {
            dy[k] = gradient_at::<F, A, N>(
                grad_output,
                grad_key,
                grad_value,
                input,
                bias,
                transformed,
                (row + k * step) * width + j,
                j,
                args,
                transform,
            );
        }
        #[unroll]
        for k in 0..4usize {
            let r = row + k * step;
            if weighted_terms {
                w[k] += dy[k] * normalized::<F, A, N>(input, mean, rstd, r, width, j, centered);
            }
            if plain_terms {
                s[k] += dy[k];
            }
        }
        row += 4 * step;
    }
    while row < rows {
        let dy = gradient_at::<F, A, N>(
            grad_output,
            grad_key,
            grad_value,
            input,
            bias,
            transformed,
            row * width + j,
            j,
            args,
            transform,
        );
        if weighted_terms {
            w[0] += dy * normalized::<F, A, N>(input, mean, rstd, row, width, j, centered);
        }
        if plain_terms {
            s[0] += dy;
        }
        row += step;
    }
    ((w[0] + w[1]) + (w[2] + w[3]), (s[0] + s[1]) + (s[2] + s[3]))
}

/// `value` summed over the row lanes of this unit's column vector when the launch asks for
/// these sums (`wanted`) and has more than one lane (every unit of the cube must call it).
#[cube]
fn cube_sum<A: Float, N: Size>(
    value: Vector<A, N>,
    #[comptime] wanted: bool,
    #[comptime] vectors: u32,
    #[comptime] row_lanes: u32,
) -> Vector<A, N> {
    let mut sum = value;
    if comptime![wanted && row_lanes > 1] {
        sum = lanes_sum::<A, N>(value, vectors, row_lanes);
    }
    sum
}

/// `sums[j] = sum` in the storage type, when the launch asks for these sums.
#[cube]
fn store_sum<F: Float, A: Float, N: Size>(
    sums: &mut [Vector<F, N>],
    j: usize,
    sum: Vector<A, N>,
    #[comptime] wanted: bool,
) {
    if wanted {
        sums[j] = Vector::<F, N>::cast_from(sum);
    }
}

/// The scalars of a [`column_sums`] launch's transform (a launch without one passes any
/// values: they are not read). For a dropout: the draw's key, threshold and scale, and the
/// slice `(own, row, first)` of the draw the gradient holds (see the dropout kernel), `whole`
/// (comptime) compiling a whole draw without its arithmetic. For the QKV merge: the core's
/// layout, `head_dim` in vectors.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct TransformArgs {
    /// The draw's key, low word (before the salt).
    pub key_lo: u32,
    /// The draw's key, high word (before the salt).
    pub key_hi: u32,
    /// Elements whose bits are below this are dropped.
    pub threshold: u32,
    /// What kept elements are multiplied by.
    pub scale: f32,
    /// Elements per run of the slice.
    pub own: u32,
    /// Draw elements per row of the slice (0: whole).
    pub row: u32,
    /// The run's first element within its row.
    pub first: u32,
    /// The gradient is the whole draw.
    #[cube(comptime)]
    pub whole: bool,
    /// Positions (QKV merge).
    pub seq: u32,
    /// Query heads.
    pub heads: u32,
    /// Query heads per key/value head.
    pub per_group: u32,
    /// Vectors per head.
    pub head_dim: u32,
}

/// `args` with the draw's key salted by the micro-batch's `salt` (not read without `drop`).
#[cube]
fn salted(args: &TransformArgs, salt: &[u32], #[comptime] drop: bool) -> TransformArgs {
    TransformArgs {
        key_lo: salted_key(args.key_lo, salt, 0usize, drop),
        key_hi: salted_key(args.key_hi, salt, 1usize, drop),
        threshold: args.threshold,
        scale: args.scale,
        own: args.own,
        row: args.row,
        first: args.first,
        whole: args.whole,
        seq: args.seq,
        heads: args.heads,
        per_group: args.per_group,
        head_dim: args.head_dim,
    }
}

/// What [`column_sums`] does to `dy` before summing it (and stores), chosen at compile time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GradientTransform {
    /// Nothing: the sums are of `dy` as it is, and nothing is stored.
    None,
    /// Dropout with the launch's draw (bias-dropout-add's backward).
    Dropout,
    /// GELU's slope at `input + bias`, exact (bias-GELU's backward).
    BiasGelu,
    /// The same for the tanh approximation (`--openai-gelu`).
    BiasGeluTanh,
    /// The attention core's per-head gradients merged into the QKV projection's rows.
    QkvMerge,
}

/// `dy` at vector `at` (column vector `j`) in the sums' type, transformed first as
/// `transform` says (in `F`, as the element-wise kernel rounds it) and then stored to
/// `transformed`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn gradient_at<F: Float, A: Float, N: Size>(
    grad_output: &[Vector<F, N>],
    grad_key: &[Vector<F, N>],
    grad_value: &[Vector<F, N>],
    input: &[Vector<F, N>],
    bias: &[Vector<F, N>],
    transformed: &mut [Vector<F, N>],
    at: usize,
    j: usize,
    args: &TransformArgs,
    #[comptime] transform: GradientTransform,
) -> Vector<A, N> {
    let mut dy = if comptime![transform == GradientTransform::QkvMerge] {
        merged_gradient::<F, A, N>(
            grad_output,
            grad_key,
            grad_value,
            at,
            args.seq,
            args.heads,
            args.per_group,
            args.head_dim,
        )
    } else {
        grad_output[at]
    };
    if comptime![transform == GradientTransform::Dropout] {
        dy = sliced_dropout::<F, N>(
            dy,
            at,
            args.key_lo,
            args.key_hi,
            args.threshold,
            args.scale,
            args.own,
            args.row,
            args.first,
            args.whole,
        );
    } else if comptime![
        transform == GradientTransform::BiasGelu || transform == GradientTransform::BiasGeluTanh
    ] {
        let x = input[at] + bias[j];
        let tanh = comptime![transform == GradientTransform::BiasGeluTanh];
        let (_, slope) = gelu_and_slope::<A, N>(Vector::cast_from(x), tanh);
        dy = Vector::cast_from(Vector::<A, N>::cast_from(dy) * slope);
    }
    if comptime![transform != GradientTransform::None] {
        transformed[at] = dy;
    }
    Vector::<A, N>::cast_from(dy)
}

/// `x̂` of row `row`'s column vector `j`: `(x − μ) · r` (`centered`) or `x · r`.
#[cube]
fn normalized<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    mean: &[A],
    rstd: &[A],
    row: usize,
    width: usize,
    j: usize,
    #[comptime] centered: bool,
) -> Vector<A, N> {
    let mut x = Vector::<A, N>::cast_from(input[row * width + j]);
    if centered {
        x -= Vector::<A, N>::new(mean[row]);
    }
    x * Vector::<A, N>::new(rstd[row])
}

/// The sum of `value` over the `row_lanes` units (y) of this unit's column vector (x), in
/// unit 0's result (a tree through shared memory, halving the lanes each level). Every unit
/// of the cube must call it.
#[cube]
fn lanes_sum<A: Float, N: Size>(
    value: Vector<A, N>,
    #[comptime] vectors: u32,
    #[comptime] row_lanes: u32,
) -> Vector<A, N> {
    let mut scratch = Shared::<[Vector<A, N>]>::new_slice((vectors * row_lanes) as usize);
    let x = UNIT_POS_X as usize;
    let lane = UNIT_POS_Y as usize;
    let v = vectors as usize;
    scratch[lane * v + x] = value;
    sync_cube();
    // From the runtime cube size (= `row_lanes`): a comptime initial value would make
    // `stride` a constant the loop cannot update.
    let mut stride = (CUBE_DIM_Y / 2) as usize;
    while stride > 0 {
        if lane < stride {
            let sum = scratch[lane * v + x] + scratch[(lane + stride) * v + x];
            scratch[lane * v + x] = sum;
        }
        sync_cube();
        stride /= 2;
    }
    scratch[x]
}
