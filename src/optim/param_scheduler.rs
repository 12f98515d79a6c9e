//! Megatron-Core's `OptimizerParamScheduler`: the learning rate and the weight decay as
//! functions of the scheduler's step count.
//!
//! Megatron counts the schedule in *samples*: every successful iteration advances it by the
//! global batch it trained on, so a batch-size ramp-up moves the schedule by what was really
//! consumed. Iteration-based flags (`--lr-warmup-iters`, `--lr-decay-iters`, ...) are
//! converted to samples by multiplying by the global batch size, as Megatron's
//! `get_optimizer_param_scheduler` does; an iteration that was skipped for overflowing
//! gradients does not advance the schedule.

use std::f64::consts::PI;

/// `--lr-decay-style`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LrDecayStyle {
    /// Stay at `--lr` after warmup.
    #[default]
    Constant,
    /// Linear from `--lr` to `--min-lr`.
    Linear,
    /// Half a cosine from `--lr` to `--min-lr`.
    Cosine,
    /// `--lr · √(warmup / step)`, never below `--min-lr`.
    InverseSquareRoot,
    /// Warmup-stable-decay: `--lr` until the last `--lr-wsd-decay-samples` (or iterations) of
    /// the decay, then down to `--min-lr` by `--lr-wsd-decay-style`.
    Wsd,
}

impl LrDecayStyle {
    /// Megatron's name (`--lr-decay-style`, and its scheduler's saved `lr_decay_style`).
    pub fn megatron_name(self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::Linear => "linear",
            Self::Cosine => "cosine",
            Self::InverseSquareRoot => "inverse-square-root",
            Self::Wsd => "WSD",
        }
    }
}

impl std::str::FromStr for LrDecayStyle {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        choice(
            "--lr-decay-style",
            s,
            &[
                ("constant", Self::Constant),
                ("linear", Self::Linear),
                ("cosine", Self::Cosine),
                ("inverse-square-root", Self::InverseSquareRoot),
                ("WSD", Self::Wsd),
            ],
        )
    }
}

/// `--lr-wsd-decay-style`: the shape of WSD's final decay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WsdDecayStyle {
    /// `2 · 0.5^r − 1` (Megatron's default).
    #[default]
    Exponential,
    /// `1 − r`.
    Linear,
    /// Half a cosine.
    Cosine,
    /// `1 − √r`.
    MinusSqrt,
}

impl std::str::FromStr for WsdDecayStyle {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        choice(
            "--lr-wsd-decay-style",
            s,
            &[
                ("exponential", Self::Exponential),
                ("linear", Self::Linear),
                ("cosine", Self::Cosine),
                ("minus_sqrt", Self::MinusSqrt),
            ],
        )
    }
}

/// The learning-rate schedule, in scheduler steps (samples).
#[derive(Clone, Debug, PartialEq)]
pub struct LrSchedule {
    /// `--lr-warmup-init`: where the warmup starts.
    pub init_lr: f64,
    /// `--lr`.
    pub max_lr: f64,
    /// `--min-lr`.
    pub min_lr: f64,
    /// Warmup steps (`--lr-warmup-samples`, `--lr-warmup-iters` × global batch, or
    /// `--lr-warmup-fraction` × decay steps).
    pub warmup_steps: f64,
    /// Decay steps (`--lr-decay-samples`, or `--lr-decay-iters` × global batch; both default
    /// to the whole run).
    pub decay_steps: f64,
    /// `--lr-decay-style`.
    pub style: LrDecayStyle,
    /// `--lr-wsd-decay-style`.
    pub wsd_style: WsdDecayStyle,
    /// WSD's final decay, in steps (`--lr-wsd-decay-samples`, or `--lr-wsd-decay-iters` ×
    /// global batch).
    pub wsd_decay_steps: f64,
}

impl Default for LrSchedule {
    /// A constant 1e-4 without warmup.
    fn default() -> Self {
        Self {
            init_lr: 0.0,
            max_lr: 1e-4,
            min_lr: 0.0,
            warmup_steps: 0.0,
            decay_steps: 1.0,
            style: LrDecayStyle::Constant,
            wsd_style: WsdDecayStyle::Exponential,
            wsd_decay_steps: 0.0,
        }
    }
}

impl LrSchedule {
    /// The learning rate after `steps` scheduler steps (Megatron's `get_lr`).
    pub fn lr_at(&self, steps: u64) -> f64 {
        let step = steps as f64;
        if self.warmup_steps > 0.0 && step <= self.warmup_steps {
            return self.init_lr + (self.max_lr - self.init_lr) * step / self.warmup_steps;
        }
        if self.style == LrDecayStyle::Constant {
            return self.max_lr;
        }
        if step > self.decay_steps {
            return self.min_lr;
        }
        if self.style == LrDecayStyle::InverseSquareRoot {
            let lr = self.max_lr * self.warmup_steps.max(1.0).sqrt() / step.max(1.0).sqrt();
            return lr.max(self.min_lr);
        }
        let ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps);
        let coefficient = match self.style {
            LrDecayStyle::Linear => 1.0 - ratio,
            LrDecayStyle::Cosine => half_cosine(ratio),
            LrDecayStyle::Wsd => self.wsd_coefficient(step),
            LrDecayStyle::Constant | LrDecayStyle::InverseSquareRoot => unreachable!(),
        };
        self.min_lr + coefficient * (self.max_lr - self.min_lr)
    }

    /// WSD: 1 until the final decay starts, then its style's curve.
    fn wsd_coefficient(&self, step: f64) -> f64 {
        let anneal_start = self.decay_steps - self.wsd_decay_steps;
        if step <= anneal_start {
            return 1.0;
        }
        let r = (step - anneal_start) / self.wsd_decay_steps;
        match self.wsd_style {
            WsdDecayStyle::Linear => 1.0 - r,
            WsdDecayStyle::Cosine => half_cosine(r),
            WsdDecayStyle::Exponential => 2.0 * 0.5f64.powf(r) - 1.0,
            WsdDecayStyle::MinusSqrt => 1.0 - r.sqrt(),
        }
    }

    /// Megatron's `OptimizerParamScheduler` assertions, as errors naming the flags.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.min_lr >= 0.0 && self.min_lr <= self.max_lr && self.init_lr <= self.max_lr) {
            return Err(format!(
                "need 0 <= --min-lr ({}) <= --lr ({}) and --lr-warmup-init ({}) <= --lr",
                self.min_lr, self.max_lr, self.init_lr
            ));
        }
        if !(self.decay_steps > 0.0 && self.warmup_steps < self.decay_steps) {
            return Err(format!(
                "the warmup ({} samples) must be shorter than the decay ({} samples): check --lr-warmup-* and --lr-decay-*",
                self.warmup_steps, self.decay_steps
            ));
        }
        if self.style == LrDecayStyle::Wsd
            && !(self.wsd_decay_steps > 0.0 && self.wsd_decay_steps <= self.decay_steps)
        {
            return Err(
                "--lr-decay-style WSD needs --lr-wsd-decay-samples (or --lr-wsd-decay-iters), \
                 positive and within the decay"
                    .into(),
            );
        }
        Ok(())
    }
}

/// The learning rates of one step: most parameters take `base`; the word embedding and the
/// output layer take `decoupled` (`--decoupled-lr`, Megatron's `is_embedding_or_output_parameter`
/// group; the same as `base` without it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LearningRates {
    /// The learning rate of most parameters.
    pub base: f64,
    /// The word embedding's and the output layer's.
    pub decoupled: f64,
}

impl LearningRates {
    /// One learning rate for every parameter.
    pub fn uniform(lr: f64) -> Self {
        Self {
            base: lr,
            decoupled: lr,
        }
    }
}

/// `value` as one of a flag's `choices`, or an error naming the flag and what it takes.
fn choice<T: Copy>(flag: &str, value: &str, choices: &[(&str, T)]) -> Result<T, String> {
    match choices.iter().find(|(name, _)| *name == value) {
        Some(&(_, chosen)) => Ok(chosen),
        None => {
            let names: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
            Err(format!(
                "{flag} {value:?}: expected one of {}",
                names.join(", ")
            ))
        }
    }
}

/// `0.5 · (cos(π r) + 1)`: from 1 at r = 0 to 0 at r = 1.
fn half_cosine(ratio: f64) -> f64 {
    0.5 * ((PI * ratio).cos() + 1.0)
}

/// `--weight-decay-incr-style`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightDecayIncrStyle {
    /// `--weight-decay` throughout.
    #[default]
    Constant,
    /// Linear from `--start-weight-decay` to `--end-weight-decay`.
    Linear,
    /// Half a cosine from `--start-weight-decay` to `--end-weight-decay`.
    Cosine,
}

impl WeightDecayIncrStyle {
    /// Megatron's name (`--weight-decay-incr-style`, and its scheduler's `wd_incr_style`).
    pub fn megatron_name(self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::Linear => "linear",
            Self::Cosine => "cosine",
        }
    }
}

impl std::str::FromStr for WeightDecayIncrStyle {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        choice(
            "--weight-decay-incr-style",
            s,
            &[
                ("constant", Self::Constant),
                ("linear", Self::Linear),
                ("cosine", Self::Cosine),
            ],
        )
    }
}

/// The weight decay over the run, in scheduler steps (samples).
#[derive(Clone, Debug, PartialEq)]
pub struct WeightDecaySchedule {
    /// `--start-weight-decay` (default `--weight-decay`).
    pub start: f64,
    /// `--end-weight-decay` (default `--weight-decay`).
    pub end: f64,
    /// Steps over which it moves: the whole run (`--train-samples`, or `--train-iters` ×
    /// global batch).
    pub incr_steps: f64,
    /// `--weight-decay-incr-style`.
    pub style: WeightDecayIncrStyle,
}

impl WeightDecaySchedule {
    /// `weight_decay` throughout.
    pub fn constant(weight_decay: f64) -> Self {
        Self {
            start: weight_decay,
            end: weight_decay,
            incr_steps: 1.0,
            style: WeightDecayIncrStyle::Constant,
        }
    }

    /// The weight decay after `steps` scheduler steps (Megatron's `get_wd`).
    pub fn wd_at(&self, steps: u64) -> f64 {
        let step = steps as f64;
        if step > self.incr_steps || self.style == WeightDecayIncrStyle::Constant {
            return self.end;
        }
        let ratio = step / self.incr_steps;
        let coefficient = match self.style {
            WeightDecayIncrStyle::Linear => ratio,
            WeightDecayIncrStyle::Cosine => half_cosine(1.0 - ratio),
            WeightDecayIncrStyle::Constant => unreachable!(),
        };
        self.start + coefficient * (self.end - self.start)
    }

    /// Megatron's assertions: a constant style needs equal ends, and neither may be negative.
    pub fn validate(&self) -> Result<(), String> {
        if self.start < 0.0 || self.end < 0.0 || self.start > self.end {
            return Err(format!(
                "need 0 <= --start-weight-decay ({}) <= --end-weight-decay ({})",
                self.start, self.end
            ));
        }
        if self.style == WeightDecayIncrStyle::Constant && self.start != self.end {
            return Err(
                "--start-weight-decay and --end-weight-decay differ: give --weight-decay-incr-style linear or cosine"
                    .into(),
            );
        }
        Ok(())
    }
}
