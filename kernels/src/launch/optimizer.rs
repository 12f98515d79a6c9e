//! Launchers of the optimizer's kernels: the gradient norm and clipping coefficient, Adam (per
//! parameter or in place over flat buffers), and the copies into the flat gradient buffer.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{arg, check_elements, element_vector_size, gcd};
use crate::rows::cube_count;
use crate::rows::RowLaunch;
use crate::{adam, grad_norm};

/// Blocks of [`grad_norm_and_clip`]'s scratch for a buffer of `len` elements.
pub fn grad_norm_blocks(len: usize) -> usize {
    len.div_ceil(grad_norm::BLOCK).max(1)
}

/// The L2 norm of `len` f32 gradients into `norm` and the clipping coefficient `min(1,
/// max_norm / (norm + 1e-6))` into `clip` (1 when `max_norm` is 0), through `partials`
/// ([`grad_norm_blocks`] elements): two launches, an order fixed by `len` and the launch.
pub fn grad_norm_and_clip(
    client: &Client,
    launch: RowLaunch,
    grads: &Handle,
    partials: &Handle,
    [norm, clip]: [&Handle; 2],
    len: usize,
    max_norm: f32,
) {
    check_elements(len, "a gradient norm");
    let blocks = grad_norm_blocks(len);
    grad_norm::block_sums_of_squares::launch(
        client,
        cube_count(blocks),
        CubeDim::new_1d(launch.lanes),
        element_vector_size::<f32>(client, len.max(1)),
        arg(grads, len.max(1)),
        arg(partials, blocks),
        len as u32,
        launch.lanes,
    );
    grad_norm::norm_and_clip::launch(
        client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(launch.lanes),
        arg(partials, blocks),
        arg(norm, 1),
        arg(clip, 1),
        blocks as u32,
        max_norm,
        launch.lanes,
    );
}

/// The scalars of one Adam step, rounded once to f32 from the optimizer's f64 values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamScalars {
    /// β₁.
    pub beta1: f32,
    /// 1 − β₁.
    pub one_minus_beta1: f32,
    /// β₂.
    pub beta2: f32,
    /// 1 − β₂.
    pub one_minus_beta2: f32,
    /// Bias correction of the first moment, 1 − β₁ᵗ.
    pub correction1: f32,
    /// Bias correction of the second moment, 1 − β₂ᵗ.
    pub correction2: f32,
    /// ε.
    pub eps: f32,
    /// What the parameter is multiplied by before the update: 1 − lr · weight decay.
    pub keep: f32,
    /// Learning rate.
    pub lr: f32,
}

/// One Adam step of a parameter of `len` elements: `output` (`3 · len`) gets the new
/// parameter, first moment and second moment end to end; `moments` is `None` on the first
/// step.
pub fn adam_step<F: Float + CubeElement>(
    client: &Client,
    param: &Handle,
    grad: &Handle,
    moments: Option<(&Handle, &Handle)>,
    output: &Handle,
    len: usize,
    scalars: AdamScalars,
) {
    if len == 0 {
        return;
    }
    assert!(
        3 * len <= u32::MAX as usize,
        "an Adam step of more than 2³² / 3 elements"
    );
    // Without moments the kernel never reads them: bind the gradient in their place.
    let (m, v) = moments.unwrap_or((grad, grad));
    let s = scalars;
    let vector = element_vector_size::<F>(client, len);
    adam::adam_step::launch::<F>(
        client,
        cube_count((len / vector).div_ceil(adam::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(adam::UNITS_PER_CUBE),
        vector,
        arg(param, len),
        arg(grad, len),
        arg(m, len),
        arg(v, len),
        arg(output, 3 * len),
        s.beta1,
        s.one_minus_beta1,
        s.beta2,
        s.one_minus_beta2,
        s.correction1,
        s.correction2,
        s.eps,
        s.keep,
        s.lr,
        len as u32,
        moments.is_none(),
    );
}

impl AdamScalars {
    /// The values of [`adam_step_in_place`]'s `per_step` slot: `[1 − β₁ᵗ, 1 − β₂ᵗ, 1 − lr ·
    /// wd, lr]`.
    pub fn per_step(&self) -> [f32; 4] {
        [self.correction1, self.correction2, self.keep, self.lr]
    }
}

/// One in-place Adam step of the elements `start .. start + len` of flat buffers of `total`
/// elements (`param`, `m`, `v` overwritten), the gradient multiplied by the one-element
/// `clip` first. β₁, β₂ and ε come from `scalars`; the values that change from step to step
/// from slot `slot` of `per_step` ([`AdamScalars::per_step`], four f32 a slot), written there
/// by the caller: device memory, so that a captured step replays with new ones.
#[allow(clippy::too_many_arguments)]
pub fn adam_step_in_place<F: Float + CubeElement>(
    client: &Client,
    param: &Handle,
    grad: &Handle,
    (m, v): (&Handle, &Handle),
    clip: &Handle,
    (per_step, slot): (&Handle, usize),
    total: usize,
    (start, len): (usize, usize),
    scalars: AdamScalars,
) {
    if len == 0 {
        return;
    }
    assert!(
        start + len <= total && total <= u32::MAX as usize,
        "a flat Adam step of elements {start}..{} in a buffer of {total}",
        start + len
    );
    let s = scalars;
    // A vector that divides both ends of the range (a whole parameter group).
    let vector = element_vector_size::<F>(client, gcd(start, len));
    adam::adam_step_in_place::launch::<F>(
        client,
        cube_count((len / vector).div_ceil(adam::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(adam::UNITS_PER_CUBE),
        vector,
        arg(param, total),
        arg(grad, total),
        arg(m, total),
        arg(v, total),
        arg(clip, 1),
        arg(per_step, 4 * (slot + 1)),
        slot as u32,
        s.beta1,
        s.one_minus_beta1,
        s.beta2,
        s.one_minus_beta2,
        s.eps,
        start as u32,
        len as u32,
    );
}

/// One source of [`copy_at_offsets`]: `len` elements of `source` to `offset..offset + len`.
#[derive(Clone, Copy, Debug)]
pub struct CopyPiece<'a> {
    /// The elements to copy (at least `len`).
    pub source: &'a Handle,
    /// Where they go in the destination.
    pub offset: usize,
    /// How many.
    pub len: usize,
}

/// Copies every piece into its place in `destination` (`total` elements), up to
/// [`adam::COPY_SOURCES`] pieces per launch ([`adam::copy_at_offsets`]; fewer where the device
/// binds fewer buffers); the pieces must not overlap. The pieces hold `I`, the destination
/// `O`, and every element is multiplied by `scale` in f32 on the way (exact for `scale` 1): a
/// half-precision model's gradients go into the fp32 buffer, fp16's loss scale can come off
/// in the same pass.
pub fn copy_at_offsets<I: Float + CubeElement, O: Float + CubeElement>(
    client: &Client,
    pieces: &[CopyPiece<'_>],
    destination: &Handle,
    total: usize,
    scale: f32,
) {
    assert!(
        total <= u32::MAX as usize,
        "a flat buffer of {total} elements"
    );
    for piece in pieces {
        assert!(
            piece.offset + piece.len <= total,
            "a copy to elements {}..{} of a buffer of {total}",
            piece.offset,
            piece.offset + piece.len
        );
    }
    let per_launch = copy_sources_per_launch(client);
    for group in pieces.chunks(per_launch) {
        if group.iter().all(|p| p.len == 0) {
            continue;
        }
        // A vector that divides every piece's offset and length.
        let common = group.iter().fold(0, |g, p| gcd(gcd(g, p.offset), p.len));
        // Both sides' vectors: the narrower of the widest each dtype moves in one load.
        let v =
            element_vector_size::<I>(client, common).min(element_vector_size::<O>(client, common));
        let units = adam::UNITS_PER_CUBE as usize;
        // Unused slots bind the first source with length 0: a full launch has `per_launch`
        // slots, a shorter one the next power of two (a handful of kernel variants in all).
        let unused = CopyPiece { len: 0, ..group[0] };
        let slots = group.len().next_power_of_two().min(per_launch);
        let padded: Vec<CopyPiece> = group
            .iter()
            .copied()
            .chain(std::iter::repeat(unused))
            .take(slots)
            .collect();
        // Each piece's cubes follow the previous piece's.
        let cubes_of = |p: &CopyPiece| (p.len / v).div_ceil(units);
        let first_cubes: Vec<usize> = padded
            .iter()
            .scan(0, |next, p| {
                Some(std::mem::replace(next, *next + cubes_of(p)))
            })
            .collect();
        let cubes: usize = padded.iter().map(cubes_of).sum();
        adam::copy_at_offsets::launch::<I, O>(
            client,
            cube_count(cubes),
            CubeDim::new_1d(adam::UNITS_PER_CUBE),
            v,
            padded.iter().map(|p| arg(p.source, p.len)).collect(),
            arg(destination, total),
            padded.iter().map(|p| (p.offset / v) as u32).collect(),
            padded.iter().map(|p| (p.len / v) as u32).collect(),
            first_cubes.iter().map(|&c| c as u32).collect(),
            scale,
        );
    }
}

/// Sources per [`copy_at_offsets`] launch on `client`'s device: [`adam::COPY_SOURCES`], or
/// what its binding limit leaves beside the destination and the buffer of scalars and
/// lengths (29 on lavapipe, whose kernels bind 32 storage buffers, one kept by wgpu).
fn copy_sources_per_launch(client: &Client) -> usize {
    let bindings = client.properties().hardware.max_bindings as usize;
    bindings.saturating_sub(2).clamp(1, adam::COPY_SOURCES)
}
