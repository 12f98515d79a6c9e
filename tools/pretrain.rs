//! `pretrain`: Megatron-LM's `pretrain_gpt.py`, same flags, on burn. The flags and what they
//! resolve to are the library's (`ferrotron::training::pretrain_args`); this binary parses
//! them, starts the ranks (threads, or this process's MPI rank) and trains.
//!
//! ```text
//! pretrain --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 \
//!   --max-position-embeddings 256 --micro-batch-size 8 --global-batch-size 8 --lr 6e-4 \
//!   --train-iters 200 --data-path data_text_document --save ckpt
//! ```

use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::{CommandFactory, Parser};

use ferrotron::comm::world::World;
use ferrotron::training::megatron_command_line::screen_megatron_flags;
use ferrotron::training::pretrain;
use ferrotron::training::pretrain::pretrain_on;
use ferrotron::training::pretrain_args::PretrainArgs;

// Why this allocator: see `ferrotron::util::allocator`.
#[global_allocator]
static ALLOCATOR: ferrotron::util::allocator::TrainingAllocator =
    ferrotron::util::allocator::TrainingAllocator;

fn run(args: PretrainArgs, world: &World) -> Result<()> {
    // Under a launcher, `--device cuda` means this rank's GPU on its machine (Megatron's
    // `torch.cuda.set_device(local_rank)`).
    let spec = if world.is_mpi() && args.device == "cuda" {
        format!("cuda:{}", ferrotron::comm::world::local_rank())
    } else {
        args.device.clone()
    };
    let device = ferrotron::util::device::parse_device(&spec)
        .map_err(anyhow::Error::msg)?
        .autodiff();
    let config = args.resolve(world.rank() == 0)?;
    if config.exit_signal_handler {
        ferrotron::util::exit_signal::install().map_err(anyhow::Error::msg)?;
    }
    match args.distributed_backend.as_deref() {
        None | Some("gloo") | Some("mpi") => {}
        Some("nccl") => {
            let nccl = nccl_world(&args.device, config.parallel.replica_ranks(), world)?;
            return pretrain_on(&config, &device, nccl).map(drop);
        }
        Some(other) => bail!("--distributed-backend {other}: expected nccl, gloo or mpi"),
    }
    if world.is_mpi() {
        pretrain_on(&config, &device, world.comm())?;
    } else {
        pretrain(&config, &device)?;
    }
    Ok(())
}

/// `--distributed-backend nccl`: the world as an NCCL group on this rank's GPU (`device`),
/// for a run of `model_parallel` ranks.
#[cfg(feature = "cuda")]
fn nccl_world(
    device: &str,
    model_parallel: usize,
    world: &World,
) -> Result<std::sync::Arc<dyn ferrotron::comm::Communicator>> {
    use anyhow::Context;
    if !device.starts_with("cuda") {
        bail!("--distributed-backend nccl needs --device cuda (NCCL moves GPU memory)");
    }
    if !world.is_mpi() && model_parallel > 1 {
        bail!("--distributed-backend nccl runs one rank per process: start the ranks with mpirun or srun (NCCL cannot join threads on one GPU)");
    }
    let ordinal = match device.split_once(':') {
        Some((_, n)) if !world.is_mpi() => n
            .parse()
            .with_context(|| format!("--device {device}: expected cuda:N"))?,
        _ => ferrotron::comm::world::local_rank(),
    };
    Ok(world.nccl(ordinal)?)
}

#[cfg(not(feature = "cuda"))]
fn nccl_world(
    _device: &str,
    _model_parallel: usize,
    _world: &World,
) -> Result<std::sync::Arc<dyn ferrotron::comm::Communicator>> {
    bail!("--distributed-backend nccl needs a CUDA build (cargo build --release --features cuda) and --device cuda")
}

fn main() -> ExitCode {
    // Megatron's scripts pass flags for its own machinery and repeat flags: see
    // docs/megatron-flags.md.
    let screened = match screen_megatron_flags(&PretrainArgs::command(), std::env::args_os()) {
        Ok(screened) => screened,
        Err(e) => {
            eprintln!("pretrain: error: {e}");
            return ExitCode::from(2);
        }
    };
    let args = PretrainArgs::parse_from(&screened.argv);
    ferrotron::comm::world::share_cores_among_local_ranks();
    let world = match World::from_environment() {
        Ok(world) => world,
        Err(e) => return ferrotron::util::cli::finish("pretrain", Err(e)),
    };
    if let (Some(warning), 0) = (screened.warning(), world.rank()) {
        eprintln!("{warning}");
    }
    let result = run(args, &world);
    if let (Err(e), true) = (&result, world.size() > 1) {
        // The other ranks may be waiting in a collective for this one: end them all.
        eprintln!("pretrain: rank {}: error: {e:#}", world.rank());
        world.abort(1);
    }
    ferrotron::util::cli::finish("pretrain", result)
}
