//! LayerNorm over the last dimension (γ = 1, β = 0 at start).

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

use super::init::{init_tensor, Init};
use super::ops;

/// `(x − mean) / sqrt(var + ε) · γ + β` over the last dimension.
#[derive(Module, Debug)]
pub struct LayerNorm {
    /// γ, `[hidden]`.
    pub weight: Param<Tensor<1>>,
    /// β, `[hidden]`.
    pub bias: Param<Tensor<1>>,
    /// ε (`--layernorm-epsilon`).
    pub epsilon: f64,
}

impl LayerNorm {
    /// A LayerNorm of width `hidden`.
    pub fn new(hidden: usize, epsilon: f64, seed: u64, name: &str, device: &Device) -> Self {
        Self {
            weight: Param::from_tensor(init_tensor(
                Init::Ones,
                [hidden],
                seed,
                &format!("{name}.weight"),
                device,
            )),
            bias: Param::from_tensor(init_tensor(
                Init::Zeros,
                [hidden],
                seed,
                &format!("{name}.bias"),
                device,
            )),
            epsilon,
        }
    }

    /// Normalizes `x` over its last dimension.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        ops::layer_norm(x, self.weight.val(), self.bias.val(), self.epsilon)
    }
}
