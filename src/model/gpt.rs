//! The whole GPT, readable top to bottom.

use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor};

use super::dropout::Dropout;
use super::init::Init;
use super::kv_cache::KvCache;
use super::layer_norm::LayerNorm;
use super::transformer_block::TransformerBlock;
use super::GptConfig;
use crate::comm::Group;
use crate::parallel::layers::{weight_matmul, VocabParallelEmbedding};
use crate::parallel::mappings::copy_to_region;
use crate::parallel::random::RngRegion;
use crate::parallel::sharding::init_shard;

/// Megatron's GPT: token + position embeddings, pre-LN blocks, final LayerNorm, and logits
/// from the (tied) token embedding. On a tensor-parallel rank it holds that rank's shards and
/// produces that rank's vocabulary columns of the logits.
#[derive(Module, Debug)]
pub struct Gpt {
    /// Token embedding `[padded vocab / N, hidden]`, also the output layer.
    pub word_embeddings: VocabParallelEmbedding,
    /// Learned position embedding `[max positions, hidden]` (replicated).
    pub position_embeddings: Param<Tensor<2>>,
    /// Dropout after the embeddings (`--hidden-dropout`).
    pub embedding_dropout: Dropout,
    /// The transformer layers.
    pub layers: Vec<TransformerBlock>,
    /// LayerNorm before the output layer.
    pub final_layernorm: LayerNorm,
    /// The tensor-parallel group.
    #[module(skip)]
    pub group: Group,
}

impl Gpt {
    /// Builds this rank's part of the model; use [`GptConfig::init`] or
    /// [`GptConfig::init_parallel`], which validate the config first.
    pub(crate) fn new(config: &GptConfig, seed: u64, group: &Group, device: &Device) -> Self {
        let (h, std) = (config.hidden_size, config.init_method_std);
        Self {
            word_embeddings: VocabParallelEmbedding::new(
                config.padded_vocab_size,
                h,
                std,
                seed,
                "word_embeddings",
                group,
                device,
            ),
            position_embeddings: Param::from_tensor(init_shard(
                Init::Normal(std),
                [config.max_position_embeddings, h],
                seed,
                "position_embeddings",
                None,
                group,
                device,
            )),
            embedding_dropout: Dropout::new(config.hidden_dropout, RngRegion::Replicated),
            layers: (0..config.num_layers)
                .map(|i| TransformerBlock::new(config, i, seed, group, device))
                .collect(),
            final_layernorm: LayerNorm::new(
                h,
                config.layernorm_epsilon,
                seed,
                "final_layernorm",
                device,
            )
            .with_fusion(config.layer_norm_fusion),
            group: group.clone(),
        }
    }

    /// The embedding block: token + position embeddings, then dropout; `[batch, seq, hidden]`
    /// for token ids `[batch, seq]`.
    pub fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.embed_from(tokens, 0)
    }

    /// [`Self::embed`] for tokens at positions `start..start + seq` (incremental decoding).
    fn embed_from(&self, tokens: Tensor<2, Int>, start: usize) -> Tensor<3> {
        let s = tokens.dims()[1];
        let words = self.word_embeddings.forward(tokens);
        let positions = self
            .position_embeddings
            .val()
            .narrow(0, start, s)
            .unsqueeze::<3>();
        self.embedding_dropout.forward(words + positions)
    }

    /// This rank's logits for the output of the last layer: final LayerNorm, then the tied
    /// output layer (Megatron's `parallel_lm_logits`, never gathered).
    pub fn logits(&self, last_layer_output: Tensor<3>) -> Tensor<3> {
        let hidden = copy_to_region(self.final_layernorm.forward(last_layer_output), &self.group);
        weight_matmul(hidden, self.word_embeddings.weight.val().transpose())
    }

    /// This rank's logits `[batch, seq, padded vocab / N]` (all of them on one rank) for token
    /// ids `[batch, seq]`: Megatron's `parallel_lm_logits`, never gathered.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let mut x = self.embed(tokens);
        for layer in &self.layers {
            x = layer.forward(x);
        }
        self.logits(x)
    }

    /// The LM loss of the last layer's output (the head of [`Self::lm_loss`]).
    pub fn head_loss(
        &self,
        last_layer_output: Tensor<3>,
        labels: Tensor<2, Int>,
        loss_mask: Tensor<2>,
    ) -> Tensor<1> {
        super::loss::parallel_lm_loss(
            self.logits(last_layer_output),
            labels,
            loss_mask,
            self.vocab_start(),
            &self.group,
        )
    }

    /// [`Self::forward`] for `tokens` continuing the positions held in `cache`, which takes
    /// their keys and values (inference: no dropout). Feeding a prompt and then one token at a
    /// time gives the logits a full forward over the whole sequence gives, each step costing
    /// one position.
    pub fn forward_cached(&self, tokens: Tensor<2, Int>, cache: &mut KvCache) -> Tensor<3> {
        let s = tokens.dims()[1];
        let mut x = self.embed_from(tokens, cache.positions);
        if cache.layers.len() != self.layers.len() {
            *cache = KvCache::new(self.layers.len());
        }
        for (layer, past) in self.layers.iter().zip(&mut cache.layers) {
            x = layer.forward_cached(x, past);
        }
        cache.positions += s;
        self.logits(x)
    }

    /// The first vocabulary id of this rank's logits.
    pub fn vocab_start(&self) -> usize {
        self.word_embeddings.vocab_start()
    }

    /// Megatron's LM loss for a micro-batch: the masked mean of the vocab-parallel
    /// cross-entropy.
    pub fn lm_loss(
        &self,
        tokens: Tensor<2, Int>,
        labels: Tensor<2, Int>,
        loss_mask: Tensor<2>,
    ) -> Tensor<1> {
        super::loss::parallel_lm_loss(
            self.forward(tokens),
            labels,
            loss_mask,
            self.vocab_start(),
            &self.group,
        )
    }
}
