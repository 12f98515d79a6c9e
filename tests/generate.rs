//! Text generation: greedy continuations equal HuggingFace `GPT2LMHeadModel.generate` token
//! for token on an imported model (`tests/fixtures/hf_generate.json`, made by
//! `tests/fixtures/hf_tiny_gpt2.py`), the KV cache gives the full forward's logits, HF's and
//! ferrotron's losses on that model agree, and the `generate` tool's output modes agree with
//! one another.

mod common;

use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};
use common::*;
use ferrotron::checkpoint::load_model;
use ferrotron::inference::beam_search::beam_search;
use ferrotron::inference::next_token_scores::{score_rows, OutputColumns};
use ferrotron::inference::window_eval::mean_window_loss;
use ferrotron::inference::{generate, GenerateOptions, Sampler, SamplingConfig};
use ferrotron::model::{Gpt, KvCache};

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
    let lines: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
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
    let beam: serde_json::Value = serde_json::from_str(&beam).unwrap();
    assert_eq!(beam["tokens"], lines[0]["tokens"]);
    let logprobs = beam["logprobs"].as_array().unwrap();
    assert_eq!(logprobs.len(), token_ids(&beam["tokens"]).len());
    assert!(logprobs.iter().all(|p| p.as_f64().unwrap() <= 0.0));
    let three = run(&["--prompt", prompts[0], "--beam-width", "3", "--json"]);
    let three: serde_json::Value = serde_json::from_str(&three).unwrap();
    assert!(!token_ids(&three["tokens"]).is_empty());
    let refused = run_tool(
        env!("CARGO_BIN_EXE_generate"),
        &[
            "--load",
            "ckpt",
            "--prompt",
            "a",
            "--beam-width",
            "3",
            "--top-k",
            "5",
        ],
        dir.path(),
    );
    assert_eq!(refused.status.code(), Some(1));
    assert!(stderr(&refused).contains("beam search is greedy"));
    // Bad input: file and line named, exit code 1.
    std::fs::write(dir.path().join("bad.jsonl"), "\"ok\"\n{\"text\": 3}\n").unwrap();
    let out = run_tool(
        env!("CARGO_BIN_EXE_generate"),
        &["--load", "ckpt", "--prompts-file", "bad.jsonl"],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("bad.jsonl:2:"), "{}", stderr(&out));
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
