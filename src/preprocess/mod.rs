//! `preprocess`: JSONL → token ids → Megatron indexed datasets, streaming and in parallel.
//!
//! One reader thread cuts the input into chunks of whole lines, `workers` threads tokenize
//! chunks, and the calling thread writes results back in input order. At most
//! `in_flight_chunks` chunks exist at any time (a chunk's slot is returned only once it is
//! written), so memory is bounded by the chunk size, not the input size.

mod encode_chunk;
pub mod input;
pub mod jsonl;
pub mod progress;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

use crate::data::builder::DatasetSummary;
use crate::data::{DType, DatasetError, FinishedDataset, IndexedDatasetBuilder};
use crate::tokenizer::TextTokenizer;
pub use encode_chunk::BadLine;
use encode_chunk::{encode_chunk, EncodeSettings, EncodedChunk};
pub use input::{default_output_prefix, resolve_inputs};
use input::{Chunk, ChunkReader};
pub use progress::{Counts, ProgressMode};

/// How many skipped lines are listed by number in the summary.
pub const LISTED_BAD_LINES: usize = 10;

/// Everything a preprocessing run needs besides the tokenizer.
#[derive(Clone, Debug)]
pub struct PreprocessConfig {
    /// Input files, in order (see [`resolve_inputs`]).
    pub inputs: Vec<PathBuf>,
    /// Outputs are `{output_prefix}_{key}_document.{bin,idx}`.
    pub output_prefix: PathBuf,
    /// JSON keys to read; one dataset per key.
    pub json_keys: Vec<String>,
    /// Append the tokenizer's EOD id to every non-empty document.
    pub append_eod: bool,
    /// Tokenizing threads.
    pub workers: usize,
    /// Target size of a chunk of input lines, in bytes.
    pub chunk_bytes: usize,
    /// Print a progress line every this many documents (when not on a terminal).
    pub log_interval: u64,
    /// Skip invalid lines (and report them) instead of stopping at the first.
    pub skip_bad_lines: bool,
    /// Progress display.
    pub progress: ProgressMode,
    /// Set from outside (Ctrl-C) to stop the run; nothing is left at the final names.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl PreprocessConfig {
    /// A configuration with Megatron's defaults for the given input and prefix.
    pub fn new(inputs: Vec<PathBuf>, output_prefix: PathBuf) -> Self {
        Self {
            inputs,
            output_prefix,
            json_keys: vec!["text".into()],
            append_eod: false,
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            chunk_bytes: 1 << 20,
            log_interval: 1000,
            skip_bad_lines: false,
            progress: ProgressMode::Quiet,
            cancel: None,
        }
    }

    /// The dataset prefix written for `key`.
    pub fn dataset_prefix(&self, key: &str) -> PathBuf {
        let mut s = self.output_prefix.as_os_str().to_owned();
        s.push(format!("_{key}_document"));
        PathBuf::from(s)
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    /// An input could not be read.
    #[error("cannot read input {}: {cause}", path.display())]
    Input {
        /// The input.
        path: PathBuf,
        /// Why.
        cause: std::io::Error,
    },
    /// A line that is not a valid document (without `--skip-bad-lines`).
    #[error("{0}")]
    BadLine(BadLine),
    /// Writing an output failed.
    #[error(transparent)]
    Output(#[from] DatasetError),
    /// An impossible configuration.
    #[error("{0}")]
    Config(String),
    /// Stopped by Ctrl-C.
    #[error("interrupted; no output was written")]
    Interrupted,
    /// A worker thread died.
    #[error("internal error: {0}")]
    Internal(String),
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct PreprocessSummary {
    /// Totals.
    pub counts: Counts,
    /// Wall time, start-up included.
    pub elapsed: Duration,
    /// One per `--json-keys` key, in order.
    pub datasets: Vec<DatasetSummary>,
    /// Number of skipped lines.
    pub skipped_lines: u64,
    /// The first [`LISTED_BAD_LINES`] skipped lines.
    pub first_skipped: Vec<BadLine>,
}

/// Runs the pipeline: reads `config.inputs`, tokenizes, and writes one dataset per key.
/// The outputs appear only when everything succeeded.
pub fn run(
    config: &PreprocessConfig,
    tokenizer: &TextTokenizer,
) -> Result<PreprocessSummary, PreprocessError> {
    let start = Instant::now();
    if config.json_keys.is_empty() {
        return Err(PreprocessError::Config(
            "--json-keys needs at least one key".into(),
        ));
    }
    let eod = eod_to_append(config, tokenizer)?;
    let dtype = DType::for_vocab_size(tokenizer.vocab_size());
    let mut builders = config
        .json_keys
        .iter()
        .map(|key| IndexedDatasetBuilder::new(config.dataset_prefix(key), dtype))
        .collect::<Result<Vec<_>, _>>()?;
    let total_bytes = total_input_bytes(config)?;

    let workers = config.workers.max(1);
    let in_flight = 2 * workers + 2;
    let stop = AtomicBool::new(false);
    let settings = EncodeSettings {
        json_keys: &config.json_keys,
        eod,
        skip_bad_lines: config.skip_bad_lines,
    };
    let (slot_tx, slot_rx) = bounded::<()>(in_flight);
    for _ in 0..in_flight {
        slot_tx
            .send(())
            .map_err(|_| PreprocessError::Internal("slot channel closed".into()))?;
    }
    let (chunk_tx, chunk_rx) = bounded::<Chunk>(in_flight);
    let (done_tx, done_rx) = unbounded::<EncodedChunk>();

    let mut progress =
        progress::Progress::new(config.progress, total_bytes, config.log_interval, start);
    let outcome = std::thread::scope(|scope| {
        let stop = &stop;
        let reader = scope.spawn(move || read_chunks(config, slot_rx, chunk_tx, stop));
        for _ in 0..workers {
            let chunk_rx = chunk_rx.clone();
            let done_tx = done_tx.clone();
            let settings = &settings;
            let mut encoder = tokenizer.encoder();
            scope.spawn(move || {
                for chunk in chunk_rx {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    if done_tx
                        .send(encode_chunk(&chunk, settings, &mut encoder))
                        .is_err()
                    {
                        break;
                    }
                }
            });
        }
        drop(chunk_rx);
        drop(done_tx);
        let written = write_in_order(config, &mut builders, done_rx, slot_tx, &mut progress);
        if written.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        let read = reader
            .join()
            .unwrap_or_else(|_| Err(PreprocessError::Internal("reader thread panicked".into())));
        // A read error explains a short write, so it takes precedence.
        read.and(written)
    });
    progress.finish();
    let (counts, skipped_lines, first_skipped) = outcome?;

    let finished = builders
        .into_iter()
        .map(|b| b.finish())
        .collect::<Result<Vec<FinishedDataset>, _>>()?;
    let datasets = finished
        .into_iter()
        .map(|f| f.persist())
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PreprocessSummary {
        counts,
        elapsed: start.elapsed(),
        datasets,
        skipped_lines,
        first_skipped,
    })
}

/// The id appended after each document with `--append-eod` (none without it).
fn eod_to_append(
    config: &PreprocessConfig,
    tokenizer: &TextTokenizer,
) -> Result<Option<u32>, PreprocessError> {
    match (config.append_eod, tokenizer.eod()) {
        (false, _) => Ok(None),
        (true, Some(eod)) => Ok(Some(eod)),
        (true, None) => Err(PreprocessError::Config(
            "--append-eod: the tokenizer has no end-of-document token; name it with --eod-token"
                .into(),
        )),
    }
}

/// The inputs' total size, for the progress bar.
fn total_input_bytes(config: &PreprocessConfig) -> Result<u64, PreprocessError> {
    config
        .inputs
        .iter()
        .map(|p| {
            std::fs::metadata(p)
                .map(|m| m.len())
                .map_err(|cause| PreprocessError::Input {
                    path: p.clone(),
                    cause,
                })
        })
        .sum()
}

fn cancelled(config: &PreprocessConfig) -> bool {
    config
        .cancel
        .as_ref()
        .is_some_and(|c| c.load(Ordering::Relaxed))
}

/// The reader thread: takes a slot, reads a chunk, hands it to the workers.
fn read_chunks(
    config: &PreprocessConfig,
    slots: Receiver<()>,
    chunks: Sender<Chunk>,
    stop: &AtomicBool,
) -> Result<(), PreprocessError> {
    let mut reader = ChunkReader::new(config.inputs.clone(), config.chunk_bytes);
    while reader.has_more()? {
        // The writer drops its end when it stops early; then there is nothing left to do.
        if slots.recv().is_err() || stop.load(Ordering::Relaxed) || cancelled(config) {
            return Ok(());
        }
        if chunks.send(reader.next_chunk()?).is_err() {
            return Ok(());
        }
    }
    Ok(())
}

type WriteOutcome = (Counts, u64, Vec<BadLine>);

/// The writer: puts encoded chunks back in input order and appends them to the datasets.
fn write_in_order(
    config: &PreprocessConfig,
    builders: &mut [IndexedDatasetBuilder],
    done: Receiver<EncodedChunk>,
    slots: Sender<()>,
    progress: &mut progress::Progress,
) -> Result<WriteOutcome, PreprocessError> {
    let mut counts = Counts::default();
    let mut skipped = 0u64;
    let mut first_skipped = Vec::new();
    let mut pending = BTreeMap::new();
    let mut next_seq = 0u64;
    for encoded in done {
        pending.insert(encoded.seq, encoded);
        while let Some(chunk) = pending.remove(&next_seq) {
            if cancelled(config) {
                return Err(PreprocessError::Interrupted);
            }
            if let Some(bad) = chunk.failure {
                return Err(PreprocessError::BadLine(bad));
            }
            skipped += chunk.skipped.len() as u64;
            let room = LISTED_BAD_LINES.saturating_sub(first_skipped.len());
            first_skipped.extend(chunk.skipped.into_iter().take(room));
            for (builder, key) in builders.iter_mut().zip(&chunk.keys) {
                let mut start = 0usize;
                for &len in &key.document_lengths {
                    let end = start + len as usize;
                    builder.add_sequence(&key.tokens[start..end])?;
                    builder.end_document()?;
                    start = end;
                }
                counts.tokens += key.tokens.len() as u64;
            }
            counts.documents += chunk.documents;
            counts.bytes += chunk.bytes;
            progress.update(&counts);
            next_seq += 1;
            // Return the chunk's slot so the reader may read another.
            let _ = slots.send(());
        }
    }
    if cancelled(config) {
        return Err(PreprocessError::Interrupted);
    }
    if !pending.is_empty() {
        return Err(PreprocessError::Internal(
            "a worker stopped before finishing its chunk".into(),
        ));
    }
    Ok((counts, skipped, first_skipped))
}

/// Lists the outputs of a run for messages.
pub fn describe_outputs(datasets: &[DatasetSummary]) -> Vec<String> {
    datasets
        .iter()
        .map(|d| {
            format!(
                "{}.{{bin,idx}}: {} documents, {} sequences, {} tokens ({})",
                d.prefix.display(),
                d.documents,
                d.sequences,
                d.tokens,
                d.dtype
            )
        })
        .collect()
}
