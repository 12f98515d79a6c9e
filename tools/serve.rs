//! `serve`: a text-generation server speaking Megatron-LM's `PUT /api` and OpenAI's
//! `POST /v1/completions`.
//!
//!   serve --load ckpt --port 5000
//!   curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \
//!        -d '{"prompts": ["The history of"], "tokens_to_generate": 32, "top_k": 1}'

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Result};
use clap::Parser;

use ferrotron::comm::world::{launcher_variable, run_model_ranks};
use ferrotron::comm::Communicator;
use ferrotron::inference::load::load_for_inference;
use ferrotron::inference::server::queue::Worker;
use ferrotron::inference::server::{serve, ServerOptions};
use ferrotron::parallel::state::ParallelState;
use ferrotron::tokenizer::TokenizerArgs;
use ferrotron::util::device::parse_device;

/// Serve a checkpoint over HTTP (Megatron's tools/run_text_generation_server.py). Concurrent
/// requests are queued and decoded together in batches through the KV cache; SIGINT/SIGTERM
/// finish the running batch and exit 0.
#[derive(Parser, Debug)]
#[command(name = "serve", version, args_override_self = true)]
struct Args {
    /// Checkpoint directory (as given to `pretrain --save`).
    #[arg(long)]
    load: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the one chosen is printed).
    #[arg(long, default_value_t = 5000)]
    port: u16,
    /// Prompts decoded together at most.
    #[arg(long, default_value_t = 64)]
    max_batch_rows: usize,
    /// Requests waiting at most; more are answered 503.
    #[arg(long, default_value_t = 64)]
    queue_size: usize,
    /// Threads reading requests.
    #[arg(long, default_value_t = 16)]
    request_threads: usize,
    /// Request bodies larger than this many bytes are answered 413.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Split the model over this many ranks (threads, or the ranks of an MPI launcher); rank 0
    /// serves and announces each batch, the others decode it on their shards.
    #[arg(long, default_value_t = 1)]
    tensor_model_parallel_size: usize,
    /// Backend: cpu, or (in builds with those features) cuda, cuda:N, wgpu, wgpu-cpu.
    #[arg(long, default_value = "cpu")]
    device: String,
    #[command(flatten)]
    tokenizer: TokenizerArgs,
}

fn run(args: Args) -> Result<()> {
    if args.max_batch_rows == 0 || args.queue_size == 0 {
        bail!("--max-batch-rows and --queue-size must be positive");
    }
    run_model_ranks(args.tensor_model_parallel_size, |world| {
        serve_on_rank(&args, world)
    })
}

/// Rank 0 serves; the other ranks of the tensor-parallel group follow its batches.
fn serve_on_rank(args: &Args, world: Arc<dyn Communicator>) -> Result<()> {
    let parallel = ParallelState::new(world, args.tensor_model_parallel_size, 1, 1)?;
    let device = parse_device(&args.device).map_err(anyhow::Error::msg)?;
    let tokenizer = args.tokenizer.load()?;
    let (model, _) = load_for_inference(&args.load, &device, &parallel.tensor, &tokenizer)?;
    let worker = Worker {
        model,
        device,
        vocab_size: tokenizer.vocab_size(),
        stop_token: tokenizer.eod(),
        max_batch_rows: args.max_batch_rows,
        group: parallel.tensor.clone(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    if !parallel.is_world_rank0() {
        // A signal to the whole job (mpirun forwards it) is rank 0's to act on: this rank
        // ends when rank 0 announces the end.
        if launcher_variable().is_some() {
            ctrlc::set_handler(|| {})?;
        }
        return worker.follow().map_err(anyhow::Error::msg);
    }
    let flag = stop.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))?;
    let options = ServerOptions {
        host: args.host.clone(),
        port: args.port,
        request_threads: args.request_threads,
        queue_capacity: args.queue_size,
        max_body_bytes: args.max_body_bytes,
    };
    serve(&options, worker, tokenizer, stop)?;
    eprintln!("serve: stopped");
    Ok(())
}

fn main() -> ExitCode {
    ferrotron::util::cli::finish("serve", run(Args::parse()))
}
