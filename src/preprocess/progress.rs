//! Progress reporting: a bar on a terminal, periodic log lines otherwise.
//!
//! Throughput is reported honestly in bytes of JSONL input (1 MB = 10⁶ bytes) per second of
//! wall time since the run started, start-up included (Megatron reports characters per
//! second, in MiB, excluding its start-up).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// A bar when stderr is a terminal, log lines otherwise.
    Auto,
    /// Log lines every `--log-interval` documents.
    Lines,
    /// Nothing but errors.
    Quiet,
}

/// Counts so far, for display.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    /// Documents written.
    pub documents: u64,
    /// Input bytes consumed.
    pub bytes: u64,
    /// Tokens written (all keys).
    pub tokens: u64,
}

pub(crate) struct Progress {
    start: Instant,
    bar: Option<ProgressBar>,
    lines: bool,
    log_interval: u64,
    next_log_at: u64,
    last_log: Instant,
}

fn rates(counts: &Counts, elapsed: Duration) -> (f64, f64, f64) {
    let secs = elapsed.as_secs_f64().max(1e-9);
    (
        counts.documents as f64 / secs,
        counts.bytes as f64 / 1e6 / secs,
        counts.tokens as f64 / secs,
    )
}

impl Progress {
    pub fn new(mode: ProgressMode, total_bytes: u64, log_interval: u64, start: Instant) -> Self {
        let terminal = std::io::stderr().is_terminal();
        let bar = (mode == ProgressMode::Auto && terminal).then(|| {
            let bar = ProgressBar::with_draw_target(
                Some(total_bytes),
                ProgressDrawTarget::stderr_with_hz(4),
            );
            bar.set_style(
                ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:30}] {percent:>3}% eta {eta} | {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar
        });
        let lines = match mode {
            ProgressMode::Auto => !terminal,
            ProgressMode::Lines => true,
            ProgressMode::Quiet => false,
        };
        let log_interval = log_interval.max(1);
        Self {
            start,
            bar,
            lines,
            log_interval,
            next_log_at: log_interval,
            last_log: start,
        }
    }

    pub fn update(&mut self, counts: &Counts) {
        let elapsed = self.start.elapsed();
        if let Some(bar) = &self.bar {
            let (docs_s, mb_s, tok_s) = rates(counts, elapsed);
            bar.set_position(counts.bytes);
            bar.set_message(format!(
                "{} docs ({docs_s:.0}/s) | {mb_s:.1} MB/s | {:.2}M tokens/s",
                counts.documents,
                tok_s / 1e6
            ));
        }
        // Lines at each multiple of --log-interval documents, at most one a second.
        if self.lines
            && counts.documents >= self.next_log_at
            && self.last_log.elapsed() >= Duration::from_secs(1)
        {
            let (docs_s, mb_s, tok_s) = rates(counts, elapsed);
            eprintln!(
                "Processed {} documents ({docs_s:.1} docs/s, {mb_s:.2} MB/s, {:.2}M tokens/s).",
                counts.documents,
                tok_s / 1e6
            );
            self.next_log_at = (counts.documents / self.log_interval + 1) * self.log_interval;
            self.last_log = Instant::now();
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// The one-line summary printed at the end of a run.
pub fn summary_line(counts: &Counts, elapsed: Duration) -> String {
    let (docs_s, mb_s, tok_s) = rates(counts, elapsed);
    format!(
        "Done: {} documents, {:.2} MB, {} tokens in {:.2} s ({docs_s:.0} docs/s, {mb_s:.2} MB/s, {:.2}M tokens/s).",
        counts.documents,
        counts.bytes as f64 / 1e6,
        counts.tokens,
        elapsed.as_secs_f64(),
        tok_s / 1e6
    )
}
