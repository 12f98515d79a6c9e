//! `export-hf`: write a checkpoint as a HuggingFace GPT-2 or Llama-family model.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;

use ferrotron::checkpoint::load_model;
use ferrotron::export::hf_model::{export_hf, write_hf_dir};
use ferrotron::tokenizer::TokenizerArgs;

/// Export a checkpoint to a directory that `transformers.AutoModelForCausalLM.from_pretrained`
/// loads: `config.json` and `model.safetensors`, with the unpadded vocabulary. A GPT-2-shaped
/// model becomes `GPT2LMHeadModel`; RMSNorm + rotary + SwiGLU models `LlamaForCausalLM`
/// (`Qwen2ForCausalLM` with only a qkv bias, `Qwen3ForCausalLM` with query/key norms).
#[derive(Parser, Debug)]
#[command(name = "export-hf", version, args_override_self = true)]
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
    let eod = tokenizer.eod().unwrap_or(50256);
    let (config, tensors) = export_hf(&model, &checkpoint.config, vocab, eod)?;
    write_hf_dir(&args.output, &config, &tensors)?;
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
