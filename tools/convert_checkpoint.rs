//! `convert-checkpoint`: a checkpoint between ferrotron's format and Megatron-LM's
//! `--ckpt-format torch`, resharded to another tensor-parallel size.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::Parser;

use ferrotron::checkpoint::convert::{convert_checkpoint, ConvertTarget};
use ferrotron::checkpoint::Checkpoint;
use ferrotron::checkpoint::CheckpointFormat;
use ferrotron::model::GptConfig;
use ferrotron::training::architecture_args::ArchitectureArgs;

/// Convert the latest checkpoint under --load into --save: ferrotron's into Megatron's
/// `--ckpt-format torch` (`iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt`, which Megatron loads
/// with `--no-load-optim --no-load-rng` or `--finetune`), Megatron's into ferrotron's, or
/// Megatron's into Megatron's at another tensor-parallel size. A Megatron source needs the
/// model flags it was trained with (its saved `args` are not read yet).
#[derive(Parser, Debug)]
#[command(name = "convert-checkpoint", version, args_override_self = true)]
struct Args {
    /// The checkpoint directory to read (ferrotron's or Megatron's; detected).
    #[arg(long)]
    load: PathBuf,
    /// The directory to write (must not hold a checkpoint yet).
    #[arg(long)]
    save: PathBuf,
    /// The format to write: torch (Megatron's) or ferrotron.
    #[arg(long, default_value = "torch")]
    ckpt_format: String,
    /// Tensor-parallel ranks to write [default: the source's].
    #[arg(long)]
    target_tensor_parallel_size: Option<usize>,
    /// Pipeline stages to write: the layers split evenly, as Megatron's default [default: the
    /// source's].
    #[arg(long)]
    target_pipeline_parallel_size: Option<usize>,
    /// Megatron-Core's names: transformer_engine (its default) or local.
    #[arg(long, default_value = "transformer_engine")]
    transformer_impl: String,
    /// Megatron's vocabulary padding multiple (times the tensor-parallel size).
    #[arg(long, default_value_t = 128)]
    make_vocab_size_divisible_by: usize,
    /// The real vocabulary size: pads the target exactly as Megatron does (needed when the
    /// target has fewer tensor-parallel ranks than the source, whose padding is larger).
    #[arg(long)]
    vocab_size: Option<usize>,
    /// The tokenizer type recorded for Megatron (its loader compares it for runs with a
    /// --vocab-file) [default: a Megatron source's, else GPT2BPETokenizer].
    #[arg(long)]
    tokenizer_type: Option<String>,
    /// The source's global batch size: the consumed samples of a Megatron source whose
    /// arguments lack them are taken as iteration × this (0 without it).
    #[arg(long)]
    global_batch_size: Option<u64>,
    /// A Megatron source's layers.
    #[arg(long)]
    num_layers: Option<usize>,
    /// A Megatron source's hidden size.
    #[arg(long)]
    hidden_size: Option<usize>,
    /// A Megatron source's attention heads.
    #[arg(long)]
    num_attention_heads: Option<usize>,
    /// A Megatron source's MLP width [default: 4 × hidden, or the SwiGLU width].
    #[arg(long)]
    ffn_hidden_size: Option<usize>,
    /// A Megatron source's position table size [default: --seq-length].
    #[arg(long)]
    max_position_embeddings: Option<usize>,
    /// A Megatron source's sequence length.
    #[arg(long)]
    seq_length: Option<usize>,
    /// A Megatron source's norm epsilon (recorded in the written args).
    #[arg(long, alias = "layernorm-epsilon", default_value_t = 1e-5)]
    norm_epsilon: f64,
    #[command(flatten)]
    architecture: ArchitectureArgs,
}

/// The model the flags say a Megatron source holds (its padded vocabulary from the files),
/// or `None` without model flags (the source's saved arguments say it).
fn megatron_config(args: &Args) -> Result<Option<GptConfig>> {
    let Some(source) = Checkpoint::find(&args.load).filter(|c| c.format().is_megatron()) else {
        return Ok(None);
    };
    let shape = (args.num_layers, args.hidden_size, args.num_attention_heads);
    let (Some(layers), Some(hidden), Some(heads)) = shape else {
        if shape != (None, None, None) {
            bail!(
                "give all of --num-layers, --hidden-size and --num-attention-heads, or none \
                 (the model is then the one {} saved in its arguments)",
                args.load.display()
            );
        }
        return Ok(None);
    };
    let positions = args
        .max_position_embeddings
        .or(args.seq_length)
        .unwrap_or(0);
    let config = GptConfig::new(
        layers,
        hidden,
        heads,
        positions,
        source.megatron_vocab_rows()?,
    )
    .with_ffn_hidden_size(args.ffn_hidden_size)
    .with_layernorm_epsilon(args.norm_epsilon);
    Ok(Some(
        args.architecture
            .apply(config)
            .map_err(anyhow::Error::msg)?,
    ))
}

fn run(args: Args) -> Result<()> {
    let format = match args.ckpt_format.as_str() {
        "torch" => CheckpointFormat::MegatronTorch,
        "ferrotron" => CheckpointFormat::Ferrotron,
        other => bail!(
            "--ckpt-format {other:?}: expected torch (Megatron's) or ferrotron; for Megatron's \
             torch_dist, convert the torch checkpoint with Megatron's own --ckpt-convert-format"
        ),
    };
    let target = ConvertTarget {
        format,
        tensor_parallel: args.target_tensor_parallel_size,
        pipeline_parallel: args.target_pipeline_parallel_size,
        spec: args.transformer_impl.parse().map_err(anyhow::Error::msg)?,
        make_vocab_size_divisible_by: args.make_vocab_size_divisible_by,
        vocab_size: args.vocab_size,
        tokenizer_type: args.tokenizer_type.clone(),
        global_batch_size: args.global_batch_size,
    };
    let config = megatron_config(&args)?;
    let done = convert_checkpoint(&args.load, config.as_ref(), &args.save, &target)?;
    eprintln!(
        "converted iteration {} ({:?} at TP={}, PP={}) to {} ({:?} at TP={}, PP={}, vocabulary padded to {})",
        done.iteration,
        done.source,
        done.source_tensor_parallel,
        done.source_pipeline_parallel,
        args.save.display(),
        format,
        done.tensor_parallel,
        done.pipeline_parallel,
        done.config.padded_vocab_size
    );
    Ok(())
}

fn main() -> ExitCode {
    ferrotron::util::cli::finish("convert-checkpoint", run(Args::parse()))
}
