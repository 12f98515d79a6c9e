//! Autoregressive generation: the prompt once, then one token at a time through the KV cache.

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::no_repeat_ngram::ban;
use super::sampling::Sampler;
use crate::model::{Gpt, KvCache};

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Stop after this many new tokens.
    pub max_new_tokens: usize,
    /// Stop after this token (`<|endoftext|>`), which is kept in the output.
    pub stop_token: Option<u32>,
    /// The tokenizer's real vocabulary: logits of Megatron's padding rows are never picked.
    pub vocab_size: usize,
    /// Reuse keys and values of earlier positions (off: recompute the whole prefix per token,
    /// the reference and the benchmark's baseline).
    pub kv_cache: bool,
    /// Never complete an n-gram of this size that the sequence already holds (0: off).
    pub no_repeat_ngram_size: usize,
}

/// The new tokens and what the model thought of each.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// `log P(token | everything before it)` under the model's own distribution (over the real
    /// vocabulary, before temperature, top-k/top-p or n-gram bans).
    pub log_probs: Vec<f64>,
}

/// How many new tokens fit: `max_new_tokens`, but never past the model's positions.
pub fn token_budget(model: &Gpt, prompt: &[u32], max_new_tokens: usize) -> Result<usize, String> {
    let max_positions = model.max_positions;
    if prompt.is_empty() {
        return Err("the prompt encodes to no tokens".into());
    }
    if prompt.len() > max_positions {
        return Err(format!(
            "the prompt holds {} tokens, more than the model's {max_positions} positions",
            prompt.len()
        ));
    }
    Ok(max_new_tokens.min(max_positions + 1 - prompt.len()))
}

/// Generates up to `options.max_new_tokens` tokens after `prompt` (never past the model's
/// positions), calling `on_token` with each as it comes.
pub fn generate(
    model: &Gpt,
    prompt: &[u32],
    options: &GenerateOptions,
    sampler: &mut Sampler,
    device: &Device,
    mut on_token: impl FnMut(u32),
) -> Result<Generation, String> {
    let budget = token_budget(model, prompt, options.max_new_tokens)?;
    let mut cache = KvCache::new(model.layers.len());
    let mut sequence = prompt.to_vec();
    let mut out = Generation::default();
    let mut feed: &[u32] = prompt;
    while out.tokens.len() < budget {
        let logits = model.gather_logits(if options.kv_cache {
            model.forward_cached(token_rows(&[feed], device), &mut cache)
        } else {
            model.forward(token_rows(&[&sequence], device))
        });
        let mut row = last_rows(logits, options.vocab_size).remove(0);
        let log_probs = log_softmax(&row);
        ban(&mut row, &sequence, options.no_repeat_ngram_size);
        let token = sampler.next_token(&row);
        sequence.push(token);
        out.tokens.push(token);
        out.log_probs.push(log_probs[token as usize] as f64);
        on_token(token);
        if Some(token) == options.stop_token {
            break;
        }
        feed = &sequence[sequence.len() - 1..];
    }
    Ok(out)
}

/// Equal-length token rows as a `[rows, length]` tensor.
pub(crate) fn token_rows(rows: &[&[u32]], device: &Device) -> Tensor<2, Int> {
    let values: Vec<i64> = rows
        .iter()
        .flat_map(|r| r.iter().map(|&t| t as i64))
        .collect();
    Tensor::from_data(TensorData::new(values, [rows.len(), rows[0].len()]), device)
}

/// Each row's logits at its last position, over the first `vocab_size` entries.
pub(crate) fn last_rows(logits: Tensor<3>, vocab_size: usize) -> Vec<Vec<f32>> {
    let [b, s, v] = logits.dims();
    let width = vocab_size.min(v);
    let values = logits
        .narrow(1, s - 1, 1)
        .narrow(2, 0, width)
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 logits");
    (0..b)
        .map(|i| values[i * width..(i + 1) * width].to_vec())
        .collect()
}

/// `log_softmax`, accumulated in float64 and rounded to float32 (as torch's float32 result).
pub(crate) fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let log_sum = logits
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln();
    logits
        .iter()
        .map(|&x| (x as f64 - max - log_sum) as f32)
        .collect()
}
