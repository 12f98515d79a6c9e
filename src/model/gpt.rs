//! The whole GPT, readable top to bottom.

use burn::module::{Module, Param, ParamId};
use burn::tensor::{Device, Int, Tensor};

use super::attention::CoreKeeps;
use super::documents::Documents;
use super::dropout::Dropout;
use super::kv_cache::KvCache;
use super::norm::Norm;
use super::recompute::Targets;
use super::stage::StageLayers;
use super::transformer_block::TransformerBlock;
use super::GptConfig;
use crate::comm::Group;
use crate::parallel::layers::{weight_matmul, ColumnParallelLinear, VocabParallelEmbedding};
use crate::parallel::mappings::{
    copy_to_region, gather_from_region, gather_from_sequence_region, scatter_to_sequence_region,
};
use crate::parallel::random::RngRegion;
use crate::parallel::sharding::init_shard;
use crate::util::init::Init;

/// Megatron's GPT: token (+ learned position) embeddings, pre-norm blocks, a final norm, and
/// logits from the tied token embedding or an output layer of their own. On a tensor-parallel rank it holds that rank's shards and
/// produces that rank's vocabulary columns of the logits.
///
/// On a pipeline rank it holds that stage's part ([`StageLayers`]): the embeddings on the
/// first stage, the final norm and the output layer (a copy of the word embedding when tied)
/// on the last, and its layers at their places in `layers` (the others `None`). Parameters
/// keep their names (`layers.7.…`) and initial values whatever the split, so every split
/// trains the same model and checkpoints do not depend on it.
#[derive(Module, Debug)]
pub struct Gpt {
    /// Token embedding `[padded vocab / N, hidden]`, also the output layer when tied.
    pub word_embeddings: Option<VocabParallelEmbedding>,
    /// Learned position embedding `[max positions, hidden]` (replicated;
    /// `--position-embedding-type learned_absolute`).
    pub position_embeddings: Option<Param<Tensor<2>>>,
    /// Dropout after the embeddings (`--hidden-dropout`).
    pub embedding_dropout: Dropout,
    /// The transformer layers, each at its number; `None` for those of other stages.
    pub layers: Vec<Option<TransformerBlock>>,
    /// Norm before the output layer.
    pub final_layernorm: Option<Norm>,
    /// The output layer `[hidden, padded vocab / N]` when it is not the word embedding
    /// (`--untie-embeddings-and-output-weights`).
    pub output_layer: Option<ColumnParallelLinear>,
    /// Whether this part holds the embeddings (the first pipeline stage).
    pub holds_embedding: bool,
    /// Whether the output layer is the word embedding (not
    /// `--untie-embeddings-and-output-weights`).
    pub tied_output: bool,
    /// The positions the model was built for (`--max-position-embeddings`).
    pub max_positions: usize,
    /// Between the embeddings and the output layer, activations are this tensor-parallel
    /// rank's chunk of the sequence (`--sequence-parallel`).
    pub sequence_parallel: bool,
    /// The tensor-parallel group.
    #[module(skip)]
    pub group: Group,
}

impl Gpt {
    /// The parameters this rank holds that another pipeline stage holds too, and that train as
    /// one (Megatron's `shared_embedding`): the word embedding, which the last stage reads
    /// again as the tied output layer. Their gradients are summed over the embedding group.
    /// Empty when one stage has both ends (no pipeline), where one copy serves both.
    pub fn shared_with_other_stages(&self, stage: &StageLayers) -> Vec<ParamId> {
        if stage.embedding && stage.head {
            return Vec::new();
        }
        self.tied_embedding().into_iter().collect()
    }

    /// The word embedding's and the output layer's weights this part of the model holds
    /// (Megatron's `is_embedding_or_output_parameter`: what `--decoupled-lr` trains).
    pub fn embedding_and_output_weights(&self) -> Vec<ParamId> {
        let embedding = self.word_embeddings.as_ref().map(|e| e.weight.id);
        let output = self.output_layer.as_ref().map(|o| o.weight.id);
        embedding.into_iter().chain(output).collect()
    }

    /// The word embedding's weight when it is also the output layer and this part of the
    /// model holds it.
    pub fn tied_embedding(&self) -> Option<ParamId> {
        if !self.tied_output {
            return None;
        }
        self.word_embeddings.as_ref().map(|e| e.weight.id)
    }

    /// Builds this rank's part of the model (`stage` of it); use [`GptConfig::init`],
    /// [`GptConfig::init_parallel`] or [`GptConfig::init_stage`], which validate the config
    /// first.
    pub(crate) fn new(
        config: &GptConfig,
        seed: u64,
        group: &Group,
        stage: &StageLayers,
        device: &Device,
    ) -> Self {
        let (h, std) = (config.hidden_size, config.init_method_std);
        // The last stage's copy of the word embedding starts equal to the first stage's (the
        // same seed and name give the same values), as Megatron's initial embedding sync.
        let tied_head = stage.head && config.tied_output();
        // Under sequence parallelism the final norm sees this rank's sequence chunk.
        let sequence_group = if config.sequence_parallel {
            group.clone()
        } else {
            Group::single()
        };
        let word_embeddings = (stage.embedding || tied_head).then(|| {
            VocabParallelEmbedding::new(
                config.padded_vocab_size,
                h,
                std,
                seed,
                "word_embeddings",
                group,
                device,
            )
        });
        Self {
            word_embeddings,
            position_embeddings: (stage.embedding && config.learned_positions()).then(|| {
                Param::from_tensor(init_shard(
                    Init::Normal(std),
                    [config.max_position_embeddings, h],
                    seed,
                    "position_embeddings",
                    None,
                    group,
                    device,
                ))
            }),
            embedding_dropout: Dropout::new(config.hidden_dropout, RngRegion::Replicated),
            layers: (0..config.num_layers)
                .map(|i| {
                    stage
                        .holds_layer(i)
                        .then(|| TransformerBlock::new(config, i, seed, group, device))
                })
                .collect(),
            final_layernorm: stage.head.then(|| {
                Norm::new(
                    config.normalization,
                    h,
                    config.layernorm_epsilon,
                    config.apply_layernorm_1p,
                    "final_layernorm",
                    device,
                )
                .with_fusion(config.layer_norm_fusion)
                .with_input_split_over(&sequence_group)
            }),
            output_layer: (stage.head && !config.tied_output()).then(|| {
                let vocab = config.padded_vocab_size;
                ColumnParallelLinear::new(h, vocab, std, seed, "output_layer", false, group, device)
                    .with_bias(false)
                    .with_sequence_parallel(config.sequence_parallel)
            }),
            sequence_parallel: config.sequence_parallel,
            holds_embedding: stage.embedding,
            tied_output: config.tied_output(),
            max_positions: config.max_position_embeddings,
            group: group.clone(),
        }
    }

    /// The same model on a context-parallel rank of `split` (`None`: whole sequences): its
    /// attention gathers the whole sequence's keys and values, its dropouts draw the whole
    /// sequence's masks at this rank's rows. Parameters are untouched (context parallelism
    /// does not shard them).
    pub fn with_context_split(
        mut self,
        split: Option<crate::parallel::context::ContextSplit>,
    ) -> Self {
        self.embedding_dropout = self.embedding_dropout.with_context(split.clone());
        for layer in self.layers.iter_mut().flatten() {
            layer.hidden_dropout = layer.hidden_dropout.clone().with_context(split.clone());
            layer.self_attention = layer.self_attention.clone().with_context(split.clone());
        }
        self
    }

    /// The word embedding (first and last stage only).
    pub fn word_embedding(&self) -> &VocabParallelEmbedding {
        self.word_embeddings
            .as_ref()
            .expect("only the first and the last pipeline stage hold the word embedding")
    }

    /// Layer `layer` (numbered in the whole model), if this stage holds it.
    pub fn layer(&self, layer: usize) -> Option<&TransformerBlock> {
        self.layers.get(layer).and_then(Option::as_ref)
    }

    /// The layers this stage holds, in order.
    pub fn held_layers(&self) -> impl Iterator<Item = &TransformerBlock> {
        self.layers.iter().flatten()
    }

    /// Whether this stage holds the embeddings (the first pipeline stage).
    pub fn has_embedding(&self) -> bool {
        self.holds_embedding
    }

    /// Whether this stage holds the output layer and computes the loss (the last stage).
    pub fn has_head(&self) -> bool {
        self.final_layernorm.is_some()
    }

    /// Runs `layers` (a model chunk of this stage) on `x`, a micro-batch of `documents`,
    /// their attention cores keeping for the backward what `keeps` says.
    pub fn run_layers(
        &self,
        layers: std::ops::Range<usize>,
        mut x: Tensor<3>,
        keeps: CoreKeeps,
        documents: &Documents,
    ) -> Tensor<3> {
        for i in layers {
            x = self.held_layer(i).forward_keeping(x, keeps, documents);
        }
        x
    }

    /// Whether every one of `layers` computes its attention core on `device` in the one op
    /// from the projection's rows, which can keep only its inputs
    /// ([`CoreKeeps::Inputs`]).
    pub fn cores_from_rows(&self, layers: std::ops::Range<usize>, device: &Device) -> bool {
        layers
            .into_iter()
            .all(|i| self.held_layer(i).self_attention.core_from_rows(device))
    }

    /// Layer `i`, which this stage must hold.
    fn held_layer(&self, i: usize) -> &TransformerBlock {
        self.layer(i)
            .unwrap_or_else(|| panic!("layer {i} is not on this pipeline stage"))
    }

    /// The embedding block: token (+ learned position) embeddings, then dropout;
    /// `[batch, seq, hidden]` for token ids `[batch, seq]` (this rank's chunk of the sequence
    /// under `--sequence-parallel`), the learned positions those of `documents` where it has
    /// them.
    pub fn embed(&self, tokens: Tensor<2, Int>, documents: &Documents) -> Tensor<3> {
        match (&documents.positions, &self.position_embeddings) {
            (Some(positions), Some(table)) => {
                let [b, s] = positions.dims();
                let words = self.word_embedding().forward(tokens);
                let rows = table.val().select(0, positions.clone().reshape([b * s]));
                let h = rows.dims()[1];
                self.embedding_output(words + rows.reshape([b, s, h]))
            }
            _ => self.embed_from(tokens, 0),
        }
    }

    /// [`Self::embed`] for tokens at positions `start..start + seq` (incremental decoding).
    fn embed_from(&self, tokens: Tensor<2, Int>, start: usize) -> Tensor<3> {
        let s = tokens.dims()[1];
        let words = self.word_embedding().forward(tokens);
        let embeddings = match &self.position_embeddings {
            Some(table) => {
                let table = table.val();
                // The whole table when the sequence spans it (a slice's backward is a zeroed
                // table and a slice-assignment: two launches a step for nothing).
                let positions = if start == 0 && s == table.dims()[0] {
                    table
                } else {
                    table.narrow(0, start, s)
                };
                words + positions.unsqueeze::<3>()
            }
            None => words,
        };
        self.embedding_output(embeddings)
    }

    /// The embeddings' dropout, and under sequence parallelism this rank's chunk.
    fn embedding_output(&self, embeddings: Tensor<3>) -> Tensor<3> {
        let embeddings = self.embedding_dropout.forward(embeddings);
        if self.sequence_parallel {
            scatter_to_sequence_region(embeddings, &self.group)
        } else {
            embeddings
        }
    }

    /// This rank's logits for the output of the last layer: final norm, then the output
    /// layer, tied or not (Megatron's `parallel_lm_logits`, never gathered).
    pub fn logits(&self, last_layer_output: Tensor<3>) -> Tensor<3> {
        let final_layernorm = self
            .final_layernorm
            .as_ref()
            .expect("only the last pipeline stage holds the final norm");
        let hidden = final_layernorm.forward(last_layer_output);
        if let Some(output_layer) = &self.output_layer {
            return output_layer.forward(hidden);
        }
        let hidden = if self.sequence_parallel {
            gather_from_sequence_region(hidden, &self.group)
        } else {
            copy_to_region(hidden, &self.group)
        };
        weight_matmul(hidden, self.word_embedding().weight.val().transpose())
    }

    /// The whole padded vocabulary's logits from this rank's `[.., padded vocab / N]` shard:
    /// the shards all-gathered over the tensor-parallel group (Megatron's text generation
    /// gathers them so that every rank samples the same token from the same numbers).
    pub fn gather_logits(&self, logits: Tensor<3>) -> Tensor<3> {
        if self.group.size() == 1 {
            logits
        } else {
            gather_from_region(logits, &self.group)
        }
    }

    /// This rank's logits `[batch, seq, padded vocab / N]` (all of them on one rank) for token
    /// ids `[batch, seq]`: Megatron's `parallel_lm_logits`, never gathered.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.forward_documents(tokens, &Documents::none())
    }

    /// [`Self::forward`] of packed `documents` (their own positions and attention).
    pub fn forward_documents(&self, tokens: Tensor<2, Int>, documents: &Documents) -> Tensor<3> {
        let x = self.embed(tokens, documents);
        let y = self.run_layers(0..self.layers.len(), x, CoreKeeps::Everything, documents);
        self.logits(y)
    }

    /// The LM loss of the last layer's output (the head of [`Self::lm_loss`]) against
    /// `targets`: their masked mean, or the masked sum over their normalizer.
    pub fn head_loss(&self, last_layer_output: Tensor<3>, targets: Targets) -> Tensor<1> {
        let logits = self.logits(last_layer_output);
        let (labels, mask) = (targets.labels, targets.loss_mask);
        let (vocab_start, group) = (self.vocab_start(), &self.group);
        match targets.loss_normalizer {
            None => super::loss::parallel_lm_loss(logits, labels, mask, vocab_start, group),
            Some(normalizer) => {
                super::loss::partial_lm_loss(logits, labels, mask, normalizer, vocab_start, group)
            }
        }
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
        for (layer, past) in self.held_layers().zip(&mut cache.layers) {
            x = layer.forward_cached(x, past);
        }
        cache.positions += s;
        self.logits(x)
    }

    /// The first vocabulary id of this rank's logits.
    pub fn vocab_start(&self) -> usize {
        match &self.output_layer {
            Some(output_layer) => self.group.rank() * output_layer.weight.dims()[1],
            None => self.word_embedding().vocab_start(),
        }
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
