//! Multi-rank training against the single-process run, on both kinds of ranks:
//!
//! - thread worlds (`run_ranks`), in every `cargo test`;
//! - MPI processes: the test binary starts itself under `mpirun -np 4` (Open MPI, see docs/parallelism.md)
//!   and each process, finding itself launched by MPI, runs as one rank.
//!
//! Layouts: TP=2 × DP=2 and DP=4, with the replicated and the distributed (ZeRO-1) optimizer,
//! dropout on; checkpoints written at one layout resume at another; the collective
//! conformance suite on MPI; a rank killed mid-training ends the job.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::Device;
use ferrotron::comm::{run_ranks, Communicator};
use ferrotron::model::Recompute;
use ferrotron::training::pretrain::pretrain_on;
use ferrotron::training::{pretrain, ParallelConfig, PretrainConfig};

use crate::common::mpi::*;
use crate::common::*;

type Losses = Vec<(u64, f64)>;

const ITERS: u64 = 20;

/// One layout of a 4-rank world.
#[derive(Clone, Copy)]
struct Layout {
    tp: usize,
    distributed_optimizer: bool,
    overlap_grad_reduce: bool,
    recompute: Recompute,
}

const fn layout(tp: usize, distributed_optimizer: bool) -> Layout {
    Layout {
        tp,
        distributed_optimizer,
        overlap_grad_reduce: false,
        recompute: Recompute::None,
    }
}

const fn overlapped(tp: usize, recompute: Recompute) -> Layout {
    Layout {
        overlap_grad_reduce: true,
        recompute,
        ..layout(tp, false)
    }
}

/// The layouts checked on a 4-rank world. The last three all-reduce the gradients during the
/// backward pass, the last with full recomputation of single layers (the backward pass then
/// runs in recomputed pieces).
const LAYOUTS: [Layout; 7] = [
    layout(2, false),
    layout(2, true),
    layout(1, false),
    layout(1, true),
    overlapped(2, Recompute::None),
    overlapped(1, Recompute::None),
    overlapped(1, Recompute::Uniform(1)),
];

/// The layouts the MPI test runs too: every layout runs on threads already, so processes need
/// only the traffic threads do not carry over a process boundary: tensor-parallel collectives
/// with the distributed optimizer's reduce-scatter and all-gather (at DP=2 and DP=4), and the
/// data-parallel all-reduce from a background thread while tensor-parallel collectives run.
const MPI_LAYOUTS: [Layout; 3] = [LAYOUTS[1], LAYOUTS[3], LAYOUTS[4]];

fn config(cache: &Path, layout: Layout, train_iters: u64) -> PretrainConfig {
    let base = layout_comparison_run(cache, 2, train_iters, ITERS);
    PretrainConfig {
        recompute: layout.recompute,
        parallel: ParallelConfig {
            tensor_model_parallel_size: layout.tp,
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

fn name(layout: Layout) -> String {
    format!(
        "TP={} × DP={}{}{}{}",
        layout.tp,
        4 / layout.tp,
        if layout.distributed_optimizer {
            ", distributed optimizer"
        } else {
            ""
        },
        if layout.overlap_grad_reduce {
            ", overlapped gradient all-reduce"
        } else {
            ""
        },
        if layout.recompute != Recompute::None {
            ", recomputation"
        } else {
            ""
        }
    )
}

/// Every layout's training and validation losses, on this rank of a 4-rank `world`; checks
/// that each data-parallel step reported the time it waited for the gradient sums.
fn layout_runs(
    cache: &Path,
    layouts: &[Layout],
    world: Arc<dyn Communicator>,
) -> anyhow::Result<Vec<(Losses, Losses)>> {
    layouts
        .iter()
        .map(|&layout| {
            let out = pretrain_on(&config(cache, layout, ITERS), &device(), world.clone())?;
            if !layout.distributed_optimizer {
                anyhow::ensure!(
                    out.grad_reduce_exposed_seconds.len() == ITERS as usize,
                    "{}: {} gradient reductions timed",
                    name(layout),
                    out.grad_reduce_exposed_seconds.len()
                );
            }
            Ok((out.losses, out.validation))
        })
        .collect()
}

/// Asserts every layout's losses follow the single-process run's.
fn check_layouts(
    reference: &(Losses, Losses),
    layouts: &[Layout],
    runs: &[(Losses, Losses)],
    ranks: &str,
) {
    assert_eq!(reference.0.len(), ITERS as usize);
    assert_eq!(runs.len(), layouts.len());
    assert!(
        reference.0[ITERS as usize - 1].1 < reference.0[0].1 - 0.5,
        "loss does not fall: {:?}",
        reference.0
    );
    let mut failures = Vec::new();
    for (&layout, (losses, validation)) in layouts.iter().zip(runs) {
        let worst = worst_relative(losses, &reference.0);
        let worst_valid = worst_relative(validation, &reference.1);
        println!(
            "{ranks}, {}: worst relative difference to the single process over {ITERS} iterations: \
             training {worst:.2e}, validation {worst_valid:.2e}",
            name(layout)
        );
        // Only the order of float sums differs (gradients over ranks, matmuls cut by TP).
        if !(worst < 1e-5 && worst_valid < 1e-5) {
            failures.push(format!("{}: {worst} / {worst_valid}", name(layout)));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

/// The single-process run's training and validation losses, computed once for every test
/// of this binary (they run on threads of one process), its index cache under cargo's
/// temporary directory.
fn reference() -> &'static (Losses, Losses) {
    static REFERENCE: std::sync::OnceLock<(Losses, Losses)> = std::sync::OnceLock::new();
    REFERENCE.get_or_init(|| {
        let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("data_parallel_reference");
        let out = pretrain(&config(&cache, layout(1, false), ITERS), &device()).unwrap();
        (out.losses, out.validation)
    })
}

#[test]
fn thread_ranks_reproduce_the_single_process_losses() {
    let dir = tempfile::tempdir().unwrap();
    let runs = run_ranks(4, |world| layout_runs(dir.path(), &LAYOUTS, world)).unwrap();
    check_layouts(reference(), &LAYOUTS, &runs[0], "4 threads");
    // Every rank reports the same losses.
    assert!(runs.iter().all(|r| r == &runs[0]));
    // Threads sum in rank order, whatever the buckets: all-reducing during the backward pass
    // (in other buckets, in pieces, recomputed or not) gives exactly the losses of reducing
    // after it.
    let runs = &runs[0];
    assert_eq!(
        runs[4], runs[0],
        "TP=2: overlapped vs after the backward pass"
    );
    assert_eq!(
        runs[5], runs[2],
        "TP=1: overlapped vs after the backward pass"
    );
    assert_eq!(runs[6], runs[2], "TP=1: overlapped with recomputation");
}

/// `--log-num-zeros-in-grad` counts the zero elements of the summed gradients, each parameter
/// once. With an untied output layer the embedding rows of the tokens a batch lacks are
/// exactly zero whatever the order of the sums, so every layout must count what the single
/// process counts: the distributed optimizer on its shards after the reduce-scatter, TP=2 on
/// its shards with the replicated norms counted once. Without linear biases: the key biases'
/// gradient is zero in exact arithmetic and float noise otherwise, so whether one of its
/// elements comes out exactly zero depends on the order of the sums (and so on the CPU:
/// benchmarks/results/2026-12-03-figures-from-comments.md).
#[test]
fn every_layout_counts_the_zero_gradient_elements_of_the_single_process() {
    let dir = tempfile::tempdir().unwrap();
    let counting = |layout: Layout| {
        let mut c = config(dir.path(), layout, 3);
        c.model.untie_embeddings_and_output_weights = true;
        c.model.add_bias_linear = false;
        c.log_options.num_zeros_in_grad = true;
        c
    };
    let reference = pretrain(&counting(layout(1, false)), &device())
        .unwrap()
        .num_zeros_in_grad;
    assert_eq!(reference.len(), 3, "{reference:?}");
    // Most of the 50,304 embedding rows (32 wide) are absent from a batch of 128 tokens.
    assert!(
        reference.iter().all(|&(_, z)| z > 1_000_000),
        "{reference:?}"
    );
    let layouts = [
        layout(1, false),
        layout(1, true),
        layout(2, false),
        layout(2, true),
    ];
    let runs = run_ranks(4, |world| {
        layouts
            .iter()
            .map(|&l| Ok(pretrain_on(&counting(l), &device(), world.clone())?.num_zeros_in_grad))
            .collect::<anyhow::Result<Vec<_>>>()
    })
    .unwrap();
    for (&l, zeros) in layouts.iter().zip(&runs[0]) {
        assert_eq!(zeros, &reference, "{}", name(l));
    }
    assert!(
        runs.iter().all(|r| r == &runs[0]),
        "every rank logs the same"
    );
}

// ---------------------------------------------------------------------------------------
// MPI: the test binary runs itself under mpirun.

#[test]
fn mpi_collectives_pass_the_conformance_suite() {
    if let Some(world) = mpi_rank() {
        ferrotron::comm::conformance::run_all(world.comm().as_ref())
            .unwrap_or_else(|e| panic!("rank {}: {e:#}", world.rank()));
        return;
    }
    for ranks in [4, 3] {
        let (ok, out) = mpirun(ranks, &[], Duration::from_secs(120));
        assert!(ok, "{ranks} MPI ranks:\n{out}");
    }
}

#[test]
fn mpi_ranks_reproduce_the_single_process_losses() {
    if let Some(world) = mpi_rank() {
        let dir = dir_from_env();
        let runs = layout_runs(&dir.join("cache"), &MPI_LAYOUTS, world.comm()).unwrap();
        if world.rank() == 0 {
            std::fs::write(dir.join("runs.json"), serde_json::to_string(&runs).unwrap()).unwrap();
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
        out.contains("using world size: 4, data-parallel size: 2, context-parallel size: 1, hierarchical context-parallel sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 1"),
        "{out}"
    );
    // The sharded Adam state per rank is 1/DP of the whole (DP = 2 and 4 here).
    let shares: Vec<(f64, f64, f64)> = out
        .lines()
        .filter_map(|l| {
            let rest = l.split("distributed optimizer: Adam state ").nth(1)?;
            let mine: f64 = rest.split(" MB per rank (").next()?.parse().ok()?;
            let rest = rest.split(" MB per rank (").nth(1)?;
            let whole: f64 = rest.split(" MB unsharded").next()?.parse().ok()?;
            let dp: f64 = rest
                .split("data-parallel size ")
                .nth(1)?
                .trim_end_matches(')')
                .parse()
                .ok()?;
            Some((mine, whole, dp))
        })
        .collect();
    assert_eq!(shares.len(), 2, "{out}");
    for (mine, whole, dp) in shares {
        println!("distributed optimizer: {mine} MB of Adam state per rank, {whole} MB unsharded, DP={dp}");
        assert!(
            (mine * dp - whole).abs() <= 0.01 * whole + 0.1,
            "{mine} × {dp} vs {whole}"
        );
    }
    let runs: Vec<(Losses, Losses)> =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("runs.json")).unwrap())
            .unwrap();
    check_layouts(reference(), &MPI_LAYOUTS, &runs, "4 MPI ranks");
}

/// A checkpoint saved by one layout, resumed by another: losses continue as the
/// uninterrupted single-process run's.
#[test]
fn checkpoints_move_between_mpi_layouts_and_a_single_process() {
    let save_at = 4;
    let iters = 8;
    if let Some(world) = mpi_rank() {
        let dir = dir_from_env();
        let cache = dir.join("cache");
        // TP=2 × DP=2 (distributed optimizer) writes a checkpoint at iteration 4 ...
        let first = PretrainConfig {
            save: Some(dir.join("from_mpi")),
            exit_interval: Some(save_at),
            ..config(&cache, layout(2, true), iters)
        };
        pretrain_on(&first, &device(), world.comm()).unwrap();
        // ... and TP=2 × DP=2 resumes the single process's checkpoint.
        let resumed = PretrainConfig {
            load: Some(dir.join("from_single")),
            ..config(&cache, layout(2, false), iters)
        };
        let out = pretrain_on(&resumed, &device(), world.comm()).unwrap();
        if world.rank() == 0 {
            std::fs::write(
                dir.join("resumed.json"),
                serde_json::to_string(&out.losses).unwrap(),
            )
            .unwrap();
        }
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let full = pretrain(&config(&cache, layout(1, false), iters), &device())
        .unwrap()
        .losses;
    let single = PretrainConfig {
        save: Some(dir.path().join("from_single")),
        exit_interval: Some(save_at),
        ..config(&cache, layout(1, false), iters)
    };
    pretrain(&single, &device()).unwrap();
    let (ok, out) = mpirun(
        4,
        &[("FERROTRON_TEST_DIR", dir.path())],
        Duration::from_secs(600),
    );
    assert!(ok, "{out}");
    // Only data-parallel replica 0 writes: one file per tensor-parallel rank.
    assert_eq!(
        list_dir(&dir.path().join("from_mpi/iter_0000004")),
        ["mp_rank_00", "mp_rank_01"]
    );
    let from_mpi = pretrain(
        &PretrainConfig {
            load: Some(dir.path().join("from_mpi")),
            ..config(&cache, layout(1, false), iters)
        },
        &device(),
    )
    .unwrap()
    .losses;
    let resumed: Losses =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("resumed.json")).unwrap())
            .unwrap();
    let tail = full[save_at as usize..].to_vec();
    let a = worst_relative(&from_mpi, &tail);
    let b = worst_relative(&resumed, &tail);
    println!("TP=2×DP=2 checkpoint resumed in one process: {a:.2e}; single-process checkpoint resumed at TP=2×DP=2: {b:.2e}");
    assert!(a < 1e-4 && b < 1e-4, "{a} {b}");
}

/// `kill -9` of one rank mid-training: mpirun ends every rank, exits non-zero, and the last
/// complete checkpoint loads.
#[test]
fn a_killed_mpi_rank_ends_the_job_and_leaves_the_last_checkpoint() {
    if let Some(world) = mpi_rank() {
        let dir = dir_from_env();
        let cfg = PretrainConfig {
            save: Some(dir.join("ckpt")),
            save_interval: Some(2),
            ..config(&dir.join("cache"), layout(2, false), 100_000)
        };
        // Rank 3 kills itself once the checkpoint of iteration 2 exists, noting when.
        if world.rank() == 3 {
            let ckpt = dir.join("ckpt/latest_checkpointed_iteration.txt");
            let note = dir.join("killed_at");
            std::thread::spawn(move || loop {
                if ckpt.exists() {
                    std::fs::write(&note, "").unwrap();
                    // SAFETY: sending a signal to this very process.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                std::thread::sleep(Duration::from_millis(50));
            });
        }
        pretrain_on(&cfg, &device(), world.comm()).unwrap();
        unreachable!("training of 100000 iterations cannot finish");
    }
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let (ok, out) = mpirun(
        4,
        &[("FERROTRON_TEST_DIR", dir.path())],
        Duration::from_secs(300),
    );
    let ended = std::time::SystemTime::now();
    assert!(!ok, "the job should fail:\n{out}");
    let killed = std::fs::metadata(dir.path().join("killed_at"))
        .and_then(|m| m.modified())
        .expect("rank 3 noted its kill");
    let after_kill = ended.duration_since(killed).unwrap_or_default();
    println!(
        "job ended {after_kill:?} after the kill ({:?} after start), non-zero exit",
        start.elapsed()
    );
    assert!(
        after_kill < Duration::from_secs(30),
        "{after_kill:?}\n{out}"
    );
    let ckpt = dir.path().join("ckpt");
    let (_, info) = ferrotron::checkpoint::load_model(&ckpt, &Device::flex()).unwrap();
    assert!(info.state.iteration >= 2 && info.state.iteration % 2 == 0);
}

/// The `pretrain` flags of the tests that run the binary on several ranks: a GPT of hidden
/// size 16 (2 heads, 16 positions), 8 sequences a step, every iteration logged, no
/// evaluation; each test adds its layers, iterations and layout.
const TINY_RANKS_RUN: &[&str] = &[
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "16",
    "--max-position-embeddings",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--log-interval",
    "1",
    "--eval-interval",
    "0",
    "--split",
    "100,0,0",
    "--data-cache-path",
    "cache",
];

/// The `pretrain` binary itself under `mpirun -np 2`: two data-parallel ranks, Megatron's
/// layout line and iteration lines printed once (by rank 0), one checkpoint.
#[test]
fn the_pretrain_binary_runs_under_mpirun() {
    let dir = tempfile::tempdir().unwrap();
    let data = golden("wikitext2_valid", "text");
    let run = |layers: &str, extra: &[&str]| {
        mpirun_command(2)
            .arg(env!("CARGO_BIN_EXE_pretrain"))
            .args(TINY_RANKS_RUN)
            .args(["--num-layers", layers, "--train-iters", "3"])
            .args(["--use-distributed-optimizer", "--DDP-impl", "local"])
            .args(["--save", "ckpt", "--data-path"])
            .arg(&data)
            .args(extra)
            .current_dir(dir.path())
            .output()
            .expect("mpirun (install Open MPI, see docs/parallelism.md)")
    };
    let out = run("1", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", stderr(&out));
    assert_eq!(
        stdout
            .matches("using world size: 2, data-parallel size: 2, context-parallel size: 1, hierarchical context-parallel sizes: None, tensor-model-parallel size: 1, pipeline-model-parallel size: 1")
            .count(),
        1,
        "{stdout}"
    );
    assert_eq!(
        stdout.matches(" iteration        3/       3 |").count(),
        1,
        "{stdout}"
    );
    assert_eq!(
        list_dir(&dir.path().join("ckpt/iter_0000003")),
        ["mp_rank_00"]
    );

    // An error on the ranks (here: loading the checkpoint into a deeper model) ends the job
    // with a non-zero exit and the rank's message, promptly.
    let start = Instant::now();
    let out = run("2", &["--load", "ckpt"]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("pretrain: rank ")
            && err.contains("error: --load ckpt: the checkpoint is a model of 1 layers"),
        "{err}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{:?}",
        start.elapsed()
    );
}

/// Runs `command` (mpirun), sends SIGTERM to one of its ranks once `line` is logged, and
/// returns whether it exited 0 and its whole stdout.
fn signal_one_rank_after(mut command: std::process::Command, line: &str) -> (bool, String) {
    use std::io::{BufRead, BufReader};
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = String::new();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for logged in lines.by_ref() {
        let logged = logged.unwrap();
        stdout += &logged;
        stdout.push('\n');
        if logged.contains(line) {
            let rank = children_of(child.id()).into_iter().next().expect("a rank");
            // SAFETY: sending a signal to a rank process of this test.
            unsafe { libc::kill(rank as i32, libc::SIGTERM) };
            break;
        }
    }
    for logged in lines {
        stdout += &logged.unwrap();
        stdout.push('\n');
    }
    (child.wait().unwrap().success(), stdout)
}

/// `--exit-signal-handler` under `mpirun -np 4` (TP=2 × DP=2): SIGTERM to one rank, as a
/// scheduler's pre-emption notice might reach it, and every rank finishes the iteration,
/// one checkpoint is written, every rank exits 0 (so mpirun does); `--load` then continues
/// the loss curve of the uninterrupted run.
#[test]
fn a_stop_signal_saves_once_on_every_rank_and_the_run_continues() {
    let dir = tempfile::tempdir().unwrap();
    let data = golden("wikitext2_valid", "text");
    let command = |extra: &[&str]| {
        let mut cmd = mpirun_command(4);
        // One layer at TP=2 × DP=2, long enough (200 iterations) that the signal comes first.
        cmd.arg(env!("CARGO_BIN_EXE_pretrain"))
            .args(TINY_RANKS_RUN)
            .args(["--num-layers", "1", "--train-iters", "200"])
            .args([
                "--lr-decay-style",
                "constant",
                "--tensor-model-parallel-size",
                "2",
            ])
            .arg("--data-path")
            .arg(&data)
            .args(extra)
            .current_dir(dir.path());
        cmd
    };
    let reference = command(&["--exit-interval", "12"]).output().unwrap();
    assert!(reference.status.success(), "{}", stderr(&reference));
    let reference = logged_losses(&String::from_utf8_lossy(&reference.stdout));
    assert_eq!(reference.len(), 12);

    // Signal one rank (a child of mpirun) once iteration 2 is logged.
    let stopping = command(&["--exit-signal-handler", "--save", "ckpt"]);
    let (exited_0, stdout) = signal_one_rank_after(stopping, " iteration        2/");
    assert!(exited_0, "{stdout}");
    let stops = stdout.matches("exiting program after receiving a stop signal");
    assert_eq!(stops.count(), 1, "{stdout}");
    let ckpt = dir.path().join("ckpt");
    let saved: u64 = std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!((2..12).contains(&saved), "stopped at {saved}");
    let iterations: Vec<String> = list_dir(&ckpt)
        .into_iter()
        .filter(|n| n.starts_with("iter_"))
        .collect();
    assert_eq!(iterations, [format!("iter_{saved:07}")]);
    assert_eq!(logged_losses(&stdout), reference[..saved as usize]);

    let resumed = command(&["--load", "ckpt", "--exit-interval", "12"])
        .output()
        .unwrap();
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(
        logged_losses(&String::from_utf8_lossy(&resumed.stdout)),
        reference[saved as usize..]
    );
}

/// The processes whose parent is `pid` (the ranks mpirun started).
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|stat| {
                // pid (comm) state ppid ...: the fields after the last ')'.
                stat.rsplit(')')
                    .next()
                    .and_then(|rest| rest.split_whitespace().nth(1))
                    == Some(&pid.to_string())
            })
        })
        .collect()
}
