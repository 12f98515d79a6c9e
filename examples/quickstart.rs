//! The README's demo: preprocess the bundled sample corpus exactly as
//! `preprocess --input examples/data/sample.jsonl --append-eod` would, inspect the result, then
//! train a small GPT on it on the CPU for a few minutes (the loss falls from ~10.8).
//!
//! ```text
//! cargo run --release --example quickstart
//! ```

use std::path::PathBuf;

use anyhow::Result;
use burn::tensor::Device;
use ferrotron::data::{DataSources, DatasetStats, IndexedDataset};
use ferrotron::model::vocab::{padded_vocab_log_line, padded_vocab_size};
use ferrotron::model::GptConfig;
use ferrotron::preprocess::{
    self, describe_outputs, progress::summary_line, PreprocessConfig, ProgressMode,
};
use ferrotron::tokenizer::TextTokenizer;
use ferrotron::training::{pretrain, LrDecayStyle, LrSchedule, PretrainConfig};

// Why this allocator: see `ferrotron::util::allocator`.
#[global_allocator]
static ALLOCATOR: ferrotron::util::allocator::TrainingAllocator =
    ferrotron::util::allocator::TrainingAllocator;

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

    // The same as:
    // pretrain --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128
    //   --micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 10
    //   --lr-decay-style cosine --train-iters 120 --log-interval 10 --eval-interval 40
    //   --eval-iters 2 --split 95,5,0 --data-path target/quickstart/sample_text_document
    //   --save target/quickstart/checkpoints
    println!("\n== pretrain a 2-layer GPT on it (CPU, two to three minutes)");
    let vocab = tokenizer.vocab_size();
    let padded = padded_vocab_size(vocab, 128, 1);
    println!("{}", padded_vocab_log_line(vocab, padded));
    let config = PretrainConfig {
        seq_length: 128,
        micro_batch_size: 4,
        global_batch_size: 8,
        train_iters: 120,
        schedule: LrSchedule {
            max_lr: 1e-3,
            min_lr: 1e-4,
            // Megatron counts the schedule in samples: iterations × global batch.
            warmup_steps: 80.0,
            decay_steps: 960.0,
            style: LrDecayStyle::Cosine,
            ..Default::default()
        },
        split: "95,5,0".into(),
        eod: tokenizer.eod().unwrap_or(50256),
        log_interval: 10,
        eval_interval: 40,
        eval_iters: 2,
        save: Some(out_dir.join("checkpoints")),
        ..PretrainConfig::new(
            GptConfig::new(2, 128, 4, 128, padded),
            DataSources::single(prefix.clone()),
        )
    };
    let outcome = pretrain(&config, &Device::flex().autodiff())?;
    let first = outcome.losses.first().map_or(f64::NAN, |l| l.1);
    let last = outcome
        .losses
        .iter()
        .rev()
        .take(10)
        .map(|l| l.1)
        .sum::<f64>()
        / 10.0;
    println!("\nlm loss: {first:.3} at the first iteration, {last:.3} over the last 10");
    println!("checkpoint: {}", out_dir.join("checkpoints").display());
    Ok(())
}
