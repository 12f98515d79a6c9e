//! The layout fuzzer (`ferrotron::training::layout_fuzz`) in CI: a few generated cases of a
//! fixed seed on thread ranks, each held to the single-process run, and the fuzzer's own
//! oracle held to a fault it must find. The long run is `cargo run --release --example
//! layout_fuzz -- --cases 200` (docs/testing.md).

use ferrotron::optim::LrSchedule;
use ferrotron::training::layout_fuzz::{
    compare, first_weight_difference, generate, FuzzCase, Observation, Ranks, Tolerance,
};
use ferrotron::training::PretrainConfig;

use crate::common::*;

/// The CI sample's seed and size: its cases cover tensor, pipeline (virtual stages among
/// them) and data parallelism, sequence parallelism, the distributed optimizer, each
/// precision, recomputation, packed documents, a sliding window and context parallelism (the
/// parallelisms, the packing, the window and CP checked below, so a generator change that
/// loses one fails).
const CI_SEED: u64 = 2026;
const CI_CASES: usize = 6;

fn cases(seed: u64, count: usize, cache: &std::path::Path) -> Vec<FuzzCase> {
    generate(
        seed,
        0,
        count,
        None,
        &golden("wikitext2_valid", "text"),
        cache,
    )
    .unwrap()
    .0
}

#[test]
fn a_seeded_sample_of_generated_layouts_reproduces_the_single_process() {
    let dir = tempfile::tempdir().unwrap();
    let cases = cases(CI_SEED, CI_CASES, &dir.path().join("cache"));
    for case in &cases {
        println!("case {}: {}", case.index, case.describe());
    }
    let any = |f: &dyn Fn(&PretrainConfig, usize) -> bool| {
        cases.iter().any(|c| f(&c.config, c.data_parallel))
    };
    assert!(any(&|c, _| c.parallel.tensor_model_parallel_size > 1));
    assert!(any(&|c, _| c.parallel.pipeline_model_parallel_size > 1));
    assert!(any(&|_, dp| dp > 1));
    assert!(any(
        &|c, _| c.model.reset_attention_mask && c.parallel.tensor_model_parallel_size > 1
    ));
    assert!(any(
        &|c, _| c.model.reset_position_ids && c.parallel.pipeline_model_parallel_size > 1
    ));
    assert!(any(&|c, _| c.model.window_size.is_some()
        && c.parallel.pipeline_model_parallel_size > 1
        && c.parallel.context_parallel_size > 1));
    assert!(any(
        &|c, _| c.parallel.context_parallel_size == 4 && c.parallel.use_distributed_optimizer
    ));
    assert_cases_reproduce_one_process(&cases, dir.path());
}

/// The oracle finds what it is for: a "layout" whose learning rate is 1 % off trains from the
/// same weights, so its first loss is the single process's, its second is not, and every
/// weight differs after the first step — the fuzzer must say iteration 2 for the loss and
/// iteration 1 for the first weight in the model's order.
#[test]
fn the_fuzzer_names_the_first_iteration_and_weight_a_wrong_run_leaves_at() {
    let dir = tempfile::tempdir().unwrap();
    let case = cases(CI_SEED, 1, &dir.path().join("cache")).remove(0);
    let single = PretrainConfig {
        save: Some(dir.path().join("single")),
        save_interval: Some(1),
        ..case.single_process()
    };
    let wrong = PretrainConfig {
        save: Some(dir.path().join("wrong")),
        schedule: LrSchedule {
            max_lr: single.schedule.max_lr * 1.01,
            ..single.schedule
        },
        ..single.clone()
    };
    let tol = Tolerance::for_run(&case.config);
    let found = first_weight_difference(&wrong, 1, &single, &Ranks::Threads, tol)
        .unwrap()
        .expect("the weights differ");
    assert_eq!(found.iteration, 1, "{found}");
    let first_weight = ferrotron::model::named_parameters::named_parameters(
        &single.model.init(1, &burn::tensor::Device::flex()).unwrap(),
    )
    .remove(0)
    .name;
    assert_eq!(found.what, first_weight, "{found}");

    let observe = |cfg: &PretrainConfig| {
        let cfg = PretrainConfig {
            save: None,
            save_interval: None,
            ..cfg.clone()
        };
        let out =
            ferrotron::training::pretrain(&cfg, &burn::tensor::Device::flex().autodiff()).unwrap();
        Observation {
            losses: out.losses,
            grad_norms: out.grad_norms,
            validation: out.validation,
            skipped: out.skipped_iterations,
            updates: Vec::new(),
        }
    };
    let (got, want) = (observe(&wrong), observe(&single));
    assert_eq!(got.losses[0], want.losses[0], "the same first step");
    let difference = compare(&got, &want, &single.model, tol).unwrap_err();
    assert_eq!(
        (difference.iteration, difference.what.as_str()),
        (2, "loss"),
        "{difference}"
    );
}
