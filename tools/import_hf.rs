//! `import-hf`: a HuggingFace GPT-2, Llama, Mistral, Qwen2 or Qwen3 model as a ferrotron
//! checkpoint.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;

use ferrotron::checkpoint::{SaveFormat, SavedModel, TrainState, TRACKER_FILE};
use ferrotron::export::hf_model::import_hf;

/// Convert a directory holding a `GPT2LMHeadModel`, `LlamaForCausalLM`, `MistralForCausalLM`,
/// `Qwen2ForCausalLM` or `Qwen3ForCausalLM` (`config.json` + `model.safetensors` or its shards,
/// as `save_pretrained` writes it) into a checkpoint that `pretrain --load` continues from
/// (iteration 0, no optimizer state) and `evaluate` / `export-hf` read.
#[derive(Parser, Debug)]
#[command(name = "import-hf", version, args_override_self = true)]
struct Args {
    /// The HuggingFace model directory.
    #[arg(long)]
    input: PathBuf,
    /// Checkpoint directory to create (must not hold a checkpoint yet).
    #[arg(long)]
    save: PathBuf,
    /// Pad the vocabulary to a multiple of this (Megatron's flag; the padded size must match
    /// the `pretrain` run that loads it, which multiplies it by its tensor-parallel size).
    #[arg(long, default_value_t = 128)]
    make_vocab_size_divisible_by: usize,
}

fn run(args: Args) -> Result<()> {
    if args.save.join(TRACKER_FILE).exists() {
        bail!(
            "--save {}: already holds a checkpoint; choose an empty directory",
            args.save.display()
        );
    }
    let imported = import_hf(&args.input, args.make_vocab_size_divisible_by)?;
    let (config, vocab) = (imported.config, imported.vocab);
    let model = SavedModel {
        values: &imported.values,
        config: &config,
        state: &TrainState::default(),
        layout: (1, 1),
    };
    SaveFormat::Ferrotron
        .save_model(&args.save, model)
        .with_context(|| {
            format!(
                "{}: writing the checkpoint to {}",
                args.input.display(),
                args.save.display()
            )
        })?;
    eprintln!(
        "imported a {}-layer {} (hidden {}, {} heads, vocabulary {vocab} padded to {}) to {}",
        config.num_layers,
        imported.model_type,
        config.hidden_size,
        config.num_attention_heads,
        config.padded_vocab_size,
        args.save.display()
    );
    Ok(())
}

fn main() -> ExitCode {
    ferrotron::util::cli::finish("import-hf", run(Args::parse()))
}
