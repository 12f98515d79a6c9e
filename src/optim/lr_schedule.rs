//! Megatron's learning-rate schedule (`OptimizerParamScheduler`): linear warmup from 0, then
//! constant, linear or cosine decay to `--min-lr` over `--lr-decay-iters`.

/// `--lr-decay-style`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LrDecayStyle {
    /// Stay at `--lr` after warmup.
    Constant,
    /// Linear from `--lr` to `--min-lr`.
    Linear,
    /// Half a cosine from `--lr` to `--min-lr`.
    Cosine,
}

impl std::str::FromStr for LrDecayStyle {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "constant" => Ok(Self::Constant),
            "linear" => Ok(Self::Linear),
            "cosine" => Ok(Self::Cosine),
            other => Err(format!(
                "--lr-decay-style {other:?} is not supported; use constant, linear or cosine"
            )),
        }
    }
}

/// The schedule, in iterations.
#[derive(Clone, Debug, PartialEq)]
pub struct LrSchedule {
    /// `--lr`.
    pub max_lr: f64,
    /// `--min-lr`.
    pub min_lr: f64,
    /// Warmup iterations (`--lr-warmup-iters`, or `--lr-warmup-fraction` × decay iterations).
    pub warmup_iters: f64,
    /// `--lr-decay-iters` (default: `--train-iters`).
    pub decay_iters: f64,
    /// `--lr-decay-style`.
    pub style: LrDecayStyle,
}

impl LrSchedule {
    /// The learning rate after `iteration` completed iterations (Megatron's `get_lr` at
    /// `num_steps = iteration × global batch`; iteration k uses `lr_at(k - 1)`).
    pub fn lr_at(&self, iteration: u64) -> f64 {
        let step = iteration as f64;
        if self.warmup_iters > 0.0 && step <= self.warmup_iters {
            return self.max_lr * step / self.warmup_iters;
        }
        if self.style == LrDecayStyle::Constant {
            return self.max_lr;
        }
        if step > self.decay_iters {
            return self.min_lr;
        }
        let ratio = (step - self.warmup_iters) / (self.decay_iters - self.warmup_iters);
        let coefficient = match self.style {
            LrDecayStyle::Linear => 1.0 - ratio,
            LrDecayStyle::Cosine => 0.5 * ((std::f64::consts::PI * ratio).cos() + 1.0),
            LrDecayStyle::Constant => 1.0,
        };
        self.min_lr + coefficient * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_megatrons_formulas() {
        // The seed tutorial: --lr 0.00015 --lr-decay-iters 300 --lr-warmup-fraction .01 cosine.
        let s = LrSchedule {
            max_lr: 1.5e-4,
            min_lr: 0.0,
            warmup_iters: 3.0,
            decay_iters: 300.0,
            style: LrDecayStyle::Cosine,
        };
        assert_eq!(s.lr_at(0), 0.0);
        assert!((s.lr_at(1) - 5e-5).abs() < 1e-18);
        assert!((s.lr_at(3) - 1.5e-4).abs() < 1e-18);
        // Halfway through the decay the cosine is at its middle: (153 - 3) / (303 - 3) = 1/2.
        let s2 = LrSchedule {
            decay_iters: 303.0,
            ..s.clone()
        };
        assert!((s2.lr_at(153) - 0.75e-4).abs() < 1e-15);
        assert_eq!(s.lr_at(301), 0.0);
        assert_eq!(s.lr_at(1000), 0.0);
        let lin = LrSchedule {
            style: LrDecayStyle::Linear,
            min_lr: 1e-5,
            warmup_iters: 0.0,
            decay_iters: 100.0,
            max_lr: 1e-3,
        };
        assert!((lin.lr_at(25) - (1e-5 + 0.75 * (1e-3 - 1e-5))).abs() < 1e-15);
        let c = LrSchedule {
            style: LrDecayStyle::Constant,
            ..lin
        };
        assert_eq!(c.lr_at(99), 1e-3);
    }
}
