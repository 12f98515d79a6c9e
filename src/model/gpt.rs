//! The whole GPT, readable top to bottom.

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig};
use burn::tensor::{Device, Int, Tensor};

use super::init::{init_tensor, Init};
use super::layer_norm::LayerNorm;
use super::transformer_block::TransformerBlock;
use super::GptConfig;

/// Megatron's GPT: token + position embeddings, pre-LN blocks, final LayerNorm, and logits
/// from the (tied) token embedding.
#[derive(Module, Debug)]
pub struct Gpt {
    /// Token embedding `[padded vocab, hidden]`, also the output layer.
    pub word_embeddings: Param<Tensor<2>>,
    /// Learned position embedding `[max positions, hidden]`.
    pub position_embeddings: Param<Tensor<2>>,
    /// Dropout after the embeddings (`--hidden-dropout`).
    pub embedding_dropout: Dropout,
    /// The transformer layers.
    pub layers: Vec<TransformerBlock>,
    /// LayerNorm before the output layer.
    pub final_layernorm: LayerNorm,
}

impl Gpt {
    /// Builds the model; use [`GptConfig::init`], which validates the config first.
    pub(crate) fn new(config: &GptConfig, seed: u64, device: &Device) -> Self {
        let (h, std) = (config.hidden_size, config.init_method_std);
        let normal = Init::Normal(std);
        Self {
            word_embeddings: Param::from_tensor(init_tensor(
                normal,
                [config.padded_vocab_size, h],
                seed,
                "word_embeddings",
                device,
            )),
            position_embeddings: Param::from_tensor(init_tensor(
                normal,
                [config.max_position_embeddings, h],
                seed,
                "position_embeddings",
                device,
            )),
            embedding_dropout: DropoutConfig::new(config.hidden_dropout).init(),
            layers: (0..config.num_layers)
                .map(|i| TransformerBlock::new(config, i, seed, device))
                .collect(),
            final_layernorm: LayerNorm::new(
                h,
                config.layernorm_epsilon,
                seed,
                "final_layernorm",
                device,
            ),
        }
    }

    /// Final hidden states `[batch, seq, hidden]` for token ids `[batch, seq]`.
    pub fn hidden_states(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [b, s] = tokens.dims();
        let h = self.word_embeddings.dims()[1];
        let words = self
            .word_embeddings
            .val()
            .select(0, tokens.reshape([b * s]))
            .reshape([b, s, h]);
        let positions = self
            .position_embeddings
            .val()
            .narrow(0, 0, s)
            .unsqueeze::<3>();
        let mut x = self.embedding_dropout.forward(words + positions);
        for layer in &self.layers {
            x = layer.forward(x);
        }
        self.final_layernorm.forward(x)
    }

    /// Logits `[batch, seq, padded vocab]` for token ids `[batch, seq]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let hidden = self.hidden_states(tokens);
        hidden.matmul(self.word_embeddings.val().transpose().unsqueeze())
    }
}
