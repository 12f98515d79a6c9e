//! LAMBADA zero-shot accuracy as Megatron-LM's `tasks/zeroshot_gpt` computes it: each passage's
//! last word is predicted from the rest, and a passage counts only if every token of the word is
//! the model's first choice (greedy, over the whole output layer).
//!
//! Non-strict (Megatron's default) tokenizes the whole passage and predicts its last *token*;
//! `--strict-lambada` tokenizes the text before the last word and `" " + word` apart and predicts
//! all of the word's tokens.

use std::path::Path;

use anyhow::{bail, Context, Result};
use burn::tensor::Device;

use super::next_token_scores::{score_rows, OutputColumns};
use crate::model::Gpt;
use crate::tokenizer::TextEncoder;

/// One passage, split into what the model reads and the word it must produce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LambadaItem {
    pub context: Vec<u32>,
    pub target: Vec<u32>,
}

/// Reads a LAMBADA file (JSON lines with a `"text"` string, as published); a passage longer than
/// `seq_length + 1` tokens (Megatron's sample size) is an error naming its line.
pub fn read_lambada(
    path: &Path,
    encoder: &mut TextEncoder,
    strict: bool,
    seq_length: usize,
) -> Result<Vec<LambadaItem>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let mut items = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), n + 1);
        let value: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: not a JSON line", at()))?;
        let Some(passage) = value.get("text").and_then(|t| t.as_str()) else {
            bail!("{}: expected an object with a \"text\" string", at());
        };
        let item = split_passage(passage, encoder, strict).with_context(at)?;
        let tokens = item.context.len() + item.target.len();
        if tokens > seq_length + 1 {
            bail!(
                "{}: the passage is {tokens} tokens, more than --seq-length + 1 = {}",
                at(),
                seq_length + 1
            );
        }
        items.push(item);
    }
    if items.is_empty() {
        bail!("{}: no passages", path.display());
    }
    Ok(items)
}

/// Megatron's `_LambadaDataset.get_tokens`.
fn split_passage(text: &str, encoder: &mut TextEncoder, strict: bool) -> Result<LambadaItem> {
    let encode = |encoder: &mut TextEncoder, s: &str| -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        encoder.encode(s, &mut ids)?;
        Ok(ids)
    };
    let item = if strict {
        let Some(last) = text.split_whitespace().next_back() else {
            bail!("the passage is empty");
        };
        let start = text.rfind(last).expect("the last word is in the text");
        LambadaItem {
            context: encode(encoder, text[..start].trim())?,
            target: encode(encoder, &format!(" {last}"))?,
        }
    } else {
        let mut tokens = encode(encoder, text)?;
        let last = tokens.pop();
        LambadaItem {
            context: tokens,
            target: last.into_iter().collect(),
        }
    };
    if item.context.is_empty() || item.target.is_empty() {
        bail!("the passage needs a context and a last word, each of at least one token");
    }
    Ok(item)
}

/// For each item, whether the model predicts every token of its target greedily.
pub fn lambada_correct(
    model: &Gpt,
    items: &[LambadaItem],
    batch_size: usize,
    device: &Device,
) -> Result<Vec<bool>, String> {
    let rows: Vec<Vec<u32>> = items
        .iter()
        .map(|item| [item.context.as_slice(), &item.target].concat())
        .collect();
    let scores = score_rows(model, &rows, OutputColumns::Padded, batch_size, device)?;
    Ok(items
        .iter()
        .zip(scores)
        .map(|(item, s)| {
            let first = item.context.len() - 1;
            s.is_argmax[first..first + item.target.len()]
                .iter()
                .all(|&ok| ok)
        })
        .collect())
}
