//! The question evaluation harnesses ask a language model (lm-evaluation-harness's
//! `loglikelihood`): for a context and a continuation, the sum of the continuation tokens'
//! log-probabilities and whether greedy decoding would have produced exactly them.
//!
//! Tokenization is the harness's `HFLM._encode_pair`: trailing spaces of the context move to the
//! continuation, the pair is tokenized whole and the context alone, and the continuation is what
//! the whole has beyond the context's tokens (so a BPE merge across the boundary is scored as
//! the model would see it). An empty context reads the end-of-document token. Scores are over
//! the tokenizer's vocabulary, as a HuggingFace model's.

use std::path::Path;

use anyhow::{bail, Context, Result};
use burn::tensor::Device;
use serde::Deserialize;

use super::next_token_scores::{score_rows, OutputColumns};
use crate::model::Gpt;
use crate::tokenizer::TextEncoder;

/// One request line: `{"context": ..., "continuation": ...}`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoglikelihoodRequest {
    pub context: String,
    pub continuation: String,
}

/// The answer to one request.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Loglikelihood {
    pub loglikelihood: f64,
    pub is_greedy: bool,
    /// How many continuation tokens were scored.
    pub tokens: usize,
}

/// Reads a JSON-lines file of requests; errors name the line.
pub fn read_requests(path: &Path) -> Result<Vec<LoglikelihoodRequest>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let mut requests = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let request: LoglikelihoodRequest = serde_json::from_str(line).with_context(|| {
            format!(
                "{}:{}: expected {{\"context\": string, \"continuation\": string}}",
                path.display(),
                n + 1
            )
        })?;
        requests.push(request);
    }
    Ok(requests)
}

/// A request's context and continuation tokens (`HFLM._encode_pair`).
pub fn encode_request(
    request: &LoglikelihoodRequest,
    encoder: &mut TextEncoder,
    eod: Option<u32>,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let mut encode = |s: &str| -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        encoder.encode(s, &mut ids)?;
        Ok(ids)
    };
    let (context, continuation) = if request.context.is_empty() {
        let Some(eod) = eod else {
            bail!("an empty context reads the end-of-document token; this tokenizer has none");
        };
        (vec![eod], encode(&request.continuation)?)
    } else {
        let kept = request.context.trim_end().len();
        let (context, spaces) = request.context.split_at(kept);
        let whole = encode(&format!("{}{spaces}{}", context, request.continuation))?;
        let context = encode(context)?;
        let continuation = whole.get(context.len()..).unwrap_or_default().to_vec();
        (context, continuation)
    };
    if continuation.is_empty() {
        bail!("the continuation encodes to no tokens");
    }
    Ok((context, continuation))
}

/// Answers the encoded requests; the context is cut from the left to the model's positions.
pub fn loglikelihoods(
    model: &Gpt,
    encoded: &[(Vec<u32>, Vec<u32>)],
    vocab_size: usize,
    batch_size: usize,
    device: &Device,
) -> Result<Vec<Loglikelihood>, String> {
    let window = model.max_positions + 1;
    if let Some((_, c)) = encoded.iter().find(|(_, c)| c.len() >= window) {
        return Err(format!(
            "a continuation of {} tokens does not fit the model's {} positions",
            c.len(),
            model.max_positions
        ));
    }
    let rows: Vec<Vec<u32>> = encoded
        .iter()
        .map(|(context, continuation)| {
            let whole = [context.as_slice(), continuation].concat();
            whole[whole.len().saturating_sub(window)..].to_vec()
        })
        .collect();
    let scores = score_rows(
        model,
        &rows,
        OutputColumns::Real(vocab_size),
        batch_size,
        device,
    )?;
    Ok(encoded
        .iter()
        .zip(scores)
        .map(|((_, continuation), s)| {
            let from = s.log_probs.len() - continuation.len();
            Loglikelihood {
                loglikelihood: s.log_probs[from..].iter().sum(),
                is_greedy: s.is_argmax[from..].iter().all(|&g| g),
                tokens: continuation.len(),
            }
        })
        .collect())
}
