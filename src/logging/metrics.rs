//! One sink for what a run reports as it trains: Megatron's log lines on stdout, the
//! `metrics.jsonl` beside the checkpoints (the loss plot is drawn from it at the end), and
//! TensorBoard scalars under Megatron's tags. Only world rank 0 opens one.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};

use super::loss_plot::{draw_loss_plot, read_metrics};
use super::megatron_log::{iteration_line, timestamp_now, validation_line, IterationStats};
use super::memory::{memory_report_line, peak_rss_bytes};
use super::tensorboard::TensorBoardWriter;

/// Where and how often a run reports.
#[derive(Clone, Debug)]
pub struct MetricsOptions {
    /// `--save`: `metrics.jsonl` and `loss.png` go there.
    pub save_dir: Option<PathBuf>,
    /// `--tensorboard-dir`.
    pub tensorboard_dir: Option<PathBuf>,
    /// `--log-interval`.
    pub log_interval: u64,
    /// `--tensorboard-log-interval`.
    pub tensorboard_log_interval: u64,
    /// `--train-iters`.
    pub train_iters: u64,
    /// `--seq-length`.
    pub seq_length: usize,
    /// Model FLOPs per token (the TFLOP/s figure).
    pub flops_per_token: f64,
    /// `--log-throughput`: Megatron's TFLOP/s per rank in the log line.
    pub log_throughput: bool,
    /// Ranks of the run (the throughput per rank divides by them).
    pub world_size: usize,
    /// One device's peak TFLOP/s, for the model FLOPs utilization next to the throughput.
    pub peak_tflops: Option<f64>,
}

/// One finished iteration, as the sink records it.
#[derive(Clone, Debug)]
pub struct IterationRecord {
    /// The iteration.
    pub iteration: u64,
    /// Training samples consumed after it.
    pub consumed_samples: u64,
    /// Its global batch (smaller during a batch-size ramp-up).
    pub global_batch_size: usize,
    /// The learning rate it used.
    pub lr: f64,
    /// The learning rate the log line shows (the schedule's, after the step).
    pub next_lr: f64,
    /// The global batch's mean LM loss.
    pub lm_loss: f64,
    /// The gradient norm (`None` when skipped).
    pub grad_norm: Option<f64>,
    /// The loss scale after it.
    pub loss_scale: f64,
    /// Skipped for overflowing gradients.
    pub skipped: bool,
    /// Each pipeline stage's idle share.
    pub pipeline_idle: Option<Vec<f64>>,
    /// Seconds waited for the data-parallel gradient reduction.
    pub grad_reduce_exposed_seconds: Option<f64>,
    /// `--log-params-norm`: the L2 norm of all parameters after the step.
    pub params_norm: Option<f64>,
    /// `--log-num-zeros-in-grad`: zero gradient elements of the step.
    pub num_zeros_in_grad: Option<u64>,
}

/// The counters of Megatron's log interval.
struct Interval {
    start: Instant,
    iterations: u64,
    samples: u64,
    loss_sum: f64,
    advanced: u64,
    skipped: u64,
    nan: u64,
}

impl Interval {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            iterations: 0,
            samples: 0,
            loss_sum: 0.0,
            advanced: 0,
            skipped: 0,
            nan: 0,
        }
    }
}

/// World rank 0's reporting of a run.
pub struct MetricsSink {
    options: MetricsOptions,
    jsonl: Option<File>,
    tensorboard: Option<TensorBoardWriter>,
    interval: Interval,
    memory_reported: bool,
}

impl MetricsSink {
    /// Opens the files `options` ask for (appending to an existing `metrics.jsonl`, so a
    /// resumed run's plot shows the whole history).
    pub fn open(options: MetricsOptions) -> Result<Self> {
        let jsonl = match &options.save_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating --save {}", dir.display()))?;
                Some(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(dir.join("metrics.jsonl"))
                        .with_context(|| format!("opening {}/metrics.jsonl", dir.display()))?,
                )
            }
            None => None,
        };
        let tensorboard = match &options.tensorboard_dir {
            Some(dir) => Some(
                TensorBoardWriter::create(dir)
                    .with_context(|| format!("--tensorboard-dir {}", dir.display()))?,
            ),
            None => None,
        };
        Ok(Self {
            options,
            jsonl,
            tensorboard,
            interval: Interval::new(),
            memory_reported: false,
        })
    }

    /// Records one iteration: a `metrics.jsonl` line, TensorBoard scalars every
    /// `--tensorboard-log-interval`, and Megatron's log line every `--log-interval` (and at
    /// the last iteration).
    pub fn record_iteration(&mut self, r: &IterationRecord) -> Result<()> {
        let i = &mut self.interval;
        i.iterations += 1;
        i.samples += r.global_batch_size as u64;
        if r.skipped {
            i.skipped += 1;
            i.nan += u64::from(!r.lm_loss.is_finite());
        } else {
            i.loss_sum += r.lm_loss;
            i.advanced += 1;
        }
        self.write_jsonl_iteration(r)?;
        self.write_tensorboard_iteration(r)?;
        let o = &self.options;
        if r.iteration.is_multiple_of(o.log_interval.max(1)) || r.iteration == o.train_iters {
            self.log_interval(r)?;
        }
        Ok(())
    }

    fn write_jsonl_iteration(&mut self, r: &IterationRecord) -> Result<()> {
        let Some(file) = self.jsonl.as_mut() else {
            return Ok(());
        };
        let line = serde_json::json!({
            "iteration": r.iteration,
            "consumed_samples": r.consumed_samples,
            "tokens": r.consumed_samples * self.options.seq_length as u64,
            "lm_loss": r.lm_loss,
            "global_batch_size": r.global_batch_size,
            "lr": r.lr,
            "grad_norm": r.grad_norm,
            "loss_scale": r.loss_scale,
            "skipped": r.skipped,
            "peak_rss_mib": peak_rss_bytes().map(|b| b as f64 / 1048576.0),
            "pipeline_idle_fraction": r.pipeline_idle,
            "grad_reduce_exposed_seconds": r.grad_reduce_exposed_seconds
        });
        writeln!(file, "{line}")?;
        Ok(())
    }

    fn write_tensorboard_iteration(&mut self, r: &IterationRecord) -> Result<()> {
        let Some(tb) = self.tensorboard.as_mut() else {
            return Ok(());
        };
        if !r
            .iteration
            .is_multiple_of(self.options.tensorboard_log_interval.max(1))
        {
            return Ok(());
        }
        // Megatron's tags, each also against the consumed samples. The loss scale is 1
        // without a grad scaler, as Megatron logs it.
        let mut scalars = vec![
            ("learning-rate", r.lr),
            ("batch-size", r.global_batch_size as f64),
            ("lm loss", r.lm_loss),
            ("loss-scale", r.loss_scale),
        ];
        scalars.extend(r.grad_norm.map(|norm| ("grad-norm", norm)));
        scalars.extend(r.num_zeros_in_grad.map(|zeros| ("num-zeros", zeros as f64)));
        scalars.extend(r.params_norm.map(|norm| ("params-norm", norm)));
        for (tag, value) in scalars {
            tb.add_scalar(tag, value, r.iteration)?;
            tb.add_scalar(&format!("{tag} vs samples"), value, r.consumed_samples)?;
        }
        Ok(())
    }

    /// Megatron's log line for the interval just ended, its TensorBoard timings, and the
    /// memory report once.
    fn log_interval(&mut self, r: &IterationRecord) -> Result<()> {
        let o = &self.options;
        let i = &self.interval;
        let elapsed = i.start.elapsed().as_secs_f64();
        let tokens = (i.samples * o.seq_length as u64) as f64;
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.add_scalar("iteration-time", elapsed / i.iterations as f64, r.iteration)?;
            tb.add_scalar("tokens-per-sec", tokens / elapsed, r.iteration)?;
            tb.flush()?;
        }
        let per_rank = tokens * o.flops_per_token / elapsed / 1e12 / o.world_size.max(1) as f64;
        println!(
            "{}",
            iteration_line(&IterationStats {
                iteration: r.iteration,
                train_iters: o.train_iters,
                consumed_samples: r.consumed_samples,
                ms_per_iteration: 1000.0 * elapsed / i.iterations as f64,
                learning_rate: r.next_lr,
                global_batch_size: r.global_batch_size,
                lm_loss: (i.advanced > 0).then(|| i.loss_sum / i.advanced as f64),
                loss_scale: r.loss_scale,
                grad_norm: r.grad_norm,
                skipped_iterations: i.skipped,
                nan_iterations: i.nan,
                tokens_per_second: tokens / elapsed,
                tflops: tokens * o.flops_per_token / elapsed / 1e12,
                throughput_per_rank: o.log_throughput.then_some(per_rank),
                mfu: o
                    .peak_tflops
                    .filter(|_| o.log_throughput)
                    .map(|peak| per_rank / peak),
                num_zeros_in_grad: r.num_zeros_in_grad,
                params_norm: r.params_norm,
                timestamp: timestamp_now(),
            })
        );
        if !self.memory_reported {
            // Megatron reports memory once, after the first logged iteration.
            if let Some(peak) = peak_rss_bytes() {
                println!("{}", memory_report_line(0, r.iteration, peak));
            }
            self.memory_reported = true;
        }
        self.interval = Interval::new();
        Ok(())
    }

    /// Records a validation loss during training (log, TensorBoard, `metrics.jsonl`).
    pub fn record_validation(
        &mut self,
        iteration: u64,
        consumed_samples: u64,
        loss: f64,
    ) -> Result<()> {
        print_validation(&format!("validation loss at iteration {iteration}"), loss);
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.add_scalar("lm loss validation", loss, iteration)?;
            tb.add_scalar("lm loss validation vs samples", loss, consumed_samples)?;
            tb.add_scalar("lm loss validation ppl", loss.min(20.0).exp(), iteration)?;
            tb.flush()?;
        }
        if let Some(file) = self.jsonl.as_mut() {
            let line = serde_json::json!({
                "iteration": iteration,
                "consumed_samples": consumed_samples,
                "tokens": consumed_samples * self.options.seq_length as u64,
                "valid_lm_loss": loss
            });
            writeln!(file, "{line}")?;
        }
        Ok(())
    }

    /// Closes `metrics.jsonl` and draws `loss.png` from it (a warning if that fails: the
    /// run's results do not depend on the plot).
    pub fn finish(self) {
        let Some(dir) = self.options.save_dir.clone() else {
            return;
        };
        drop(self);
        draw_plot(&dir);
    }
}

/// `DIR/loss.png` from `DIR/metrics.jsonl`.
fn draw_plot(dir: &Path) {
    let plot = dir.join("loss.png");
    let drawn =
        read_metrics(&dir.join("metrics.jsonl"), "").and_then(|run| draw_loss_plot(&plot, &[run]));
    if let Err(e) = drawn {
        eprintln!("warning: could not write {}: {e:#}", plot.display());
    }
}

/// Megatron's validation block: the line between two rules.
pub fn print_validation(label: &str, loss: f64) {
    let line = validation_line(label, loss);
    let rule = "-".repeat(line.len());
    println!("{rule}\n{line}\n{rule}");
}
