//! Scoring a model on the first contiguous windows of a dataset (the `evaluate` tool).
//!
//! Window i is tokens `i·L .. i·L + L + 1` of the whole token stream, unshuffled, so any other
//! implementation (a HuggingFace export, Megatron) can score exactly the same samples.

use burn::tensor::Device;

use super::next_token_scores::{score_rows, OutputColumns};
use crate::data::IndexedDataset;
use crate::model::Gpt;

/// The first `count` windows of `seq_length + 1` tokens; an error if the dataset is too short.
pub fn contiguous_windows(
    data: &IndexedDataset,
    seq_length: usize,
    count: usize,
) -> Result<Vec<Vec<u32>>, String> {
    let needed = count * seq_length + 1;
    let total = data.total_tokens() as usize;
    if total < needed {
        return Err(format!(
            "{} has {total} tokens; {count} windows of {seq_length}+1 tokens need {needed}",
            data.prefix().display()
        ));
    }
    let all = data.all_tokens().slice(0..needed).to_u32_vec();
    Ok((0..count)
        .map(|i| all[i * seq_length..i * seq_length + seq_length + 1].to_vec())
        .collect())
}

/// Mean next-token cross-entropy of `model` over `windows`, scored over the first
/// `vocab_size` logits only (the tokenizer's real vocabulary, without Megatron's padding rows,
/// as a HuggingFace export with the unpadded vocabulary scores). The windows must fit the
/// model's positions (the `evaluate` tool checks `--seq-length` first).
pub fn mean_window_loss(
    model: &Gpt,
    windows: &[Vec<u32>],
    vocab_size: usize,
    batch_size: usize,
    device: &Device,
) -> f64 {
    let scores = score_rows(
        model,
        windows,
        OutputColumns::Real(vocab_size),
        batch_size,
        device,
    )
    .expect("windows within the model's positions");
    let count: usize = scores.iter().map(|s| s.log_probs.len()).sum();
    let total: f64 = scores.iter().flat_map(|s| &s.log_probs).sum();
    -total / count.max(1) as f64
}
