//! The transformer's MLP: hidden → ffn → activation → hidden, with GELU (GPT-2) or SwiGLU
//! (Llama).

use burn::module::Module;
use burn::tensor::{Device, Tensor};

use super::ops::{bias_gelu, swiglu};
use super::GptConfig;
use crate::comm::Group;
use crate::parallel::layers::{ColumnParallelLinear, RowParallelLinear};

/// Megatron's `ParallelMLP`: h → ffn column-parallel, the activation on each rank's columns,
/// ffn → h row-parallel.
///
/// Under `--swiglu` the first layer has a second, gating half: `silu(x·W_gate) ⊙ (x·W)`.
/// Megatron stores both halves in one `[gate; up]` matrix whose tensor-parallel shards each
/// hold a piece of both; here they are two column-parallel layers, so that every parameter is
/// split by plain chunks (and checkpoints reshard without knowing the MLP).
#[derive(Module, Debug)]
pub struct Mlp {
    /// hidden → ffn (this rank's columns): the activation's input, or SwiGLU's linear half.
    pub dense_h_to_4h: ColumnParallelLinear,
    /// hidden → ffn, SwiGLU's gate (`--swiglu`).
    pub dense_h_to_4h_gate: Option<ColumnParallelLinear>,
    /// ffn → hidden (this rank's rows; std / √(2 · layers) at init).
    pub dense_4h_to_h: RowParallelLinear,
    /// tanh GELU (`--openai-gelu`) instead of the exact erf form.
    pub openai_gelu: bool,
    /// SwiGLU's `silu(gate) ⊙ up` as one fused kernel where the backend has it
    /// (`--no-bias-swiglu-fusion` turns it off); the math is the same.
    pub fused: bool,
    /// GELU as one fused kernel each way where the backend has it (`--no-bias-gelu-fusion`
    /// turns it off); the math is the same.
    pub fused_gelu: bool,
}

impl Mlp {
    /// The MLP named `name` (e.g. `layers.0.mlp`).
    pub fn new(config: &GptConfig, seed: u64, name: &str, group: &Group, device: &Device) -> Self {
        let (h, f) = (config.hidden_size, config.ffn_size());
        let std = config.init_method_std;
        let output_std = std / (2.0 * config.num_layers as f64).sqrt();
        let bias = config.add_bias_linear;
        let column = |suffix: &str| {
            ColumnParallelLinear::new(
                h,
                f,
                std,
                seed,
                &format!("{name}.{suffix}"),
                false,
                group,
                device,
            )
            .with_bias(bias)
            .with_sequence_parallel(config.sequence_parallel)
        };
        Self {
            dense_h_to_4h: column("dense_h_to_4h"),
            dense_h_to_4h_gate: config.swiglu.then(|| column("dense_h_to_4h_gate")),
            dense_4h_to_h: RowParallelLinear::new(
                f,
                h,
                output_std,
                seed,
                &format!("{name}.dense_4h_to_h"),
                true,
                group,
                device,
            )
            .with_bias(bias)
            .with_sequence_parallel(config.sequence_parallel),
            openai_gelu: config.openai_gelu,
            fused: config.bias_swiglu_fusion,
            fused_gelu: config.bias_gelu_fusion,
        }
    }

    /// `[batch, seq, hidden]` → `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        match self.forward_skip_bias(x) {
            (y, Some(bias)) => y + bias.unsqueeze(),
            (y, None) => y,
        }
    }

    /// [`Self::forward`] without the output layer's bias, and the bias (for a fused
    /// bias-dropout-add).
    pub fn forward_skip_bias(&self, x: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        let h = match &self.dense_h_to_4h_gate {
            Some(gate) => {
                let x = self.dense_h_to_4h.enter_region(x);
                swiglu(
                    gate.forward_in_region(x.clone()),
                    self.dense_h_to_4h.forward_in_region(x),
                    self.fused,
                )
            }
            None => {
                let (h, bias) = self.dense_h_to_4h.forward_skip_bias(x);
                bias_gelu(h, bias, self.openai_gelu, self.fused_gelu)
            }
        };
        self.dense_4h_to_h.forward_skip_bias(h)
    }
}
