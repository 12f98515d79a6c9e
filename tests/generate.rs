//! Text generation: greedy continuations equal HuggingFace `GPT2LMHeadModel.generate` token
//! for token on an imported model (`tests/fixtures/hf_generate.json`, made by
//! `tests/fixtures/hf_tiny_gpt2.py`), the KV cache gives the full forward's logits, HF's and
//! ferrotron's losses on that model agree, and the `generate` tool's output modes agree with
//! one another.

use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};
use ferrotron::checkpoint::load_model;
use ferrotron::inference::beam_search::beam_search;
use ferrotron::inference::next_token_scores::{score_rows, OutputColumns};
use ferrotron::inference::window_eval::mean_window_loss;
use ferrotron::inference::{generate, GenerateOptions, Sampler, SamplingConfig};
use ferrotron::model::{Gpt, KvCache};

use crate::common::mpi::mpirun_command;
use crate::common::*;

const EOS: u32 = 249;
const HF_VOCAB: usize = 250;

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("hf_generate.json")).unwrap()).unwrap()
}

/// The HF fixture model, through `import-hf` (vocabulary 250 padded to 256).
fn imported(dir: &Path) -> Gpt {
    let input = fixture("hf_tiny_gpt2");
    let out = run_tool(
        env!("CARGO_BIN_EXE_import-hf"),
        &["--input", input.to_str().unwrap(), "--save", "ckpt"],
        dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let (model, checkpoint) = load_model(&dir.join("ckpt"), &Device::flex()).unwrap();
    assert_eq!(checkpoint.config.padded_vocab_size, 256);
    model
}

#[test]
fn greedy_generation_equals_huggingface_generate() {
    let dir = tempfile::tempdir().unwrap();
    let model = imported(dir.path());
    let reference = reference();
    for case in reference["greedy"].as_array().unwrap() {
        let prompt = token_ids(&case["prompt"]);
        let expected = token_ids(&case["tokens"]);
        for kv_cache in [true, false] {
            let options = GenerateOptions {
                max_new_tokens: 20,
                stop_token: Some(EOS),
                vocab_size: HF_VOCAB,
                kv_cache,
                no_repeat_ngram_size: 0,
            };
            let mut streamed = Vec::new();
            let tokens = generate(
                &model,
                &prompt,
                &options,
                &mut Sampler::new(SamplingConfig::greedy()),
                &Device::flex(),
                |t| streamed.push(t),
            )
            .unwrap()
            .tokens;
            assert_eq!(tokens, expected, "prompt {prompt:?}, kv cache {kv_cache}");
            assert_eq!(streamed, tokens);
        }
    }
}

#[test]
fn huggingface_and_ferrotron_losses_agree_on_the_imported_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = imported(dir.path());
    let reference = reference();
    let windows: Vec<Vec<u32>> = reference["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(token_ids)
        .collect();
    let ours = mean_window_loss(&model, &windows, HF_VOCAB, 2, &Device::flex());
    let theirs = reference["mean_loss"].as_f64().unwrap();
    assert!(
        (ours - theirs).abs() < 1e-4,
        "ferrotron {ours} vs HuggingFace {theirs}"
    );
}

#[test]
fn cached_decoding_gives_the_full_forwards_logits() {
    let dir = tempfile::tempdir().unwrap();
    let model = imported(dir.path());
    let device = Device::flex();
    let sequence: Vec<i64> = (0..24).map(|i| (i * 37 % 250) as i64).collect();
    let full: Vec<f32> = model
        .forward(Tensor::<2, Int>::from_data(
            TensorData::new(sequence.clone(), [1, 24]),
            &device,
        ))
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    // A 10-token prompt, then 3 tokens at once, then one at a time.
    let mut cache = KvCache::new(model.layers.len());
    let mut cached = Vec::new();
    for range in [0..10, 10..13]
        .into_iter()
        .chain((13..24).map(|i| i..i + 1))
    {
        let part = Tensor::<2, Int>::from_data(
            TensorData::new(sequence[range.clone()].to_vec(), [1, range.len()]),
            &device,
        );
        let logits: Vec<f32> = model
            .forward_cached(part, &mut cache)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        cached.extend(logits);
    }
    assert_eq!(cache.positions, 24);
    assert_eq!(cached.len(), full.len());
    let worst = full
        .iter()
        .zip(&cached)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "cached logits differ by {worst}");
}

/// A 2-iteration pretrain checkpoint with the GPT-2 tokenizer, for the tool.
fn tiny_checkpoint(dir: &Path) {
    let data = golden("wikitext2_valid", "text");
    let out = run_tool(
        env!("CARGO_BIN_EXE_pretrain"),
        &[
            "--num-layers",
            "1",
            "--hidden-size",
            "16",
            "--num-attention-heads",
            "2",
            "--seq-length",
            "32",
            "--max-position-embeddings",
            "48",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "2",
            "--lr",
            "1e-3",
            "--train-iters",
            "2",
            "--eval-iters",
            "0",
            "--data-path",
            data.to_str().unwrap(),
            "--data-cache-path",
            "cache",
            "--save",
            "ckpt",
        ],
        dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

/// One line of `generate --json`.
fn parsed(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap()
}

#[test]
fn the_generate_tool_streams_what_it_reports_as_json() {
    let dir = tempfile::tempdir().unwrap();
    tiny_checkpoint(dir.path());
    let run = |extra: &[&str]| {
        let mut args = vec!["--load", "ckpt", "--max-new-tokens", "12"];
        args.extend_from_slice(extra);
        let out = run_tool(env!("CARGO_BIN_EXE_generate"), &args, dir.path());
        assert!(out.status.success(), "{}", stderr(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    let prompts = ["The history of", "In 1990 , the"];
    std::fs::write(
        dir.path().join("prompts.jsonl"),
        format!("{{\"prompt\": \"{}\"}}\n\"{}\"\n", prompts[0], prompts[1]),
    )
    .unwrap();
    let json = run(&["--prompts-file", "prompts.jsonl", "--greedy", "--json"]);
    let lines: Vec<serde_json::Value> = json.lines().map(parsed).collect();
    assert_eq!(lines.len(), 2);
    let tokenizer = ferrotron::tokenizer::TextTokenizer::gpt2_embedded().unwrap();
    for (line, prompt) in lines.iter().zip(prompts) {
        assert_eq!(line["prompt"], prompt);
        let mut expected = Vec::new();
        tokenizer.encoder().encode(prompt, &mut expected).unwrap();
        assert_eq!(token_ids(&line["prompt_tokens"]), expected);
        let tokens = token_ids(&line["tokens"]);
        assert!(!tokens.is_empty() && tokens.len() <= 12);
        assert_eq!(line["text"], tokenizer.decode(&tokens).unwrap());
    }
    // Without the cache: the same tokens.
    let again = run(&[
        "--prompts-file",
        "prompts.jsonl",
        "--greedy",
        "--json",
        "--no-kv-cache",
    ]);
    assert_eq!(again, json);
    // Streamed text: the prompt and the same continuation.
    let text = run(&["--prompt", prompts[0], "--temperature", "0"]);
    assert_eq!(
        text,
        format!("{}{}\n", prompts[0], lines[0]["text"].as_str().unwrap())
    );
    // Sampling repeats for a seed.
    let sample = [
        "--prompt", prompts[0], "--top-k", "50", "--top-p", "0.9", "--json",
    ];
    let a = run(&[&sample[..], &["--seed", "5"]].concat());
    assert_eq!(a, run(&[&sample[..], &["--seed", "5"]].concat()));
    // Beam search with one beam is greedy decoding; log-probabilities come with --logprobs.
    let beam = run(&[
        "--prompt",
        prompts[0],
        "--num-beams",
        "1",
        "--json",
        "--logprobs",
        "--greedy",
    ]);
    let beam = parsed(&beam);
    assert_eq!(beam["tokens"], lines[0]["tokens"]);
    let logprobs = beam["logprobs"].as_array().unwrap();
    assert_eq!(logprobs.len(), token_ids(&beam["tokens"]).len());
    assert!(logprobs.iter().all(|p| p.as_f64().unwrap() <= 0.0));
    // A stop string ends the text where it begins; the tokens are those of the kept text.
    let full = lines[0]["text"].as_str().unwrap();
    let stop: String = full
        .chars()
        .skip(full.chars().count() / 2)
        .take(3)
        .collect();
    let cut = run(&[
        "--prompt", prompts[0], "--greedy", "--json", "--stop", &stop,
    ]);
    let cut = parsed(&cut);
    assert_eq!(
        cut["text"].as_str().unwrap(),
        &full[..full.find(&stop).unwrap()]
    );
    let kept = token_ids(&cut["tokens"]);
    assert_eq!(kept[..], token_ids(&lines[0]["tokens"])[..kept.len()]);
    let three = parsed(&run(&[
        "--prompt",
        prompts[0],
        "--beam-width",
        "3",
        "--json",
    ]));
    assert!(!token_ids(&three["tokens"]).is_empty());
    let sampled_beams = ["--prompt", "a", "--beam-width", "3", "--top-k", "5"];
    assert_generate_refuses(dir.path(), &sampled_beams, "beam search is greedy");
    // Bad input: file and line named, exit code 1.
    std::fs::write(dir.path().join("bad.jsonl"), "\"ok\"\n{\"text\": 3}\n").unwrap();
    assert_generate_refuses(dir.path(), &["--prompts-file", "bad.jsonl"], "bad.jsonl:2:");
}

/// `generate --load ckpt` with `args` in `dir` exits 1 before any output, saying `message`.
fn assert_generate_refuses(dir: &Path, args: &[&str], message: &str) {
    let mut all = vec!["--load", "ckpt"];
    all.extend_from_slice(args);
    let out = run_tool(env!("CARGO_BIN_EXE_generate"), &all, dir);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_refused_saying(&out, message);
    assert!(out.stdout.is_empty());
}

/// Beam search equals HuggingFace `generate(num_beams=B, no_repeat_ngram_size=K,
/// length_penalty=P, early_stopping=False, do_sample=False)` token for token, and its score
/// (`tests/fixtures/hf_beam_search.json`, made by `tests/fixtures/hf_beam_search.py`: 15 cases,
/// some of whose best hypotheses end early at the stop token).
#[test]
fn beam_search_equals_huggingface_beam_search() {
    let dir = tempfile::tempdir().unwrap();
    let model = imported(dir.path());
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("hf_beam_search.json")).unwrap())
            .unwrap();
    for case in reference["cases"].as_array().unwrap() {
        let number = |key: &str| case[key].as_f64().unwrap();
        let options = GenerateOptions {
            max_new_tokens: number("max_new_tokens") as usize,
            stop_token: Some(number("eos_token_id") as u32),
            vocab_size: HF_VOCAB,
            kv_cache: true,
            no_repeat_ngram_size: number("no_repeat_ngram_size") as usize,
        };
        let prompt = token_ids(&case["prompt"]);
        let beams = number("num_beams") as usize;
        let penalty = number("length_penalty");
        let best = beam_search(&model, &prompt, &options, beams, penalty, &Device::flex()).unwrap();
        assert_eq!(best.tokens, token_ids(&case["tokens"]), "{case}");
        let score = best.log_probs.iter().sum::<f64>() / (best.tokens.len() as f64).powf(penalty);
        assert!(
            (score - number("score")).abs() < 1e-4,
            "{case}: score {score}"
        );
    }
}

/// The log-probabilities generation reports are the evaluator's scores of the same tokens.
#[test]
fn generated_log_probs_are_the_scorers() {
    let dir = tempfile::tempdir().unwrap();
    let model = imported(dir.path());
    let prompt = [100, 4, 200, 31, 5];
    let options = GenerateOptions {
        max_new_tokens: 12,
        stop_token: None,
        vocab_size: HF_VOCAB,
        kv_cache: true,
        no_repeat_ngram_size: 0,
    };
    let mut sampler = Sampler::new(SamplingConfig {
        greedy: false,
        temperature: 0.8,
        top_k: 0,
        top_p: 0.0,
        seed: 3,
    });
    let out = generate(
        &model,
        &prompt,
        &options,
        &mut sampler,
        &Device::flex(),
        |_| {},
    )
    .unwrap();
    let row = [prompt.as_slice(), &out.tokens].concat();
    let scores = score_rows(
        &model,
        &[row],
        OutputColumns::Real(HF_VOCAB),
        1,
        &Device::flex(),
    )
    .unwrap();
    let expected = &scores[0].log_probs[prompt.len() - 1..];
    assert_eq!(out.log_probs.len(), expected.len());
    for (got, want) in out.log_probs.iter().zip(expected) {
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }
}

/// A running `serve` on a free loopback port, stopped (SIGTERM) when dropped.
struct Served {
    child: std::process::Child,
    url: String,
}

impl Served {
    fn start(dir: &Path, extra: &[&str]) -> Served {
        Self::start_with(
            std::process::Command::new(env!("CARGO_BIN_EXE_serve")),
            dir,
            extra,
        )
    }

    /// `serve` under `launcher` (the binary itself, or `mpirun ... serve`).
    fn start_with(mut launcher: std::process::Command, dir: &Path, extra: &[&str]) -> Served {
        use std::io::BufRead;
        let tokenizer = fixture("zero_shot/tokenizer.json");
        let mut child = launcher
            .args([
                "--load",
                "ckpt",
                "--port",
                "0",
                "--tokenizer-type",
                "HuggingFaceTokenizer",
            ])
            .args(["--tokenizer-model", tokenizer.to_str().unwrap()])
            .args(extra)
            .current_dir(dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .expect(&line)
            .to_string();
        Served { child, url }
    }

    /// (status, JSON body) of one request.
    fn call(&self, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let url = format!("{}{path}", self.url);
        let mut response = match method {
            "PUT" => agent.put(&url).content_type("application/json").send(body),
            "POST" => agent.post(&url).content_type("application/json").send(body),
            _ => agent.get(&url).call(),
        }
        .unwrap();
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        )
    }

    /// SIGTERM; the exit status.
    fn stop(self) -> std::process::ExitStatus {
        self.stop_with_stderr().0
    }

    /// SIGTERM; the exit status and what the server wrote to stderr.
    fn stop_with_stderr(mut self) -> (std::process::ExitStatus, String) {
        use std::io::Read;
        let pid = self.child.id().to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        let status = self.child.wait().unwrap();
        let mut err = String::new();
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (status, err)
    }
}

/// The zero-shot fixture's model (it has a tokenizer), imported into `dir/ckpt`.
fn zero_shot_checkpoint(dir: &Path) -> Gpt {
    let input = fixture("zero_shot/model");
    let out = run_tool(
        env!("CARGO_BIN_EXE_import-hf"),
        &["--input", input.to_str().unwrap(), "--save", "ckpt"],
        dir,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    load_model(&dir.join("ckpt"), &Device::flex()).unwrap().0
}

const SERVED_PROMPTS: [&str; 8] = [
    "The team then won",
    "In 1908",
    "Route 29 crosses",
    "Yorkshire had been",
    "As one of the major",
    "The last two",
    "<unk> believes that",
    "a",
];

/// `generate --greedy --json` on each prompt: the reference for the server's greedy answers.
fn greedy_reference(dir: &Path, tokens: usize) -> Vec<Vec<u32>> {
    let tokenizer = fixture("zero_shot/tokenizer.json");
    let count = tokens.to_string();
    let mut args = vec![
        "--load",
        "ckpt",
        "--greedy",
        "--json",
        "--max-new-tokens",
        &count,
    ];
    args.extend(["--tokenizer-type", "HuggingFaceTokenizer"]);
    args.extend(["--tokenizer-model", tokenizer.to_str().unwrap()]);
    for p in SERVED_PROMPTS {
        args.extend(["--prompt", p]);
    }
    let out = run_tool(env!("CARGO_BIN_EXE_generate"), &args, dir);
    assert!(out.status.success(), "{}", stderr(&out));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let mut all = token_ids(&v["prompt_tokens"]);
            let new = token_ids(&v["tokens"]);
            // The server leaves out the end-of-document token that stopped generation.
            all.extend(new.iter().filter(|&&t| t != 499));
            all
        })
        .collect()
}

/// `serve`: Megatron's `PUT /api` (greedy answers equal `generate --greedy`, log-probabilities
/// equal the evaluator's, concurrent clients batched correctly, every validation rule a 400
/// with Megatron's message), OpenAI's `/v1/completions`, 404/413/503, and SIGTERM exiting 0.
#[test]
fn the_server_answers_as_generate_and_megatron_and_survives_bad_requests() {
    let dir = tempfile::tempdir().unwrap();
    let model = zero_shot_checkpoint(dir.path());
    let expected = greedy_reference(dir.path(), 12);
    let served = Served::start(dir.path(), &[]);

    let body = serde_json::json!({
        "prompts": SERVED_PROMPTS, "tokens_to_generate": 12, "top_k": 1, "logprobs": true,
    });
    let (status, answer) = served.call("PUT", "/api", &body.to_string());
    assert_eq!(status, 200, "{answer}");
    let tokens: Vec<Vec<u32>> = answer["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(token_ids)
        .collect();
    assert_eq!(tokens, expected);
    let scores = score_rows(
        &model,
        &tokens,
        OutputColumns::Real(500),
        4,
        &Device::flex(),
    )
    .unwrap();
    for (i, s) in scores.iter().enumerate() {
        let got: Vec<f64> = answer["logprobs"][i]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(got.len(), s.log_probs.len());
        assert!(
            got.iter()
                .zip(&s.log_probs)
                .all(|(a, b)| (a - b).abs() < 1e-5),
            "{i}"
        );
        assert_eq!(
            answer["segments"][i].as_array().unwrap().len(),
            tokens[i].len()
        );
        assert!(answer["text"][i]
            .as_str()
            .unwrap()
            .starts_with(SERVED_PROMPTS[i]));
    }

    // 8 concurrent clients × 4 requests, each for one prompt: the batched answers are the
    // single-prompt ones.
    std::thread::scope(|scope| {
        for client in 0..8 {
            let (served, expected) = (&served, &expected);
            scope.spawn(move || {
                for round in 0..4 {
                    let i = (client + round) % SERVED_PROMPTS.len();
                    let body = serde_json::json!({
                        "prompts": [SERVED_PROMPTS[i]], "tokens_to_generate": 12, "top_k": 1,
                    });
                    let (status, answer) = served.call("PUT", "/api", &body.to_string());
                    assert_eq!(status, 200, "{answer}");
                    assert_eq!(
                        token_ids(&answer["tokens"][0]),
                        expected[i],
                        "client {client}"
                    );
                }
            });
        }
    });

    for (body, message) in megatron_api_rules() {
        let (status, answer) = served.call("PUT", "/api", &body);
        assert_eq!((status, answer.as_str()), (400, Some(message)), "{body}");
    }
    let (status, _) = served.call("PUT", "/api", "{\"prompts\": [\"a\"");
    assert_eq!(status, 400);
    let (status, _) = served.call("PUT", "/api", &"x".repeat(2 << 20));
    assert_eq!(status, 413);
    assert_eq!(served.call("GET", "/nothing", "").0, 404);
    assert_eq!(served.call("GET", "/api", "").0, 405);

    check_completions(&served, &expected);
    // Still serving after all of that.
    let (status, answer) = served.call("PUT", "/api", &body.to_string());
    assert_eq!(
        (status, answer["tokens"].as_array().unwrap().len()),
        (200, 8)
    );
    assert!(served.stop().success());
}

/// OpenAI's completions: greedy (temperature 0) equals the reference, `echo` and `logprobs`
/// (a leading null), `stop` strings, and its 400s.
fn check_completions(served: &Served, expected: &[Vec<u32>]) {
    let body = serde_json::json!({
        "prompt": [SERVED_PROMPTS[0], SERVED_PROMPTS[1]], "max_tokens": 12, "temperature": 0,
        "echo": true, "logprobs": 0,
    });
    let (status, answer) = served.call("POST", "/v1/completions", &body.to_string());
    assert_eq!(status, 200, "{answer}");
    for i in 0..2 {
        let choice = &answer["choices"][i];
        let logprobs = choice["logprobs"]["token_logprobs"].as_array().unwrap();
        assert_eq!(logprobs.len(), expected[i].len());
        assert!(logprobs[0].is_null() && logprobs[1].is_f64());
        let text = choice["text"].as_str().unwrap();
        let pieces: String = choice["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(pieces, text);
    }
    let plain =
        serde_json::json!({"prompt": SERVED_PROMPTS[0], "max_tokens": 12, "temperature": 0});
    let (_, answer) = served.call("POST", "/v1/completions", &plain.to_string());
    let text = answer["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    let stop = text.chars().skip(3).take(2).collect::<String>();
    let mut stopped = plain.clone();
    stopped["stop"] = serde_json::json!([stop]);
    let (_, answer) = served.call("POST", "/v1/completions", &stopped.to_string());
    assert_eq!(
        answer["choices"][0]["text"].as_str().unwrap(),
        &text[..text.find(&stop).unwrap()]
    );
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    for bad in [
        r#"{"max_tokens": 3}"#,
        r#"{"prompt": "a", "n": 2}"#,
        r#"{"prompt": "a", "stream": true}"#,
        r#"{"prompt": "a", "temperature": -1}"#,
        r#"{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}"#,
        r#"{"prompt": 5}"#,
    ] {
        let (status, answer) = served.call("POST", "/v1/completions", bad);
        assert_eq!(status, 400, "{bad}");
        assert!(answer["error"]["message"].is_string(), "{answer}");
    }
    let (status, _) = served.call("POST", "/completions", r#"{"prompt": "a"}"#);
    assert_eq!(status, 400, "Megatron's /completions needs max_tokens");
}

/// Each of Megatron's `PUT /api` rules, in its order, with its message.
fn megatron_api_rules() -> Vec<(String, &'static str)> {
    let many = serde_json::json!({"prompts": vec!["a"; 129]}).to_string();
    let rules = vec![
        (r#"{}"#, "prompts argument required"),
        (
            r#"{"prompts": ["a"], "max_len": 3}"#,
            "max_len is no longer used.  Replace with tokens_to_generate",
        ),
        (
            r#"{"prompts": ["a"], "sentences": ["a"]}"#,
            "sentences is no longer used.  Replace with prompts",
        ),
        (
            r#"{"prompts": ["a"], "beam_width": 2}"#,
            "Beam search is no longer supported.",
        ),
        (r#"{"prompts": "a"}"#, "prompts is not a list of strings"),
        (r#"{"prompts": [1]}"#, "prompts is not a list of strings"),
        (r#"{"prompts": []}"#, "prompts is empty"),
        (
            r#"{"prompts": ["a"], "tokens_to_generate": "3"}"#,
            "tokens_to_generate must be an integer greater than 0",
        ),
        (
            r#"{"prompts": ["a"], "tokens_to_generate": -1}"#,
            "tokens_to_generate must be an integer greater than or equal to 0",
        ),
        (
            r#"{"prompts": ["a"], "logprobs": 1}"#,
            "logprobs must be a boolean value",
        ),
        (
            r#"{"prompts": ["a"], "tokens_to_generate": 0}"#,
            "tokens_to_generate=0 implies logprobs should be True",
        ),
        (
            r#"{"prompts": ["a"], "temperature": 0}"#,
            "temperature must be a positive number less than or equal to 100.0",
        ),
        (
            r#"{"prompts": ["a"], "temperature": 100.5}"#,
            "temperature must be a positive number less than or equal to 100.0",
        ),
        (
            r#"{"prompts": ["a"], "top_k": 1.5}"#,
            "top_k must be an integer equal to or greater than 0 and less than or equal to 1000",
        ),
        (
            r#"{"prompts": ["a"], "top_k": 1001}"#,
            "top_k must be equal to or greater than 0 and less than or equal to 1000",
        ),
        (
            r#"{"prompts": ["a"], "top_p": 1}"#,
            "top_p must be a positive float less than or equal to 1.0",
        ),
        (
            r#"{"prompts": ["a"], "top_k": 5, "top_p": 0.5}"#,
            "cannot set both top-k and top-p samplings.",
        ),
        (
            r#"{"prompts": ["a"], "top_p": 1.5}"#,
            "top_p must be less than or equal to 1.0",
        ),
        (
            r#"{"prompts": ["a"], "top_p_decay": 0.5}"#,
            "top_p_decay cannot be set without top_p",
        ),
        (
            r#"{"prompts": ["a"], "top_p": 0.5, "top_p_bound": 0.7}"#,
            "top_p_bound must be greater than 0 and less than top_p",
        ),
        (
            r#"{"prompts": ["a"], "add_BOS": "yes"}"#,
            "add_BOS must be a boolean value",
        ),
        (r#"{"prompts": [""]}"#, "Empty prompts require add_BOS=true"),
        (
            r#"{"prompts": ["a"], "stop_on_eol": 1}"#,
            "stop_on_eol must be a boolean value",
        ),
        (
            r#"{"prompts": ["a"], "random_seed": -2}"#,
            "random_seed must be a positive integer",
        ),
        (
            r#"{"prompts": ["a"], "stop_token": "x"}"#,
            "stop_token must be an integer",
        ),
        (
            r#"{"prompts": ["a"], "length_penalty": 1}"#,
            "length_penalty must be a float",
        ),
    ];
    let mut rules: Vec<(String, &str)> =
        rules.into_iter().map(|(b, m)| (b.to_string(), m)).collect();
    rules.push((many, "Maximum number of prompts is 128"));
    rules
}

/// A full queue is answered 503 and the server keeps serving.
#[test]
fn a_full_queue_is_a_503_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    zero_shot_checkpoint(dir.path());
    let served = Served::start(dir.path(), &["--queue-size", "1", "--max-batch-rows", "1"]);
    let body = serde_json::json!({"prompts": ["The team"], "tokens_to_generate": 100, "top_k": 1})
        .to_string();
    let statuses: Vec<u16> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..12)
            .map(|_| scope.spawn(|| served.call("PUT", "/api", &body).0))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        statuses.iter().all(|&s| s == 200 || s == 503),
        "{statuses:?}"
    );
    assert!(
        statuses.contains(&503) && statuses.contains(&200),
        "{statuses:?}"
    );
    assert_eq!(served.call("PUT", "/api", &body).0, 200);
    assert!(served.stop().success());
}

/// `generate --tensor-model-parallel-size N` (threads, and ranks under `mpirun`): every rank
/// holds 1/N of the model, loaded from a TP=1 checkpoint, and the tokens are TP=1's — greedy,
/// sampled and beam search, on a GPT-2 (tied output) and a Llama (GQA, untied output).
#[test]
fn tensor_parallel_generation_gives_the_single_rank_tokens() {
    let dir = tempfile::tempdir().unwrap();
    zero_shot_checkpoint(dir.path());
    let llama = fixture("hf_tiny_llama");
    let out = run_tool(
        env!("CARGO_BIN_EXE_import-hf"),
        &["--input", llama.to_str().unwrap(), "--save", "llama"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let tokenizer = fixture("zero_shot/tokenizer.json");
    let zero_shot = ["--load", "ckpt", "--tokenizer-type", "HuggingFaceTokenizer"];
    let zero_shot = [
        &zero_shot[..],
        &["--tokenizer-model", tokenizer.to_str().unwrap()],
    ]
    .concat();
    // The Llama fixture has no tokenizer: NullTokenizer reads the prompt's ids.
    let llama = [
        "--load",
        "llama",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "250",
    ];
    let prompts = ["--prompt", "The team then won", "--prompt", "In 1908"];
    let ids = ["--prompt", "1 2 3", "--prompt", "100 4 200 31 5"];
    let cases: Vec<Vec<&str>> = vec![
        [&zero_shot[..], &prompts, &["--greedy"]].concat(),
        [&zero_shot[..], &prompts, &["--top-k", "20", "--seed", "5"]].concat(),
        [&zero_shot[..], &prompts, &["--num-beams", "3"]].concat(),
        [&llama[..], &ids, &["--greedy"]].concat(),
    ];
    let generate = |case: &[&str], tp: &str, mpi: bool| -> String {
        let mut args = case.to_vec();
        args.extend(["--json", "--logprobs", "--max-new-tokens", "12"]);
        args.extend(["--tensor-model-parallel-size", tp]);
        let out = if mpi {
            let mut cmd = mpirun_command(tp.parse().unwrap());
            cmd.arg(env!("CARGO_BIN_EXE_generate"))
                .args(&args)
                .current_dir(dir.path());
            cmd.output().unwrap()
        } else {
            run_tool(env!("CARGO_BIN_EXE_generate"), &args, dir.path())
        };
        assert!(out.status.success(), "{case:?} tp {tp}: {}", stderr(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    for (i, case) in cases.iter().enumerate() {
        let single: Vec<serde_json::Value> = generate(case, "1", false)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(single.len(), 2);
        let tps: &[&str] = if i == 3 { &["2"] } else { &["2", "4"] };
        for tp in tps {
            let split: Vec<serde_json::Value> = generate(case, tp, false)
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            assert_same_generation(&single, &split, &format!("{case:?} tp {tp}"));
        }
        for tp in if i == 0 { &["2", "4"][..] } else { &[] } {
            let mpi: Vec<serde_json::Value> = generate(case, tp, true)
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            assert_same_generation(&single, &mpi, &format!("mpirun -np {tp}"));
        }
    }
}

/// The same tokens, and log-probabilities equal to float noise.
fn assert_same_generation(a: &[serde_json::Value], b: &[serde_json::Value], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x["tokens"], y["tokens"], "{what}");
        let (p, q) = (
            x["logprobs"].as_array().unwrap(),
            y["logprobs"].as_array().unwrap(),
        );
        assert!(
            p.iter()
                .zip(q)
                .all(|(p, q)| (p.as_f64().unwrap() - q.as_f64().unwrap()).abs() < 1e-4),
            "{what}"
        );
    }
}

/// `serve --tensor-model-parallel-size 2`, on threads and under `mpirun -np 2`: rank 0 serves
/// and the other rank decodes the same batches on its shard; the answers are one rank's, and
/// SIGTERM (forwarded to every rank by mpirun) ends all of them with status 0.
#[test]
fn tensor_parallel_serving_answers_as_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    zero_shot_checkpoint(dir.path());
    let expected = greedy_reference(dir.path(), 12);
    let body = serde_json::json!({
        "prompts": SERVED_PROMPTS, "tokens_to_generate": 12, "top_k": 1, "logprobs": true,
    })
    .to_string();
    let mut mpirun = mpirun_command(2);
    mpirun.arg(env!("CARGO_BIN_EXE_serve"));
    let launchers = [
        std::process::Command::new(env!("CARGO_BIN_EXE_serve")),
        mpirun,
    ];
    for (mpi, launcher) in [false, true].into_iter().zip(launchers) {
        let served =
            Served::start_with(launcher, dir.path(), &["--tensor-model-parallel-size", "2"]);
        let (status, answer) = served.call("PUT", "/api", &body);
        assert_eq!(status, 200, "{answer}");
        let tokens: Vec<Vec<u32>> = answer["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(token_ids)
            .collect();
        assert_eq!(tokens, expected);
        // mpirun, signalled, ends the job with status 1 whatever the ranks did: rank 0's own
        // clean exit is what shows (the other rank's error would be printed too).
        let (status, err) = served.stop_with_stderr();
        assert!(status.success() || (mpi && !err.contains("error")), "{err}");
        assert!(err.contains("serve: stopped"), "{err}");
    }
}
