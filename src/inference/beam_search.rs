//! Beam search as HuggingFace `generate(num_beams=B, do_sample=False, early_stopping=False)`
//! runs it (transformers 5's `_beam_search`), so a checkpoint decodes the same text in both:
//!
//! - each running beam's next-token scores are the log-softmax over the real vocabulary, with
//!   n-gram bans at −∞ (not renormalised), plus the beam's running score (float32, as HF);
//! - the best 2B of all beams' continuations are kept (only beam 0 is live at the first step);
//!   those of the first B that end in the stop token or at the length limit are finished, scored
//!   `sum of log-probabilities / generated_length ^ length_penalty`, and the best B finished are
//!   kept; the best B that did not finish run on;
//! - the search ends when every kept continuation finished, or when B are finished and the best
//!   running beam, scored at its current length, cannot beat the worst of them.

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::generate::{
    last_rows, log_softmax, token_budget, token_rows, GenerateOptions, Generation,
};
use super::no_repeat_ngram::ban;
use crate::model::{Gpt, KvCache};

/// One hypothesis: the tokens after the prompt, the model's log-probability of each, and the
/// search's running score (their sum, after bans).
#[derive(Clone, Debug, Default)]
struct Beam {
    generation: Generation,
    score: f32,
}

/// One continuation of one running beam.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    score: f32,
    beam: usize,
    token: u32,
    log_prob: f32,
}

/// The best of `beams` hypotheses after `prompt` (its new tokens and their log-probabilities).
pub fn beam_search(
    model: &Gpt,
    prompt: &[u32],
    options: &GenerateOptions,
    beams: usize,
    length_penalty: f64,
    device: &Device,
) -> Result<Generation, String> {
    if beams == 0 {
        return Err("the beam width must be at least 1".into());
    }
    let budget = token_budget(model, prompt, options.max_new_tokens)?;
    let mut cache = KvCache::new(model.layers.len());
    let mut running = vec![Beam::default()];
    let mut finished: Vec<(f64, Generation)> = Vec::new();
    let mut feed = token_rows(&[prompt], device);
    for step in 0..budget {
        let logits = model.gather_logits(model.forward_cached(feed, &mut cache));
        let rows = last_rows(logits, options.vocab_size);
        let kept = best_continuations(&running, &rows, prompt, options, 2 * beams);
        let ends = |c: &Candidate| Some(c.token) == options.stop_token || step + 1 == budget;
        let length_scale = ((step + 1) as f64).powf(length_penalty);
        for c in kept.iter().take(beams).filter(|c| ends(c)) {
            let score = c.score as f64 / length_scale;
            finished.push((score, extend(&running[c.beam], c).generation));
        }
        finished.sort_by(|a, b| b.0.total_cmp(&a.0));
        finished.truncate(beams);
        let next: Vec<&Candidate> = kept.iter().filter(|c| !ends(c)).take(beams).collect();
        if next.is_empty() {
            break;
        }
        let best_running = next[0].score as f64 / length_scale;
        if finished.len() == beams && best_running <= finished[beams - 1].0 {
            break;
        }
        select_rows(&mut cache, next.iter().map(|c| c.beam), device);
        running = next.iter().map(|c| extend(&running[c.beam], c)).collect();
        let last: Vec<[u32; 1]> = running
            .iter()
            .map(|b| [b.generation.tokens[step]])
            .collect();
        feed = token_rows(&last.iter().map(|t| &t[..]).collect::<Vec<_>>(), device);
    }
    Ok(finished
        .into_iter()
        .next()
        .map(|(_, g)| g)
        .unwrap_or_default())
}

/// The `keep` best continuations of all running beams, best first.
fn best_continuations(
    running: &[Beam],
    rows: &[Vec<f32>],
    prompt: &[u32],
    options: &GenerateOptions,
    keep: usize,
) -> Vec<Candidate> {
    let mut all = Vec::with_capacity(running.len() * options.vocab_size);
    for (b, (beam, logits)) in running.iter().zip(rows).enumerate() {
        let log_probs = log_softmax(logits);
        let mut scores = log_probs.clone();
        let sequence = [prompt, &beam.generation.tokens].concat();
        ban(&mut scores, &sequence, options.no_repeat_ngram_size);
        all.extend(
            scores
                .iter()
                .zip(&log_probs)
                .enumerate()
                .map(|(v, (&s, &lp))| Candidate {
                    score: s + beam.score,
                    beam: b,
                    token: v as u32,
                    log_prob: lp,
                }),
        );
    }
    // Best first; among equals the lower (beam, token), as a stable sort of torch.topk's input.
    let order = |a: &Candidate, b: &Candidate| b.score.total_cmp(&a.score);
    let keep = keep.min(all.len());
    if keep < all.len() {
        all.select_nth_unstable_by(keep, |a, b| {
            order(a, b).then((a.beam, a.token).cmp(&(b.beam, b.token)))
        });
        all.truncate(keep);
    }
    all.sort_by(|a, b| order(a, b).then((a.beam, a.token).cmp(&(b.beam, b.token))));
    all
}

fn extend(beam: &Beam, c: &Candidate) -> Beam {
    let mut generation = beam.generation.clone();
    generation.tokens.push(c.token);
    generation.log_probs.push(c.log_prob as f64);
    Beam {
        generation,
        score: c.score,
    }
}

/// Reorders (and, after the prompt's single row, multiplies) the cached keys and values so that
/// row `i` holds the history of the beam that the `i`-th new beam continues.
fn select_rows(cache: &mut KvCache, rows: impl Iterator<Item = usize>, device: &Device) {
    let rows: Vec<i64> = rows.map(|r| r as i64).collect();
    let n = rows.len();
    let index = Tensor::<1, Int>::from_data(TensorData::new(rows, [n]), device);
    for layer in cache.layers.iter_mut().flatten() {
        layer.keys = layer.keys.clone().select(0, index.clone());
        layer.values = layer.values.clone().select(0, index.clone());
    }
}
