//! A dense layer `y = x·W + b` with its weight stored `[in, out]`.
//!
//! ferrotron's own (rather than burn's `nn::Linear`) so that initialization is explicit and
//! deterministic, and so that the tensor-parallel column/row layers can share its shape.

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

use super::init::{init_tensor, Init};

/// `y = x·W + b`.
#[derive(Module, Debug)]
pub struct Linear {
    /// `[in, out]`.
    pub weight: Param<Tensor<2>>,
    /// `[out]`.
    pub bias: Param<Tensor<1>>,
}

impl Linear {
    /// A layer with Normal(0, `std`) weights and zero bias; `name` seeds the weights.
    pub fn new(
        d_in: usize,
        d_out: usize,
        std: f64,
        seed: u64,
        name: &str,
        device: &Device,
    ) -> Self {
        Self {
            weight: Param::from_tensor(init_tensor(
                Init::Normal(std),
                [d_in, d_out],
                seed,
                &format!("{name}.weight"),
                device,
            )),
            bias: Param::from_tensor(init_tensor(
                Init::Zeros,
                [d_out],
                seed,
                &format!("{name}.bias"),
                device,
            )),
        }
    }

    /// Applies the layer over the last dimension of `x`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        x.matmul(self.weight.val().unsqueeze()) + self.bias.val().unsqueeze()
    }
}
