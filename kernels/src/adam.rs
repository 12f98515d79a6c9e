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

/// Units per cube.
pub const UNITS_PER_CUBE: u32 = 256;

/// `param`, `m`, `v` (`len` each, `first`: no moments yet, their buffers unread) → `output`
/// = new parameter, new `m`, new `v`, end to end (`3 · len`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn adam_step<F: Float>(
    param: &[F],
    grad: &[F],
    m: &[F],
    v: &[F],
    output: &mut [F],
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
    let n = len as usize;
    if i < n {
        let g = grad[i];
        let mut m_new = g * F::cast_from(one_minus_beta1);
        let mut v_new = (g * g) * F::cast_from(one_minus_beta2);
        if !first {
            m_new = m[i] * F::cast_from(beta1) + m_new;
            v_new = v[i] * F::cast_from(beta2) + v_new;
        }
        let m_hat = m_new / F::cast_from(correction1);
        let v_hat = v_new / F::cast_from(correction2);
        let update = m_hat / (F::sqrt(v_hat) + F::cast_from(eps));
        output[i] = param[i] * F::cast_from(keep) - update * F::cast_from(lr);
        output[n + i] = m_new;
        output[2 * n + i] = v_new;
    }
}
