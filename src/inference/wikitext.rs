//! WikiText perplexity as Megatron-LM's `tasks/zeroshot_gpt` computes it: the whole file
//! detokenized and tokenized as one text, scored in windows of `seq_length` tokens that start
//! every `overlapping_eval` tokens, each window counting only its last `overlapping_eval`
//! targets (the first window all of its own), so every token after the first is scored once
//! with at least `seq_length - overlapping_eval` tokens of context. The loss is divided by the
//! number of BPE targets; the *adjusted* perplexity rescales it to WikiText's own word-level
//! tokens, so models with different tokenizers can be compared.

use std::path::Path;

use anyhow::{bail, Context, Result};
use burn::tensor::Device;

use super::detokenizer::Detokenizer;
use super::next_token_scores::{score_rows, OutputColumns};
use crate::model::Gpt;
use crate::tokenizer::TextEncoder;

/// The evaluation text: its tokens and the number of WikiText tokens it was published with.
#[derive(Clone, Debug)]
pub struct WikitextText {
    pub tokens: Vec<u32>,
    /// Megatron's count: the raw file, stripped, split at single spaces.
    pub num_original_tokens: usize,
}

/// Reads a raw WikiText file (e.g. `wiki.test.tokens`), detokenizes and tokenizes it.
pub fn read_wikitext(
    path: &Path,
    detokenizer: Detokenizer,
    encoder: &mut TextEncoder,
) -> Result<WikitextText> {
    let raw = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let num_original_tokens = raw.trim().split(' ').count();
    let mut tokens = Vec::new();
    encoder.encode(&detokenizer.apply(&raw), &mut tokens)?;
    if tokens.len() < 2 || num_original_tokens < 2 {
        bail!("{}: too little text to score", path.display());
    }
    Ok(WikitextText {
        tokens,
        num_original_tokens,
    })
}

/// One of Megatron's windows: up to `seq_length + 1` tokens, of whose targets (`tokens[j + 1]`)
/// those with `j >= first_scored` count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScoredWindow {
    pub tokens: Vec<u32>,
    pub first_scored: usize,
}

/// Megatron's `_LMDataset` windows (the last ones cut at the end of the text rather than padded
/// with end-of-document tokens that are not scored: the same scores). Its count is Megatron's,
/// trailing windows that score nothing included.
pub fn overlapping_windows(
    tokens: &[u32],
    seq_length: usize,
    overlapping_eval: usize,
) -> Vec<ScoredWindow> {
    let step = overlapping_eval.clamp(1, seq_length);
    let targets = tokens.len().saturating_sub(1);
    let count = targets.saturating_sub(step).div_ceil(step) + 1;
    (0..count)
        .map(|i| {
            let start = (i * step).min(tokens.len());
            let end = (start + seq_length + 1).min(tokens.len());
            let first_scored = if i == 0 || step == seq_length {
                0
            } else {
                seq_length - step
            };
            ScoredWindow {
                tokens: tokens[start..end].to_vec(),
                first_scored,
            }
        })
        .collect()
}

/// Megatron's result line's numbers.
#[derive(Clone, Copy, Debug)]
pub struct Perplexity {
    /// Σ over scored targets of −log P (natural log, over the whole output layer).
    pub loss_sum: f64,
    pub num_tokenized_tokens: usize,
    pub num_original_tokens: usize,
}

impl Perplexity {
    pub fn avg_loss(&self) -> f64 {
        self.loss_sum / (self.num_tokenized_tokens - 1) as f64
    }

    pub fn token_ratio(&self) -> f64 {
        (self.num_tokenized_tokens - 1) as f64 / (self.num_original_tokens - 1) as f64
    }

    /// `exp(min(20, loss))`, Megatron's cap.
    pub fn ppl(&self) -> f64 {
        self.avg_loss().min(20.0).exp()
    }

    pub fn adjusted_ppl(&self) -> f64 {
        (self.avg_loss() * self.token_ratio()).min(20.0).exp()
    }
}

/// Scores `text` in Megatron's windows.
pub fn wikitext_perplexity(
    model: &Gpt,
    text: &WikitextText,
    seq_length: usize,
    overlapping_eval: usize,
    batch_size: usize,
    device: &Device,
) -> Result<Perplexity, String> {
    let windows = overlapping_windows(&text.tokens, seq_length, overlapping_eval);
    let scored: Vec<&ScoredWindow> = windows
        .iter()
        .filter(|w| w.tokens.len() > w.first_scored + 1)
        .collect();
    let rows: Vec<Vec<u32>> = scored.iter().map(|w| w.tokens.clone()).collect();
    let scores = score_rows(model, &rows, OutputColumns::Padded, batch_size, device)?;
    let loss_sum = scored
        .iter()
        .zip(&scores)
        .map(|(w, s)| -s.log_probs[w.first_scored..].iter().sum::<f64>())
        .sum();
    Ok(Perplexity {
        loss_sum,
        num_tokenized_tokens: text.tokens.len(),
        num_original_tokens: text.num_original_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every target after the first is scored exactly once, as Megatron's masks give.
    #[test]
    fn windows_score_every_target_once() {
        for (n, seq, overlap) in [
            (100, 16, 4),
            (100, 16, 16),
            (17, 16, 8),
            (5, 16, 4),
            (64, 8, 3),
        ] {
            let tokens: Vec<u32> = (0..n).collect();
            let windows = overlapping_windows(&tokens, seq, overlap);
            let mut counted = vec![0; n as usize];
            for w in &windows {
                assert!(w.tokens.len() <= seq + 1);
                for j in w.first_scored..w.tokens.len().saturating_sub(1) {
                    counted[w.tokens[j + 1] as usize] += 1;
                }
            }
            assert_eq!(counted[0], 0);
            assert!(
                counted[1..].iter().all(|&c| c == 1),
                "{n} {seq} {overlap}: {counted:?}"
            );
            let targets = n as usize - 1;
            let megatron =
                (targets.saturating_sub(overlap) as f64 / overlap as f64).ceil() as usize + 1;
            assert_eq!(windows.len(), megatron.max(1));
        }
    }
}
