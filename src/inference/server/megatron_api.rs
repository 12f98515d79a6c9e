//! Megatron-LM's `PUT /api` (`tools/run_text_generation_server.py`,
//! `megatron/core/inference/text_generation_server/text_generation_server.py`): its request
//! fields, defaults, validation rules and messages, checked in its order. Megatron answers most
//! broken rules with HTTP 200 and the message; here every one is a 400.
//!
//! Fields Megatron still checks but no longer acts on (`top_p_decay`, `top_p_bound`,
//! `stop_on_eol`, `stop_on_double_eol`, `prevent_newline_after_colon`, `stop_token`,
//! `length_penalty`) are checked the same way and, as there, have no effect.

use serde_json::{Map, Value};

use super::queue::{Completed, Completion};
use super::{Context, ServedRequest};
use crate::inference::sampling::SamplingConfig;

/// A validated `PUT /api` request.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiRequest {
    pub prompts: Vec<String>,
    pub tokens_to_generate: usize,
    pub logprobs: bool,
    pub temperature: f64,
    pub top_k: usize,
    pub top_p: f64,
    pub add_bos: bool,
    pub random_seed: Option<u32>,
}

/// Megatron's checks, in its order; the error is its message.
pub fn parse_api_request(body: &Value) -> Result<ApiRequest, String> {
    let Some(fields) = body.as_object() else {
        return Err("prompts argument required".into());
    };
    check_retired_fields(fields)?;
    let prompts = parse_prompts(fields)?;
    let tokens_to_generate = match fields.get("tokens_to_generate") {
        None => 64,
        Some(v) => match integer(v) {
            None => return Err("tokens_to_generate must be an integer greater than 0".into()),
            Some(n) if n < 0 => {
                return Err(
                    "tokens_to_generate must be an integer greater than or equal to 0".into(),
                )
            }
            Some(n) => n as usize,
        },
    };
    let logprobs = boolean(fields, "logprobs", "logprobs must be a boolean value")?;
    if tokens_to_generate == 0 && !logprobs {
        return Err("tokens_to_generate=0 implies logprobs should be True".into());
    }
    let temperature = parse_temperature(fields)?;
    let (top_k, top_p) = parse_top_k_top_p(fields)?;
    check_top_p_schedule(fields, top_p)?;
    let add_bos = boolean(fields, "add_BOS", "add_BOS must be a boolean value")?;
    if prompts.iter().any(String::is_empty) && !add_bos {
        return Err("Empty prompts require add_BOS=true".into());
    }
    for flag in [
        "stop_on_double_eol",
        "stop_on_eol",
        "prevent_newline_after_colon",
    ] {
        boolean(fields, flag, &format!("{flag} must be a boolean value"))?;
    }
    let random_seed = match fields.get("random_seed") {
        None => None,
        Some(v) => match integer(v) {
            None => return Err("random_seed must be integer".into()),
            Some(n) if n < 0 => return Err("random_seed must be a positive integer".into()),
            Some(n) => Some(n as u32),
        },
    };
    if fields
        .get("stop_token")
        .is_some_and(|v| integer(v).is_none())
    {
        return Err("stop_token must be an integer".into());
    }
    if fields.get("length_penalty").is_some_and(|v| !v.is_f64()) {
        return Err("length_penalty must be a float".into());
    }
    Ok(ApiRequest {
        prompts,
        tokens_to_generate,
        logprobs,
        temperature,
        top_k,
        top_p,
        add_bos,
        random_seed,
    })
}

fn check_retired_fields(fields: &Map<String, Value>) -> Result<(), String> {
    if !fields.contains_key("prompts") {
        return Err("prompts argument required".into());
    }
    for (field, message) in [
        (
            "max_len",
            "max_len is no longer used.  Replace with tokens_to_generate",
        ),
        (
            "sentences",
            "sentences is no longer used.  Replace with prompts",
        ),
        ("beam_width", "Beam search is no longer supported."),
    ] {
        if fields.contains_key(field) {
            return Err(message.into());
        }
    }
    Ok(())
}

fn parse_prompts(fields: &Map<String, Value>) -> Result<Vec<String>, String> {
    let Some(list) = fields["prompts"].as_array() else {
        return Err("prompts is not a list of strings".into());
    };
    if list.is_empty() {
        return Err("prompts is empty".into());
    }
    if list.len() > 128 {
        return Err("Maximum number of prompts is 128".into());
    }
    list.iter()
        .map(|p| p.as_str().map(str::to_owned))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| "prompts is not a list of strings".into())
}

fn parse_temperature(fields: &Map<String, Value>) -> Result<f64, String> {
    const MESSAGE: &str = "temperature must be a positive number less than or equal to 100.0";
    match fields.get("temperature") {
        None => Ok(1.0),
        Some(v) => match v.as_f64() {
            Some(t) if t > 0.0 && t <= 100.0 && !v.is_boolean() => Ok(t),
            _ => Err(MESSAGE.into()),
        },
    }
}

fn parse_top_k_top_p(fields: &Map<String, Value>) -> Result<(usize, f64), String> {
    let top_k = match fields.get("top_k") {
        None => 0,
        Some(v) => match integer(v) {
            None => {
                return Err("top_k must be an integer equal to or greater than 0 and less than or equal to 1000".into())
            }
            Some(k) if !(0..=1000).contains(&k) => {
                return Err("top_k must be equal to or greater than 0 and less than or equal to 1000".into())
            }
            Some(k) => k as usize,
        },
    };
    let top_p = match fields.get("top_p") {
        None => 0.0,
        Some(v) => {
            // Megatron asks for a Python float: `1` is refused, `1.0` taken.
            let Some(p) = v.as_f64().filter(|_| v.is_f64()) else {
                return Err("top_p must be a positive float less than or equal to 1.0".into());
            };
            if p > 0.0 && top_k > 0 {
                return Err("cannot set both top-k and top-p samplings.".into());
            }
            if !(0.0..=1.0).contains(&p) {
                return Err("top_p must be less than or equal to 1.0".into());
            }
            p
        }
    };
    Ok((top_k, top_p))
}

fn check_top_p_schedule(fields: &Map<String, Value>, top_p: f64) -> Result<(), String> {
    if let Some(v) = fields.get("top_p_decay") {
        let Some(decay) = v.as_f64().filter(|_| v.is_f64()) else {
            return Err("top_p_decay must be a positive float less than or equal to 1.0".into());
        };
        if top_p == 0.0 {
            return Err("top_p_decay cannot be set without top_p".into());
        }
        if !(0.0..=1.0).contains(&decay) {
            return Err("top_p_decay must be less than or equal to 1.0".into());
        }
    }
    if let Some(v) = fields.get("top_p_bound") {
        let Some(bound) = v.as_f64().filter(|_| v.is_f64()) else {
            return Err("top_p_bound must be a positive float less than or equal to top_p".into());
        };
        if top_p == 0.0 {
            return Err("top_p_bound cannot be set without top_p".into());
        }
        if !(bound > 0.0 && bound <= top_p) {
            return Err("top_p_bound must be greater than 0 and less than top_p".into());
        }
    }
    Ok(())
}

/// A JSON integer (not a bool, not `1.0`).
fn integer(v: &Value) -> Option<i64> {
    v.as_i64()
}

fn boolean(fields: &Map<String, Value>, name: &str, message: &str) -> Result<bool, String> {
    match fields.get(name) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(message.into()),
    }
}

impl ServedRequest for ApiRequest {
    /// The prompts as completions for the queue (an error names a prompt the model cannot take).
    fn completions(&self, context: &Context) -> Result<Vec<Completion>, String> {
        self.prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                let mut tokens: Vec<u32> = Vec::new();
                if self.add_bos {
                    tokens.extend(context.tokenizer.eod());
                }
                tokens.extend(context.encode(prompt)?);
                let sampling = SamplingConfig {
                    greedy: self.top_k == 1,
                    temperature: self.temperature,
                    top_k: self.top_k,
                    top_p: self.top_p,
                    seed: 0,
                };
                let max_new_tokens = self.tokens_to_generate;
                context.completion(tokens, i, max_new_tokens, sampling, self.random_seed)
            })
            .collect()
    }

    fn log_probs(&self) -> bool {
        self.logprobs
    }

    /// Megatron's response: `text` (prompt + continuation), `tokens` (prompt's and new),
    /// `segments` (each token's text) and, when asked, `logprobs`.
    fn response(
        &self,
        completions: &[Completion],
        done: &[Completed],
        context: &Context,
    ) -> Result<Value, String> {
        let mut text = Vec::new();
        let mut tokens = Vec::new();
        let mut segments = Vec::new();
        for ((prompt, c), d) in self.prompts.iter().zip(completions).zip(done) {
            text.push(format!("{prompt}{}", context.decode(&d.tokens)?));
            let all = [c.prompt.as_slice(), &d.tokens].concat();
            segments.push(context.segments(&all)?);
            tokens.push(all);
        }
        let mut response =
            serde_json::json!({"text": text, "tokens": tokens, "segments": segments});
        if self.logprobs {
            let logprobs: Vec<&Vec<f64>> =
                done.iter().filter_map(|d| d.log_probs.as_ref()).collect();
            response["logprobs"] = serde_json::json!(logprobs);
        }
        Ok(response)
    }
}
