//! `merge-datasets`: concatenate indexed datasets (Megatron's `tools/merge_datasets.py`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::Parser;

use ferrotron::data::merge::{merge_datasets, prefixes_in_directory};
use ferrotron::data::normalize_prefix;

/// Concatenate Megatron indexed datasets into one.
///
/// `--input DIR` merges every `X.bin`/`X.idx` pair in DIR in name order, as Megatron's
/// merge_datasets.py does; dataset prefixes may also be listed one by one, in the order wanted.
#[derive(Parser, Debug)]
#[command(name = "merge-datasets", version, args_override_self = true)]
struct Args {
    /// A directory of datasets, or dataset prefixes (with or without .bin/.idx).
    #[arg(long, required = true, num_args = 1..)]
    input: Vec<PathBuf>,

    /// Output prefix: writes PREFIX.bin and PREFIX.idx.
    #[arg(long)]
    output_prefix: PathBuf,

    /// Megatron's multimodal datasets (not supported).
    #[arg(long, hide = true)]
    multimodal: bool,
}

fn run(args: Args) -> Result<()> {
    if args.multimodal {
        bail!("--multimodal datasets are not supported by ferrotron");
    }
    let mut prefixes = Vec::new();
    for input in &args.input {
        if input.is_dir() {
            let found = prefixes_in_directory(input)?;
            if found.is_empty() {
                bail!("{}: no .bin/.idx pairs in this directory", input.display());
            }
            prefixes.extend(found);
        } else {
            prefixes.push(normalize_prefix(input));
        }
    }
    let summary = merge_datasets(&prefixes, &args.output_prefix)?;
    eprintln!(
        "merged {} datasets into {}.{{bin,idx}}: {} documents, {} sequences, {} tokens ({})",
        prefixes.len(),
        summary.prefix.display(),
        summary.documents,
        summary.sequences,
        summary.tokens,
        summary.dtype
    );
    Ok(())
}

fn main() -> ExitCode {
    ferrotron::util::cli::finish("merge-datasets", run(Args::parse()))
}
