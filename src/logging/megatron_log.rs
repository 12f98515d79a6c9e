//! Megatron's log lines, character for character where the values allow.

/// Python's `'%.{digits}E' % x`: mantissa, `E`, sign and at least two exponent digits
/// (`1.500E-04`; Rust's `{:E}` would print `1.5E-4`).
pub fn sci(x: f64, digits: usize) -> String {
    let s = format!("{x:.digits$E}");
    match s.split_once('E') {
        Some((mantissa, exp)) => {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp),
            };
            format!("{mantissa}E{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// What one training log line reports.
#[derive(Clone, Debug)]
pub struct IterationStats {
    /// Iteration just finished.
    pub iteration: u64,
    /// `--train-iters`.
    pub train_iters: u64,
    /// Samples consumed so far.
    pub consumed_samples: u64,
    /// Mean wall time of the iterations since the last line.
    pub ms_per_iteration: f64,
    /// Learning rate.
    pub learning_rate: f64,
    /// Global batch size.
    pub global_batch_size: usize,
    /// Mean LM loss of the iterations since the last line that were not skipped (none when
    /// all were).
    pub lm_loss: Option<f64>,
    /// The loss scale (1 without a scaler).
    pub loss_scale: f64,
    /// Gradient norm of the last iteration (none when it was skipped).
    pub grad_norm: Option<f64>,
    /// Iterations skipped for overflow since the last line.
    pub skipped_iterations: u64,
    /// Skipped iterations whose loss was not finite, since the last line.
    pub nan_iterations: u64,
    /// Training tokens per second.
    pub tokens_per_second: f64,
    /// Achieved model TFLOP/s.
    pub tflops: f64,
    /// With `--log-throughput`: Megatron's TFLOP/s per GPU (the model's FLOPs over the
    /// interval's time and the world's ranks).
    pub throughput_per_rank: Option<f64>,
    /// With `--log-throughput --peak-tflops`: the model FLOPs utilization, the throughput per
    /// rank as a share of one device's peak (ferrotron's field; Megatron prints none).
    pub mfu: Option<f64>,
    /// With `--log-num-zeros-in-grad`: zero gradient elements of the last iteration.
    pub num_zeros_in_grad: Option<u64>,
    /// With `--log-params-norm`: the L2 norm of all parameters.
    pub params_norm: Option<f64>,
    /// When the line is printed (Megatron's leading `[%Y-%m-%d %H:%M:%S.%f]`).
    pub timestamp: String,
}

/// Now, as Megatron stamps its log lines: `2026-11-25 23:10:00.123456` (local time).
pub fn timestamp_now() -> String {
    chrono::Local::now()
        .format("%Y-%m-%d %H:%M:%S%.6f")
        .to_string()
}

/// ` [2026-11-25 23:10:00.123456] iteration       10/    1000 | consumed samples:           80 | elapsed time per iteration (ms): 1210.0 | ...`
/// (Megatron-LM's `training_log`, field for field, with ferrotron's tokens/s and TFLOP/s
/// at the end).
pub fn iteration_line(s: &IterationStats) -> String {
    let optional = |value: Option<String>| value.unwrap_or_default();
    let throughput = optional(
        s.throughput_per_rank
            .map(|t| format!(" throughput per GPU (TFLOP/s/GPU): {t:.1} |")),
    );
    let mfu = optional(s.mfu.map(|m| format!(" MFU: {:.1}% |", 100.0 * m)));
    let lm_loss = optional(s.lm_loss.map(|l| format!(" lm loss: {} |", sci(l, 6))));
    let grad_norm = optional(s.grad_norm.map(|g| format!(" grad norm: {g:.3} |")));
    let zeros = optional(s.num_zeros_in_grad.map(|z| format!(" num zeros: {z} |")));
    let params_norm = optional(s.params_norm.map(|p| format!(" params norm: {p:.3} |")));
    format!(
        " [{}] iteration {:8}/{:8} | consumed samples: {:12} | elapsed time per iteration (ms): {:.1} |{throughput}{mfu} \
         learning rate: {} | global batch size: {:5} |{lm_loss} loss scale: {:.1} |{grad_norm}{zeros}{params_norm} \
         number of skipped iterations: {:3} | number of nan iterations: {:3} | tokens/s: {:.0} | TFLOP/s: {:.4} |",
        s.timestamp,
        s.iteration,
        s.train_iters,
        s.consumed_samples,
        s.ms_per_iteration,
        sci(s.learning_rate, 6),
        s.global_batch_size,
        s.loss_scale,
        s.skipped_iterations,
        s.nan_iterations,
        s.tokens_per_second,
        s.tflops,
    )
}

/// ` validation loss at iteration 100 | lm loss value: 7.086492E+00 | lm loss PPL: 1.195706E+03 | `
pub fn validation_line(label: &str, loss: f64) -> String {
    format!(
        " {label} | lm loss value: {} | lm loss PPL: {} | ",
        sci(loss, 6),
        sci(loss.min(700.0).exp(), 6)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_python() {
        assert_eq!(sci(1.5e-4, 3), "1.500E-04");
        assert_eq!(sci(10.32014, 6), "1.032014E+01");
        assert_eq!(sci(1195.706, 6), "1.195706E+03");
        assert_eq!(sci(0.0, 3), "0.000E+00");
        assert_eq!(sci(2.5e-120, 1), "2.5E-120");
        assert_eq!(
            validation_line("validation loss at iteration 100", 7.086492),
            " validation loss at iteration 100 | lm loss value: 7.086492E+00 | lm loss PPL: 1.195706E+03 | "
        );
        let line = iteration_line(&IterationStats {
            iteration: 10,
            train_iters: 1000,
            consumed_samples: 80,
            ms_per_iteration: 1210.0,
            learning_rate: 1.5e-4,
            global_batch_size: 8,
            lm_loss: Some(10.32014),
            loss_scale: 4294967296.0,
            grad_norm: Some(1.458),
            skipped_iterations: 0,
            nan_iterations: 0,
            tokens_per_second: 6770.0,
            tflops: 0.0123,
            throughput_per_rank: Some(0.0123),
            mfu: Some(0.0123 / 989.0),
            num_zeros_in_grad: Some(7),
            params_norm: Some(12.3456),
            timestamp: "2026-11-25 23:10:00.123456".into(),
        });
        // Megatron-LM d98e8a6's `training_log`, with its optional fields on.
        assert!(line.starts_with(
            " [2026-11-25 23:10:00.123456] iteration       10/    1000 | consumed samples:           80 | \
             elapsed time per iteration (ms): 1210.0 | throughput per GPU (TFLOP/s/GPU): 0.0 | MFU: 0.0% | \
             learning rate: 1.500000E-04 | global batch size:     8 | lm loss: 1.032014E+01 | loss scale: 4294967296.0 | \
             grad norm: 1.458 | num zeros: 7 | params norm: 12.346 | number of skipped iterations:   0 | number of nan iterations:   0 |"
        ), "{line}");
        assert_eq!(timestamp_now().len(), "2026-11-25 23:10:00.123456".len());
    }
}
