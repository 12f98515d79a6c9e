//! Pipeline parallelism against the single-process run (the one-stage model), on thread
//! ranks in every `cargo test`, and two of the layouts on MPI processes (the test binary
//! under `mpirun`):
//!
//! - PP=2, PP=4, PP=2 × DP=2 (PyTorch's Pipe + DDP tutorial layout), TP=2 × PP=2 and (on
//!   8 threads) TP=2 × PP=2 × DP=2, with 1F1B
//!   and with the interleaved schedule (2 virtual stages per rank), with dropout, the
//!   distributed optimizer, every recomputation (full uniform and block, selective) and
//!   `--overlap-grad-reduce` in some of them, and with an uneven split
//!   (`--decoder-last-pipeline-num-layers`): 20 iterations within 1e-5;
//! - checkpoints written at PP=2 resume at PP=1 and the reverse, losses continuing;
//! - the measured idle time of each stage, and the layout line.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use ferrotron::comm::{run_ranks, Communicator};
use ferrotron::model::Recompute;
use ferrotron::training::pretrain::{pretrain_on, PretrainOutcome};
use ferrotron::training::{pretrain, ParallelConfig, PretrainConfig};

use crate::common::mpi::*;
use crate::common::*;

type Losses = Vec<(u64, f64)>;

const ITERS: u64 = 20;

/// One parallel layout of the model.
#[derive(Clone, Copy, Debug)]
struct Layout {
    tp: usize,
    pp: usize,
    /// Layers per virtual pipeline stage (interleaved schedule).
    virtual_layers: Option<usize>,
    distributed_optimizer: bool,
    recompute: Recompute,
    /// `--overlap-grad-reduce`.
    overlap_grad_reduce: bool,
    /// Layers on the last stage (`--decoder-last-pipeline-num-layers`).
    last_stage_layers: Option<usize>,
    /// Layers of the model (4, or 8 for PP=4 with 2 virtual stages).
    layers: usize,
}

impl Layout {
    const fn pipeline(tp: usize, pp: usize, virtual_layers: Option<usize>) -> Self {
        Self {
            tp,
            pp,
            virtual_layers,
            distributed_optimizer: false,
            recompute: Recompute::None,
            overlap_grad_reduce: false,
            last_stage_layers: None,
            layers: 4,
        }
    }

    const fn recomputing(self, recompute: Recompute) -> Self {
        Self { recompute, ..self }
    }

    const fn overlapping(self) -> Self {
        Self {
            overlap_grad_reduce: true,
            ..self
        }
    }

    fn name(&self, world: usize) -> String {
        format!(
            "TP={} × PP={} × DP={}{}{}{}{}{}{}",
            self.tp,
            self.pp,
            world / (self.tp * self.pp),
            match self.virtual_layers {
                Some(n) => format!(", interleaved ({n} layer per virtual stage)"),
                None => String::new(),
            },
            if self.distributed_optimizer {
                ", distributed optimizer"
            } else {
                ""
            },
            match self.recompute {
                Recompute::None => String::new(),
                r => format!(", recompute {r:?}"),
            },
            if self.overlap_grad_reduce {
                ", overlap-grad-reduce"
            } else {
                ""
            },
            if self.layers != 4 {
                format!(", {} layers", self.layers)
            } else {
                String::new()
            },
            match self.last_stage_layers {
                Some(n) => format!(", {n} layer(s) on the last stage"),
                None => String::new(),
            }
        )
    }
}

/// Layouts of a 2-rank world.
const TWO_RANKS: [Layout; 5] = [
    Layout::pipeline(1, 2, None),
    Layout::pipeline(1, 2, Some(1)),
    Layout {
        last_stage_layers: Some(1),
        ..Layout::pipeline(1, 2, None)
    },
    Layout::pipeline(1, 2, None).recomputing(Recompute::Selective),
    Layout::pipeline(1, 2, Some(1)).recomputing(Recompute::Block(1)),
];

/// The layouts the MPI test runs too, on 4 processes: every layout runs on threads already,
/// so MPI needs only the traffic threads do not carry over process boundaries: pipeline
/// point-to-point with data-parallel reduction (PP=2 × DP=2), and with tensor-parallel
/// collectives under the interleaved schedule (TP=2 × PP=2, 2 virtual stages).
const MPI_LAYOUTS: [Layout; 2] = [FOUR_RANKS[1], FOUR_RANKS[4]];

/// Layouts of a 4-rank world.
const FOUR_RANKS: [Layout; 9] = [
    Layout::pipeline(1, 4, None),
    Layout::pipeline(1, 2, None),
    Layout::pipeline(2, 2, None),
    Layout::pipeline(1, 2, Some(1)),
    Layout::pipeline(2, 2, Some(1)),
    Layout {
        distributed_optimizer: true,
        ..Layout::pipeline(1, 2, None).recomputing(Recompute::Uniform(1))
    },
    Layout {
        layers: 8,
        ..Layout::pipeline(1, 4, Some(1))
    },
    // PP=2 × DP=2: the data-parallel reduction overlapped with each chunk's last backward,
    // with selective recomputation, and interleaved.
    Layout::pipeline(1, 2, None)
        .recomputing(Recompute::Selective)
        .overlapping(),
    Layout::pipeline(1, 2, Some(1)).overlapping(),
];

/// Layouts of an 8-rank world: TP=2 × PP=2 × DP=2, with 1F1B and interleaved.
const EIGHT_RANKS: [Layout; 2] = [
    Layout::pipeline(2, 2, None),
    Layout::pipeline(2, 2, Some(1)),
];

fn config(cache: &Path, layout: Layout, train_iters: u64) -> PretrainConfig {
    // 4 layers: 1 per stage at PP=4, 1 per virtual stage at PP=2 × 2 (8 for PP=4 × 2 virtual
    // stages, against an 8-layer one-stage run). Hidden dropout draws each layer's own masks,
    // wherever the layer runs.
    let base = layout_comparison_run(cache, layout.layers, train_iters, ITERS);
    PretrainConfig {
        recompute: layout.recompute,
        parallel: ParallelConfig {
            tensor_model_parallel_size: layout.tp,
            pipeline_model_parallel_size: layout.pp,
            num_layers_per_virtual_pipeline_stage: layout.virtual_layers,
            decoder_last_pipeline_num_layers: layout.last_stage_layers,
            use_distributed_optimizer: layout.distributed_optimizer,
            overlap_grad_reduce: layout.overlap_grad_reduce,
            ..base.parallel
        },
        ..base
    }
}

fn device() -> Device {
    Device::flex().autodiff()
}

/// What a layout's run gives: training losses, validation losses, per-iteration idle
/// fractions of the stages.
type Run = (Losses, Losses, Vec<Vec<f64>>);

fn summary(out: PretrainOutcome) -> Run {
    (out.losses, out.validation, out.pipeline_idle_fractions)
}

fn layout_runs(
    cache: &Path,
    layouts: &[Layout],
    world: Arc<dyn Communicator>,
) -> anyhow::Result<Vec<Run>> {
    layouts
        .iter()
        .map(|&layout| {
            Ok(summary(pretrain_on(
                &config(cache, layout, ITERS),
                &device(),
                world.clone(),
            )?))
        })
        .collect()
}

/// The one-stage runs' losses, by number of layers.
type References = std::collections::HashMap<usize, (Losses, Losses)>;

/// [`references`] computed once for every test of this binary that needs them (the tests run
/// on threads of one process), with their index cache under cargo's temporary directory.
fn shared_references() -> &'static References {
    static REFERENCES: std::sync::OnceLock<References> = std::sync::OnceLock::new();
    REFERENCES.get_or_init(|| {
        references(&Path::new(env!("CARGO_TARGET_TMPDIR")).join("pipeline_references"))
    })
}

fn references(cache: &Path) -> References {
    [4, 8]
        .into_iter()
        .map(|layers| {
            let one = Layout {
                layers,
                ..Layout::pipeline(1, 1, None)
            };
            let out = pretrain(&config(cache, one, ITERS), &device()).unwrap();
            (layers, (out.losses, out.validation))
        })
        .collect()
}

/// Asserts every layout's losses follow the one-stage run's, and that each iteration has an
/// idle fraction per stage.
fn check(references: &References, layouts: &[Layout], runs: &[Run], world: usize, ranks: &str) {
    for reference in references.values() {
        assert_eq!(reference.0.len(), ITERS as usize);
        assert!(
            reference.0[ITERS as usize - 1].1 < reference.0[0].1 - 0.5,
            "loss does not fall: {:?}",
            reference.0
        );
    }
    let mut failures = Vec::new();
    for (layout, (losses, validation, idle)) in layouts.iter().zip(runs) {
        let reference = &references[&layout.layers];
        let worst = worst_relative(losses, &reference.0);
        let worst_valid = worst_relative(validation, &reference.1);
        let mean_idle: Vec<f64> = (0..layout.pp)
            .map(|s| idle.iter().map(|it| it[s]).sum::<f64>() / idle.len() as f64)
            .collect();
        println!(
            "{ranks}, {}: worst relative difference to one stage over {ITERS} iterations: \
             training {worst:.2e}, validation {worst_valid:.2e}; mean idle fraction per stage \
             {mean_idle:.3?}",
            layout.name(world)
        );
        assert_eq!(idle.len(), ITERS as usize);
        assert!(idle
            .iter()
            .all(|it| it.len() == layout.pp && it.iter().all(|f| (0.0..=1.0).contains(f))));
        if worst > 1e-5 || worst_valid > 1e-5 {
            failures.push((layout.name(world), worst, worst_valid));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

/// Runs `layouts` on a world of `ranks` threads and checks them against the one-stage runs;
/// every rank knows the losses (the last stage's, summed over the pipeline).
fn check_on_threads(ranks: usize, layouts: &[Layout]) {
    let dir = tempfile::tempdir().unwrap();
    let reference = shared_references();
    let runs = run_ranks(ranks, |world| layout_runs(dir.path(), layouts, world)).unwrap();
    check(
        reference,
        layouts,
        &runs[0],
        ranks,
        &format!("{ranks} threads"),
    );
    assert!(runs.iter().all(|r| r
        .iter()
        .zip(&runs[0])
        .all(|(a, b)| a.0 == b.0 && a.1 == b.1)));
}

// One test per world size, so that the test threads share them out.
#[test]
fn pipeline_stages_on_two_threads_reproduce_the_one_stage_losses() {
    check_on_threads(2, &TWO_RANKS);
}

#[test]
fn pipeline_stages_on_four_threads_reproduce_the_one_stage_losses() {
    check_on_threads(4, &FOUR_RANKS);
}

/// 3-D: tensor × pipeline × data parallelism on 8 ranks.
#[test]
fn pipeline_stages_on_eight_threads_reproduce_the_one_stage_losses() {
    check_on_threads(8, &EIGHT_RANKS);
}

/// A checkpoint written at PP=2 resumes at PP=1, and one written at PP=1 resumes at PP=2
/// (interleaved), the losses continuing as the uninterrupted run's.
#[test]
fn checkpoints_move_between_pipeline_layouts() {
    let (save_at, iters) = (4, 8);
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let one = Layout::pipeline(1, 1, None);
    let full = pretrain(&config(&cache, one, iters), &device())
        .unwrap()
        .losses;
    let tail = full[save_at as usize..].to_vec();
    let mut worst = Vec::new();
    for (from, to, name) in [
        (Layout::pipeline(1, 2, None), one, "PP=2 → PP=1"),
        (
            one,
            Layout::pipeline(1, 2, Some(1)),
            "PP=1 → PP=2 interleaved",
        ),
        (
            Layout::pipeline(2, 2, None),
            Layout::pipeline(1, 4, None),
            "TP=2×PP=2 → PP=4",
        ),
    ] {
        let save = dir.path().join(name.replace(' ', "_"));
        let first = PretrainConfig {
            save: Some(save.clone()),
            exit_interval: Some(save_at),
            ..config(&cache, from, iters)
        };
        pretrain(&first, &device()).unwrap();
        if from.pp > 1 {
            // Megatron's file names: mp_rank_TT_PPP.
            let files = list_dir(&save.join("iter_0000004"));
            let expected: Vec<String> = (0..from.pp)
                .flat_map(|p| (0..from.tp).map(move |t| format!("mp_rank_{t:02}_{p:03}")))
                .collect();
            let mut expected = expected;
            expected.sort();
            assert_eq!(files, expected);
            // Each iteration's line in metrics.jsonl has every stage's idle share.
            let metrics = std::fs::read_to_string(save.join("metrics.jsonl")).unwrap();
            let first: serde_json::Value =
                serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
            let idle = first["pipeline_idle_fraction"].as_array().unwrap();
            assert_eq!(idle.len(), from.pp);
        }
        let resumed = PretrainConfig {
            load: Some(save),
            ..config(&cache, to, iters)
        };
        let losses = pretrain(&resumed, &device()).unwrap().losses;
        let w = worst_relative(&losses, &tail);
        println!("{name}: resumed losses vs the uninterrupted run: {w:.2e}");
        worst.push((name, w));
    }
    assert!(worst.iter().all(|(_, w)| *w < 1e-5), "{worst:?}");
}

/// Megatron's refusals, in one line each.
#[test]
fn impossible_pipeline_layouts_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path();
    let err = |layout: Layout, global: usize| {
        let cfg = PretrainConfig {
            global_batch_size: global,
            ..config(cache, layout, 2)
        };
        format!("{:#}", pretrain(&cfg, &device()).unwrap_err())
    };
    let three = err(Layout::pipeline(1, 3, None), 8);
    assert!(three.contains("--num-layers 4 is not divisible"), "{three}");
    let virtual_layers = err(Layout::pipeline(1, 2, Some(3)), 8);
    assert!(
        virtual_layers.contains("--num-layers-per-virtual-pipeline-stage 3"),
        "{virtual_layers}"
    );
    let few = err(Layout::pipeline(1, 2, Some(1)), 3);
    assert!(
        few.contains("interleaved schedule needs a multiple"),
        "{few}"
    );
}

// ---------------------------------------------------------------------------------------
// MPI: the test binary runs itself under mpirun.

#[test]
fn mpi_pipeline_stages_reproduce_the_one_stage_losses() {
    if let Some(world) = mpi_rank() {
        let dir = dir_from_env();
        let runs = layout_runs(&dir.join("cache"), &MPI_LAYOUTS, world.comm()).unwrap();
        if world.rank() == 0 {
            let file = dir.join(format!("runs{}.json", world.size()));
            std::fs::write(file, serde_json::to_string(&runs).unwrap()).unwrap();
        }
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (ok, out) = mpirun(
        4,
        &[("FERROTRON_TEST_DIR", dir.path())],
        Duration::from_secs(900),
    );
    assert!(ok, "{out}");
    assert!(
        out.contains("using world size: 4, data-parallel size: 1, context-parallel size: 1, hierarchical context-parallel sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 2"),
        "{out}"
    );
    let file = dir.path().join("runs4.json");
    let runs: Vec<Run> = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    check(shared_references(), &MPI_LAYOUTS, &runs, 4, "4 MPI ranks");
}

/// fp16 (dynamic loss scale) and bf16 through pipeline stages: half-precision activations
/// and gradients cross the stages, and the overflow check and loss scale are shared by all
/// of them, so the skipped iterations and scales are the one-stage run's and the losses
/// follow it.
#[test]
fn half_precision_pipelines_follow_the_one_stage_run() {
    use ferrotron::optim::Precision;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path();
    let half = |layout: Layout, precision: Precision| PretrainConfig {
        precision,
        dynamic_loss_scale: ferrotron::optim::grad_scaler::DynamicGradScalerConfig {
            // From 2^20, the first iterations overflow and are skipped.
            initial_scale: 2f64.powi(20),
            ..Default::default()
        },
        ..config(cache, layout, 10)
    };
    let mut failures = Vec::new();
    for precision in [Precision::Fp16, Precision::Bf16] {
        let one = pretrain(&half(Layout::pipeline(1, 1, None), precision), &device()).unwrap();
        for layout in [
            Layout::pipeline(1, 2, None),
            Layout::pipeline(1, 2, Some(1)),
        ] {
            let out = pretrain(&half(layout, precision), &device()).unwrap();
            assert_eq!(out.skipped_iterations, one.skipped_iterations);
            assert_eq!(out.loss_scales, one.loss_scales);
            let worst = worst_relative(&out.losses, &one.losses);
            println!(
                "{}, {}: skipped {:?}, worst relative difference to one stage {worst:.2e}",
                precision.name(),
                layout.name(2),
                out.skipped_iterations
            );
            if worst > 1e-4 {
                failures.push((precision.name(), layout.name(2), worst));
            }
        }
        if precision == Precision::Fp16 {
            assert!(
                !one.skipped_iterations.is_empty(),
                "2^20 should overflow in fp16"
            );
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}
