//! One pre-norm transformer layer.

use burn::module::Module;
use burn::tensor::{Device, Tensor};

use super::attention::{CausalSelfAttention, CoreInputs, CoreKeeps};
use super::documents::Documents;
use super::dropout::Dropout;
use super::kv_cache::LayerKv;
use super::mlp::Mlp;
use super::norm::Norm;
use super::GptConfig;
use crate::comm::Group;
use crate::parallel::random::{enter_layer, RngRegion};

/// `x + drop(attn(norm(x)))`, then `x + drop(mlp(norm(x)))`.
#[derive(Module, Debug)]
pub struct TransformerBlock {
    /// Norm before attention.
    pub input_layernorm: Norm,
    /// Causal self-attention.
    pub self_attention: CausalSelfAttention,
    /// Norm before the MLP.
    pub post_attention_layernorm: Norm,
    /// The MLP.
    pub mlp: Mlp,
    /// `--hidden-dropout` on each branch before the residual add (replicated region).
    pub hidden_dropout: Dropout,
    /// Bias, dropout and residual add in one kernel where the backend has it
    /// (`--no-bias-dropout-fusion` turns it off; the math is the same).
    pub bias_dropout_fusion: bool,
    /// The layer's place in the whole model, which keys its dropout streams.
    #[module(skip)]
    pub layer_number: usize,
}

impl TransformerBlock {
    /// Layer `index` (its parameters are named `layers.{index}.…`).
    pub fn new(
        config: &GptConfig,
        index: usize,
        seed: u64,
        group: &Group,
        device: &Device,
    ) -> Self {
        let name = format!("layers.{index}");
        // Under sequence parallelism the norms and dropouts see this rank's sequence chunk.
        let sequence_group = if config.sequence_parallel {
            group.clone()
        } else {
            Group::single()
        };
        let norm = |which: &str| {
            Norm::new(
                config.normalization,
                config.hidden_size,
                config.layernorm_epsilon,
                config.apply_layernorm_1p,
                &format!("{name}.{which}"),
                device,
            )
            .with_fusion(config.layer_norm_fusion)
            .with_input_split_over(&sequence_group)
        };
        Self {
            input_layernorm: norm("input_layernorm"),
            self_attention: CausalSelfAttention::new(
                config,
                seed,
                &format!("{name}.self_attention"),
                group,
                device,
            )
            .with_window(config.layer_window(index)),
            post_attention_layernorm: norm("post_attention_layernorm"),
            mlp: Mlp::new(config, seed, &format!("{name}.mlp"), group, device),
            hidden_dropout: Dropout::new(config.hidden_dropout, RngRegion::Replicated)
                .with_chunk_of(&sequence_group),
            bias_dropout_fusion: config.bias_dropout_fusion,
            layer_number: index,
        }
    }

    /// `[batch, seq, hidden]` → `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_keeping(x, CoreKeeps::Everything, &Documents::none())
    }

    /// [`Self::forward`] of a micro-batch of `documents`, the attention core keeping for its
    /// backward what `keeps` says.
    pub fn forward_keeping(
        &self,
        x: Tensor<3>,
        keeps: CoreKeeps,
        documents: &Documents,
    ) -> Tensor<3> {
        let inputs = self.attention_inputs(x.clone(), documents);
        let context = self.self_attention.core(inputs, keeps, documents);
        self.after_attention_core(x, context)
    }

    /// The layer up to the attention core: what the core computes from `ln(x)`. With
    /// [`CausalSelfAttention::core`] and [`Self::after_attention_core`] it is
    /// [`Self::forward`], cut where selective recomputation cuts it.
    pub fn attention_inputs(&self, x: Tensor<3>, documents: &Documents) -> CoreInputs {
        // The layer's dropouts (attention core, both branches) draw from its own streams.
        enter_layer(self.layer_number);
        self.self_attention
            .core_inputs(self.input_layernorm.forward(x), documents)
    }

    /// The layer after the attention core, from the layer's input `x` (for the residual) and
    /// the core's `context` `[batch, seq, local heads · head_dim]`.
    pub fn after_attention_core(&self, x: Tensor<3>, context: Tensor<3>) -> Tensor<3> {
        let (attn, bias) = self.self_attention.project_out_skip_bias(context);
        let x = self.bias_dropout_add(x, attn, bias);
        let (mlp, bias) = self
            .mlp
            .forward_skip_bias(self.post_attention_layernorm.forward(x.clone()));
        self.bias_dropout_add(x, mlp, bias)
    }

    /// `residual + dropout(y + bias)` with the hidden dropout.
    fn bias_dropout_add(
        &self,
        residual: Tensor<3>,
        y: Tensor<3>,
        bias: Option<Tensor<1>>,
    ) -> Tensor<3> {
        self.hidden_dropout
            .bias_dropout_add(residual, y, bias, self.bias_dropout_fusion)
    }

    /// [`Self::forward`] for the positions after those cached in `past` (inference).
    pub fn forward_cached(&self, x: Tensor<3>, past: &mut Option<LayerKv>) -> Tensor<3> {
        let attn = self
            .self_attention
            .forward_cached(self.input_layernorm.forward(x.clone()), past);
        let x = x + attn;
        let mlp = self
            .mlp
            .forward(self.post_attention_layernorm.forward(x.clone()));
        x + mlp
    }
}
