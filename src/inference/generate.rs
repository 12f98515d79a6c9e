//! Autoregressive generation: the prompt once, then one token at a time through the KV cache.

use burn::tensor::{Device, Int, Tensor, TensorData};

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
}

/// Generates up to `options.max_new_tokens` tokens after `prompt` (never past the model's
/// positions), calling `on_token` with each as it comes, and returns the new tokens.
pub fn generate(
    model: &Gpt,
    prompt: &[u32],
    options: &GenerateOptions,
    sampler: &mut Sampler,
    device: &Device,
    mut on_token: impl FnMut(u32),
) -> Result<Vec<u32>, String> {
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
    let budget = options.max_new_tokens.min(max_positions + 1 - prompt.len());
    let mut cache = KvCache::new(model.layers.len());
    let mut sequence = prompt.to_vec();
    let mut new_tokens = Vec::with_capacity(budget);
    let mut feed: &[u32] = prompt;
    while new_tokens.len() < budget {
        let logits = if options.kv_cache {
            model.forward_cached(ids(feed, device), &mut cache)
        } else {
            model.forward(ids(&sequence, device))
        };
        let token = sampler.next_token(&last_row(logits, options.vocab_size));
        sequence.push(token);
        new_tokens.push(token);
        on_token(token);
        if Some(token) == options.stop_token || sequence.len() > max_positions {
            break;
        }
        feed = &sequence[sequence.len() - 1..];
    }
    Ok(new_tokens)
}

fn ids(tokens: &[u32], device: &Device) -> Tensor<2, Int> {
    let values: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    Tensor::from_data(TensorData::new(values, [1, tokens.len()]), device)
}

/// The logits of the last position, over the first `vocab_size` entries.
fn last_row(logits: Tensor<3>, vocab_size: usize) -> Vec<f32> {
    let [_, s, v] = logits.dims();
    logits
        .narrow(1, s - 1, 1)
        .narrow(2, 0, vocab_size.min(v))
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 logits")
}
