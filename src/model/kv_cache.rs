//! Keys and values of the positions already seen, so that generating one more token costs one
//! position's work instead of the whole prefix's.

use burn::tensor::Tensor;

/// One layer's cached keys and values, `[batch, local heads, positions, head_dim]` each.
#[derive(Clone, Debug)]
pub struct LayerKv {
    /// Keys.
    pub keys: Tensor<4>,
    /// Values.
    pub values: Tensor<4>,
}

/// The cache of a whole model: one entry per layer, filled by [`crate::model::Gpt::forward_cached`].
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    /// Per layer; `None` until the first forward.
    pub layers: Vec<Option<LayerKv>>,
    /// Positions cached so far (the next token's position).
    pub positions: usize,
}

impl KvCache {
    /// An empty cache for `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            positions: 0,
        }
    }
}
