//! The language-model loss, kept apart from the model (the tensor-parallel version replaces
//! it with the vocab-parallel cross-entropy).

use burn::tensor::{Int, Tensor};

/// Per-token cross-entropy `[batch, seq]` of `logits` `[batch, seq, vocab]` against `labels`:
/// `logsumexp(logits) − logits[label]`, which never materializes the full log-softmax.
pub fn token_losses(logits: Tensor<3>, labels: Tensor<2, Int>) -> Tensor<2> {
    let max = logits.clone().max_dim(2).detach();
    let target = logits.clone().gather(2, labels.unsqueeze_dim::<3>(2));
    let log_sum_exp = (logits - max.clone()).exp().sum_dim(2).log() + max;
    (log_sum_exp - target).squeeze_dim::<2>(2)
}

/// Megatron's LM loss: the masked mean of the per-token cross-entropy,
/// `Σ loss · mask / Σ mask`.
pub fn lm_loss(logits: Tensor<3>, labels: Tensor<2, Int>, loss_mask: Tensor<2>) -> Tensor<1> {
    let losses = token_losses(logits, labels);
    (losses * loss_mask.clone()).sum() / loss_mask.sum()
}
