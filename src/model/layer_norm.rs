//! LayerNorm over the last dimension (γ = 1, β = 0 at start).

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

use super::ops;
use crate::util::init::{init_tensor, Init};

/// `(x − mean) / sqrt(var + ε) · γ + β` over the last dimension.
#[derive(Module, Debug)]
pub struct LayerNorm {
    /// γ, `[hidden]`.
    pub weight: Param<Tensor<1>>,
    /// β, `[hidden]`.
    pub bias: Param<Tensor<1>>,
    /// ε (`--layernorm-epsilon`).
    pub epsilon: f64,
    /// Use the fused kernel where the backend has it (off: `--no-persist-layer-norm`).
    pub fused: bool,
}

impl LayerNorm {
    /// A LayerNorm of width `hidden` (fused where the backend has the kernel).
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
            fused: true,
        }
    }

    /// The same LayerNorm, with the fused kernel allowed or not.
    pub fn with_fusion(mut self, fused: bool) -> Self {
        self.fused = fused;
        self
    }

    /// Normalizes `x` over its last dimension.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        ops::layer_norm(
            x,
            self.weight.val(),
            self.bias.val(),
            self.epsilon,
            self.fused,
        )
    }
}
