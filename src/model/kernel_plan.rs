//! The kernels a model runs on a CubeCL device, said in one line of the log. Each fused
//! operation's implementation is chosen when the model is built: by the device (the fused
//! kernels run on CubeCL devices, burn's composed ops elsewhere), by the run's flags (Megatron's
//! `--use-flash-attn`, `--attention-backend`, `--no-masked-softmax-fusion`,
//! `--no-persist-layer-norm`, `--no-rope-fusion`, `--no-bias-gelu-fusion`,
//! `--no-bias-swiglu-fusion`, `--no-bias-dropout-fusion`) and, for the attention core's
//! kernels, by the device's matrix units, planes and shared memory
//! (`ferrotron_kernels::launch::AttentionLaunch::for_client`). The line is asked of the layers'
//! own choices, so that it says what runs.

use burn::tensor::{DType, Device};

use super::attention::CausalSelfAttention;
use super::Gpt;

impl Gpt {
    /// The log's line on the kernels this model (its first layer on this rank, every layer
    /// being built alike) runs on `device` with its weights stored as `dtype`; `None` off
    /// CubeCL devices, where every operation is burn's composed ops.
    pub fn kernels_in_words(&self, device: &Device, dtype: DType) -> Option<String> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if crate::util::device::is_cube(device) {
            let layer = self.held_layers().next()?;
            let fused = |on: bool| if on { "fused" } else { "composed" };
            let mlp = &layer.mlp;
            let activation = match mlp.dense_h_to_4h_gate {
                Some(_) => format!("SwiGLU {}", fused(mlp.fused)),
                None => format!("GELU {}", fused(mlp.fused_gelu)),
            };
            let attention = &layer.self_attention;
            let rotary = attention.rotary.as_ref().map_or(String::new(), |r| {
                if attention.reset_position_ids {
                    "; rotary embedding composed, at the documents' positions".into()
                } else {
                    format!("; rotary embedding {}", fused(r.is_fused()))
                }
            });
            return Some(format!(
                "kernels: attention: {}; norms {}{rotary}; MLP {activation}; bias-dropout-add {}; \
                 embedding and vocab-parallel cross-entropy fused",
                attention.core_in_words(device, dtype),
                fused(layer.input_layernorm.fused),
                fused(layer.bias_dropout_fusion),
            ));
        }
        let _ = (device, dtype);
        None
    }
}

impl CausalSelfAttention {
    /// What the attention core runs on the CubeCL device `device` with heads stored as
    /// `dtype`, in words, as [`Self::core_inputs`], [`Self::core`] and [`Self::core_heads`]
    /// choose it.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    pub fn core_in_words(&self, device: &Device, dtype: DType) -> String {
        if let Some(split) = &self.context {
            let core = if self.flash_attention {
                "fused core (--use-flash-attn)"
            } else {
                "composed core"
            };
            return format!(
                "{core} per context-parallel chunk: keys and values gathered over {} ranks \
                 ({:?}), each chunk's queries over the keys before them",
                split.size(),
                split.comm
            );
        }
        let masked = self.reset_attention_mask || self.sliding_window.is_some();
        if masked && !self.flash_attention {
            return "composed core: products, composed softmax masked from each query's first \
                    key (--reset-attention-mask, --window-size; with --use-flash-attn the \
                    fused kernels skip the tiles no query of a block sees)"
                .into();
        }
        let from_rows = if self.core_from_rows(device) {
            let inside = match (self.query_key_value.bias.is_some(), self.rotary.is_some()) {
                (true, true) => "split, bias and rotary embedding",
                (true, false) => "split and bias",
                (false, true) => "split and rotary embedding",
                (false, false) => "split",
            };
            format!(", from the QKV rows ({inside} inside)")
        } else {
            String::new()
        };
        if self.flash_attention {
            let kernels = super::fused::attention_kernels_in_words(device, dtype, self.head_dim)
                .unwrap_or_default();
            let documents = if masked {
                ", each query from its first visible key (tiles before it skipped)"
            } else {
                ""
            };
            return format!("fused core (--use-flash-attn) {kernels}{from_rows}{documents}");
        }
        let softmax = match (self.masked_softmax_fusion, from_rows.is_empty()) {
            (true, false) => "fused causal softmax with its dropout",
            (true, true) => "fused causal softmax",
            (false, _) => "composed softmax",
        };
        let keeps = if !from_rows.is_empty() && self.core_keeps_only_inputs {
            ", keeping only q, k, v"
        } else {
            ""
        };
        format!("composed core: products, {softmax}{from_rows}{keeps}")
    }
}
