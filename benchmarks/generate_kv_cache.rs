//! Generation speed with the KV cache against recomputing the whole prefix for every token
//! (the baseline, `generate --no-kv-cache`), same model, prompt and tokens, same run.
//!
//! ```text
//! cargo bench --bench generate_kv_cache
//! ```
//!
//! Model: 6 layers, hidden 384, 6 heads, 1024 positions, padded GPT-2 vocabulary 50304,
//! random weights (fp32, CPU). A 16-token prompt, `FERROTRON_BENCH_NEW_TOKENS` (default 256)
//! greedy tokens. Prints tokens/s of both, the ratio, and the peak RSS.

use std::time::Instant;

use burn::tensor::Device;
use ferrotron::inference::{generate, GenerateOptions, Sampler, SamplingConfig};
use ferrotron::model::GptConfig;

fn peak_rss_mib() -> f64 {
    ferrotron::logging::memory::peak_rss_bytes().map_or(f64::NAN, |b| b as f64 / 1048576.0)
}

fn main() {
    let new_tokens: usize = std::env::var("FERROTRON_BENCH_NEW_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let device = Device::flex();
    let config = GptConfig::new(6, 384, 6, 1024, 50304);
    let model = config.init(0, &device).expect("valid config");
    let prompt: Vec<u32> = (0..16).map(|i| 1000 + 37 * i).collect();
    let run = |kv_cache: bool| {
        let options = GenerateOptions {
            max_new_tokens: new_tokens,
            stop_token: None,
            vocab_size: 50257,
            kv_cache,
            no_repeat_ngram_size: 0,
        };
        let mut sampler = Sampler::new(SamplingConfig::greedy());
        // Warm-up: a few tokens.
        let warm = GenerateOptions {
            max_new_tokens: 4,
            ..options.clone()
        };
        generate(&model, &prompt, &warm, &mut sampler, &device, |_| {}).unwrap();
        let start = Instant::now();
        let tokens = generate(&model, &prompt, &options, &mut sampler, &device, |_| {})
            .unwrap()
            .tokens;
        (tokens, tokens_per_second(new_tokens, start))
    };
    let (cached_tokens, cached) = run(true);
    let (full_tokens, full) = run(false);
    let agree = cached_tokens
        .iter()
        .zip(&full_tokens)
        .take_while(|(a, b)| a == b)
        .count();
    println!(
        "generate, {new_tokens} new tokens after a 16-token prompt (6 layers, hidden 384, vocab 50304, CPU):"
    );
    println!("  no KV cache (baseline): {full:8.1} tokens/s");
    println!("  KV cache:               {cached:8.1} tokens/s");
    println!("  ratio: {:.2}x", cached / full);
    println!("  the two agree on the first {agree} of {new_tokens} tokens");
    println!("  peak RSS: {:.0} MiB", peak_rss_mib());
}

fn tokens_per_second(tokens: usize, start: Instant) -> f64 {
    tokens as f64 / start.elapsed().as_secs_f64()
}
