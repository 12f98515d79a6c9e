//! The transformer's MLP: hidden → ffn → GELU → hidden.

use burn::module::Module;
use burn::tensor::activation::{gelu, gelu_approximate};
use burn::tensor::{Device, Tensor};

use super::GptConfig;
use crate::comm::Group;
use crate::parallel::layers::{ColumnParallelLinear, RowParallelLinear};

/// Megatron's `ParallelMLP`: h → ffn column-parallel, GELU on each rank's columns,
/// ffn → h row-parallel.
#[derive(Module, Debug)]
pub struct Mlp {
    /// hidden → ffn (this rank's columns).
    pub dense_h_to_4h: ColumnParallelLinear,
    /// ffn → hidden (this rank's rows; std / √(2 · layers) at init).
    pub dense_4h_to_h: RowParallelLinear,
    /// tanh GELU (`--openai-gelu`) instead of the exact erf form.
    pub openai_gelu: bool,
}

impl Mlp {
    /// The MLP named `name` (e.g. `layers.0.mlp`).
    pub fn new(config: &GptConfig, seed: u64, name: &str, group: &Group, device: &Device) -> Self {
        let (h, f) = (config.hidden_size, config.ffn_size());
        let std = config.init_method_std;
        let output_std = std / (2.0 * config.num_layers as f64).sqrt();
        Self {
            dense_h_to_4h: ColumnParallelLinear::new(
                h,
                f,
                std,
                seed,
                &format!("{name}.dense_h_to_4h"),
                false,
                group,
                device,
            ),
            dense_4h_to_h: RowParallelLinear::new(
                f,
                h,
                output_std,
                seed,
                &format!("{name}.dense_4h_to_h"),
                true,
                group,
                device,
            ),
            openai_gelu: config.openai_gelu,
        }
    }

    /// `[batch, seq, hidden]` → `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let h = self.dense_h_to_4h.forward(x);
        let h = if self.openai_gelu {
            gelu_approximate(h)
        } else {
            gelu(h)
        };
        self.dense_4h_to_h.forward(h)
    }
}
