//! Packed documents as a forward pass sees them: each token's position and first visible key
//! within its own document (Megatron's `--reset-position-ids` and `--reset-attention-mask`;
//! how they are read off the end-of-document tokens is `data::sample_masks`).
//!
//! Both are one integer per token, never an `s × s` mask: the keys a query sees are the run
//! from its document's first token to itself, so attention needs only where that run starts.

use burn::tensor::{Bool, Device, Int, Tensor};

/// The micro-batch's per-document positions and attention starts, each `[batch, seq]` (the
/// whole sequence, also under sequence parallelism); `None` where the run does not reset
/// them (positions `0..seq`, causal attention from key 0). The default is neither.
#[derive(Clone, Debug, Default)]
pub struct Documents {
    /// Each token's position in its document (`--reset-position-ids`).
    pub positions: Option<Tensor<2, Int>>,
    /// Each query's first visible key: its document's first token (`--reset-attention-mask`).
    pub first_keys: Option<Tensor<2, Int>>,
}

impl Documents {
    /// Neither reset: one document per sequence as far as the model can tell.
    pub fn none() -> Self {
        Self::default()
    }
}

/// `[batch, 1, sq, sk]`, true where query `i` (at position `offset + i` among the keys: a
/// KV cache holds `offset` before it) may not see key `j`: after it (causal), or before
/// `first_keys[i]` (another document, or outside its window).
pub fn hidden_keys(first_keys: Tensor<2, Int>, sk: usize, offset: usize) -> Tensor<4, Bool> {
    let [b, sq] = first_keys.dims();
    let device = first_keys.device();
    let shape = [b, 1, sq, sk];
    let keys = Tensor::<1, Int>::arange(0..sk as i64, &device)
        .reshape([1, 1, 1, sk])
        .expand(shape);
    let before = keys.lower(first_keys.reshape([b, 1, sq, 1]).expand(shape));
    let after = Tensor::<2, Bool>::tril_mask([sq, sk], offset as i64, &device)
        .reshape([1, 1, sq, sk])
        .expand(shape);
    before.bool_or(after)
}

/// The first key each of `sq` queries at positions `offset ..` sees in a sliding window of
/// `window` keys before it: `max(0, position − window)` (Megatron's
/// `get_sliding_window_causal_mask` with `window_size = (window, 0)`).
pub fn window_first_keys(
    window: usize,
    offset: usize,
    sq: usize,
    device: &Device,
) -> Tensor<1, Int> {
    Tensor::<1, Int>::arange(offset as i64..(offset + sq) as i64, device)
        .sub_scalar(window as i64)
        .clamp_min(0)
}
