//! `evaluate`: mean LM loss of a checkpoint on the first contiguous windows of a dataset.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::Parser;

use ferrotron::checkpoint::load_model;
use ferrotron::data::{normalize_prefix, IndexedDataset};
use ferrotron::inference::window_eval::{contiguous_windows, mean_window_loss};
use ferrotron::tokenizer::TokenizerArgs;

/// Score a checkpoint: mean LM loss (and PPL) over windows i = tokens[i·L .. i·L+L+1] from
/// the start of the dataset, unshuffled, over the tokenizer's real (unpadded) vocabulary.
#[derive(Parser, Debug)]
#[command(name = "evaluate", version, args_override_self = true)]
struct Args {
    /// Checkpoint directory (as given to `pretrain --save`).
    #[arg(long)]
    load: PathBuf,
    /// Dataset prefix.
    #[arg(long)]
    data_path: PathBuf,
    /// Window length L (each window holds L+1 tokens).
    #[arg(long)]
    seq_length: usize,
    /// Number of windows.
    #[arg(long)]
    num_samples: usize,
    /// Windows per forward pass.
    #[arg(long, default_value_t = 4)]
    micro_batch_size: usize,
    #[command(flatten)]
    tokenizer: TokenizerArgs,
}

fn run(args: Args) -> Result<()> {
    if args.seq_length == 0 || args.num_samples == 0 {
        bail!("--seq-length and --num-samples must be positive");
    }
    let device = burn::tensor::Device::flex();
    let (model, checkpoint) = load_model(&args.load, &device)?;
    if args.seq_length > checkpoint.config.max_position_embeddings {
        bail!(
            "--seq-length {} exceeds the model's {} positions",
            args.seq_length,
            checkpoint.config.max_position_embeddings
        );
    }
    let vocab = args.tokenizer.load()?.vocab_size();
    let data = IndexedDataset::open(normalize_prefix(&args.data_path))?;
    let windows =
        contiguous_windows(&data, args.seq_length, args.num_samples).map_err(anyhow::Error::msg)?;
    let loss = mean_window_loss(&model, &windows, vocab, args.micro_batch_size, &device);
    println!(
        "checkpoint iteration {}, {} windows of {} tokens",
        checkpoint.state.iteration, args.num_samples, args.seq_length
    );
    println!("mean lm loss: {loss:.6}");
    println!("lm loss PPL: {:.4}", loss.exp());
    Ok(())
}

fn main() -> ExitCode {
    ferrotron::util::cli::finish("evaluate", run(Args::parse()))
}
