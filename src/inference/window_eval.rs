//! Scoring a model on the first contiguous windows of a dataset (the `evaluate` tool).
//!
//! Window i is tokens `i·L .. i·L + L + 1` of the whole token stream, unshuffled, so any other
//! implementation (a HuggingFace export, Megatron) can score exactly the same samples.

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::next_token_scores::{score_rows, OutputColumns};
use crate::data::{IndexedDataset, SampleMasks};
use crate::model::loss::token_losses;
use crate::model::{Documents, Gpt};

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

/// [`mean_window_loss`] with Megatron's sample masks: each window's documents at their own
/// positions and attending within themselves (`--reset-position-ids`,
/// `--reset-attention-mask`), the mean over the targets the loss mask keeps
/// (`--eod-mask-loss`), as training's loss counts them.
pub fn masked_window_loss(
    model: &Gpt,
    windows: &[Vec<u32>],
    vocab_size: usize,
    batch_size: usize,
    device: &Device,
    masks: &SampleMasks,
) -> f64 {
    let (mut total, mut counted) = (0.0, 0.0);
    for chunk in windows.chunks(batch_size.max(1)) {
        let steps = chunk[0].len() - 1;
        let inputs: Vec<&[u32]> = chunk.iter().map(|w| &w[..steps]).collect();
        let ids = |rows: Vec<u32>| {
            let ids: Vec<i64> = rows.into_iter().map(i64::from).collect();
            Tensor::<2, Int>::from_data(TensorData::new(ids, [chunk.len(), steps]), device)
        };
        // One per-token list per row, or none where the switch is off.
        let per_row = |of: &dyn Fn(&[u32]) -> Option<Vec<u32>>| {
            let rows: Option<Vec<Vec<u32>>> = inputs.iter().map(|w| of(w)).collect();
            rows.map(|rows| ids(rows.concat()))
        };
        let documents = Documents {
            positions: per_row(&|w| masks.positions(w)),
            first_keys: per_row(&|w| masks.first_keys(w)),
        };
        let logits = model.gather_logits(model.forward_documents(ids(inputs.concat()), &documents));
        let logits = logits
            .clone()
            .narrow(2, 0, vocab_size.min(logits.dims()[2]));
        let targets = chunk.iter().flat_map(|w| w[1..].iter().copied()).collect();
        let losses = token_losses(logits, ids(targets))
            .into_data()
            .try_into_vec_as::<f32>()
            .expect("f32 losses");
        let kept = inputs.iter().flat_map(|w| masks.loss_mask(w));
        for (loss, keep) in losses.iter().zip(kept) {
            total += (loss * keep) as f64;
            counted += keep as f64;
        }
    }
    total / counted.max(1.0)
}
