//! The layout fuzzer's long run: draws `--cases` run configurations from `--seed` and holds
//! each, on its parallel layout, to the same run in one process
//! (`ferrotron::training::layout_fuzz` says what is drawn and compared).
//!
//! ```text
//! cargo run --release --example layout_fuzz -- --cases 200            # thread ranks
//! mpirun -np 4 target/release/examples/layout_fuzz --cases 50          # MPI ranks (world 4)
//! cargo run --release --example layout_fuzz -- --seed 7 --first 17 --cases 1   # one case again
//! ```
//!
//! Exits 1 when any case differs, after printing each case's verdict and a summary.

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use ferrotron::comm::world::{launcher_variable, World};
use ferrotron::training::layout_fuzz::{case_dir, check_case, generate, Ranks, References};

// Why this allocator: see `ferrotron::util::allocator`.
#[global_allocator]
static ALLOCATOR: ferrotron::util::allocator::TrainingAllocator =
    ferrotron::util::allocator::TrainingAllocator;

#[derive(Parser)]
#[command(about = "Hold generated parallel layouts to the single-process run")]
struct Args {
    /// Cases to run (draws the trainer refuses are skipped and not counted).
    #[arg(long, default_value_t = 20)]
    cases: usize,
    /// The generator's seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The index of the first case in the seed's stream.
    #[arg(long, default_value_t = 0)]
    first: u64,
    /// Where the runs' checkpoints and the dataset's index cache go.
    #[arg(long, default_value = "target/layout_fuzz")]
    dir: PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let data = root.join("tests/fixtures/golden/wikitext2_valid_text_document");
    let (ranks, world) = match launcher_variable() {
        Some(_) => {
            let world = World::from_environment()?;
            let size = world.size();
            (Ranks::World(world.comm()), Some(size))
        }
        None => (Ranks::Threads, None),
    };
    let rank0 = !matches!(&ranks, Ranks::World(w) if w.rank() != 0);
    let cache = args.dir.join("cache");
    let (cases, refused) = generate(args.seed, args.first, args.cases, world, &data, &cache);
    let mut references = References::default();
    let mut failed = Vec::new();
    for case in &cases {
        let dir = args.dir.join(format!("case_{:05}", case.index));
        if rank0 {
            case_dir(&args.dir, case.index)?;
        }
        let verdict = check_case(case, &ranks, &dir, &mut references)?;
        if let Some(verdict) = verdict {
            println!("{verdict}");
            if verdict.passed() {
                std::fs::remove_dir_all(&dir)?;
            } else {
                failed.push(case.index);
            }
        }
    }
    if rank0 {
        let mut reasons: Vec<&str> = refused.iter().map(|(_, why)| why.as_str()).collect();
        reasons.sort_unstable();
        reasons.dedup();
        println!(
            "layout fuzz, seed {}: {} cases from index {}, {} differ {:?}; {} draws the trainer refuses skipped: {reasons:#?}",
            args.seed,
            cases.len(),
            args.first,
            failed.len(),
            failed,
            refused.len()
        );
    }
    if !failed.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}
