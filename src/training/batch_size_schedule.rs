//! The global batch size over a run (Megatron-Core's `num_microbatches_calculator`): constant,
//! ramped up linearly (`--rampup-batch-size START INCREMENT SAMPLES`), or in steps
//! (`--step-batch-size-schedule "0:256 1M:512"`, which replaced the ramp-up in Megatron-LM's
//! main branch).
//!
//! The batch size depends only on the samples consumed so far, so a resumed run picks up
//! where it stopped, and the number of iterations of a sample-based run is known before it
//! starts.

/// How the global batch size grows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum BatchSizeSchedule {
    /// `--global-batch-size` throughout.
    #[default]
    Constant,
    /// `--rampup-batch-size START INCREMENT SAMPLES`: from START to `--global-batch-size` in
    /// steps of INCREMENT, evenly over the first SAMPLES samples.
    Rampup {
        /// The first global batch size.
        start: usize,
        /// The step between batch sizes.
        increment: usize,
        /// Samples over which it grows.
        samples: u64,
    },
    /// `--step-batch-size-schedule`: `(first sample, global batch size)` pairs, ascending,
    /// the first at sample 0.
    Steps(Vec<(u64, usize)>),
}

impl BatchSizeSchedule {
    /// Parses `--rampup-batch-size START INCREMENT SAMPLES` against `--global-batch-size`,
    /// with Megatron's checks.
    pub fn rampup(values: &[u64], global_batch_size: usize) -> Result<Self, String> {
        let &[start, increment, samples] = values else {
            return Err(format!(
                "--rampup-batch-size takes three numbers (start batch size, increment, ramp-up samples), got {values:?}"
            ));
        };
        let (start, increment) = (start as usize, increment as usize);
        if start == 0 || increment == 0 {
            return Err(
                "--rampup-batch-size: the start batch size and the increment must be positive"
                    .into(),
            );
        }
        if start > global_batch_size || !(global_batch_size - start).is_multiple_of(increment) {
            return Err(format!(
                "--rampup-batch-size {start} {increment} {samples}: --global-batch-size {global_batch_size} minus the start must be a non-negative multiple of the increment"
            ));
        }
        Ok(Self::Rampup {
            start,
            increment,
            samples,
        })
    }

    /// Parses `--step-batch-size-schedule "THRESHOLD:BATCH ..."` (commas also separate;
    /// K, M, B and T multiply by 10³…10¹²). With `tokens_per_sample` the thresholds are
    /// tokens (Megatron passes the sequence length), else samples.
    pub fn steps(text: &str, tokens_per_sample: Option<u64>) -> Result<Self, String> {
        let mut steps = Vec::new();
        for entry in text.replace(',', " ").split_whitespace() {
            let (threshold, batch) = entry.split_once(':').ok_or_else(|| {
                format!("--step-batch-size-schedule: {entry:?} is not THRESHOLD:BATCH_SIZE")
            })?;
            let threshold = suffixed_number(threshold)?;
            let batch = suffixed_number(batch)? as usize;
            if batch == 0 {
                return Err(format!(
                    "--step-batch-size-schedule: {entry:?} has batch size 0"
                ));
            }
            steps.push((threshold / tokens_per_sample.unwrap_or(1), batch));
        }
        steps.sort_by_key(|s| s.0);
        match steps.first() {
            Some((0, _)) => {}
            _ => return Err("--step-batch-size-schedule: the first threshold must be 0".into()),
        }
        if steps.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err("--step-batch-size-schedule: two entries have the same threshold".into());
        }
        Ok(Self::Steps(steps))
    }

    /// The global batch size the schedule asks for after `consumed` samples (Megatron's
    /// `get_current_global_batch_size`).
    pub fn global_batch_at(&self, global_batch_size: usize, consumed: u64) -> usize {
        match self {
            Self::Constant => global_batch_size,
            &Self::Rampup {
                start,
                increment,
                samples,
            } => {
                if consumed > samples {
                    return global_batch_size;
                }
                let increments = (global_batch_size - start) / increment;
                let per_increment = samples as f64 / increments as f64;
                let done = (consumed as f64 / per_increment) as usize;
                start + done * increment
            }
            Self::Steps(steps) => steps
                .iter()
                .take_while(|(threshold, _)| consumed >= *threshold)
                .last()
                .map_or(steps[0].1, |s| s.1),
        }
    }

    /// The batch the run trains on after `consumed` samples: the scheduled size, which must
    /// split into whole micro-batches on every data-parallel rank (`unit` = micro-batch size
    /// × data-parallel size), or with `--decrease-batch-size-if-needed` is rounded down to
    /// one that does.
    pub fn running_batch_at(
        &self,
        global_batch_size: usize,
        consumed: u64,
        unit: usize,
        decrease_if_needed: bool,
    ) -> Result<usize, String> {
        let scheduled = self.global_batch_at(global_batch_size, consumed);
        if scheduled.is_multiple_of(unit) {
            return Ok(scheduled);
        }
        if decrease_if_needed && scheduled >= unit {
            return Ok(scheduled / unit * unit);
        }
        Err(format!(
            "the global batch size {scheduled} (after {consumed} samples) is not a multiple of --micro-batch-size × data-parallel size = {unit}{}",
            if decrease_if_needed { "" } else { " (--decrease-batch-size-if-needed rounds it down)" }
        ))
    }

    /// Iterations of a run of `train_samples` samples (Megatron's `update_train_iters`): the
    /// ramp-up's iterations, then whole global batches (a partial last batch is dropped).
    pub fn iterations_for(&self, global_batch_size: usize, train_samples: u64) -> u64 {
        let gbs = global_batch_size as u64;
        match self {
            Self::Constant => train_samples / gbs,
            &Self::Rampup { samples, .. } => {
                let (mut iterations, mut consumed) = (0, 0);
                while consumed <= samples && consumed <= train_samples {
                    consumed += self.global_batch_at(global_batch_size, consumed) as u64;
                    iterations += 1;
                }
                iterations + train_samples.saturating_sub(consumed) / gbs
            }
            Self::Steps(_) => {
                let (mut iterations, mut consumed) = (0, 0);
                while consumed < train_samples {
                    consumed += self.global_batch_at(global_batch_size, consumed) as u64;
                    iterations += 1;
                }
                iterations
            }
        }
    }

    /// The largest batch the schedule ever asks for.
    pub fn largest(&self, global_batch_size: usize) -> usize {
        match self {
            Self::Steps(steps) => steps.iter().map(|s| s.1).max().unwrap_or(global_batch_size),
            _ => global_batch_size,
        }
    }
}

/// `250B` → 250·10⁹, Megatron's `_parse_numeric_value` (a decimal before the suffix is
/// allowed: `1.5M`).
fn suffixed_number(text: &str) -> Result<u64, String> {
    let upper = text.trim().to_ascii_uppercase();
    let (digits, multiplier) = match upper.chars().last() {
        Some('T') => (&upper[..upper.len() - 1], 1e12),
        Some('B') => (&upper[..upper.len() - 1], 1e9),
        Some('M') => (&upper[..upper.len() - 1], 1e6),
        Some('K') => (&upper[..upper.len() - 1], 1e3),
        _ => (upper.as_str(), 1.0),
    };
    let value: f64 = digits
        .parse()
        .map_err(|_| format!("--step-batch-size-schedule: {text:?} is not a number"))?;
    if !(value >= 0.0 && value.is_finite()) {
        return Err(format!("--step-batch-size-schedule: {text:?} is negative"));
    }
    Ok((value * multiplier) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_schedules_parse_as_megatron_parses_them() {
        let s = BatchSizeSchedule::steps("0:768 250B:1536, 500B:3072", Some(1000)).unwrap();
        assert_eq!(
            s,
            BatchSizeSchedule::Steps(vec![(0, 768), (250_000_000, 1536), (500_000_000, 3072)])
        );
        assert_eq!(s.global_batch_at(3072, 249_999_999), 768);
        assert_eq!(s.global_batch_at(3072, 250_000_000), 1536);
        assert!(BatchSizeSchedule::steps("5:8 10:16", None).is_err());
        assert!(BatchSizeSchedule::steps("0:8 x:16", None).is_err());
    }
}
