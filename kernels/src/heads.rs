//! The fused QKV projection's output and the per-head tensors the attention core works on,
//! one kernel each way.
//!
//! The projection writes each row `[batch, seq]` as Megatron lays it out per query group:
//! the group's `per_group` query heads, its key head, its value head, each `head_dim` wide.
//! The core wants queries, keys and values as `[batch, heads, seq, head_dim]`, keys and
//! values repeated for each query head of their group. Composed of tensor ops that is three
//! narrows, reshapes and copies forward, and backward (burn's slice backward) a zeroed
//! tensor and a slice-assignment per part plus two additions — eight launches per layer
//! where [`qkv_merge`] is one, and it sums a group's repeated keys and values in a fixed order.
//!
//! After the core, its output `[batch, heads, seq, head_dim]` goes back to rows `[batch, seq,
//! heads · head_dim]` for the output projection, and the projection's gradient the other way:
//! [`swap_heads_and_positions`], one launch each way where burn's generic strided copy ran,
//! a launch per layer each way that took many times what its bytes need (measured:
//! benchmarks/results/2026-11-30-h200-gpu-history.md).
//!
//! Pure data movement (plus that sum, in `A`); one unit per vector of `N` elements of a head
//! row (`N` divides `head_dim`, and the kernels' `head_dim` and `len` count vectors).

use cubecl::prelude::*;

use crate::rows::cube_index;

/// Units per cube.
pub const UNITS_PER_CUBE: u32 = 256;

/// Queries, keys and values `[batch, groups · per_group, seq, head_dim]` from the mixed rows
/// `[batch, seq, groups · (per_group + 2) · head_dim]`; `len` is the vectors of one output.
///
/// With `has_bias` the projection's bias (one mixed row's width) is added on the way, in the
/// storage type as the composed bias add rounds it: the projection's product leaves the bias
/// out (Megatron's `skip_bias_add`), and its add is not a launch and a pass of its own.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn qkv_split<F: Float, N: Size>(
    mixed: &[Vector<F, N>],
    bias: &[Vector<F, N>],
    query: &mut [Vector<F, N>],
    key: &mut [Vector<F, N>],
    value: &mut [Vector<F, N>],
    len: u32,
    seq: u32,
    heads: u32,
    per_group: u32,
    head_dim: u32,
    #[comptime] has_bias: bool,
) {
    let t = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if t < len as usize {
        let d = head_dim as usize;
        let c = t % d;
        let position = (t / d) % seq as usize;
        let head = (t / (d * seq as usize)) % heads as usize;
        let batch = t / (d * seq as usize * heads as usize);
        let (p, group) = (per_group as usize, head / per_group as usize);
        let width = (heads as usize / p) * (p + 2) * d;
        // Where the group's heads start in a row, plus the unit's vector in a head.
        let column = group * (p + 2) * d + c;
        let base = (batch * seq as usize + position) * width + column;
        let (q_at, k_at, v_at) = ((head % p) * d, p * d, (p + 1) * d);
        let mut q = mixed[base + q_at];
        let mut k = mixed[base + k_at];
        let mut v = mixed[base + v_at];
        if has_bias {
            q += bias[column + q_at];
            k += bias[column + k_at];
            v += bias[column + v_at];
        }
        query[t] = q;
        key[t] = k;
        value[t] = v;
    }
}

/// The mixed rows' gradient from the gradients of [`qkv_split`]'s outputs: a query element
/// is copied back, a key or value element is the sum over its group's query heads (in head
/// order, in `A`); `len` is the vectors of the mixed rows.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn qkv_merge<F: Float, A: Float, N: Size>(
    grad_query: &[Vector<F, N>],
    grad_key: &[Vector<F, N>],
    grad_value: &[Vector<F, N>],
    grad_mixed: &mut [Vector<F, N>],
    len: u32,
    seq: u32,
    heads: u32,
    per_group: u32,
    head_dim: u32,
) {
    let t = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if t < len as usize {
        grad_mixed[t] = merged_gradient::<F, A, N>(
            grad_query, grad_key, grad_value, t, seq, heads, per_group, head_dim,
        );
    }
}

/// Vector `t` of the mixed rows' gradient ([`qkv_merge`]'s), for kernels that form it on
/// the way (the QKV bias gradient's column sums).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn merged_gradient<F: Float, A: Float, N: Size>(
    grad_query: &[Vector<F, N>],
    grad_key: &[Vector<F, N>],
    grad_value: &[Vector<F, N>],
    t: usize,
    seq: u32,
    heads: u32,
    per_group: u32,
    head_dim: u32,
) -> Vector<F, N> {
    let (d, p) = (head_dim as usize, per_group as usize);
    let c = t % d;
    let part = (t / d) % (p + 2);
    let width = (heads as usize / p) * (p + 2) * d;
    let group = (t % width) / ((p + 2) * d);
    let position = (t / width) % seq as usize;
    let batch = t / (width * seq as usize);
    // Element (batch, group · p + head, position, c) of a per-head tensor is at
    // `first + head · head_stride`.
    let head_stride = seq as usize * d;
    let first = ((batch * heads as usize + group * p) * seq as usize + position) * d + c;
    if part < p {
        grad_query[first + part * head_stride]
    } else {
        let mut sum = Vector::<A, N>::new(A::new(0.0));
        for h in 0..p {
            if part == p {
                sum += Vector::cast_from(grad_key[first + h * head_stride]);
            } else {
                sum += Vector::cast_from(grad_value[first + h * head_stride]);
            }
        }
        Vector::cast_from(sum)
    }
}

/// `input` `[batch, outer, inner, head_dim]` as `output` `[batch, inner, outer, head_dim]`:
/// the core's heads `[batch, heads, seq, head_dim]` as rows `[batch, seq, heads · head_dim]`
/// (`outer` the heads) and back (`outer` the positions). One unit per output vector, so the
/// writes are coalesced and the reads whole head rows; `len` is the vectors of the output.
#[cube(launch)]
pub fn swap_heads_and_positions<F: Float, N: Size>(
    input: &[Vector<F, N>],
    output: &mut [Vector<F, N>],
    len: u32,
    outer: u32,
    inner: u32,
    head_dim: u32,
) {
    let t = cube_index() * UNITS_PER_CUBE as usize + UNIT_POS_X as usize;
    if t < len as usize {
        let (d, outer, inner) = (head_dim as usize, outer as usize, inner as usize);
        let c = t % d;
        let o = (t / d) % outer;
        let i = (t / (d * outer)) % inner;
        let batch = t / (d * outer * inner);
        output[t] = input[((batch * outer + o) * inner + i) * d + c];
    }
}
