//! The language-model loss, kept apart from the model.

use burn::tensor::{Int, Tensor};

use crate::comm::Group;
use crate::parallel::cross_entropy::vocab_parallel_cross_entropy;
use crate::util::fixed_order_sum::fixed_order_sum;
use crate::util::masked_mean::masked_mean;

/// Per-token cross-entropy `[batch, seq]` of full logits `[batch, seq, vocab]` against
/// `labels`: `logsumexp(logits) − logits[label]` (the fused single-rank cross-entropy).
pub fn token_losses(logits: Tensor<3>, labels: Tensor<2, Int>) -> Tensor<2> {
    vocab_parallel_cross_entropy(logits, labels, 0, &Group::single())
}

/// Megatron's LM loss: the masked mean of the per-token cross-entropy,
/// `Σ loss · mask / Σ mask`, over full logits.
pub fn lm_loss(logits: Tensor<3>, labels: Tensor<2, Int>, loss_mask: Tensor<2>) -> Tensor<1> {
    parallel_lm_loss(logits, labels, loss_mask, 0, &Group::single())
}

/// [`lm_loss`] over one rank's vocabulary shard of the logits (columns from `vocab_start`).
pub fn parallel_lm_loss(
    logits: Tensor<3>,
    labels: Tensor<2, Int>,
    loss_mask: Tensor<2>,
    vocab_start: usize,
    group: &Group,
) -> Tensor<1> {
    let losses = vocab_parallel_cross_entropy(logits, labels, vocab_start, group);
    masked_mean(losses, loss_mask)
}

/// [`parallel_lm_loss`]'s numerator over `normalizer`: `Σ loss · mask / normalizer`, for a
/// rank holding part of each sequence (context parallelism), whose ranks' losses then sum to
/// the masked mean over the whole sequences (`normalizer` their `Σ mask`).
pub fn partial_lm_loss(
    logits: Tensor<3>,
    labels: Tensor<2, Int>,
    loss_mask: Tensor<2>,
    normalizer: f64,
    vocab_start: usize,
    group: &Group,
) -> Tensor<1> {
    let losses = vocab_parallel_cross_entropy(logits, labels, vocab_start, group);
    fixed_order_sum(losses * loss_mask).div_scalar(normalizer)
}
