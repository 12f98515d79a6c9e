//! Fused causal attention with its products on matrix units (tensor cores): CubeCL's `cmma`,
//! one plane (warp) per `tile` rows of a block.
//!
//! Why: the tiled kernels ([`crate::attention`]) multiply on the GPU's ordinary floating-point
//! units, which on a GPU made `--use-flash-attn` slower than the composed attention on cuBLAS's
//! tensor cores (measured: benchmarks/results/2026-11-27-h200-device-order.md). Here every
//! product — `q kᵀ` and `p̃ v` forward; `q kᵀ`, `do vᵀ` and `ds k` for `dq`; `k qᵀ`, `v doᵀ`,
//! `p̃ᵀ do` and `dsᵀ q` for `dk`, `dv` — is a run of `tile × tile × tile` matrix
//! multiply-accumulates of the storage type (f16/bf16) into f32, as FlashAttention-2 does them.
//!
//! The math, the kernels' split and their outputs are the tiled kernels' (the same `output`,
//! f32 `logsumexp` and `delta`, the same dropout bits; one kernel per query block for `dq`,
//! one per key block for `dk`/`dv`, so no two cubes write a gradient row: no atomics);
//! what differs is rounding: the dropped probabilities and the score gradients are rounded to
//! the storage type before they are multiplied, as the composed attention's stored
//! probabilities are, and the products sum in the matrix unit's order.
//!
//! Layout: a cube of `planes` planes takes `block = planes · tile` rows of one head (queries,
//! or keys for `dk`/`dv`) and walks the other side in tiles of `block` rows (only those on or
//! below the causal diagonal), loaded into shared memory by the whole cube. Plane `p` owns
//! rows `p · tile ..`: it forms its `tile × block` products with the matrix unit, its units
//! turn them element by element into probabilities (the forward's online softmax: a running
//! maximum and sum per row) or score gradients, and the matrix unit adds their products to
//! the plane's running rows. Products, probabilities and running rows pass through shared
//! memory, because a matrix fragment's elements are not addressable by row. The prologue, the
//! mask, the dropout and the tile loads are every attention family's
//! ([`crate::attention_common`]).

use cubecl::prelude::*;

use crate::attention_common::{has_row, TileRows};

mod backward;
mod forward;

pub use backward::*;
pub use forward::*;

const OPERAND_A: cmma::MatrixIdent = cmma::MatrixIdent::A;
const OPERAND_B: cmma::MatrixIdent = cmma::MatrixIdent::B;
const ACCUMULATOR: cmma::MatrixIdent = cmma::MatrixIdent::Accumulator;
const ROW_MAJOR: cmma::MatrixLayout = cmma::MatrixLayout::RowMajor;
const COL_MAJOR: cmma::MatrixLayout = cmma::MatrixLayout::ColMajor;
const UNDEFINED: cmma::MatrixLayout = cmma::MatrixLayout::Undefined;

/// `rows` (`[block, head_dim]`, f32) times `factor` into the rows of the cube's block of
/// `target` in vectors of `N`, those the head has, by all the cube's units.
#[cube]
pub(crate) fn store_rows<F: Float, A: Float, N: Size>(
    rows: &Shared<[A]>,
    factor: A,
    target: &mut [Vector<F, N>],
    own: &TileRows,
    #[comptime] block: u32,
    #[comptime] head_dim: u32,
) {
    let n = N::value().comptime();
    let d = head_dim as usize;
    let mut x = UNIT_POS as usize * n;
    while x < comptime!((block * head_dim) as usize) {
        if has_row(own, own.start + x / d) {
            let mut v = Vector::<F, N>::new(F::new(0.0));
            #[unroll]
            for k in 0..n {
                v.insert(k, F::cast_from(rows[x + k] * factor));
            }
            target[((own.head_row + own.start) * d + x) / n] = v;
        }
        x += CUBE_DIM as usize * n;
    }
}

/// Every element of `values` set to `value` by the cube's units.
#[cube]
pub(crate) fn fill_shared<A: Float>(values: &mut Shared<[A]>, value: A, #[comptime] len: usize) {
    let mut e = UNIT_POS as usize;
    while e < len {
        values[e] = value;
        e += CUBE_DIM as usize;
    }
}

/// A `tile × tile` operand (`ident` A or B) of the matrix unit, read from `values` with rows
/// (or, column-major, columns) `stride` apart.
#[cube]
fn operand<F: Float>(
    #[comptime] ident: cmma::MatrixIdent,
    #[comptime] tile: u32,
    #[comptime] layout: cmma::MatrixLayout,
    values: &[F],
    stride: u32,
) -> cmma::Matrix<F> {
    let t = tile as usize;
    cmma::Matrix::<F>::from_slice(ident, t, t, t, layout, values, stride)
}

/// `out = a bᵀ` for the plane's `tile` rows of `a` (`[block, head_dim]`, row-major) and all of
/// `b` (`[block, head_dim]`, read column-major as `bᵀ`), into the plane's rows of `out`
/// (`[block, block]`, f32): the scores `q kᵀ` (unscaled), `do vᵀ`, and in the key kernel
/// `k qᵀ` and `v doᵀ`. For each sub-tile of `b`'s rows, `head_dim / tile` matrix products.
#[cube]
pub(crate) fn rows_times_transposed<F: Float, A: Float>(
    a: &Shared<[F]>,
    b: &Shared<[F]>,
    out: &mut Shared<[A]>,
    plane: usize,
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] head_dim: u32,
) {
    let (t, d) = (tile as usize, head_dim as usize);
    let w = comptime!((tile * planes) as usize);
    let rows = plane * t;
    for c in 0..comptime!(planes as usize) {
        let zero = A::new(0.0);
        let acc = cmma::Matrix::<A>::from_value(ACCUMULATOR, t, t, t, UNDEFINED, zero);
        for kk in 0..comptime!((head_dim / tile) as usize) {
            let x = operand::<F>(
                OPERAND_A,
                tile,
                ROW_MAJOR,
                &a[rows * d + kk * t..],
                head_dim,
            );
            let y = operand::<F>(
                OPERAND_B,
                tile,
                COL_MAJOR,
                &b[c * t * d + kk * t..],
                head_dim,
            );
            cmma::execute(&x, &y, &acc, &acc);
        }
        cmma::store(
            &mut out[rows * w + c * t..],
            &acc,
            comptime!(tile * planes),
            ROW_MAJOR,
        );
    }
}

/// `out += a b` for the plane's `tile` rows of `a` (`[block, block]`, the storage type) and
/// all of `b` (`[block, head_dim]`, row-major), the plane's rows of `out` (`[block,
/// head_dim]`, f32) read into the matrix unit's accumulators and written back: `o += p̃ v`,
/// `dq += ds k`, `dv += p̃ᵀ do`, `dk += dsᵀ q`.
#[cube]
pub(crate) fn accumulate_rows_times<F: Float, A: Float>(
    a: &Shared<[F]>,
    b: &Shared<[F]>,
    out: &mut Shared<[A]>,
    plane: usize,
    #[comptime] tile: u32,
    #[comptime] planes: u32,
    #[comptime] head_dim: u32,
) {
    let (t, d) = (tile as usize, head_dim as usize);
    let w = comptime!((tile * planes) as usize);
    let rows = plane * t;
    for j in 0..comptime!((head_dim / tile) as usize) {
        let at = rows * d + j * t;
        let acc =
            cmma::Matrix::<A>::from_slice(ACCUMULATOR, t, t, t, ROW_MAJOR, &out[at..], head_dim);
        for c in 0..comptime!(planes as usize) {
            let width = comptime!(tile * planes);
            let x = operand::<F>(OPERAND_A, tile, ROW_MAJOR, &a[rows * w + c * t..], width);
            let y = operand::<F>(
                OPERAND_B,
                tile,
                ROW_MAJOR,
                &b[c * t * d + j * t..],
                head_dim,
            );
            cmma::execute(&x, &y, &acc, &acc);
        }
        cmma::store(&mut out[at..], &acc, head_dim, ROW_MAJOR);
    }
}
