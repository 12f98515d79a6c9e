//! The text-generation server (`serve`): Megatron's `PUT /api` and OpenAI's
//! `POST /v1/completions` over a real HTTP stack (`tiny_http`), request threads that validate
//! and tokenize, and one model worker that batches whatever is queued ([`queue`]).
//!
//! A bad request is answered 400 with its message, a full queue 503, an unknown path 404; none
//! of them stops the server. SIGINT/SIGTERM stop taking requests, let the running batch finish
//! and its clients get their answers, and return.

pub mod megatron_api;
pub mod openai;
pub mod queue;

use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use serde_json::Value;
use tiny_http::{Header, Method, Request, Response, Server};

use self::queue::{Completed, Completion, Queue, QueueError, Worker};
use crate::inference::sampling::SamplingConfig;
use crate::tokenizer::TextTokenizer;

/// Where and how to listen.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    pub host: String,
    pub port: u16,
    /// Threads reading requests (each waits for its answer while the worker decodes).
    pub request_threads: usize,
    /// Requests waiting for the worker at most; more get 503.
    pub queue_capacity: usize,
    /// Request bodies larger than this get 413.
    pub max_body_bytes: usize,
}

/// What request threads share: the tokenizer and the model's limits.
pub struct Context {
    pub tokenizer: TextTokenizer,
    pub max_positions: usize,
    seeds: AtomicU32,
}

impl Context {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let mut ids = Vec::new();
        self.tokenizer
            .encoder()
            .encode(text, &mut ids)
            .map_err(|e| e.to_string())?;
        Ok(ids)
    }

    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer.decode(ids).map_err(|e| e.to_string())
    }

    /// Each token's own text.
    fn segments(&self, ids: &[u32]) -> Result<Vec<String>, String> {
        ids.iter().map(|&t| self.decode(&[t])).collect()
    }

    fn check_prompt(&self, tokens: &[u32], index: usize) -> Result<(), String> {
        if tokens.is_empty() {
            return Err(format!("prompt {index} encodes to no tokens"));
        }
        if tokens.len() > self.max_positions {
            return Err(format!(
                "prompt {index} is {} tokens, more than the model's {} positions",
                tokens.len(),
                self.max_positions
            ));
        }
        Ok(())
    }

    /// Prompt `index` of a request as a completion: its tokens checked against the model, and
    /// the request's seed plus `index` (or a fresh seed when it gave none).
    fn completion(
        &self,
        prompt: Vec<u32>,
        index: usize,
        max_new_tokens: usize,
        mut sampling: SamplingConfig,
        seed: Option<u32>,
    ) -> Result<Completion, String> {
        self.check_prompt(&prompt, index)?;
        sampling.seed = seed.map_or_else(|| self.fresh_seed(), |s| s.wrapping_add(index as u32));
        Ok(Completion {
            prompt,
            max_new_tokens,
            sampling,
        })
    }

    /// A seed for a request that gave none: different for every prompt served.
    fn fresh_seed(&self) -> u32 {
        let n = self.seeds.fetch_add(1, Ordering::Relaxed);
        n.wrapping_mul(2_654_435_761)
            .wrapping_add(std::process::id())
    }
}

/// Serves until `stop` is set; prints `listening on http://HOST:PORT` once ready.
pub fn serve(
    options: &ServerOptions,
    worker: Worker,
    tokenizer: TextTokenizer,
    stop: Arc<AtomicBool>,
) -> Result<()> {
    let server = Server::http((options.host.as_str(), options.port))
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("cannot listen on {}:{}", options.host, options.port))?;
    let address = server.server_addr().to_ip().context("not an IP address")?;
    let context = Arc::new(Context {
        tokenizer,
        max_positions: worker.model.max_positions,
        seeds: AtomicU32::new(1),
    });
    let (queue, worker_thread) = Queue::start(worker, options.queue_capacity);
    let server = Arc::new(server);
    println!("listening on http://{address}");
    std::thread::scope(|scope| {
        for _ in 0..options.request_threads.max(1) {
            let (server, queue, context, stop) = (&server, queue.clone(), &context, &stop);
            scope.spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(Some(request)) = server.recv_timeout(Duration::from_millis(100)) {
                        handle(request, &queue, context, options.max_body_bytes);
                    }
                }
            });
        }
    });
    drop(queue);
    worker_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the model worker panicked"))?;
    Ok(())
}

/// Answers one request; never panics on its content.
fn handle(mut request: Request, queue: &Queue, context: &Context, max_body: usize) {
    let route = (request.method().clone(), request.url().to_string());
    let (status, body) = match read_json(&mut request, max_body) {
        Err((status, message)) => (status, error_body(&route.1, &message)),
        Ok(json) => match (&route.0, route.1.as_str()) {
            (Method::Put, "/api") => respond(
                megatron_api::parse_api_request(&json),
                "/api",
                queue,
                context,
            ),
            (Method::Post, path @ ("/v1/completions" | "/completions")) => {
                let megatron = path == "/completions";
                let parsed = openai::parse_completions_request(&json, megatron);
                respond(parsed, path, queue, context)
            }
            (_, "/api" | "/v1/completions" | "/completions") => {
                (405, error_body(&route.1, "method not allowed"))
            }
            _ => (404, error_body(&route.1, "not found")),
        },
    };
    let header = Header::from_bytes("Content-Type", "application/json").expect("valid header");
    let response = Response::from_string(body.to_string())
        .with_status_code(status)
        .with_header(header);
    let _ = request.respond(response);
}

fn read_json(request: &mut Request, max_body: usize) -> Result<Value, (u16, String)> {
    let mut body = Vec::new();
    request
        .as_reader()
        .take(max_body as u64 + 1)
        .read_to_end(&mut body)
        .map_err(|e| (400, format!("cannot read the request body: {e}")))?;
    if body.len() > max_body {
        return Err((
            413,
            format!("the request body is larger than {max_body} bytes"),
        ));
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&body).map_err(|e| (400, format!("the request body is not JSON: {e}")))
}

/// Megatron's errors are a JSON string; OpenAI's an `{"error": {...}}` object.
fn error_body(path: &str, message: &str) -> Value {
    if path == "/api" {
        Value::String(message.into())
    } else {
        serde_json::json!({"error": {"message": message, "type": "invalid_request_error"}})
    }
}

fn run_queue(
    queue: &Queue,
    completions: Vec<Completion>,
    log_probs: bool,
) -> Result<Vec<Completed>, (u16, String)> {
    queue.complete(completions, log_probs).map_err(|e| match e {
        QueueError::Full => (503, "the server is busy: try again".to_string()),
        QueueError::Failed(message) => (400, message),
    })
}

/// What both APIs' requests do: become completions, and make a response of their results.
trait ServedRequest {
    fn completions(&self, context: &Context) -> Result<Vec<Completion>, String>;
    fn log_probs(&self) -> bool;
    fn response(
        &self,
        completions: &[Completion],
        done: &[Completed],
        context: &Context,
    ) -> Result<Value, String>;
}

/// A parsed request through the queue to its response (status, body), errors in `path`'s form.
fn respond(
    parsed: Result<impl ServedRequest, String>,
    path: &str,
    queue: &Queue,
    context: &Context,
) -> (u16, Value) {
    let answer = || -> Result<Value, (u16, String)> {
        let request = parsed.map_err(|m| (400, m))?;
        let completions = request.completions(context).map_err(|m| (400, m))?;
        let done = run_queue(queue, completions.clone(), request.log_probs())?;
        request
            .response(&completions, &done, context)
            .map_err(|m| (500, m))
    };
    match answer() {
        Ok(body) => (200, body),
        Err((status, message)) => (status, error_body(path, &message)),
    }
}
