//! Rotary position embedding (RoFormer) of queries or keys `[batch · heads, seq, head_dim]`,
//! element-wise: each pair of a head's first `rotary_dim` channels at position `p` is turned
//! by the angle `p · θ_i` of its pair `i`, the other channels are copied.
//!
//! Pairs are `(i, i + rotary_dim / 2)` (the two halves; HF's and Megatron's default) or
//! `(2i, 2i + 1)` (interleaved). For a pair `(a, b)` the forward gives
//! `(a cos − b sin, b cos + a sin)`; the backward is the rotation by the negative angle
//! (the transpose of a rotation), `(a cos + b sin, b cos − a sin)`, the same kernel with
//! `inverse`.
//!
//! The angles come as tables: `cos` and `sin` (f32, `[positions, rotary_dim / 2]`), computed
//! on the host (in float64, as the composed path's) and read at row `offset + s` for sequence
//! position `s`, so a table covering more positions than the sequence serves any offset.

use cubecl::prelude::*;

use crate::rows::cube_index;

/// Units per cube.
pub const UNITS_PER_CUBE: u32 = 256;

/// `output[i]` for `i < len`: element `i` of `input` rotated with its pair's partner (or
/// copied past `rotary_dim`); in vectors of `N` (`len` counts them), which divide
/// `rotary_dim / 2` and `head_dim` so that a vector's elements share their half and position,
/// and `N = 1` for interleaved pairs.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn rotary_embedding<F: Float, A: Float, N: Size>(
    input: &[Vector<F, N>],
    cos: &[Vector<A, N>],
    sin: &[Vector<A, N>],
    output: &mut [Vector<F, N>],
    len: u32,
    seq: u32,
    head_dim: u32,
    rotary_dim: u32,
    offset: u32,
    #[comptime] interleaved: bool,
    #[comptime] inverse: bool,
) {
    let i = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if i < len as usize {
        let n = N::value();
        let e = i * n;
        let d = head_dim as usize;
        let r = rotary_dim as usize;
        let c = e % d;
        let x = Vector::<A, N>::cast_from(input[i]);
        let mut y = x;
        if c < r {
            let half = r / 2;
            let position = (e / d) % seq as usize + offset as usize;
            // The first of a pair takes `− partner · sin`, the second `+ partner · sin`.
            let mut pair = c % half;
            let mut partner = e + half;
            let mut sign = A::new(-1.0);
            if interleaved {
                pair = c / 2;
                partner = e + 1;
                if c % 2 == 1 {
                    partner = e - 1;
                    sign = A::new(1.0);
                }
            } else if c >= half {
                partner = e - half;
                sign = A::new(1.0);
            }
            if inverse {
                sign = A::new(0.0) - sign;
            }
            let angle = (position * half + pair) / n;
            let other = Vector::<A, N>::cast_from(input[partner / n]);
            y = x * cos[angle] + other * (Vector::new(sign) * sin[angle]);
        }
        output[i] = Vector::cast_from(y);
    }
}
