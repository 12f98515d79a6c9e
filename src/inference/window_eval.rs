//! Scoring a model on the first contiguous windows of a dataset (the `evaluate` tool).
//!
//! Window i is tokens `i·L .. i·L + L + 1` of the whole token stream, unshuffled, so any other
//! implementation (a HuggingFace export, Megatron) can score exactly the same samples.

use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::data::IndexedDataset;
use crate::model::loss::token_losses;
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
/// as a HuggingFace export with the unpadded vocabulary scores).
pub fn mean_window_loss(
    model: &Gpt,
    windows: &[Vec<u32>],
    vocab_size: usize,
    batch_size: usize,
    device: &Device,
) -> f64 {
    let mut total = 0.0;
    let mut count = 0usize;
    for chunk in windows.chunks(batch_size.max(1)) {
        let seq = chunk[0].len() - 1;
        let ids = |range: std::ops::Range<usize>| -> Vec<i64> {
            chunk
                .iter()
                .flat_map(|w| w[range.clone()].iter().map(|&t| t as i64))
                .collect()
        };
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(ids(0..seq), [chunk.len(), seq]), device);
        let labels = Tensor::<2, Int>::from_data(
            TensorData::new(ids(1..seq + 1), [chunk.len(), seq]),
            device,
        );
        let logits = model.forward(tokens).narrow(2, 0, vocab_size);
        let losses: Vec<f64> = token_losses(logits, labels)
            .try_into_vec_as::<f64>()
            .expect("float losses");
        total += losses.iter().sum::<f64>();
        count += losses.len();
    }
    total / count.max(1) as f64
}
