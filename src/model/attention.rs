//! Causal self-attention with a fused QKV projection (Megatron's `ParallelAttention`).

use burn::module::Module;
use burn::tensor::{Device, Tensor};

use super::dropout::Dropout;
use super::kv_cache::LayerKv;
use super::ops::{offset_causal_masked_softmax, scaled_causal_masked_softmax};
use super::GptConfig;
use crate::comm::Group;
use crate::parallel::layers::{ColumnParallelLinear, RowParallelLinear};
use crate::parallel::random::RngRegion;

/// Multi-head causal self-attention, its heads split across the tensor-parallel ranks.
///
/// The fused QKV output is laid out per head as Megatron's is (`[heads, 3, head_dim]`), so the
/// column split gives each rank whole heads, q, k and v together.
#[derive(Module, Debug)]
pub struct CausalSelfAttention {
    /// hidden → 3 × hidden, column-parallel (this rank's heads).
    pub query_key_value: ColumnParallelLinear,
    /// hidden → hidden, row-parallel (std / √(2 · layers) at init).
    pub dense: RowParallelLinear,
    /// Dropout on the attention probabilities (a model-parallel region: per-rank masks).
    pub attention_dropout: Dropout,
    /// Heads on this rank.
    pub local_heads: usize,
    /// Use the fused softmax kernel where the backend has it (off:
    /// `--no-masked-softmax-fusion`).
    pub masked_softmax_fusion: bool,
    /// Use the fused (FlashAttention-style) attention kernel where the backend has it
    /// (`--use-flash-attn`).
    pub flash_attention: bool,
}

impl CausalSelfAttention {
    /// The attention named `name` (e.g. `layers.0.self_attention`).
    pub fn new(config: &GptConfig, seed: u64, name: &str, group: &Group, device: &Device) -> Self {
        let h = config.hidden_size;
        let std = config.init_method_std;
        let output_std = std / (2.0 * config.num_layers as f64).sqrt();
        let qkv_name = format!("{name}.query_key_value");
        Self {
            query_key_value: ColumnParallelLinear::new(
                h,
                3 * h,
                std,
                seed,
                &qkv_name,
                false,
                group,
                device,
            ),
            dense: RowParallelLinear::new(
                h,
                h,
                output_std,
                seed,
                &format!("{name}.dense"),
                true,
                group,
                device,
            ),
            attention_dropout: Dropout::new(config.attention_dropout, RngRegion::ModelParallel),
            local_heads: config.num_attention_heads / group.size(),
            masked_softmax_fusion: config.masked_softmax_fusion,
            flash_attention: config.flash_attention,
        }
    }

    /// Queries, keys and values `[batch, local heads, seq, head_dim]` of `x`, from the fused
    /// per-head `[q k v]` projection.
    pub fn query_key_value_heads(&self, x: Tensor<3>) -> [Tensor<4>; 3] {
        let [b, s, _] = x.dims();
        let qkv = self.query_key_value.forward(x); // [b, s, local heads · 3 · head_dim]
        let heads = self.local_heads;
        let head_dim = qkv.dims()[2] / (3 * heads);
        let qkv = qkv.reshape([b, s, heads, 3 * head_dim]);
        [0, 1, 2].map(|i| {
            qkv.clone()
                .narrow(3, i * head_dim, head_dim)
                .swap_dims(1, 2)
        })
    }

    /// The output projection of the per-head context `[batch, local heads, seq, head_dim]`.
    pub fn project_out(&self, context: Tensor<4>) -> Tensor<3> {
        let [b, heads, s, head_dim] = context.dims();
        self.dense
            .forward(context.swap_dims(1, 2).reshape([b, s, heads * head_dim]))
    }

    /// The attention core (Megatron's `CoreAttention`): `dropout(softmax(q kᵀ / √d)) v`, the
    /// per-head context `[batch, local heads, seq, head_dim]`. It has no parameters and keeps
    /// the largest activations (`[batch, heads, seq, seq]`), which is why selective
    /// recomputation recomputes exactly this.
    ///
    /// With `--use-flash-attn` on a CubeCL device it is one fused kernel that keeps only the
    /// output and a log-sum-exp per row (dropping the same probabilities as the composed
    /// path for the same seed).
    pub fn core(&self, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
        let head_dim = q.dims()[3];
        let scale = 1.0 / (head_dim as f64).sqrt();
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if self.flash_attention && crate::util::device::is_cube(&q.device()) {
            let draw = self.attention_dropout.draw(q.is_autodiff());
            return super::fused_ops::causal_attention(q, k, v, scale, draw);
        }
        let scores = q.matmul(k.transpose());
        let probs = scaled_causal_masked_softmax(scores, scale, self.masked_softmax_fusion);
        self.attention_dropout.forward(probs).matmul(v)
    }

    /// `[batch, seq, hidden]` → `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [q, k, v] = self.query_key_value_heads(x);
        self.project_out(self.core(q, k, v))
    }

    /// [`Self::forward`] for `x` = the positions after those in `past` (inference only, no
    /// dropout): their keys and values are appended to `past`, and each query attends to every
    /// cached position and to the new ones up to itself.
    pub fn forward_cached(&self, x: Tensor<3>, past: &mut Option<LayerKv>) -> Tensor<3> {
        let [q, k, v] = self.query_key_value_heads(x);
        let [_, _, s, head_dim] = q.dims();
        let (k, v) = match past.take() {
            Some(p) => (
                Tensor::cat(vec![p.keys, k], 2),
                Tensor::cat(vec![p.values, v], 2),
            ),
            None => (k, v),
        };
        *past = Some(LayerKv {
            keys: k.clone(),
            values: v.clone(),
        });
        let cached = k.dims()[2] - s;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let scores = q.matmul(k.transpose());
        let probs = if cached == 0 {
            scaled_causal_masked_softmax(scores, scale, self.masked_softmax_fusion)
        } else {
            offset_causal_masked_softmax(scores, scale, cached)
        };
        self.project_out(probs.matmul(v))
    }
}
