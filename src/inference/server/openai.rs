//! OpenAI's `POST /v1/completions`, for the clients people already have (the `openai` package,
//! evaluation harnesses' `local-completions`): `prompt` (a string or a list), `max_tokens`
//! (default 16), `temperature` (0: greedy), `top_p`, `top_k`, `logprobs`, `echo`, `stop`,
//! `seed`. Other fields (`model`, `user`, ...) are ignored; `n` other than 1 and `stream` are
//! refused. Megatron's own `POST /completions` is the same endpoint with `max_tokens` required.

use serde_json::{json, Map, Value};

use super::queue::{Completed, Completion};
use super::{Context, ServedRequest};
use crate::inference::sampling::SamplingConfig;
use crate::inference::stop_strings::cut_at_stop;

/// A validated completions request.
#[derive(Clone, Debug, PartialEq)]
pub struct CompletionsRequest {
    pub prompts: Vec<String>,
    pub max_tokens: usize,
    pub sampling: SamplingConfig,
    pub seeded: bool,
    pub logprobs: bool,
    pub echo: bool,
    pub stop: Vec<String>,
}

/// Checks the fields; `max_tokens_required` for Megatron's `/completions`.
pub fn parse_completions_request(
    body: &Value,
    max_tokens_required: bool,
) -> Result<CompletionsRequest, String> {
    let Some(fields) = body.as_object() else {
        return Err("the request body must be a JSON object".into());
    };
    let prompts = match fields.get("prompt") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(list)) if !list.is_empty() && list.len() <= 128 => list
            .iter()
            .map(|p| p.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or("prompt must be a string or a list of 1 to 128 strings")?,
        _ => return Err("prompt must be a string or a list of 1 to 128 strings".into()),
    };
    if max_tokens_required && !fields.contains_key("max_tokens") {
        return Err("max_tokens is required".into());
    }
    let max_tokens = optional_integer(fields, "max_tokens", 16, 0, i64::MAX)? as usize;
    if fields.get("n").is_some_and(|n| n.as_i64() != Some(1)) {
        return Err("n must be 1 (one completion per prompt)".into());
    }
    if fields
        .get("stream")
        .is_some_and(|s| s != &Value::Bool(false))
    {
        return Err("stream is not supported".into());
    }
    let temperature = optional_number(fields, "temperature", 1.0, 0.0, 100.0)?;
    let top_p = optional_number(fields, "top_p", 1.0, 0.0, 1.0)?;
    let top_k = optional_integer(fields, "top_k", 0, 0, 1000)? as usize;
    let logprobs = match fields.get("logprobs") {
        None | Some(Value::Null) => false,
        Some(v) => match v.as_i64() {
            Some(0..=5) => true,
            _ => return Err("logprobs must be null or an integer from 0 to 5".into()),
        },
    };
    let echo = match fields.get("echo") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("echo must be a boolean".into()),
    };
    let stop = parse_stop(fields.get("stop"))?;
    let seed = match fields.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_i64().ok_or("seed must be an integer")? as u32),
    };
    Ok(CompletionsRequest {
        prompts,
        max_tokens,
        sampling: SamplingConfig {
            greedy: temperature == 0.0,
            temperature: if temperature == 0.0 { 1.0 } else { temperature },
            top_k,
            top_p: if top_p >= 1.0 { 0.0 } else { top_p },
            seed: seed.unwrap_or(0),
        },
        seeded: seed.is_some(),
        logprobs,
        echo,
        stop,
    })
}

fn parse_stop(stop: Option<&Value>) -> Result<Vec<String>, String> {
    const MESSAGE: &str = "stop must be null, a string or a list of up to 4 strings";
    let stop = match stop {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(list)) if list.len() <= 4 => list
            .iter()
            .map(|s| s.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or(MESSAGE)?,
        Some(_) => return Err(MESSAGE.into()),
    };
    if stop.iter().any(String::is_empty) {
        return Err("stop strings must not be empty".into());
    }
    Ok(stop)
}

fn optional_number(
    fields: &Map<String, Value>,
    name: &str,
    default: f64,
    low: f64,
    high: f64,
) -> Result<f64, String> {
    match fields.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => match v.as_f64() {
            Some(x) if (low..=high).contains(&x) => Ok(x),
            _ => Err(format!("{name} must be a number from {low} to {high}")),
        },
    }
}

fn optional_integer(
    fields: &Map<String, Value>,
    name: &str,
    default: i64,
    low: i64,
    high: i64,
) -> Result<i64, String> {
    match fields.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => match v.as_i64() {
            Some(x) if (low..=high).contains(&x) => Ok(x),
            _ => Err(format!("{name} must be an integer of at least {low}")),
        },
    }
}

impl ServedRequest for CompletionsRequest {
    /// The prompts as completions for the queue.
    fn completions(&self, context: &Context) -> Result<Vec<Completion>, String> {
        self.prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                let tokens = context.encode(prompt)?;
                let seed = self.seeded.then_some(self.sampling.seed);
                context.completion(tokens, i, self.max_tokens, self.sampling.clone(), seed)
            })
            .collect()
    }

    fn log_probs(&self) -> bool {
        self.logprobs
    }

    /// OpenAI's `text_completion` object.
    fn response(
        &self,
        completions: &[Completion],
        done: &[Completed],
        context: &Context,
    ) -> Result<Value, String> {
        let mut choices = Vec::new();
        let (mut prompt_tokens, mut completion_tokens) = (0, 0);
        for (index, ((prompt, c), d)) in self.prompts.iter().zip(completions).zip(done).enumerate()
        {
            prompt_tokens += c.prompt.len();
            completion_tokens += d.tokens.len();
            choices.push(self.choice(index, prompt, c, d, context)?);
        }
        Ok(json!({
            "id": format!("cmpl-{}", context.fresh_seed()),
            "object": "text_completion",
            "created": std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            "model": "ferrotron",
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }))
    }
}

impl CompletionsRequest {
    fn choice(
        &self,
        index: usize,
        prompt: &str,
        c: &Completion,
        d: &Completed,
        context: &Context,
    ) -> Result<Value, String> {
        let (text, new_tokens, cut) = cut_at_stop(&d.tokens, &self.stop, |t| context.decode(t))?;
        let stopped = d.stopped || cut;
        let logprobs = match (&d.log_probs, self.logprobs) {
            (Some(all), true) => {
                Some(self.logprobs_object(prompt.chars().count(), c, &new_tokens, all, context)?)
            }
            _ => None,
        };
        Ok(json!({
            "index": index,
            "text": if self.echo { format!("{prompt}{text}") } else { text },
            "logprobs": logprobs,
            "finish_reason": if stopped { "stop" } else { "length" },
        }))
    }

    /// `{tokens, token_logprobs, top_logprobs, text_offset}` for the new tokens (with `echo`,
    /// the prompt's too, the first of which has no log-probability: null).
    fn logprobs_object(
        &self,
        prompt_chars: usize,
        c: &Completion,
        new_tokens: &[u32],
        all: &[f64],
        context: &Context,
    ) -> Result<Value, String> {
        let first = if self.echo { 0 } else { c.prompt.len() };
        let tokens = [c.prompt.as_slice(), new_tokens].concat();
        let shown = &tokens[first..];
        let token_logprobs: Vec<Option<f64>> = (first..tokens.len())
            .map(|j| {
                if j == 0 {
                    None
                } else {
                    all.get(j - 1).copied()
                }
            })
            .collect();
        let segments = context.segments(shown)?;
        // Offsets into prompt + completion, as OpenAI's: the completion starts after the prompt.
        let mut offset = if self.echo { 0 } else { prompt_chars };
        let text_offset: Vec<usize> = segments
            .iter()
            .map(|s| {
                let here = offset;
                offset += s.chars().count();
                here
            })
            .collect();
        Ok(json!({
            "tokens": segments,
            "token_logprobs": token_logprobs,
            "top_logprobs": Value::Null,
            "text_offset": text_offset,
        }))
    }
}
