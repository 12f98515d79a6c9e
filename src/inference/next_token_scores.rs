//! What a model thinks of each next token of some token rows: its log-probability and whether
//! it was the model's first choice. LAMBADA accuracy, WikiText perplexity and the
//! log-likelihoods evaluation harnesses ask for are all made of these two numbers.

use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::model::loss::token_losses;
use crate::model::Gpt;

/// The scores of one row: entry `j` is about `row[j + 1]` given `row[..=j]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowScores {
    /// `log P(row[j + 1] | row[..=j])`.
    pub log_probs: Vec<f64>,
    /// Whether `row[j + 1]` is the highest-scoring token there.
    pub is_argmax: Vec<bool>,
}

/// Which output columns a score is taken over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputColumns {
    /// The whole output layer, Megatron's padding rows included: what Megatron's zero-shot
    /// tasks score (`vocab_parallel_cross_entropy`, `argmax` over the gathered output).
    Padded,
    /// The tokenizer's first `n` ids: what a HuggingFace model (and so an evaluation harness)
    /// scores.
    Real(usize),
}

/// Scores `rows` in batches of `batch_size` rows. Rows of a batch are right-padded to the
/// longest: a causal model's output at a position does not depend on later ones, so the padding
/// changes no score (Megatron pads its zero-shot samples the same way).
pub fn score_rows(
    model: &Gpt,
    rows: &[Vec<u32>],
    columns: OutputColumns,
    batch_size: usize,
    device: &Device,
) -> Result<Vec<RowScores>, String> {
    if let Some(row) = rows.iter().find(|r| r.len() > model.max_positions + 1) {
        return Err(format!(
            "a sample of {} tokens is longer than the model's {} positions + 1",
            row.len(),
            model.max_positions
        ));
    }
    let mut scores = Vec::with_capacity(rows.len());
    for chunk in rows.chunks(batch_size.max(1)) {
        scores.extend(score_batch(model, chunk, columns, device));
    }
    Ok(scores)
}

fn score_batch(
    model: &Gpt,
    rows: &[Vec<u32>],
    columns: OutputColumns,
    device: &Device,
) -> Vec<RowScores> {
    let steps = rows
        .iter()
        .map(|r| r.len().saturating_sub(1))
        .max()
        .unwrap_or(0);
    if steps == 0 {
        return vec![RowScores::default(); rows.len()];
    }
    let shifted = |offset: usize| {
        let ids: Vec<i64> = rows
            .iter()
            .flat_map(|r| (0..steps).map(move |j| r.get(j + offset).map_or(0, |&t| t as i64)))
            .collect();
        Tensor::<2, Int>::from_data(TensorData::new(ids, [rows.len(), steps]), device)
    };
    let mut logits = model.gather_logits(model.forward(shifted(0)));
    if let OutputColumns::Real(n) = columns {
        let width = n.min(logits.dims()[2]);
        logits = logits.narrow(2, 0, width);
    }
    let choices = host_ints(logits.clone().argmax(2));
    let losses = host_floats(token_losses(logits, shifted(1)));
    rows.iter()
        .enumerate()
        .map(|(i, row)| {
            let n = row.len().saturating_sub(1);
            let at = |j: usize| i * steps + j;
            RowScores {
                log_probs: (0..n).map(|j| -losses[at(j)]).collect(),
                is_argmax: (0..n)
                    .map(|j| choices[at(j)] == row[j + 1] as i64)
                    .collect(),
            }
        })
        .collect()
}

fn host_floats<const D: usize>(tensor: Tensor<D>) -> Vec<f64> {
    tensor.try_into_vec_as::<f64>().expect("float scores")
}

fn host_ints<const D: usize>(tensor: Tensor<D, Int>) -> Vec<i64> {
    tensor
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .expect("integer choices")
}
