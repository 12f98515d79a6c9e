//! `idx-dump`: inspect a Megatron indexed dataset (`.bin`/`.idx`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::json;

use ferrotron::data::{normalize_prefix, DatasetStats, IndexedDataset};
use ferrotron::tokenizer::TokenizerArgs;

/// Show the header, counts and length statistics of a `.bin`/`.idx` pair, check it, and
/// decode documents.
#[derive(Parser, Debug)]
#[command(name = "idx-dump", version, args_override_self = true)]
struct Args {
    /// Dataset prefix (PREFIX.bin + PREFIX.idx); a path ending in .bin or .idx also works.
    prefix: PathBuf,

    /// Print document N decoded to text.
    #[arg(long, value_name = "N")]
    doc: Option<usize>,

    /// With --doc: print the raw token ids instead of (with --json: besides) the text.
    #[arg(long)]
    ids: bool,

    /// Machine-readable JSON output.
    #[arg(long)]
    json: bool,

    #[command(flatten)]
    tokenizer: TokenizerArgs,
}

fn run(args: Args) -> Result<()> {
    let prefix = normalize_prefix(&args.prefix);
    let ds = IndexedDataset::open(&prefix)?;
    let tokenizer = args.tokenizer.load()?;
    let stats = DatasetStats::compute(&ds, tokenizer.eod());
    let vocab = tokenizer.vocab_size() as i64;
    let ids_in_vocab = stats.max_token_id.is_none_or(|m| m < vocab);

    if let Some(d) = args.doc {
        let tokens = ds.document(d)?.to_u32_vec();
        let text = if args.ids && !args.json {
            None
        } else {
            Some(
                tokenizer
                    .decode(&tokens)
                    .with_context(|| format!("decoding document {d}"))?,
            )
        };
        if args.json {
            let mut out = json!({ "document": d, "tokens": tokens.len(), "text": text });
            if args.ids {
                out["ids"] = json!(tokens);
            }
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else if args.ids {
            let ids: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
            println!("{}", ids.join(" "));
        } else {
            print!("{}", text.unwrap_or_default());
            println!();
        }
        return Ok(());
    }

    if args.json {
        let out = json!({
            "prefix": prefix,
            "version": 1,
            "dtype": ds.dtype().name(),
            "dtype_code": ds.dtype().code(),
            "sequences": ds.sequence_count(),
            "documents": ds.document_count(),
            "total_tokens": ds.total_tokens(),
            "bin_bytes": ds.data_bytes(),
            "idx_bytes": ds.index_bytes(),
            "sequence_length": {
                "min": stats.min_length,
                "mean": stats.mean_length,
                "median": stats.median_length,
                "max": stats.max_length,
            },
            "empty_documents": stats.empty_documents,
            "max_token_id": stats.max_token_id,
            "eod_tokens": stats.eod_tokens,
            "ids_within_vocab": ids_in_vocab,
            "consistent": true,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }

    println!("dataset        {}", prefix.display());
    println!("version        1");
    println!("dtype          {} (code {})", ds.dtype(), ds.dtype().code());
    println!("sequences      {}", ds.sequence_count());
    println!(
        "documents      {} ({} empty)",
        ds.document_count(),
        stats.empty_documents
    );
    println!("total tokens   {}", ds.total_tokens());
    println!(
        "files          .bin {} bytes, .idx {} bytes",
        ds.data_bytes(),
        ds.index_bytes()
    );
    println!(
        "seq length     min {} / mean {:.1} / median {} / max {}",
        stats.min_length, stats.mean_length, stats.median_length, stats.max_length
    );
    if let Some(eod) = stats.eod_tokens {
        println!("eod tokens     {eod}");
    }
    match stats.max_token_id {
        Some(m) => println!(
            "max token id   {m} ({} the tokenizer's vocabulary of {vocab})",
            if ids_in_vocab { "within" } else { "OUTSIDE" }
        ),
        None => println!("max token id   - (no tokens)"),
    }
    println!(
        "check          OK: header, array sizes, contiguous pointers, monotonic document indices, .bin size"
    );
    if !ids_in_vocab {
        println!("warning        token ids exceed the tokenizer's vocabulary: was this dataset made with another tokenizer?");
    }
    Ok(())
}

fn main() -> ExitCode {
    ferrotron::util::cli::finish("idx-dump", run(Args::parse()))
}
