//! `generate`: text continuations of prompts from a ferrotron checkpoint.
//!
//!   generate --load ckpt --prompt "The history of" --max-new-tokens 40 --greedy
//!   generate --load ckpt --prompts-file prompts.jsonl --temperature 0.8 --top-p 0.9 --json

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use burn::module::Module;
use burn::tensor::Device;
use clap::Parser;

use ferrotron::comm::world::run_model_ranks;
use ferrotron::comm::Communicator;
use ferrotron::inference::beam_search::beam_search;
use ferrotron::inference::generate::Generation;
use ferrotron::inference::load::load_for_inference;
use ferrotron::inference::stop_strings::cut_at_stop;
use ferrotron::inference::{generate, GenerateOptions, Sampler, SamplingConfig};
use ferrotron::model::Gpt;
use ferrotron::parallel::state::ParallelState;
use ferrotron::tokenizer::{TextTokenizer, TokenizerArgs};
use ferrotron::util::device::parse_device;

/// Continue prompts with a checkpoint (any tensor-parallel layout it was saved with): greedy or
/// sampled (temperature, top-k, top-p), stopping at the end-of-document token, with a KV cache
/// so each new token costs one position. Text streams to stdout as it comes; `--json` writes
/// one line per prompt instead.
#[derive(Parser, Debug)]
#[command(name = "generate", version, args_override_self = true)]
struct Args {
    /// Checkpoint directory (as given to `pretrain --save`).
    #[arg(long)]
    load: PathBuf,
    /// A prompt (repeat the flag for several).
    #[arg(long)]
    prompt: Vec<String>,
    /// A JSONL file of prompts: each line a JSON string or an object with "prompt" (or "text").
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// New tokens per prompt at most (Megatron's --out-seq-length).
    #[arg(long, alias = "out-seq-length", default_value_t = 64)]
    max_new_tokens: usize,
    /// Always the most likely token (same as --temperature 0).
    #[arg(long)]
    greedy: bool,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Sample among the k most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sample among the most likely tokens holding this probability mass (0: all).
    #[arg(long, default_value_t = 0.0)]
    top_p: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 1234)]
    seed: u32,
    /// Beam search with this many beams (HuggingFace's num_beams; 1: no beam search). Greedy:
    /// not with --temperature, --top-k or --top-p.
    #[arg(long, alias = "num-beams", default_value_t = 1)]
    beam_width: usize,
    /// Beam search: finished hypotheses are scored sum(log-probs) / length^P.
    #[arg(long, default_value_t = 1.0)]
    length_penalty: f64,
    /// Never complete an n-gram of this size that the prompt and the text so far hold (0: off).
    #[arg(long, default_value_t = 0)]
    no_repeat_ngram_size: usize,
    /// End the continuation where this string begins (repeat for several; the text is then
    /// printed whole at the end rather than streamed).
    #[arg(long)]
    stop: Vec<String>,
    /// One JSON line per prompt: {"prompt", "prompt_tokens", "tokens" (new ids), "text"}.
    #[arg(long)]
    json: bool,
    /// With --json: add "logprobs", each new token's log-probability under the model.
    #[arg(long)]
    logprobs: bool,
    /// Recompute the whole prefix for every token (the reference for the cache).
    #[arg(long)]
    no_kv_cache: bool,
    /// Split the model over this many ranks (threads, or the ranks of an MPI launcher): each
    /// holds 1/N of every layer; the checkpoint is resharded from whatever layout it was saved
    /// in. The tokens are TP=1's.
    #[arg(long, default_value_t = 1)]
    tensor_model_parallel_size: usize,
    /// Backend: cpu, or (in builds with those features) cuda, cuda:N, wgpu, wgpu-cpu.
    #[arg(long, default_value = "cpu")]
    device: String,
    #[command(flatten)]
    tokenizer: TokenizerArgs,
}

/// The prompts of `--prompts-file`, with line numbers in errors.
fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--prompts-file {}", path.display()))?;
    let mut prompts = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a JSON line", path.display(), n + 1))?;
        let prompt = match &value {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Object(o) => o
                .get("prompt")
                .or_else(|| o.get("text"))
                .and_then(|v| v.as_str())
                .map(str::to_owned),
            _ => None,
        };
        match prompt {
            Some(p) => prompts.push(p),
            None => bail!(
                "{}:{}: expected a JSON string or an object with a \"prompt\" (or \"text\") string",
                path.display(),
                n + 1
            ),
        }
    }
    Ok(prompts)
}

/// Writes text to stdout as tokens arrive, holding back a trailing partial UTF-8 character.
struct TextStream<'a> {
    tokenizer: &'a TextTokenizer,
    tokens: Vec<u32>,
    printed: usize,
}

impl TextStream<'_> {
    fn push(&mut self, token: u32) {
        self.tokens.push(token);
        if let Ok(text) = self.tokenizer.decode(&self.tokens) {
            let complete = text.trim_end_matches('\u{fffd}');
            if complete.len() > self.printed {
                print!("{}", &complete[self.printed..]);
                let _ = std::io::stdout().flush();
                self.printed = complete.len();
            }
        }
    }

    fn finish(&mut self) {
        if let Ok(text) = self.tokenizer.decode(&self.tokens) {
            if text.len() > self.printed {
                print!("{}", &text[self.printed..]);
            }
        }
        println!();
    }
}

fn run(args: Args) -> Result<()> {
    let mut prompts = args.prompt.clone();
    if let Some(path) = &args.prompts_file {
        prompts.extend(read_prompts(path)?);
    }
    if prompts.is_empty() {
        bail!("nothing to continue: give --prompt TEXT or --prompts-file FILE.jsonl");
    }
    let sampling = SamplingConfig {
        greedy: args.greedy,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    sampling.validate().map_err(anyhow::Error::msg)?;
    let sampled =
        !sampling.is_greedy() && (args.temperature != 1.0 || args.top_k > 0 || args.top_p > 0.0);
    if args.beam_width > 1 && sampled {
        bail!("beam search is greedy: it takes no --temperature, --top-k or --top-p");
    }
    if args.beam_width == 0 {
        bail!("--beam-width must be at least 1");
    }
    if args.logprobs && !args.json {
        bail!("--logprobs adds to the --json output: give --json too");
    }
    run_model_ranks(args.tensor_model_parallel_size, |world| {
        generate_on_rank(&args, &prompts, sampling.clone(), world)
    })
}

/// Every rank of the tensor-parallel group runs the same decoding on its shard of the model:
/// the logits are gathered, so all draw the same tokens (same seed); world rank 0 prints.
fn generate_on_rank(
    args: &Args,
    prompts: &[String],
    sampling: SamplingConfig,
    world: Arc<dyn Communicator>,
) -> Result<()> {
    let parallel = ParallelState::new(world, args.tensor_model_parallel_size, 1, 1)?;
    let printing = parallel.is_world_rank0();
    let device = parse_device(&args.device).map_err(anyhow::Error::msg)?;
    let tokenizer = args.tokenizer.load()?;
    let (model, _) = load_for_inference(&args.load, &device, &parallel.tensor, &tokenizer)?;
    if printing && parallel.layout.tp > 1 {
        let params = model.num_params();
        eprintln!(
            " > tensor model parallel size {}: {params} parameters per rank ({:.1} MiB in fp32)",
            parallel.layout.tp,
            params as f64 * 4.0 / 1048576.0
        );
    }
    let options = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        stop_token: tokenizer.eod(),
        vocab_size: tokenizer.vocab_size(),
        kv_cache: !args.no_kv_cache,
        no_repeat_ngram_size: args.no_repeat_ngram_size,
    };
    let mut sampler = Sampler::new(sampling);
    for prompt in prompts {
        let mut ids = Vec::new();
        tokenizer.encoder().encode(prompt, &mut ids)?;
        let generation = if args.json || !printing || !args.stop.is_empty() {
            continue_prompt(args, &model, &ids, &options, &mut sampler, &device, |_| {})
        } else {
            print!("{prompt}");
            let mut stream = TextStream {
                tokenizer: &tokenizer,
                tokens: vec![],
                printed: 0,
            };
            let generation =
                continue_prompt(args, &model, &ids, &options, &mut sampler, &device, |t| {
                    stream.push(t)
                });
            stream.finish();
            generation
        }
        .map_err(|e| anyhow::anyhow!("prompt {prompt:?}: {e}"))?;
        let (text, tokens, _) =
            cut_at_stop(&generation.tokens, &args.stop, |t| tokenizer.decode(t))?;
        let log_probs = &generation.log_probs[..tokens.len()];
        if printing && !args.json && !args.stop.is_empty() {
            println!("{prompt}{text}");
        }
        if args.json && printing {
            let mut line = serde_json::json!({
                "prompt": prompt,
                "prompt_tokens": ids,
                "tokens": tokens,
                "text": text,
            });
            if args.logprobs {
                line["logprobs"] = serde_json::json!(log_probs);
            }
            println!("{line}");
        }
    }
    Ok(())
}

/// Beam search (whose tokens are known only at the end), or sampling token by token.
fn continue_prompt(
    args: &Args,
    model: &Gpt,
    ids: &[u32],
    options: &GenerateOptions,
    sampler: &mut Sampler,
    device: &Device,
    mut on_token: impl FnMut(u32),
) -> Result<Generation, String> {
    if args.beam_width > 1 {
        let generation = beam_search(
            model,
            ids,
            options,
            args.beam_width,
            args.length_penalty,
            device,
        )?;
        generation.tokens.iter().for_each(|&t| on_token(t));
        Ok(generation)
    } else {
        generate(model, ids, options, sampler, device, on_token)
    }
}

fn main() -> ExitCode {
    ferrotron::util::cli::finish("generate", run(Args::parse()))
}
