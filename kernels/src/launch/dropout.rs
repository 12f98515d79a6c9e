//! Dropout draws as the kernels take them, and the launchers of dropout and bias-dropout-add.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::salt::salt_arg;
use super::{arg, element_vector_size};
use crate::dropout;
use crate::rows::cube_count;

/// `output = residual + dropout(input + bias)` of `len` elements, the bias (`hidden`
/// elements, broadcast over rows) optional, the draw optional (none: nothing dropped), the
/// tensors holding the draw's slice.
#[allow(clippy::too_many_arguments)]
pub fn bias_dropout_add<F: Float + CubeElement>(
    client: &Client,
    [residual, input]: [&Handle; 2],
    bias: Option<&Handle>,
    output: &Handle,
    len: usize,
    hidden: usize,
    draw: Option<DropoutDraw>,
) {
    if len == 0 {
        return;
    }
    let d = draw.unwrap_or(NO_DRAW);
    d.slice.check_holds(len);
    assert!(
        hidden > 0 && len.is_multiple_of(hidden),
        "{len} elements in rows of {hidden}"
    );
    let vector = element_vector_size::<F>(client, hidden);
    dropout::bias_dropout_add::launch::<F>(
        client,
        cube_count((len / vector).div_ceil(dropout::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(dropout::UNITS_PER_CUBE),
        vector,
        arg(residual, len),
        arg(input, len),
        // Without a bias the kernel never reads it: bind the input in its place.
        bias.map_or_else(|| arg(input, 1), |b| arg(b, hidden)),
        arg(output, len),
        salt_arg(client, draw, input),
        d.key_lo,
        d.key_hi,
        d.threshold,
        d.scale,
        len as u32,
        hidden as u32,
        d.slice.own,
        d.slice.row,
        d.slice.first,
        bias.is_some(),
        draw.is_some(),
        d.slice.is_whole(),
    );
}

/// A dropout draw: its key and the drop probability, as the kernel takes them. The key is
/// `(key_lo, key_hi)` XOR `salt`: the constant part travels with the launch, the salt (the
/// micro-batch's) through device memory ([`super::dropout_salt_buffer`]), so that a captured
/// graph can replay with another micro-batch's masks. The tensor it is applied to holds its
/// `slice` (a sequence-parallel rank's chunk of the sequence, a tensor-parallel rank's heads of
/// the attention probabilities), so that every layout drops what one process drops.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutDraw {
    /// Low 32 bits of the draw's constant.
    pub key_lo: u32,
    /// High 32 bits of the draw's constant.
    pub key_hi: u32,
    /// The micro-batch's salt: the key is the constant XOR this.
    pub salt: u64,
    /// Which of the step's salt buffers holds it (the micro-batch's place in the step).
    pub salt_slot: u64,
    /// Elements whose bits are below this are dropped (`p · 2³²`).
    pub threshold: u32,
    /// What kept elements are multiplied by (`1 / (1 − p)`).
    pub scale: f32,
    /// Which elements of the draw the tensor holds.
    pub slice: DrawSlice,
}

impl DropoutDraw {
    /// The draw's key as the kernels use it, `(low, high)` words: the constant XOR the salt.
    pub fn key(&self) -> (u32, u32) {
        (
            self.key_lo ^ self.salt as u32,
            self.key_hi ^ (self.salt >> 32) as u32,
        )
    }

    /// The draw for a tensor holding `slice` of it.
    pub fn sliced(self, slice: DrawSlice) -> Self {
        Self { slice, ..self }
    }

    /// The draw as the row kernels (the softmax's) take it.
    pub(super) fn scalars(&self) -> dropout::DrawScalarsLaunch {
        dropout::DrawScalarsLaunch::new(
            self.key_lo,
            self.key_hi,
            self.threshold,
            self.scale,
            self.slice.own,
            self.slice.row,
            self.slice.first,
        )
    }
}

/// The scalars a kernel without a draw is given (it never reads them).
pub(super) const NO_DRAW: DropoutDraw = DropoutDraw {
    key_lo: 0,
    key_hi: 0,
    salt: 0,
    salt_slot: 0,
    threshold: 0,
    scale: 1.0,
    slice: DrawSlice::WHOLE,
};

/// Which elements of a draw a tensor holds: runs of `own` elements starting at `first` in
/// rows of `row` (a sequence-parallel rank's chunk of the whole sequence's mask), or all of
/// it ([`DrawSlice::WHOLE`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrawSlice {
    /// Elements per run.
    pub own: u32,
    /// Draw elements per row (0 for a whole tensor: one run).
    pub row: u32,
    /// The run's first element within its row.
    pub first: u32,
}

impl DrawSlice {
    /// A tensor that is the whole draw: one run, element `i` draw element `i` (also by the
    /// general index, `(i / own) · row + first + i % own`).
    pub const WHOLE: Self = Self {
        own: u32::MAX,
        row: 0,
        first: 0,
    };

    /// Panics unless a tensor of `len` elements holding this slice indexes its draw in 32
    /// bits (what the kernels compute the draw index in).
    pub(super) fn check_holds(&self, len: usize) {
        let rows = len.div_ceil(self.own as usize) as u64;
        assert!(
            len <= u32::MAX as usize && rows * u64::from(self.row.max(self.own)) <= 1 << 32,
            "dropout of a draw of more than 2³² elements"
        );
    }

    /// [`Self::check_holds`] for a tensor of `len` elements in rows of `row_len`, and panics
    /// if a run cuts a row: the row kernels (the softmax's, attention's) offset a row's
    /// indices once ([`crate::dropout::run_offset`]).
    pub(super) fn check_rows(&self, len: usize, row_len: usize) {
        self.check_holds(len);
        assert!(
            self.row == 0 || (self.own as usize).is_multiple_of(row_len.max(1)),
            "a draw's runs of {} elements cut rows of {row_len}",
            self.own
        );
    }

    /// Whether the tensor is the whole draw from its start (element `i` is draw element `i`;
    /// the kernels compile that case without the slice's arithmetic).
    pub fn is_whole(&self) -> bool {
        self.row == 0 && self.first == 0
    }

    /// Chunk `rank` of `parts` equal chunks along dimension 1 of the draw's tensor, a chunk
    /// holding `own` elements of each row (its part of dimension 1 times the dimensions after
    /// it).
    pub fn chunk(own: usize, parts: usize, rank: usize) -> Self {
        assert!(
            own * parts <= u32::MAX as usize,
            "a draw of more than 2³² elements"
        );
        Self {
            own: own.max(1) as u32,
            row: (own * parts) as u32,
            first: (own * rank) as u32,
        }
    }
}

/// `output = input ⊙ mask` of `len` elements for `draw` (dropout's forward, and its
/// backward on the output's gradient with the same draw), the tensors holding the draw's
/// slice.
pub fn dropout<F: Float + CubeElement>(
    client: &Client,
    input: &Handle,
    output: &Handle,
    len: usize,
    draw: DropoutDraw,
) {
    if len == 0 {
        return;
    }
    let slice = draw.slice;
    slice.check_holds(len);
    let vector = element_vector_size::<F>(client, len);
    dropout::dropout::launch::<F>(
        client,
        cube_count((len / vector).div_ceil(dropout::UNITS_PER_CUBE as usize)),
        CubeDim::new_1d(dropout::UNITS_PER_CUBE),
        vector,
        arg(input, len),
        arg(output, len),
        salt_arg(client, Some(draw), input),
        draw.key_lo,
        draw.key_hi,
        draw.threshold,
        draw.scale,
        len as u32,
        slice.own,
        slice.row,
        slice.first,
        slice.is_whole(),
    );
}
