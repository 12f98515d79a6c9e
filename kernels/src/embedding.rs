//! The word embedding's gradient: for each vocabulary row, the sum of the output gradient's
//! rows at the positions holding that token, in position order, summed in `A`.
//!
//! burn's `select` backward (`select_assign`) gives each column one unit that walks all the
//! positions: 1,024 units for a 345M model, each with a 4,096-step loop of dependent
//! read-add-writes in the storage type (far too few units to fill a GPU, each waiting on its
//! own serial chain: benchmarks/results/2026-11-30-h200-gpu-history.md; in bf16, a frequent
//! token's row rounded thousands of times). PyTorch's embedding backward sorts the token ids
//! instead and sums each token's rows in f32. Here a cube per position does it without a
//! sort: its units first look for the same token at an earlier position (then another cube
//! owns the row and this one is done); the owner lists the token's positions from its own
//! on, a chunk at a time and in order, and its units — one column vector each — sum those
//! rows. Each row is written by one cube, in a fixed order, so the result does not depend on
//! scheduling (no atomics), and in f32 it is bit for bit `select_assign`'s.
//!
//! Rows no token names are not written (the launcher's output starts zeroed), nor are
//! positions whose id is negative or past the table.

use cubecl::prelude::*;

use crate::rows::cube_index;

/// The gradient `table` `[rows, width]` of an embedding (zeroed before) from `grad`
/// `[positions, width]` and the positions' `tokens`; `width` counts vectors of `N`. Cubes
/// are `positions × column_blocks`, `units` units each (x), each unit one column vector of
/// its block; a chunk is `4 · units` positions.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn embedding_gradient<F: Float, A: Float, N: Size>(
    tokens: &[i32],
    grad: &[Vector<F, N>],
    table: &mut [Vector<F, N>],
    positions: u32,
    width: u32,
    rows: u32,
    column_blocks: u32,
    #[comptime] units: u32,
) {
    let cube = cube_index();
    let position = cube / column_blocks as usize;
    let column = (cube % column_blocks as usize) * units as usize + UNIT_POS_X as usize;
    let n = positions as usize;
    // The same for every unit of the cube, so are the loops below with a barrier inside.
    // (`n` is at least 1; a cube past the last position gets an id no row has.)
    let mut token = tokens[min(position, n - 1)];
    if position >= n {
        token = -1;
    }
    let valid = token >= 0 && (token as u32) < rows;
    // Positions before this one to look at: none for a cube without a row to write.
    let mut before = position;
    if !valid {
        before = 0;
    }
    let owner = valid && !seen_earlier(tokens, before, token, units);

    let mut sum = Vector::<A, N>::new(A::new(0.0));
    let mut list = Shared::<[u32]>::new_slice((4 * units) as usize);
    let mut counts = Shared::<[u32]>::new_slice(units as usize);
    let mut start = position;
    while owner && start < n {
        let found = list_matches(tokens, start, n, token, &mut list, &mut counts, units);
        if column < width as usize {
            for k in 0..found {
                let at = list[k as usize] as usize;
                sum += Vector::cast_from(grad[at * width as usize + column]);
            }
        }
        // Before the next chunk overwrites the list.
        barrier(units);
        start += (4 * units) as usize;
    }
    if owner && column < width as usize {
        table[token as usize * width as usize + column] = Vector::cast_from(sum);
    }
}

/// Whether `token` occurs before `position` (the cube's units look at `4 · units` positions
/// a round, and stop after the round that finds it). Every unit of the cube must call it.
#[cube]
fn seen_earlier(tokens: &[i32], position: usize, token: i32, #[comptime] units: u32) -> bool {
    let mut flag = Shared::<[u32]>::new_slice(1usize);
    if UNIT_POS_X == 0 {
        flag[0] = 0;
    }
    barrier(units);
    let chunk = (4 * units) as usize;
    let mut start = 0usize;
    let mut seen = false;
    while !seen && start < position {
        let mut s = start + UNIT_POS_X as usize;
        let end = min(start + chunk, position);
        while s < end {
            if tokens[s] == token {
                flag[0] = 1;
            }
            s += units as usize;
        }
        barrier(units);
        seen = flag[0] != 0;
        // Before a unit of a next round could set the flag the others still read.
        barrier(units);
        start += chunk;
    }
    seen
}

/// The positions in `[start, min(start + 4 · units, n))` holding `token`, in order, into
/// `list`; returns how many. Unit `u` looks at four consecutive positions, unit 0 turns the
/// units' counts into offsets, and each unit writes its positions at its offset. Every unit
/// of the cube must call it.
#[cube]
fn list_matches(
    tokens: &[i32],
    start: usize,
    n: usize,
    token: i32,
    list: &mut Shared<[u32]>,
    counts: &mut Shared<[u32]>,
    #[comptime] units: u32,
) -> u32 {
    let u = UNIT_POS_X as usize;
    let first = start + 4 * u;
    let end = min(first + 4, n);
    let mut count = 0u32;
    let mut s = first;
    while s < end {
        if tokens[s] == token {
            count += 1;
        }
        s += 1;
    }
    counts[u] = count;
    barrier(units);
    if u == 0 {
        let mut offset = 0u32;
        for v in 0..units as usize {
            let c = counts[v];
            counts[v] = offset;
            offset += c;
        }
        // The total, where the units' offsets are not needed any more after they read them.
        list[(4 * units - 1) as usize] = offset;
    }
    barrier(units);
    let mut at = counts[u];
    let total = list[(4 * units - 1) as usize];
    // Every unit must have read the total before a unit's position may overwrite its slot.
    barrier(units);
    s = first;
    while s < end {
        if tokens[s] == token {
            list[at as usize] = s as u32;
            at += 1;
        }
        s += 1;
    }
    barrier(units);
    total
}

/// A barrier across the cube's units; none for a cube of one unit (cubecl-cpu's barriers
/// are slow).
#[cube]
fn barrier(#[comptime] units: u32) {
    if units > 1 {
        sync_cube();
    }
}
