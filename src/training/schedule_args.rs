//! Megatron's batch and schedule flags (`arguments.py`'s `_add_training_args` and
//! `_add_learning_rate_args`), checked as its `validate_args` checks them and turned into
//! sample-counted schedules as its `get_optimizer_param_scheduler` does.

use clap::Args;

use super::batch_size_schedule::BatchSizeSchedule;
use crate::optim::{LrDecayStyle, LrSchedule, WeightDecayIncrStyle, WeightDecaySchedule};

/// How long a run is, how big its batches are, and how its learning rate and weight decay
/// move: counted in iterations (`--train-iters`) or in samples (`--train-samples`).
#[derive(Args, Clone, Debug, Default)]
pub struct ScheduleArgs {
    /// Samples per forward/backward pass.
    #[arg(long)]
    pub micro_batch_size: usize,
    /// Samples per optimizer step [default: --micro-batch-size].
    #[arg(long)]
    pub global_batch_size: Option<usize>,
    /// Grow the global batch: START INCREMENT SAMPLES (sample-based runs only).
    #[arg(long, num_args = 3, value_names = ["START", "INCREMENT", "SAMPLES"])]
    pub rampup_batch_size: Option<Vec<u64>>,
    /// Global batch size in steps: "THRESHOLD:BATCH ..." (thresholds in tokens, with K, M,
    /// B, T suffixes), instead of --global-batch-size.
    #[arg(long)]
    pub step_batch_size_schedule: Option<String>,
    /// Round a scheduled batch down to a multiple of micro-batch × data-parallel size.
    #[arg(long)]
    pub decrease_batch_size_if_needed: bool,
    /// Optimizer steps (or give --train-samples).
    #[arg(long)]
    pub train_iters: Option<u64>,
    /// Training samples: the run, its schedules and the training set counted in samples.
    #[arg(long)]
    pub train_samples: Option<u64>,
    /// Peak learning rate.
    #[arg(long)]
    pub lr: f64,
    /// Minimum learning rate.
    #[arg(long, default_value_t = 0.0)]
    pub min_lr: f64,
    /// Peak learning rate of the word embedding and the output layer (the same schedule).
    #[arg(long)]
    pub decoupled_lr: Option<f64>,
    /// Minimum learning rate of the word embedding and the output layer [default: --min-lr].
    #[arg(long)]
    pub decoupled_min_lr: Option<f64>,
    /// constant, linear, cosine, inverse-square-root or WSD.
    #[arg(long, default_value = "linear")]
    pub lr_decay_style: String,
    /// Iterations of decay [default: --train-iters].
    #[arg(long)]
    pub lr_decay_iters: Option<u64>,
    /// Samples of decay [default: --train-samples].
    #[arg(long)]
    pub lr_decay_samples: Option<u64>,
    /// Warmup iterations.
    #[arg(long, default_value_t = 0)]
    pub lr_warmup_iters: u64,
    /// Warmup samples.
    #[arg(long, default_value_t = 0)]
    pub lr_warmup_samples: u64,
    /// Warmup as a fraction of the decay.
    #[arg(long)]
    pub lr_warmup_fraction: Option<f64>,
    /// The learning rate the warmup starts from.
    #[arg(long, default_value_t = 0.0)]
    pub lr_warmup_init: f64,
    /// WSD's final decay: exponential, linear, cosine or minus_sqrt.
    #[arg(long, default_value = "exponential")]
    pub lr_wsd_decay_style: String,
    /// Iterations of WSD's final decay.
    #[arg(long)]
    pub lr_wsd_decay_iters: Option<u64>,
    /// Samples of WSD's final decay.
    #[arg(long)]
    pub lr_wsd_decay_samples: Option<u64>,
    /// Decoupled weight decay (weight matrices only).
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,
    /// Weight decay at the start (with --weight-decay-incr-style linear or cosine).
    #[arg(long)]
    pub start_weight_decay: Option<f64>,
    /// Weight decay at the end (with --weight-decay-incr-style linear or cosine).
    #[arg(long)]
    pub end_weight_decay: Option<f64>,
    /// constant, linear or cosine.
    #[arg(long, default_value = "constant")]
    pub weight_decay_incr_style: String,
}

/// What the flags resolve to.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedSchedule {
    /// Iterations of the run.
    pub train_iters: u64,
    /// `--train-samples`, when the run is counted in samples.
    pub train_samples: Option<u64>,
    /// The global batch after any ramp-up.
    pub global_batch_size: usize,
    /// How the global batch grows.
    pub batch_size_schedule: BatchSizeSchedule,
    /// The learning rate, in samples.
    pub lr: LrSchedule,
    /// The word embedding's and output layer's learning rate (`--decoupled-lr`).
    pub decoupled_lr: Option<LrSchedule>,
    /// The weight decay, in samples.
    pub weight_decay: WeightDecaySchedule,
}

impl ScheduleArgs {
    /// Checks the flags as Megatron's `validate_args` does and resolves them; `seq_length`
    /// turns `--step-batch-size-schedule`'s token thresholds into samples.
    pub fn resolve(&self, seq_length: usize) -> Result<ResolvedSchedule, String> {
        self.check_counting()?;
        let (global_batch_size, batch_size_schedule) = self.batch_sizes(seq_length)?;
        let gbs = global_batch_size as u64;
        let (train_iters, lr, wd_steps) = match (self.train_iters, self.train_samples) {
            (Some(iters), None) => {
                let decay = (self.lr_decay_iters.unwrap_or(iters) * gbs) as f64;
                let warmup = self.lr_warmup_iters * gbs;
                let wsd = self.lr_wsd_decay_iters.map(|i| i * gbs);
                (iters, self.lr_schedule(decay, warmup, wsd)?, iters * gbs)
            }
            (None, Some(samples)) => {
                let decay = self.lr_decay_samples.unwrap_or(samples) as f64;
                let schedule =
                    self.lr_schedule(decay, self.lr_warmup_samples, self.lr_wsd_decay_samples)?;
                let iters = batch_size_schedule.iterations_for(global_batch_size, samples);
                (iters, schedule, samples)
            }
            _ => unreachable!("checked above"),
        };
        if train_iters == 0 {
            return Err(format!(
                "--train-samples {} is less than one global batch ({global_batch_size})",
                self.train_samples.unwrap_or(0)
            ));
        }
        lr.validate()?;
        let decoupled_lr = self.decoupled_lr_schedule(&lr)?;
        let weight_decay = self.weight_decay_schedule(wd_steps as f64)?;
        weight_decay.validate()?;
        Ok(ResolvedSchedule {
            train_iters,
            train_samples: self.train_samples,
            global_batch_size,
            batch_size_schedule,
            lr,
            decoupled_lr,
            weight_decay,
        })
    }

    /// One way of counting the run: iteration flags with `--train-iters`, sample flags with
    /// `--train-samples` (Megatron's assertions, as errors naming the flags).
    fn check_counting(&self) -> Result<(), String> {
        let sample_flags = [
            (self.lr_decay_samples.is_some(), "--lr-decay-samples"),
            (self.lr_warmup_samples > 0, "--lr-warmup-samples"),
            (
                self.lr_wsd_decay_samples.is_some(),
                "--lr-wsd-decay-samples",
            ),
            (self.rampup_batch_size.is_some(), "--rampup-batch-size"),
        ];
        let iteration_flags = [
            (self.lr_decay_iters.is_some(), "--lr-decay-iters"),
            (self.lr_warmup_iters > 0, "--lr-warmup-iters"),
            (self.lr_wsd_decay_iters.is_some(), "--lr-wsd-decay-iters"),
        ];
        let (wrong, counting, warmup): (&[(bool, &str)], _, _) =
            match (self.train_iters, self.train_samples) {
                (Some(_), Some(_)) => {
                    return Err("give --train-iters or --train-samples, not both".into())
                }
                (None, None) => {
                    return Err(
                        "give --train-iters (iterations) or --train-samples (samples)".into(),
                    )
                }
                (Some(_), None) => (&sample_flags, "--train-iters", self.lr_warmup_iters),
                (None, Some(_)) => (&iteration_flags, "--train-samples", self.lr_warmup_samples),
            };
        if let Some((_, flag)) = wrong.iter().find(|(given, _)| *given) {
            return Err(format!(
                "{flag} does not go with {counting}: count the schedule the way the run is counted"
            ));
        }
        if self.lr_warmup_fraction.is_some() && warmup > 0 {
            return Err("give --lr-warmup-fraction or a warmup length, not both".into());
        }
        if self.micro_batch_size == 0 {
            return Err("--micro-batch-size must be positive".into());
        }
        Ok(())
    }

    /// The global batch size after any ramp-up and how it gets there.
    fn batch_sizes(&self, seq_length: usize) -> Result<(usize, BatchSizeSchedule), String> {
        if let Some(text) = &self.step_batch_size_schedule {
            if self.global_batch_size.is_some() || self.rampup_batch_size.is_some() {
                return Err("--step-batch-size-schedule replaces --global-batch-size and --rampup-batch-size".into());
            }
            let schedule = BatchSizeSchedule::steps(text, Some(seq_length as u64))?;
            return Ok((schedule.largest(0), schedule));
        }
        let gbs = self.global_batch_size.unwrap_or(self.micro_batch_size);
        let schedule = match &self.rampup_batch_size {
            Some(values) => BatchSizeSchedule::rampup(values, gbs)?,
            None => BatchSizeSchedule::Constant,
        };
        Ok((gbs, schedule))
    }

    /// The learning-rate schedule over `decay` steps after `warmup` steps (a fraction of the
    /// decay with `--lr-warmup-fraction`), WSD's final decay over `wsd` steps.
    fn lr_schedule(&self, decay: f64, warmup: u64, wsd: Option<u64>) -> Result<LrSchedule, String> {
        let warmup_steps = match self.lr_warmup_fraction {
            Some(f) if (0.0..=1.0).contains(&f) => f * decay,
            Some(f) => return Err(format!("--lr-warmup-fraction {f} must be in [0, 1]")),
            None => warmup as f64,
        };
        let style: LrDecayStyle = self.lr_decay_style.parse()?;
        if style == LrDecayStyle::Wsd && wsd.is_none() {
            return Err(
                "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)"
                    .into(),
            );
        }
        Ok(LrSchedule {
            init_lr: self.lr_warmup_init,
            max_lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps,
            decay_steps: decay,
            style,
            wsd_style: self.lr_wsd_decay_style.parse()?,
            wsd_decay_steps: wsd.unwrap_or(0) as f64,
        })
    }

    /// `--decoupled-lr`: `lr`'s schedule with its own peak and floor.
    fn decoupled_lr_schedule(&self, lr: &LrSchedule) -> Result<Option<LrSchedule>, String> {
        let Some(max_lr) = self.decoupled_lr else {
            if self.decoupled_min_lr.is_some() {
                return Err("--decoupled-min-lr needs --decoupled-lr".into());
            }
            return Ok(None);
        };
        let schedule = LrSchedule {
            max_lr,
            min_lr: self.decoupled_min_lr.unwrap_or(lr.min_lr),
            ..lr.clone()
        };
        schedule
            .validate()
            .map_err(|e| format!("--decoupled-lr: {e}"))?;
        Ok(Some(schedule))
    }

    /// `--weight-decay` throughout, or from `--start-weight-decay` to `--end-weight-decay`
    /// over the run's `steps`.
    fn weight_decay_schedule(&self, steps: f64) -> Result<WeightDecaySchedule, String> {
        let style: WeightDecayIncrStyle = self.weight_decay_incr_style.parse()?;
        match (style, self.start_weight_decay, self.end_weight_decay) {
            (WeightDecayIncrStyle::Constant, None, None) => {
                Ok(WeightDecaySchedule::constant(self.weight_decay))
            }
            (WeightDecayIncrStyle::Constant, _, _) => Err(
                "--start-weight-decay and --end-weight-decay need --weight-decay-incr-style linear or cosine".into(),
            ),
            (_, Some(start), Some(end)) => Ok(WeightDecaySchedule {
                start,
                end,
                incr_steps: steps,
                style,
            }),
            _ => Err(format!(
                "--weight-decay-incr-style {} needs --start-weight-decay and --end-weight-decay",
                self.weight_decay_incr_style
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use serde_json::Value;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        schedule: ScheduleArgs,
    }

    /// The fixture's Megatron arguments as the command line a script would pass.
    fn command_line(args: &serde_json::Map<String, Value>) -> Vec<String> {
        let mut argv = vec!["pretrain".to_owned()];
        for (key, value) in args {
            if key == "data_parallel_size" {
                continue;
            }
            argv.push(format!("--{}", key.replace('_', "-")));
            match value {
                Value::Array(items) => argv.extend(items.iter().map(Value::to_string)),
                Value::String(s) => argv.push(s.clone()),
                other => argv.push(other.to_string()),
            }
        }
        argv
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1e-300)
    }

    /// Every case of `tests/fixtures/megatron_schedules.json` (Megatron-Core's own
    /// `OptimizerParamScheduler` and batch-size calculator, driven by a replay of Megatron's
    /// training loop): the same totals, and per iteration the same learning rate, weight
    /// decay and global batch, and the same learning rate in the log line.
    #[test]
    fn schedules_equal_megatron_cores_over_whole_runs() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/megatron_schedules.json"
        );
        let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = fixture["cases"].as_array().unwrap();
        assert!(cases.len() >= 18);
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let args = case["args"].as_object().unwrap();
            let cli =
                Cli::try_parse_from(command_line(args)).unwrap_or_else(|e| panic!("{name}: {e}"));
            let r = cli
                .schedule
                .resolve(16)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let want = &case["resolved"];
            assert_eq!(
                r.train_iters,
                want["train_iters"].as_u64().unwrap(),
                "{name}"
            );
            assert_eq!(
                r.lr.warmup_steps,
                want["lr_warmup_steps"].as_f64().unwrap(),
                "{name}"
            );
            assert_eq!(
                r.lr.decay_steps,
                want["lr_decay_steps"].as_f64().unwrap(),
                "{name}"
            );
            assert_eq!(
                r.weight_decay.end,
                want["end_wd"].as_f64().unwrap(),
                "{name}"
            );
            let dp = args
                .get("data_parallel_size")
                .and_then(Value::as_u64)
                .unwrap_or(1) as usize;
            let unit = cli.schedule.micro_batch_size * dp;
            let (mut steps, mut consumed) = (0u64, 0u64);
            let iterations = case["steps"].as_array().unwrap();
            assert_eq!(iterations.len() as u64, r.train_iters, "{name}");
            for it in iterations {
                let at = it["iteration"].as_u64().unwrap();
                let gbs = r
                    .batch_size_schedule
                    .running_batch_at(r.global_batch_size, consumed, unit, false)
                    .unwrap();
                assert_eq!(
                    gbs as u64,
                    it["global_batch_size"].as_u64().unwrap(),
                    "{name} {at}"
                );
                let (lr, wd) = (r.lr.lr_at(steps), r.weight_decay.wd_at(steps));
                assert!(
                    close(lr, it["lr_used"].as_f64().unwrap()),
                    "{name} {at}: lr {lr}"
                );
                assert!(
                    close(wd, it["wd_used"].as_f64().unwrap()),
                    "{name} {at}: wd {wd}"
                );
                steps += gbs as u64;
                consumed += gbs as u64;
                assert_eq!(
                    consumed,
                    it["consumed_samples"].as_u64().unwrap(),
                    "{name} {at}"
                );
                let logged = r.lr.lr_at(steps);
                assert!(
                    close(logged, it["lr_logged"].as_f64().unwrap()),
                    "{name} {at}: logged {logged}"
                );
            }
        }
        // The cases Megatron refuses are refused here too.
        for case in fixture["dropped"].as_array().unwrap() {
            let args = case["args"].as_object().unwrap();
            let mut args = args.clone();
            args.entry("micro_batch_size").or_insert(Value::from(2));
            args.entry("lr").or_insert(Value::from(1e-3));
            let dp = args
                .get("data_parallel_size")
                .and_then(Value::as_u64)
                .unwrap_or(1) as usize;
            let cli = Cli::try_parse_from(command_line(&args)).unwrap();
            let refused = cli.schedule.resolve(16).and_then(|r| {
                r.batch_size_schedule.running_batch_at(
                    r.global_batch_size,
                    0,
                    cli.schedule.micro_batch_size * dp,
                    false,
                )
            });
            assert!(refused.is_err(), "{}", case["name"]);
        }
    }
}
