//! Causal self-attention with a fused QKV projection (Megatron's `ParallelAttention`).

use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig};
use burn::tensor::{Device, Tensor};

use super::linear::Linear;
use super::ops::scaled_causal_masked_softmax;
use super::GptConfig;

/// Multi-head causal self-attention.
///
/// The fused QKV output is laid out per head as Megatron's is (`[heads, 3, head_dim]`), so a
/// column split over heads keeps each head's q, k and v together on one rank.
#[derive(Module, Debug)]
pub struct CausalSelfAttention {
    /// hidden → 3 × hidden.
    pub query_key_value: Linear,
    /// hidden → hidden (std / √(2 · layers) at init).
    pub dense: Linear,
    /// Dropout on the attention probabilities.
    pub attention_dropout: Dropout,
    /// Heads.
    pub num_heads: usize,
}

impl CausalSelfAttention {
    /// Layer `layer`'s attention.
    pub fn new(config: &GptConfig, seed: u64, name: &str, device: &Device) -> Self {
        let h = config.hidden_size;
        let std = config.init_method_std;
        let output_std = std / (2.0 * config.num_layers as f64).sqrt();
        Self {
            query_key_value: Linear::new(
                h,
                3 * h,
                std,
                seed,
                &format!("{name}.query_key_value"),
                device,
            ),
            dense: Linear::new(h, h, output_std, seed, &format!("{name}.dense"), device),
            attention_dropout: DropoutConfig::new(config.attention_dropout).init(),
            num_heads: config.num_attention_heads,
        }
    }

    /// `[batch, seq, hidden]` → `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, s, h] = x.dims();
        let (heads, head_dim) = (self.num_heads, h / self.num_heads);
        let qkv = self
            .query_key_value
            .forward(x)
            .reshape([b, s, heads, 3 * head_dim]);
        let part = |i: usize| {
            qkv.clone()
                .narrow(3, i * head_dim, head_dim)
                .swap_dims(1, 2)
        };
        let (q, k, v) = (part(0), part(1), part(2)); // [b, heads, s, head_dim]
        let scores = q.matmul(k.transpose());
        let probs = scaled_causal_masked_softmax(scores, 1.0 / (head_dim as f64).sqrt());
        let context = self.attention_dropout.forward(probs).matmul(v);
        self.dense
            .forward(context.swap_dims(1, 2).reshape([b, s, h]))
    }
}
