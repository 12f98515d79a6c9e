//! The launcher of the rotary-embedding kernel.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::attention::AttentionShape;
use super::{arg, check_elements, element_vector_size, gcd};
use crate::rotary;
use crate::rows::cube_count;

/// The angles of a rotary embedding and how its pairs are laid out.
#[derive(Clone, Copy, Debug)]
pub struct RotaryTables<'a> {
    /// `cos` of each angle (f32, `[positions, rotary_dim / 2]`: a row per position, a column
    /// per rotated pair).
    pub cos: &'a Handle,
    /// `sin` of each angle, laid out as `cos`.
    pub sin: &'a Handle,
    /// Positions (rows) the tables hold.
    pub positions: usize,
    /// Channels of each head that are rotated (even, at most the head's width; the rest are
    /// copied).
    pub rotary_dim: usize,
    /// Pairs `(2i, 2i + 1)` instead of `(i, i + rotary_dim / 2)`.
    pub interleaved: bool,
}

/// Rotary embedding of `input` (`[batch · heads, seq, head_dim]`, as [`AttentionShape`]):
/// sequence position `s` turned by the angles of table row `offset + s`, or with `inverse`
/// turned back (the backward, on the output's gradient).
pub fn rotary_embedding<F: Float + CubeElement>(
    client: &Client,
    input: &Handle,
    output: &Handle,
    shape: AttentionShape,
    tables: RotaryTables<'_>,
    offset: usize,
    inverse: bool,
) {
    if shape.is_empty() {
        return;
    }
    let r = tables.rotary_dim;
    assert!(
        r > 0 && r.is_multiple_of(2) && r <= shape.head_dim,
        "rotary embedding of {r} channels of heads {} wide",
        shape.head_dim
    );
    assert!(
        offset + shape.seq <= tables.positions,
        "rotary tables of {} positions for positions {offset}..{}",
        tables.positions,
        offset + shape.seq
    );
    let len = shape.len();
    check_elements(len, "a rotary embedding");
    let angles = tables.positions * r / 2;
    // A vector stays within one half of a head's rotated channels (interleaved pairs would
    // need their lanes swapped: one element per unit there).
    let vector = if tables.interleaved {
        1
    } else {
        element_vector_size::<F>(client, gcd(r / 2, shape.head_dim))
    };
    rotary::rotary_embedding::launch::<F, f32>(
        client,
        cube_count((len / vector).div_ceil(rotary::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(rotary::UNITS_PER_CUBE),
        vector,
        arg(input, len),
        arg(tables.cos, angles),
        arg(tables.sin, angles),
        arg(output, len),
        (len / vector) as u32,
        shape.seq as u32,
        shape.head_dim as u32,
        r as u32,
        offset as u32,
        tables.interleaved,
        inverse,
    );
}
