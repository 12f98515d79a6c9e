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

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;
use ferrotron::comm::world::{launcher_variable, World};
use ferrotron::training::layout_fuzz::{
    case_dir, check_case, generate, FuzzCase, Ranks, References,
};

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

fn main() -> Result<ExitCode> {
    let args = Args::parse();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let data = root.join("tests/fixtures/golden/wikitext2_valid_text_document");
    // Under a launcher: this process's MPI world, kept until the end (dropping it finalizes
    // MPI).
    let mpi = launcher_variable()
        .map(|_| World::from_environment())
        .transpose()?;
    let (ranks, world) = match &mpi {
        Some(mpi) => (Ranks::World(mpi.comm()), Some(mpi.size())),
        None => (Ranks::Threads, None),
    };
    let rank0 = ranks.is_rank0();
    let cache = args.dir.join("cache");
    let (cases, refused) = generate(args.seed, args.first, args.cases, world, &data, &cache)?;
    let failed = match run_cases(&cases, &ranks, &args.dir) {
        Ok(failed) => failed,
        Err(e) => match &mpi {
            // A case that cannot run on one rank must not leave the others waiting in it.
            Some(mpi) => {
                eprintln!("layout_fuzz: rank {}: {e:#}", mpi.rank());
                mpi.abort(1)
            }
            None => return Err(e),
        },
    };
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
    // Returned rather than exited with, so that the MPI world is dropped (finalized) first.
    Ok(if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Checks every case in `dir/case_NNNNN` (kept where it differs): the indices of those that
/// differ, on world rank 0.
fn run_cases(cases: &[FuzzCase], ranks: &Ranks, dir: &Path) -> Result<Vec<u64>> {
    let rank0 = ranks.is_rank0();
    let mut references = References::default();
    let mut failed = Vec::new();
    for case in cases {
        let case_root = dir.join(format!("case_{:05}", case.index));
        if rank0 {
            case_dir(dir, case.index)?;
        }
        let Some(verdict) = check_case(case, ranks, &case_root, &mut references)? else {
            continue;
        };
        println!("{verdict}");
        if verdict.passed() {
            std::fs::remove_dir_all(&case_root)?;
        } else {
            failed.push(case.index);
        }
    }
    Ok(failed)
}
