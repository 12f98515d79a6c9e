//! `preprocess`: Megatron's `tools/preprocess_data.py`, byte-identical output, much faster.
//!
//! ```text
//! preprocess --input data.jsonl --append-eod        # writes data_text_document.{bin,idx}
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;

use ferrotron::preprocess::{
    self, describe_outputs, progress::summary_line, PreprocessConfig, ProgressMode,
};
use ferrotron::tokenizer::TokenizerArgs;

/// Tokenize JSONL documents into Megatron-LM indexed datasets (`.bin`/`.idx`).
///
/// Flags follow Megatron-LM's `tools/preprocess_data.py`; the output is byte-identical to it.
#[derive(Parser, Debug)]
#[command(name = "preprocess", version, args_override_self = true)]
struct Args {
    /// Input JSONL file(s), one JSON object per line; a directory means all its files, sorted.
    #[arg(long, required = true, num_args = 1..)]
    input: Vec<PathBuf>,

    /// Output prefix: writes PREFIX_{key}_document.{bin,idx} [default: the input without its extension].
    #[arg(long)]
    output_prefix: Option<PathBuf>,

    /// JSON keys to tokenize, one dataset each.
    #[arg(long, num_args = 1.., default_value = "text")]
    json_keys: Vec<String>,

    /// Append the end-of-document token to every non-empty document.
    #[arg(long)]
    append_eod: bool,

    #[command(flatten)]
    tokenizer: TokenizerArgs,

    /// Tokenizing threads [default: all cores].
    #[arg(long)]
    workers: Option<usize>,

    /// Progress line every this many documents (when not on a terminal; at most one a second).
    #[arg(long, default_value_t = 1000)]
    log_interval: u64,

    /// Skip invalid lines and report them, instead of stopping at the first.
    #[arg(long)]
    skip_bad_lines: bool,

    /// Size of the input chunks handed to workers, in MiB (memory use is a small multiple of
    /// this times the number of workers).
    #[arg(long, default_value_t = 1.0)]
    chunk_size_mb: f64,

    /// No progress output, only the final summary.
    #[arg(long, short)]
    quiet: bool,

    /// Not supported: needs NLTK punkt sentence splitting.
    #[arg(long, hide = true)]
    split_sentences: bool,

    /// Not supported: only meaningful with --split-sentences.
    #[arg(long, hide = true)]
    keep_newlines: bool,

    /// Accepted for Megatron compatibility: ferrotron streams, so partitions change nothing.
    #[arg(long, hide = true)]
    partitions: Option<usize>,

    /// Accepted for Megatron compatibility: output order is always input order.
    #[arg(long, hide = true)]
    keep_sequential_samples: bool,

    /// Accepted for Megatron compatibility: only used with --split-sentences.
    #[arg(long, hide = true)]
    lang: Option<String>,
}

fn run(args: Args) -> Result<()> {
    if args.split_sentences || args.keep_newlines {
        bail!(
            "--split-sentences/--keep-newlines are not supported: they need NLTK punkt sentence \
             splitting, which ferrotron does not ship. Split sentences beforehand, or drop the flag \
             to store each document as one sequence."
        );
    }
    if let Some(p) = args.partitions.filter(|&p| p > 1) {
        eprintln!("note: --partitions {p} ignored: ferrotron streams the input, and the output is the same");
    }
    if args.lang.is_some() {
        eprintln!("note: --lang ignored: it only matters with --split-sentences");
    }
    if args.workers == Some(0) {
        bail!("--workers must be at least 1");
    }
    if !(args.chunk_size_mb > 0.0 && args.chunk_size_mb <= 1024.0) {
        bail!("--chunk-size-mb must be in (0, 1024]");
    }

    let inputs = preprocess::resolve_inputs(&args.input)?;
    let output_prefix = match args.output_prefix {
        Some(p) => p,
        None => preprocess::default_output_prefix(&args.input)
            .context("several inputs given: name the output with --output-prefix")?,
    };
    let tokenizer = args.tokenizer.load()?;

    let cancel = Arc::new(AtomicBool::new(false));
    {
        let cancel = cancel.clone();
        // If a handler cannot be installed, Ctrl-C still kills the run; the final names are
        // untouched either way because outputs are renamed into place only at the end.
        // A second Ctrl-C exits at once (temporary files may then stay behind, hidden).
        let _ = ctrlc::set_handler(move || {
            if cancel.swap(true, Ordering::Relaxed) {
                std::process::exit(130);
            }
        });
    }
    let mut config = PreprocessConfig::new(inputs, output_prefix);
    config.json_keys = args.json_keys;
    config.append_eod = args.append_eod;
    if let Some(w) = args.workers {
        config.workers = w;
    }
    config.chunk_bytes = (args.chunk_size_mb * (1 << 20) as f64) as usize;
    config.log_interval = args.log_interval;
    config.skip_bad_lines = args.skip_bad_lines;
    config.progress = if args.quiet {
        ProgressMode::Quiet
    } else {
        ProgressMode::Auto
    };
    config.cancel = Some(cancel);

    eprintln!(
        "preprocess: {} input file(s), {} worker(s), tokenizer {} (vocab {}), keys {:?}",
        config.inputs.len(),
        config.workers,
        args.tokenizer.tokenizer_type,
        tokenizer.vocab_size(),
        config.json_keys
    );
    let summary = preprocess::run(&config, &tokenizer)?;
    if summary.skipped_lines > 0 {
        eprintln!("skipped {} bad line(s); the first:", summary.skipped_lines);
        for bad in &summary.first_skipped {
            eprintln!("  {bad}");
        }
    }
    for line in describe_outputs(&summary.datasets) {
        eprintln!("wrote {line}");
    }
    eprintln!("{}", summary_line(&summary.counts, summary.elapsed));
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("preprocess: error: {e:#}");
            // 130 is the shell's code for "stopped by SIGINT".
            let interrupted = matches!(
                e.downcast_ref(),
                Some(preprocess::PreprocessError::Interrupted)
            );
            ExitCode::from(if interrupted { 130 } else { 1 })
        }
    }
}
