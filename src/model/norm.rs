//! The normalization before each sublayer and the output layer: LayerNorm or RMSNorm
//! (`--normalization`), over the last dimension.

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

use super::architecture::Normalization;
use super::ops;
use crate::comm::Group;
use crate::parallel::mappings::copy_to_region;
use crate::util::init::{init_tensor, Init};

/// `(x − mean) / √(var + ε) · γ + β` (LayerNorm) or `x / √(mean(x²) + ε) · γ` (RMSNorm, no β),
/// with γ stored as `γ − 1` under `--apply-layernorm-1p` (so that weight decay pulls it
/// towards 1, not 0).
#[derive(Module, Debug)]
pub struct Norm {
    /// γ (or γ − 1 under `--apply-layernorm-1p`), `[width]`.
    pub weight: Param<Tensor<1>>,
    /// β, `[width]`; LayerNorm only.
    pub bias: Option<Param<Tensor<1>>>,
    /// ε (`--norm-epsilon`).
    pub epsilon: f64,
    /// RMSNorm instead of LayerNorm.
    pub rms: bool,
    /// γ stored zero-centred (`--apply-layernorm-1p`).
    pub one_plus: bool,
    /// Use the fused kernel (LayerNorm's or RMSNorm's) where the backend has it (off:
    /// `--no-persist-layer-norm`).
    pub fused: bool,
    /// The group over which this norm sees only part of its input (the query/key norms see
    /// this rank's heads): its weights are whole on every rank, but each rank's gradient is
    /// its part's, so the weights enter through [`copy_to_region`] and their gradients are
    /// summed over the group (what Megatron's `finalize_model_grads` does for them).
    #[module(skip)]
    pub input_split_over: Option<Group>,
}

impl Norm {
    /// A norm of width `width` named `name` (γ = 1, β = 0 at start; fused where the backend
    /// has the kernel).
    pub fn new(
        kind: Normalization,
        width: usize,
        epsilon: f64,
        one_plus: bool,
        name: &str,
        device: &Device,
    ) -> Self {
        let param = |init, field: &str| {
            Param::from_tensor(init_tensor(
                init,
                [width],
                0,
                &format!("{name}.{field}"),
                device,
            ))
        };
        let rms = kind == Normalization::RmsNorm;
        Self {
            weight: param(if one_plus { Init::Zeros } else { Init::Ones }, "weight"),
            bias: (!rms).then(|| param(Init::Zeros, "bias")),
            epsilon,
            rms,
            one_plus,
            fused: true,
            input_split_over: None,
        }
    }

    /// The same norm, seeing only `group`'s rank's part of its input.
    pub fn with_input_split_over(mut self, group: &Group) -> Self {
        self.input_split_over = (group.size() > 1).then(|| group.clone());
        self
    }

    /// A parameter as this rank's forward uses it.
    fn shared<const D: usize>(&self, p: Tensor<D>) -> Tensor<D> {
        match &self.input_split_over {
            Some(group) => copy_to_region(p, group),
            None => p,
        }
    }

    /// The same norm, with the fused kernel allowed or not.
    pub fn with_fusion(mut self, fused: bool) -> Self {
        self.fused = fused;
        self
    }

    /// γ as applied.
    fn gamma(&self) -> Tensor<1> {
        let weight = self.shared(self.weight.val());
        if self.one_plus {
            weight.add_scalar(1.0)
        } else {
            weight
        }
    }

    /// Normalizes `x` over its last dimension.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        match &self.bias {
            Some(bias) if !self.rms => ops::layer_norm(
                x,
                self.gamma(),
                self.shared(bias.val()),
                self.epsilon,
                self.fused,
            ),
            _ => ops::rms_norm(x, self.gamma(), self.epsilon, self.fused),
        }
    }

    /// [`Self::forward`] for per-head tensors `[batch, heads, seq, head_dim]` (the query/key
    /// norms).
    pub fn forward_heads(&self, x: Tensor<4>) -> Tensor<4> {
        let [b, heads, s, d] = x.dims();
        self.forward(x.reshape([b, heads * s, d]))
            .reshape([b, heads, s, d])
    }
}
