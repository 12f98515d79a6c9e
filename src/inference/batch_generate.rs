//! Several prompts decoded together through one KV cache, as Megatron's text generation does
//! it: the batch is prefilled up to its shortest prompt; from there every step feeds one token
//! per row: the row's own prompt token while it still has one (its prediction is ignored), or
//! the token just sampled for it. All rows share positions, so no padding or attention mask is
//! needed, and each row's tokens are those it would get alone.

use burn::tensor::Device;

use super::generate::{last_rows, log_softmax, token_budget, token_rows, Generation};
use super::sampling::Sampler;
use crate::model::{Gpt, KvCache};

/// One prompt of a batch, with its own length limit and sampling rule.
pub struct BatchRow {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampler: Sampler,
}

/// The new tokens of every row (each ending at `stop_token`, kept, or at its limit).
pub fn generate_batch(
    model: &Gpt,
    rows: &mut [BatchRow],
    stop_token: Option<u32>,
    vocab_size: usize,
    device: &Device,
) -> Result<Vec<Generation>, String> {
    let budgets = rows
        .iter()
        .map(|r| token_budget(model, &r.prompt, r.max_new_tokens))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = vec![Generation::default(); rows.len()];
    let mut done: Vec<bool> = budgets.iter().map(|&b| b == 0).collect();
    if rows.is_empty() || done.iter().all(|&d| d) {
        return Ok(out);
    }
    let mut sequences: Vec<Vec<u32>> = rows.iter().map(|r| r.prompt.clone()).collect();
    let start = sequences.iter().map(Vec::len).min().unwrap_or(0);
    let end = (0..rows.len())
        .map(|i| sequences[i].len() + budgets[i])
        .max()
        .unwrap_or(0);
    let mut cache = KvCache::new(model.layers.len());
    let prefill: Vec<&[u32]> = sequences.iter().map(|s| &s[..start]).collect();
    let mut logits =
        model.gather_logits(model.forward_cached(token_rows(&prefill, device), &mut cache));
    for position in start..end {
        let next = last_rows(logits, vocab_size);
        for (i, row) in rows.iter_mut().enumerate() {
            if done[i] || position < row.prompt.len() {
                continue;
            }
            let token = row.sampler.next_token(&next[i]);
            sequences[i].push(token);
            out[i].tokens.push(token);
            out[i]
                .log_probs
                .push(log_softmax(&next[i])[token as usize] as f64);
            done[i] = Some(token) == stop_token || out[i].tokens.len() == budgets[i];
        }
        if done.iter().all(|&d| d) {
            break;
        }
        // A finished row repeats its last token: its later positions are never read.
        let feed: Vec<[u32; 1]> = sequences
            .iter()
            .map(|s| [*s.get(position).unwrap_or(s.last().expect("non-empty"))])
            .collect();
        let feed: Vec<&[u32]> = feed.iter().map(|t| &t[..]).collect();
        logits = model.gather_logits(model.forward_cached(token_rows(&feed, device), &mut cache));
    }
    Ok(out)
}
