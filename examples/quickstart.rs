//! The README's demo: preprocess the bundled sample corpus exactly as
//! `preprocess --input examples/data/sample.jsonl --append-eod` would, then inspect the result.
//!
//! ```text
//! cargo run --release --example quickstart
//! ```

use std::path::PathBuf;

use anyhow::Result;
use ferrotron::data::{DatasetStats, IndexedDataset};
use ferrotron::preprocess::{
    self, describe_outputs, progress::summary_line, PreprocessConfig, ProgressMode,
};
use ferrotron::tokenizer::TextTokenizer;

fn main() -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let input = root.join("examples/data/sample.jsonl");
    let out_dir = root.join("target/quickstart");
    std::fs::create_dir_all(&out_dir)?;

    println!(
        "== preprocess {} (GPT-2 BPE, --append-eod)",
        input.display()
    );
    let tokenizer = TextTokenizer::gpt2_embedded()?;
    let mut config = PreprocessConfig::new(vec![input], out_dir.join("sample"));
    config.append_eod = true;
    config.progress = ProgressMode::Auto;
    let summary = preprocess::run(&config, &tokenizer)?;
    for line in describe_outputs(&summary.datasets) {
        println!("wrote {line}");
    }
    println!("{}", summary_line(&summary.counts, summary.elapsed));

    let prefix = &summary.datasets[0].prefix;
    println!("\n== idx-dump {}", prefix.display());
    let ds = IndexedDataset::open(prefix)?;
    let stats = DatasetStats::compute(&ds, tokenizer.eod());
    println!(
        "{} documents, {} tokens ({}); sequence length min {} / mean {:.1} / median {} / max {}",
        ds.document_count(),
        ds.total_tokens(),
        ds.dtype(),
        stats.min_length,
        stats.mean_length,
        stats.median_length,
        stats.max_length
    );
    let doc = ds.document(0)?.to_u32_vec();
    let text = tokenizer.decode(&doc)?;
    println!(
        "document 0 starts with ids {:?} ...",
        &doc[..doc.len().min(12)]
    );
    println!(
        "and decodes to:\n{}",
        text.chars().take(300).collect::<String>()
    );
    println!(
        "\nNext: `cargo run --release --bin idx-dump -- {} --doc 1`",
        prefix.display()
    );
    Ok(())
}
