//! `export-hf`: write a checkpoint as a HuggingFace GPT-2 model.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;

use ferrotron::checkpoint::load_model;
use ferrotron::checkpoint::tensor_file::write_tensors;
use ferrotron::export::hf_export::{hf_gpt2_config, hf_gpt2_tensors, hf_metadata};
use ferrotron::tokenizer::TokenizerArgs;

/// Export a checkpoint to a directory that `transformers.GPT2LMHeadModel.from_pretrained`
/// loads: `config.json` and `model.safetensors`, with the unpadded vocabulary.
#[derive(Parser, Debug)]
#[command(name = "export-hf", version)]
struct Args {
    /// Checkpoint directory (as given to `pretrain --save`).
    #[arg(long)]
    load: PathBuf,
    /// Output directory (created if missing).
    #[arg(long)]
    output: PathBuf,
    #[command(flatten)]
    tokenizer: TokenizerArgs,
}

fn run(args: Args) -> Result<()> {
    let device = burn::tensor::Device::flex();
    let (model, checkpoint) = load_model(&args.load, &device)?;
    let tokenizer = args.tokenizer.load()?;
    let vocab = tokenizer.vocab_size();
    anyhow::ensure!(
        vocab <= checkpoint.config.padded_vocab_size,
        "the tokenizer's vocabulary ({vocab}) is larger than the model's ({})",
        checkpoint.config.padded_vocab_size
    );
    let tensors = hf_gpt2_tensors(&model, &checkpoint.config, vocab)?;
    std::fs::create_dir_all(&args.output)
        .with_context(|| format!("creating {}", args.output.display()))?;
    write_tensors(
        &args.output.join("model.safetensors"),
        &tensors,
        hf_metadata(),
    )?;
    let config = hf_gpt2_config(&checkpoint.config, vocab, tokenizer.eod().unwrap_or(50256));
    let config_path = args.output.join("config.json");
    std::fs::write(&config_path, serde_json::to_string_pretty(&config)?)
        .with_context(|| format!("writing {}", config_path.display()))?;
    eprintln!(
        "exported iteration {} to {} (config.json, model.safetensors; vocabulary {vocab})",
        checkpoint.state.iteration,
        args.output.display()
    );
    Ok(())
}

fn main() -> ExitCode {
    ferrotron::util::cli::finish("export-hf", run(Args::parse()))
}
