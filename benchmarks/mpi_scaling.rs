//! Multi-process numbers on the machine it runs on, each beside its baseline from the same run:
//!
//! 1. all-reduce bus bandwidth of ferrotron's MPI communicator (f32 sum, host `TensorData`
//!    in and out, the shape check included) vs Open MPI's own `MPI_Allreduce` called from C
//!    (`benchmarks/mpi_allreduce.c`, built with `mpicc`), at 2 and 4 ranks;
//! 2. data-parallel scaling: training tokens/s of the training benchmark's GPT at DP = 1 and
//!    DP = 2 processes (`mpirun -np 1|2`), same global batch; at DP = 2 with and without
//!    `--overlap-grad-reduce`, with the time per step spent waiting for the gradient sums.
//!
//! ```text
//! cargo bench --bench mpi_scaling
//! ```
//!
//! Needs Open MPI (`mpirun`, `mpicc`). The benchmark starts itself under `mpirun`; each rank
//! finds its job in `FERROTRON_BENCH_MODE`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use burn::tensor::{Device, TensorData};
use ferrotron::comm::world::{launcher_variable, World};
use ferrotron::comm::ReduceOp;
use ferrotron::data::DataSources;
use ferrotron::model::GptConfig;
use ferrotron::training::pretrain::pretrain_on;
use ferrotron::training::{LrDecayStyle, LrSchedule, ParallelConfig, PretrainConfig};

#[global_allocator]
static ALLOCATOR: ferrotron::util::allocator::TrainingAllocator =
    ferrotron::util::allocator::TrainingAllocator;

const SIZES: [usize; 3] = [1 << 20, 16 << 20, 64 << 20];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Rank side of part 1: prints "<bytes> <seconds per call>" on rank 0.
fn allreduce_rank(world: &World) {
    let comm = world.comm();
    for bytes in SIZES {
        let n = bytes / 4;
        let values: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
        let data = TensorData::new(values, [n]);
        let iters = if bytes >= 16 << 20 { 5 } else { 20 };
        comm.all_reduce(data.clone(), ReduceOp::Sum).unwrap();
        comm.barrier().unwrap();
        let start = Instant::now();
        for _ in 0..iters {
            comm.all_reduce(data.clone(), ReduceOp::Sum).unwrap();
        }
        let t = start.elapsed().as_secs_f64() / iters as f64;
        let worst = comm
            .all_reduce(TensorData::new(vec![t], [1]), ReduceOp::Max)
            .unwrap()
            .try_to_vec::<f64>()
            .unwrap()[0];
        if world.rank() == 0 {
            println!("{bytes} {worst:.9}");
        }
    }
}

/// Gradient elements per all-reduce bucket in the training runs: small enough that the
/// layers' gradients fill buckets of their own (the embedding's, the largest, is final last).
const BUCKET: usize = 1 << 20;

fn train_config(iters: u64, cache: &Path, overlap: bool) -> PretrainConfig {
    PretrainConfig {
        seq_length: 256,
        micro_batch_size: 4,
        global_batch_size: 8,
        train_iters: iters,
        schedule: LrSchedule {
            max_lr: 1e-4,
            min_lr: 1e-5,
            warmup_steps: 0.0,
            decay_steps: 800.0,
            style: LrDecayStyle::Cosine,
            ..Default::default()
        },
        split: "100,0,0".into(),
        data_cache_path: Some(cache.to_path_buf()),
        log_interval: 1000,
        eval_interval: 0,
        eval_iters: 0,
        parallel: ParallelConfig {
            ddp_bucket_size: BUCKET,
            overlap_grad_reduce: overlap,
            ..ParallelConfig::default()
        },
        ..PretrainConfig::new(
            GptConfig::new(4, 256, 4, 256, 50304),
            DataSources::single(root().join("tests/fixtures/golden/wikitext2_valid_text_document")),
        )
    }
}

/// Rank side of part 2: prints "step <seconds per step>" on rank 0, from the difference of a
/// short and a longer run (start-up cancels out), and "exposed <seconds>": the mean time per
/// step rank 0 waited for the gradient all-reduce after its backward pass (longer run, first
/// step left out).
fn train_rank(world: &World) {
    let cache = PathBuf::from(std::env::var("FERROTRON_BENCH_CACHE").unwrap());
    let overlap = std::env::var("FERROTRON_BENCH_OVERLAP").is_ok_and(|v| v == "1");
    let device = Device::flex().autodiff();
    let time = |iters| {
        let start = Instant::now();
        let out =
            pretrain_on(&train_config(iters, &cache, overlap), &device, world.comm()).unwrap();
        (
            start.elapsed().as_secs_f64(),
            out.grad_reduce_exposed_seconds,
        )
    };
    let ((short, _), (long, exposed)) = (time(2), time(6));
    if world.rank() == 0 {
        println!("step {:.6}", (long - short) / 4.0);
        let steady = &exposed[exposed.len().min(1)..];
        let mean = steady.iter().sum::<f64>() / steady.len().max(1) as f64;
        println!("exposed {mean:.6}");
    }
}

fn mpirun(ranks: usize, program: &Path, env: &[(&str, &str)]) -> String {
    let out = Command::new("mpirun")
        .args(["-np", &ranks.to_string()])
        .arg(program)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .envs(env.iter().copied())
        .output()
        .expect("mpirun (install Open MPI: apt-get install openmpi-bin libopenmpi-dev)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "mpirun failed:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn timings(text: &str) -> Vec<(usize, f64)> {
    text.lines()
        .filter_map(|l| {
            let (a, b) = l.split_once(' ')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .collect()
}

fn main() {
    if launcher_variable().is_some() {
        ferrotron::comm::world::share_cores_among_local_ranks();
        let world = World::from_environment().expect("MPI world");
        match std::env::var("FERROTRON_BENCH_MODE").as_deref() {
            Ok("allreduce") => allreduce_rank(&world),
            Ok("train") => train_rank(&world),
            other => panic!("FERROTRON_BENCH_MODE {other:?}"),
        }
        return;
    }
    let me = std::env::current_exe().unwrap();
    let target = root().join("target");
    let baseline = target.join("mpi_allreduce_baseline");
    let status = Command::new("mpicc")
        .args(["-O2", "-o"])
        .arg(&baseline)
        .arg(root().join("benchmarks/mpi_allreduce.c"))
        .status()
        .expect("mpicc (apt-get install libopenmpi-dev)");
    assert!(status.success(), "mpicc failed");

    println!(
        "all-reduce, f32 sum, bus bandwidth = 2(n-1)/n · bytes / time (NCCL-tests' definition)"
    );
    println!("ranks |     size | Open MPI (C)      | ferrotron MpiComm | ferrotron / Open MPI");
    for ranks in [2, 4] {
        let c = timings(&mpirun(ranks, &baseline, &[]));
        let ours = timings(&mpirun(
            ranks,
            &me,
            &[("FERROTRON_BENCH_MODE", "allreduce")],
        ));
        for ((bytes, tc), (_, tr)) in c.iter().zip(&ours) {
            let bus = |t: f64| 2.0 * (ranks - 1) as f64 / ranks as f64 * *bytes as f64 / t / 1e9;
            println!(
                "{ranks:5} | {:5} MiB | {:6.2} ms {:5.2} GB/s | {:6.2} ms {:5.2} GB/s | {:.2}x",
                bytes >> 20,
                tc * 1e3,
                bus(*tc),
                tr * 1e3,
                bus(*tr),
                bus(*tr) / bus(*tc)
            );
        }
    }

    let cache = tempfile::tempdir().unwrap();
    let cache_path = cache.path().to_str().unwrap().to_owned();
    println!();
    println!(
        "data parallelism: GPT 4 layers, hidden 256, seq 256, global batch 8 (micro-batch 4), fp32, \
         {} cores",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let mut base = None;
    for (ranks, overlap) in [(1, false), (2, false), (2, true)] {
        let out = mpirun(
            ranks,
            &me,
            &[
                ("FERROTRON_BENCH_MODE", "train"),
                ("FERROTRON_BENCH_CACHE", &cache_path),
                ("FERROTRON_BENCH_OVERLAP", if overlap { "1" } else { "0" }),
            ],
        );
        let value = |key: &str| -> f64 {
            out.lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
                .unwrap_or_else(|| panic!("no {key:?} in:\n{out}"))
        };
        let step = value("step ");
        let tokens = 8.0 * 256.0 / step;
        let base = *base.get_or_insert(tokens);
        let exposed = if ranks > 1 {
            format!(
                ", gradient all-reduce waited for {:5.1} ms/step",
                value("exposed ") * 1e3
            )
        } else {
            String::new()
        };
        println!(
            "DP={ranks}{}: {:7.1} ms/step, {tokens:6.0} tokens/s, {:.2}x DP=1{exposed}",
            if overlap {
                " --overlap-grad-reduce"
            } else {
                ""
            },
            step * 1e3,
            tokens / base
        );
    }
}
