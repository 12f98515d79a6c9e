//! One Adam step (decoupled weight decay, bias correction) of one parameter in one kernel:
//! reads the parameter, its gradient and both moments once and writes the three results.
//! Composed of tensor ops the same step launches about fifteen element-wise kernels per
//! parameter, which is most of a small model's launches (see the README's step profile).
//!
//! The arithmetic is the composed optimizer's, operation for operation in f32:
//! `m = β₁ m + (1 − β₁) g`, `v = β₂ v + (1 − β₂) g²` (without the first terms on the first
//! step), `p = keep · p − lr · (m / c₁) / (√(v / c₂) + ε)`.

use cubecl::prelude::*;

use crate::rows::cube_index;
use crate::vectors::spread;

/// Units per cube.
pub const UNITS_PER_CUBE: u32 = 256;

/// The updated parameter from the updated moments: `keep · p − lr · (m / c₁) / (√(v / c₂) + ε)`,
/// shared by both kernels so that their arithmetic cannot drift apart (lane by lane).
#[cube]
#[allow(clippy::too_many_arguments)]
fn adam_parameter<F: Float, N: Size>(
    p: Vector<F, N>,
    m: Vector<F, N>,
    v: Vector<F, N>,
    correction1: f32,
    correction2: f32,
    eps: f32,
    keep: f32,
    lr: f32,
) -> Vector<F, N> {
    let m_hat = m / spread::<F, N>(correction1);
    let v_hat = v / spread::<F, N>(correction2);
    let update = m_hat / (Vector::sqrt(v_hat) + spread::<F, N>(eps));
    p * spread::<F, N>(keep) - update * spread::<F, N>(lr)
}

/// `param`, `m`, `v` (`len` each, `first`: no moments yet, their buffers unread) → `output`
/// = new parameter, new `m`, new `v`, end to end (`3 · len`); in vectors of `N` (which
/// divides `len`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn adam_step<F: Float, N: Size>(
    param: &[Vector<F, N>],
    grad: &[Vector<F, N>],
    m: &[Vector<F, N>],
    v: &[Vector<F, N>],
    output: &mut [Vector<F, N>],
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    correction1: f32,
    correction2: f32,
    eps: f32,
    keep: f32,
    lr: f32,
    len: u32,
    #[comptime] first: bool,
) {
    let i = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    let n = len as usize / N::value();
    if i < n {
        let g = grad[i];
        let mut m_new = g * spread::<F, N>(one_minus_beta1);
        let mut v_new = (g * g) * spread::<F, N>(one_minus_beta2);
        if !first {
            m_new = m[i] * spread::<F, N>(beta1) + m_new;
            v_new = v[i] * spread::<F, N>(beta2) + v_new;
        }
        output[i] = adam_parameter::<F, N>(
            param[i],
            m_new,
            v_new,
            correction1,
            correction2,
            eps,
            keep,
            lr,
        );
        output[n + i] = m_new;
        output[2 * n + i] = v_new;
    }
}

/// One Adam step, in place, of the elements `start .. start + len` of flat buffers holding
/// many parameters (llm.c's layout): `param`, `m` and `v` are overwritten, and the gradient
/// is first multiplied by `clip[0]`, the global-norm clipping coefficient, read on the device
/// so that the step needs no host read. Moments start as zeros, and `β₁ · 0 + x` is `x`
/// exactly, so the first step needs no flag. The arithmetic is [`adam_step`]'s (the parameter
/// update is the same [`adam_parameter`]). In vectors of `N` (which divides `start` and
/// `len`). The values that change from step to step — `1 − β₁ᵗ`, `1 − β₂ᵗ`, `1 − lr · wd`
/// and `lr` — are read from `per_step[4 · slot ..]` on the device rather than taken as
/// arguments, so that a captured step replays with each step's values written between
/// replays.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn adam_step_in_place<F: Float, N: Size>(
    param: &mut [Vector<F, N>],
    grad: &[Vector<F, N>],
    m: &mut [Vector<F, N>],
    v: &mut [Vector<F, N>],
    clip: &[F],
    per_step: &[f32],
    slot: u32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    eps: f32,
    start: u32,
    len: u32,
) {
    let i = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if i < len as usize / N::value() {
        let at = slot as usize * 4;
        let (correction1, correction2) = (per_step[at], per_step[at + 1]);
        let (keep, lr) = (per_step[at + 2], per_step[at + 3]);
        let j = start as usize / N::value() + i;
        let g = grad[j] * Vector::new(clip[0]);
        let m_new = m[j] * spread::<F, N>(beta1) + g * spread::<F, N>(one_minus_beta1);
        let v_new = v[j] * spread::<F, N>(beta2) + (g * g) * spread::<F, N>(one_minus_beta2);
        param[j] = adam_parameter::<F, N>(
            param[j],
            m_new,
            v_new,
            correction1,
            correction2,
            eps,
            keep,
            lr,
        );
        m[j] = m_new;
        v[j] = v_new;
    }
}

/// The most sources one [`copy_at_offsets`] launch takes (fewer where the device binds fewer
/// buffers to a kernel): a model's gradients in an eighth of the launches four per launch
/// (wgpu's default limit of eight storage buffers) would take (GPT-2 345M's counts:
/// benchmarks/results/2026-12-03-figures-from-comments.md), and on a GPU each launch costs
/// the host more than the copy takes the device. A launch's sources are bound as a comptime
/// sequence, so each count is a kernel of its own: the launcher pads a partial launch to a
/// power of two (a handful of variants). The price is on CPU devices: lavapipe runs every
/// piece's branch, masked, in every cube, so a cube of a many-piece launch takes several
/// times one of a 4-piece launch, and the flat copies slow down (measured:
/// benchmarks/results/2026-11-26-lavapipe-launch-counts.md); on a GPU the branch is uniform
/// in a cube and the untaken ones cost a comparison each.
pub const COPY_SOURCES: usize = 32;

/// `destination[offset + i] = source[i] · scale` (multiplied in f32, stored as `O`) for this
/// unit's `i` in the piece whose cubes start at `first_cube`, when `i < len`. A cube past the
/// piece's last has `i ≥ len` (the piece has `⌈len / UNITS_PER_CUBE⌉` cubes), so the two
/// comparisons are the whole test of whose piece a cube is.
#[cube]
// A sequence launch argument holds owned slices (CubeCL's `Box<[C]>`), which its index lends.
#[allow(clippy::borrowed_box)]
fn copy_piece<I: Float, O: Float, N: Size>(
    source: &Box<[Vector<I, N>]>,
    destination: &mut [Vector<O, N>],
    offset: u32,
    len: u32,
    first_cube: u32,
    scale: f32,
) {
    let cube = cube_index();
    if cube >= first_cube as usize {
        let i = (cube - first_cube as usize) * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
        if i < len as usize {
            let value = Vector::<f32, N>::cast_from(source[i]) * spread::<f32, N>(scale);
            destination[offset as usize + i] = Vector::<O, N>::cast_from(value);
        }
    }
}

/// Parameters' gradients into their places in a flat buffer in one launch (one launch per
/// gradient was a quarter of a small GPT's step), each element cast from the gradients' dtype
/// `I` to the buffer's `O` and multiplied by `scale` in f32 on the way: a half-precision
/// model's gradients enter the fp32 buffer without a cast kernel per parameter, and fp16's
/// loss scale can come off in the same pass (`scale` 1 copies exactly). Each piece has cubes
/// of its own, one after another from `first_cubes[k]` (summed by the host, not by every
/// unit), so the branch is the same for all units of a cube; element `j` of piece `k` goes
/// to `offsets[k] + j`. An unused slot has length 0. Lengths and offsets count vectors of `N`.
#[cube(launch)]
pub fn copy_at_offsets<I: Float, O: Float, N: Size>(
    sources: &Sequence<Box<[Vector<I, N>]>>,
    destination: &mut [Vector<O, N>],
    offsets: &Sequence<u32>,
    lens: &Sequence<u32>,
    first_cubes: &Sequence<u32>,
    scale: f32,
) {
    #[unroll]
    for k in 0..sources.len() {
        let (offset, len, first) = (*offsets.index(k), *lens.index(k), *first_cubes.index(k));
        copy_piece::<I, O, N>(sources.index(k), destination, offset, len, first, scale);
    }
}
