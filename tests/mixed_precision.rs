//! Mixed precision (`--bf16`, `--fp16` with Megatron's dynamic loss scaler) against the fp32
//! run, and the scaler's decisions against an independent re-implementation of its rule.

use std::path::Path;

use burn::tensor::Device;
use ferrotron::checkpoint::read_full_checkpoint;
use ferrotron::data::DataSources;
use ferrotron::model::GptConfig;
use ferrotron::optim::grad_scaler::DynamicGradScalerConfig;
use ferrotron::optim::Precision;
use ferrotron::training::{
    pretrain, LrDecayStyle, LrSchedule, ParallelConfig, PretrainConfig, PretrainOutcome,
};

use crate::common::*;

fn config(cache: &Path, precision: Precision, train_iters: u64) -> PretrainConfig {
    PretrainConfig {
        seq_length: 16,
        micro_batch_size: 2,
        global_batch_size: 4,
        train_iters,
        schedule: LrSchedule {
            max_lr: 2e-3,
            min_lr: 1e-4,
            warmup_steps: 40.0,
            decay_steps: train_iters as f64 * 4.0,
            style: LrDecayStyle::Cosine,
            ..Default::default()
        },
        precision,
        dynamic_loss_scale: DynamicGradScalerConfig::default(),
        split: "95,5,0".into(),
        data_cache_path: Some(cache.to_path_buf()),
        log_interval: 50,
        eval_iters: 1,
        parallel: ParallelConfig {
            ddp_bucket_size: 1 << 20,
            ..ParallelConfig::default()
        },
        ..PretrainConfig::new(
            GptConfig::new(2, 32, 4, 16, 50304)
                .with_hidden_dropout(0.1)
                .with_attention_dropout(0.1),
            DataSources::single(golden("wikitext2_valid", "text")),
        )
    }
}

fn device() -> Device {
    Device::flex().autodiff()
}

/// Mean loss of the last `n` iterations.
fn tail_mean(losses: &[(u64, f64)], n: usize) -> f64 {
    let tail = &losses[losses.len() - n..];
    tail.iter().map(|(_, l)| l).sum::<f64>() / n as f64
}

const CURVE_ITERS: u64 = 120;

/// The fp32 run the half-precision curves are held against, computed once for both tests
/// (they run on threads of one process), its index cache under cargo's temporary directory.
fn fp32_curve() -> &'static PretrainOutcome {
    static FP32: std::sync::OnceLock<PretrainOutcome> = std::sync::OnceLock::new();
    FP32.get_or_init(|| {
        let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("mixed_precision_fp32");
        pretrain(&config(&cache, Precision::Fp32, CURVE_ITERS), &device()).unwrap()
    })
}

/// A half-precision curve ends within 2 % of fp32's, and half precision really ran.
fn check_curve_against_fp32(precision: Precision) -> PretrainOutcome {
    let fp32 = fp32_curve();
    let first = fp32.losses[0].1;
    let end32 = tail_mean(&fp32.losses, 10);
    assert!(end32 < first - 1.0, "fp32 must learn: {first} → {end32}");
    let cache = tempfile::tempdir().unwrap();
    let out = pretrain(&config(cache.path(), precision, CURVE_ITERS), &device()).unwrap();
    let end = tail_mean(&out.losses, 10);
    let relative = (end - end32).abs() / end32;
    eprintln!("{precision:?}: final loss {end:.4}, fp32 {end32:.4}");
    assert!(
        relative < 0.02,
        "{precision:?}: final loss {end} vs fp32 {end32} ({:.2} %)",
        100.0 * relative
    );
    // Half precision really ran: the curve is not fp32's to the bit.
    assert_ne!(out.losses, fp32.losses, "{precision:?} gave fp32's losses");
    out
}

#[test]
fn the_bf16_curve_ends_within_two_percent_of_fp32() {
    let out = check_curve_against_fp32(Precision::Bf16);
    // bf16 has no scaler: nothing skipped, scale 1.
    assert!(out.skipped_iterations.is_empty());
    assert!(out.loss_scales.iter().all(|&(_, s)| s == 1.0));
}

#[test]
fn the_fp16_curve_ends_within_two_percent_of_fp32() {
    check_curve_against_fp32(Precision::Fp16);
}

/// Megatron's `DynamicGradScaler.update`, written again from its source: the reference the
/// training loop's scale sequence is checked against.
struct ReferenceScaler {
    scale: f64,
    growth_tracker: u64,
    hysteresis_tracker: i64,
}

impl ReferenceScaler {
    fn update(&mut self, found_inf: bool, min_scale: f64, window: u64, hysteresis: u64) {
        if found_inf {
            self.growth_tracker = 0;
            self.hysteresis_tracker -= 1;
            if self.hysteresis_tracker <= 0 {
                self.scale = f64::max(self.scale / 2.0, min_scale);
            }
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == window {
                self.growth_tracker = 0;
                self.hysteresis_tracker = hysteresis as i64;
                self.scale *= 2.0;
            }
        }
    }
}

#[test]
fn fp16_overflows_are_skipped_and_the_scale_follows_megatrons_rule() {
    let cache = tempfile::tempdir().unwrap();
    let save = tempfile::tempdir().unwrap();
    let (window, hysteresis) = (4, 2);
    let iters = 40;
    let mut cfg = config(cache.path(), Precision::Fp16, iters);
    // 2³² times a loss gradient overflows fp16 (max 65504) at once: the run must skip
    // iterations and back off until the scaled gradients fit, then grow again.
    cfg.dynamic_loss_scale = DynamicGradScalerConfig {
        initial_scale: 2f64.powi(32),
        min_scale: 1.0,
        growth_interval: window,
        hysteresis,
        ..Default::default()
    };
    cfg.save = Some(save.path().to_path_buf());
    let out = pretrain(&cfg, &device()).unwrap();

    assert_eq!(
        out.skipped_iterations.first(),
        Some(&1),
        "2^32 must overflow"
    );
    let mut reference = ReferenceScaler {
        scale: 2f64.powi(32),
        growth_tracker: 0,
        hysteresis_tracker: hysteresis as i64,
    };
    let (mut backed_off, mut grew) = (false, false);
    for &(iteration, scale) in &out.loss_scales {
        let before = reference.scale;
        reference.update(
            out.skipped_iterations.contains(&iteration),
            1.0,
            window,
            hysteresis,
        );
        assert_eq!(
            scale, reference.scale,
            "loss scale after iteration {iteration}"
        );
        backed_off |= reference.scale < before;
        grew |= reference.scale > before;
    }
    // The first overflow only uses up hysteresis; the second halves the scale.
    assert_eq!(out.loss_scales[0].1, 2f64.powi(32));
    assert_eq!(out.loss_scales[1].1, 2f64.powi(31));
    assert!(backed_off && grew, "scales: {:?}", out.loss_scales);
    // It settles: most of the later iterations update the weights.
    let late = out
        .skipped_iterations
        .iter()
        .filter(|&&i| i > iters / 2)
        .count();
    assert!(
        late < iters as usize / 4,
        "skipped: {:?}",
        out.skipped_iterations
    );
    // Clean iterations have finite losses and the run learns.
    let clean: Vec<f64> = out
        .losses
        .iter()
        .filter(|(i, _)| !out.skipped_iterations.contains(i))
        .map(|&(_, l)| l)
        .collect();
    assert!(clean.iter().all(|l| l.is_finite()));
    assert!(clean.last().unwrap() < &(clean[0] - 0.2), "{clean:?}");

    // Skipped iterations took no optimizer step; the checkpoint says how many there were
    // and keeps the scaler's state.
    let checkpoint = read_full_checkpoint(save.path()).unwrap().unwrap();
    let skipped = out.skipped_iterations.len() as u64;
    assert_eq!(checkpoint.info.optimizer_steps, iters - skipped);
    assert_eq!(checkpoint.info.state.skipped_iterations, skipped);
    let state = checkpoint.info.grad_scaler.expect("scaler state");
    assert_eq!(state.scale, reference.scale);
    assert_eq!(state.growth_tracker, reference.growth_tracker);
    assert_eq!(state.hysteresis_tracker, reference.hysteresis_tracker);

    // The checkpoint holds the fp32 main weights: export-hf reads it as any other, and the
    // exported embedding is the main weights' (first 50257 rows), not a rounded copy.
    let out = run_tool(
        env!("CARGO_BIN_EXE_export-hf"),
        &["--load", save.path().to_str().unwrap(), "--output", "hf"],
        save.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let (hf, _) =
        ferrotron::checkpoint::tensor_file::read_tensors(&save.path().join("hf/model.safetensors"))
            .unwrap();
    let main = &checkpoint.tensors["model.word_embeddings.weight"];
    assert_eq!(
        hf["transformer.wte.weight"].values[..],
        main.values[..50257 * 32]
    );
}

#[test]
fn fp16_resume_continues_bit_exactly_across_skipped_iterations() {
    let cache = tempfile::tempdir().unwrap();
    let save = tempfile::tempdir().unwrap();
    let iters = 16;
    let mut cfg = config(cache.path(), Precision::Fp16, iters);
    cfg.dynamic_loss_scale.growth_interval = 3;
    let whole = pretrain(&cfg, &device()).unwrap();
    // Stop while the scaler is still backing off, so its state matters.
    let stop = whole.skipped_iterations[whole.skipped_iterations.len() / 2];
    let mut first = cfg.clone();
    first.save = Some(save.path().to_path_buf());
    first.exit_interval = Some(stop);
    pretrain(&first, &device()).unwrap();
    let mut second = cfg.clone();
    second.load = Some(save.path().to_path_buf());
    let resumed = pretrain(&second, &device()).unwrap();
    assert_eq!(resumed.losses[..], whole.losses[stop as usize..]);
    assert_eq!(resumed.loss_scales[..], whole.loss_scales[stop as usize..]);
}

#[test]
fn the_working_copy_computes_in_half_precision_and_its_gradients_are_summed_in_fp32() {
    use burn::tensor::{DType, Int, Tensor, TensorData};
    use ferrotron::training::GradientAccumulator;
    let model = GptConfig::new(1, 16, 2, 8, 128).init(7, &device()).unwrap();
    for (precision, dtype) in [
        (Precision::Bf16, DType::BF16),
        (Precision::Fp16, DType::F16),
    ] {
        let copy = precision.working_copy(&model);
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 5, 9, 3], [1, 4]), &device());
        let logits = copy.forward(tokens.clone());
        assert_eq!(logits.dtype(), dtype, "{precision:?} logits");
        let labels =
            Tensor::<2, Int>::from_data(TensorData::new(vec![5i64, 9, 3, 2], [1, 4]), &device());
        let mask = Tensor::<2>::ones([1, 4], &device());
        let loss = copy.lm_loss(tokens, labels, mask);
        // The cross-entropy runs in fp32 on the upcast logits.
        assert_eq!(loss.dtype(), DType::F32);
        let mut grads = GradientAccumulator::default();
        grads.add(&copy, loss.backward());
        let first = grads.order()[0];
        assert_eq!(grads.get(&first).unwrap().dtype(), DType::F32);
        assert!(grads.all_finite());
        // The main weights are untouched fp32.
        let main_ids: Vec<_> = ferrotron::model::named_parameters::parameter_names(&model)
            .into_iter()
            .map(|p| p.id)
            .collect();
        assert!(grads.order().iter().all(|id| main_ids.contains(id)));
    }
}

/// Half precision under the parallel layouts, against the single-process run in the same
/// precision: data parallelism (2 thread ranks) with fp16 and its loss scaler changes only the
/// order of the fp32 gradient sums; tensor parallelism (2 ranks) with bf16 also rounds the
/// partial sums of the row-parallel layers to bf16 before adding them, so its tolerance is
/// bf16's.
#[test]
fn half_precision_layouts_reproduce_the_single_process_losses() {
    use ferrotron::comm::run_ranks;
    use ferrotron::training::pretrain::pretrain_on;
    let cache = tempfile::tempdir().unwrap();
    let iters = 20;
    let mut fp16 = config(cache.path(), Precision::Fp16, iters);
    fp16.dynamic_loss_scale.initial_scale = 2f64.powi(16);
    fp16.dynamic_loss_scale.growth_interval = 5;
    let single = pretrain(&fp16, &device()).unwrap();
    let dp = run_ranks(2, |world| pretrain_on(&fp16, &device(), world)).unwrap();
    for out in &dp {
        let worst = worst_relative(&out.losses, &single.losses);
        assert!(worst < 1e-5, "fp16 DP=2: {worst}");
        assert_eq!(out.skipped_iterations, single.skipped_iterations);
        assert_eq!(out.loss_scales, single.loss_scales);
    }

    let mut bf16 = fp16.clone();
    bf16.precision = Precision::Bf16;
    let single = pretrain(&bf16, &device()).unwrap();
    bf16.parallel.tensor_model_parallel_size = 2;
    let tp = pretrain(&bf16, &device()).unwrap();
    let worst = worst_relative(&tp.losses, &single.losses);
    assert!(worst < 1e-2, "bf16 TP=2: {worst}");
}

/// Recomputation in half precision is the same run too: the recomputed pieces' gradients are
/// summed in the model's dtype within a micro-batch (as autodiff sums the tied embedding's
/// two uses) before joining the fp32 sums, so losses stay bitwise equal.
#[test]
fn half_precision_recomputation_gives_the_losses_of_keeping_activations() {
    use ferrotron::model::Recompute;
    let cache = tempfile::tempdir().unwrap();
    for precision in [Precision::Bf16, Precision::Fp16] {
        let mut cfg = config(cache.path(), precision, 12);
        cfg.dynamic_loss_scale.initial_scale = 2f64.powi(20);
        let kept = pretrain(&cfg, &device()).unwrap();
        for recompute in [Recompute::Uniform(1), Recompute::Selective] {
            cfg.recompute = recompute;
            let run = pretrain(&cfg, &device()).unwrap();
            assert_eq!(run.losses, kept.losses, "{precision:?}, {recompute:?}");
            assert_eq!(run.skipped_iterations, kept.skipped_iterations);
        }
    }
}
