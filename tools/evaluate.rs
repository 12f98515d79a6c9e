//! `evaluate`: score a checkpoint.
//!
//!   evaluate --load ckpt --data-path corpus_text_document --seq-length 1024 --num-samples 64
//!   evaluate --load ckpt --task LAMBADA --valid-data lambada_test.jsonl --strict-lambada
//!   evaluate --load ckpt --task WIKITEXT103 --valid-data wiki.test.tokens --overlapping-eval 32
//!   evaluate --load ckpt --loglikelihood requests.jsonl

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use burn::tensor::Device;
use clap::Parser;

use ferrotron::checkpoint::load_model;
use ferrotron::data::{normalize_prefix, IndexedDataset, SampleMasks};
use ferrotron::inference::detokenizer::Detokenizer;
use ferrotron::inference::lambada::{lambada_correct, read_lambada};
use ferrotron::inference::loglikelihood::{encode_request, loglikelihoods, read_requests};
use ferrotron::inference::wikitext::{read_wikitext, wikitext_perplexity, Perplexity};
use ferrotron::inference::window_eval::{contiguous_windows, masked_window_loss, mean_window_loss};
use ferrotron::model::Gpt;
use ferrotron::tokenizer::{TextTokenizer, TokenizerArgs};

/// Score a checkpoint in one of three ways:
///
/// - the mean LM loss (and PPL) over windows i = tokens[i·L .. i·L+L+1] from the start of a
///   dataset, unshuffled, over the tokenizer's real vocabulary (`--data-path`, `--seq-length`,
///   `--num-samples`);
/// - Megatron-LM's zero-shot tasks (`--task LAMBADA|WIKITEXT103 --valid-data FILE`, with
///   `--strict-lambada`, `--overlapping-eval`): its datasets, rules and result line;
/// - an evaluation harness's log-likelihoods (`--loglikelihood requests.jsonl`): one JSON line
///   per {"context", "continuation"} request.
#[derive(Parser, Debug)]
#[command(name = "evaluate", version, args_override_self = true)]
struct Args {
    /// Checkpoint directory (as given to `pretrain --save`).
    #[arg(long)]
    load: PathBuf,
    /// Dataset prefix (the windows evaluation).
    #[arg(long)]
    data_path: Option<PathBuf>,
    /// Window length L (each window holds L+1 tokens). For the tasks, Megatron's sample length
    /// (default: the model's positions).
    #[arg(long)]
    seq_length: Option<usize>,
    /// Number of windows (the windows evaluation).
    #[arg(long)]
    num_samples: Option<usize>,
    /// The windows evaluation: no loss where the input token is the end-of-document (as
    /// `pretrain --eod-mask-loss`).
    #[arg(long)]
    eod_mask_loss: bool,
    /// The windows evaluation: positions restart after each end-of-document (as `pretrain
    /// --reset-position-ids`).
    #[arg(long)]
    reset_position_ids: bool,
    /// The windows evaluation: a token after an end-of-document attends to nothing up to it
    /// (as `pretrain --reset-attention-mask`).
    #[arg(long)]
    reset_attention_mask: bool,
    /// Windows, passages or requests per forward pass.
    #[arg(long, default_value_t = 4)]
    micro_batch_size: usize,
    /// Megatron's zero-shot task: LAMBADA (accuracy) or WIKITEXT103 (perplexity).
    #[arg(long)]
    task: Option<Task>,
    /// The task's file: LAMBADA's JSON lines, or a raw WikiText file such as wiki.test.tokens.
    #[arg(long, alias = "data", num_args = 1..)]
    valid_data: Vec<PathBuf>,
    /// LAMBADA: predict the whole last word (all its tokens), tokenized apart from the context.
    #[arg(long)]
    strict_lambada: bool,
    /// WIKITEXT103: windows start every N tokens and score their last N targets.
    #[arg(long, default_value_t = 32)]
    overlapping_eval: usize,
    /// WIKITEXT103: wikitext, ptb or none (default: Megatron's choice from the file's path).
    #[arg(long)]
    detokenizer: Option<Detokenizer>,
    /// Log-likelihood requests: JSON lines {"context": ..., "continuation": ...}.
    #[arg(long)]
    loglikelihood: Option<PathBuf>,
    /// Print the task's result as one JSON object instead of Megatron's result line.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    tokenizer: TokenizerArgs,
}

/// Megatron's `--task` names for the zero-shot tasks (lower case accepted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Task {
    Lambada,
    Wikitext103,
}

impl std::str::FromStr for Task {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "lambada" => Ok(Self::Lambada),
            "wikitext103" | "wikitext" => Ok(Self::Wikitext103),
            _ => Err(format!(
                "unknown task {s:?}: expected LAMBADA or WIKITEXT103"
            )),
        }
    }
}

/// What every evaluation needs.
struct Scorer {
    model: Gpt,
    tokenizer: TextTokenizer,
    batch: usize,
    device: Device,
}

fn run(args: Args) -> Result<()> {
    let device = Device::flex();
    let (model, checkpoint) = load_model(&args.load, &device)?;
    eprintln!("checkpoint iteration {}", checkpoint.state.iteration);
    let scorer = Scorer {
        model,
        tokenizer: args.tokenizer.load()?,
        batch: args.micro_batch_size.max(1),
        device,
    };
    match (args.task, &args.loglikelihood) {
        (Some(_), Some(_)) => bail!("--task and --loglikelihood are separate evaluations"),
        (Some(task), None) => run_task(&args, task, &scorer),
        (None, Some(path)) => run_loglikelihood(path, &scorer),
        (None, None) => run_windows(&args, &scorer),
    }
}

fn run_windows(args: &Args, s: &Scorer) -> Result<()> {
    let (Some(prefix), Some(seq_length), Some(count)) =
        (&args.data_path, args.seq_length, args.num_samples)
    else {
        bail!("give --data-path, --seq-length and --num-samples (or --task, or --loglikelihood)");
    };
    if seq_length == 0 || count == 0 {
        bail!("--seq-length and --num-samples must be positive");
    }
    check_seq_length(seq_length, &s.model)?;
    let data = IndexedDataset::open(normalize_prefix(prefix))?;
    let windows = contiguous_windows(&data, seq_length, count).map_err(anyhow::Error::msg)?;
    let vocab = s.tokenizer.vocab_size();
    let masks = SampleMasks {
        eod_mask_loss: args.eod_mask_loss,
        reset_position_ids: args.reset_position_ids,
        reset_attention_mask: args.reset_attention_mask,
        ..SampleMasks::plain(
            s.tokenizer
                .eod()
                .context("the tokenizer has no end-of-document token")?,
        )
    };
    let loss = if masks.packs_documents() || masks.eod_mask_loss {
        masked_window_loss(&s.model, &windows, vocab, s.batch, &s.device, &masks)
    } else {
        mean_window_loss(&s.model, &windows, vocab, s.batch, &s.device)
    };
    println!("{count} windows of {seq_length} tokens");
    println!("mean lm loss: {loss:.6}");
    println!("lm loss PPL: {:.4}", loss.exp());
    Ok(())
}

fn check_seq_length(seq_length: usize, model: &Gpt) -> Result<()> {
    if seq_length > model.max_positions {
        bail!(
            "--seq-length {seq_length} exceeds the model's {} positions",
            model.max_positions
        );
    }
    Ok(())
}

fn run_task(args: &Args, task: Task, s: &Scorer) -> Result<()> {
    let [path] = args.valid_data.as_slice() else {
        bail!("--task needs one --valid-data file");
    };
    let seq_length = args.seq_length.unwrap_or(s.model.max_positions);
    check_seq_length(seq_length, &s.model)?;
    let result = match task {
        Task::Lambada => lambada(path, args.strict_lambada, seq_length, s)?,
        Task::Wikitext103 => {
            if args.overlapping_eval == 0 || args.overlapping_eval > seq_length {
                bail!("--overlapping-eval must be between 1 and --seq-length ({seq_length})");
            }
            let detokenizer = args
                .detokenizer
                .or_else(|| Detokenizer::for_path(path))
                .unwrap_or(Detokenizer::Lambada);
            wikitext(path, detokenizer, seq_length, args.overlapping_eval, s)?
        }
    };
    if args.json {
        println!("{}", result.json);
    } else {
        let rule = "-".repeat(result.line.chars().count() + 1);
        println!("{rule}\n{}\n{rule}", result.line);
    }
    Ok(())
}

/// A task's outcome: Megatron's result line, and the same numbers at full precision.
struct TaskResult {
    line: String,
    json: serde_json::Value,
}

fn lambada(path: &Path, strict: bool, seq_length: usize, s: &Scorer) -> Result<TaskResult> {
    let items = read_lambada(path, &mut s.tokenizer.encoder(), strict, seq_length)?;
    eprintln!(" > found {} samples.", items.len());
    let correct =
        lambada_correct(&s.model, &items, s.batch, &s.device).map_err(anyhow::Error::msg)?;
    let right = correct.iter().filter(|&&c| c).count();
    let accuracy = right as f64 / items.len() as f64;
    Ok(TaskResult {
        line: format!(
            " validation results on LAMBADA | number correct: {} | total examples: {} | avg accuracy: {}",
            python_e(right as f64),
            python_e(items.len() as f64),
            python_e(accuracy)
        ),
        json: serde_json::json!({
            "task": "LAMBADA", "strict": strict, "correct": right, "total": items.len(),
            "accuracy": accuracy, "per_example": correct,
        }),
    })
}

fn wikitext(
    path: &Path,
    detokenizer: Detokenizer,
    seq_length: usize,
    overlapping_eval: usize,
    s: &Scorer,
) -> Result<TaskResult> {
    let text = read_wikitext(path, detokenizer, &mut s.tokenizer.encoder())?;
    eprintln!(
        " > number of original tokens: {}, number of detokenized tokens: {}",
        text.num_original_tokens,
        text.tokens.len()
    );
    let p: Perplexity = wikitext_perplexity(
        &s.model,
        &text,
        seq_length,
        overlapping_eval,
        s.batch,
        &s.device,
    )
    .map_err(anyhow::Error::msg)?;
    Ok(TaskResult {
        line: format!(
            " validation results on WIKITEXT103 | avg loss: {} | ppl: {} | adjusted ppl: {} | token ratio: {:?} |",
            python_e(p.avg_loss()),
            python_e(p.ppl()),
            python_e(p.adjusted_ppl()),
            p.token_ratio()
        ),
        json: serde_json::json!({
            "task": "WIKITEXT103", "seq_length": seq_length, "overlapping_eval": overlapping_eval,
            "num_original_tokens": p.num_original_tokens,
            "num_tokenized_tokens": p.num_tokenized_tokens, "loss_sum": p.loss_sum,
            "avg_loss": p.avg_loss(), "ppl": p.ppl(), "adjusted_ppl": p.adjusted_ppl(),
            "token_ratio": p.token_ratio(),
        }),
    })
}

/// Python's `'{:.4E}'.format(x)`: `6.2500E-01`.
fn python_e(x: f64) -> String {
    let s = format!("{x:.4E}");
    match s.split_once('E') {
        Some((mantissa, exponent)) => {
            let e: i32 = exponent.parse().unwrap_or(0);
            format!("{mantissa}E{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
        }
        None => s,
    }
}

fn run_loglikelihood(path: &Path, s: &Scorer) -> Result<()> {
    let requests = read_requests(path)?;
    let mut encoder = s.tokenizer.encoder();
    let encoded = requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            encode_request(r, &mut encoder, s.tokenizer.eod())
                .with_context(|| format!("{}: request {}", path.display(), i + 1))
        })
        .collect::<Result<Vec<_>>>()?;
    let vocab = s.tokenizer.vocab_size();
    let answers = loglikelihoods(&s.model, &encoded, vocab, s.batch, &s.device)
        .map_err(anyhow::Error::msg)?;
    for answer in answers {
        println!("{}", serde_json::to_string(&answer)?);
    }
    Ok(())
}

fn main() -> ExitCode {
    ferrotron::util::cli::finish("evaluate", run(Args::parse()))
}
