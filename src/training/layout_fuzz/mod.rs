//! The layout fuzzer. ferrotron promises that every parallel layout trains the model the
//! single process trains; the layout tests check the layouts someone listed, and
//! composition bugs hide in the ones nobody did (Megatron-LM's users found a tensor-parallel
//! cross-entropy off by log 2 and a loss 50 % off at TP=2 for some vocabularies that way).
//! So this module draws run configurations from a seed ([`generate`]: TP, PP with virtual or
//! uneven stages, DP, sequence parallelism, the distributed optimizer, overlapped reduction,
//! recomputation, precision, the model's options, padded vocabularies, micro-batch counts,
//! every dropout on), runs each on its layout and the same run in one process, and compares
//! losses, gradient norms, validation losses and how far training moved each weight ([`compare`]). A failing
//! case is run again saving every iteration, to name the first iteration and weight that
//! left the single process.
//!
//! The CI test runs a few seeded cases on thread ranks; `cargo run --release --example
//! layout_fuzz -- --cases 200` runs many, on threads or under `mpirun` (docs/testing.md).

pub mod compare;
pub mod generate;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use burn::tensor::{Device, TensorData};

pub use compare::{
    compare, compare_updates, Closeness, Difference, Observation, Tolerance, WeightUpdate,
};
pub use generate::{draw_case, FuzzCase, FUZZ_ITERS};

use crate::checkpoint::{load_model, TRACKER_FILE};
use crate::comm::world::World;
use crate::comm::{run_ranks, Communicator};
use crate::model::named_parameters::{named_parameters, NamedValues};
use crate::training::config::BatchPlan;
use crate::training::pretrain::pretrain_on;
use crate::training::PretrainConfig;

/// Where a layout's ranks run.
#[derive(Clone)]
pub enum Ranks {
    /// Threads of this process, as many as the case's world.
    Threads,
    /// The MPI world this process is one rank of (every rank calls the fuzzer alike).
    World(Arc<dyn Communicator>),
}

impl Ranks {
    /// Whether this process compares (and reports): world rank 0, or the one process of
    /// thread ranks.
    pub fn is_rank0(&self) -> bool {
        match self {
            Ranks::Threads => true,
            Ranks::World(world) => world.rank() == 0,
        }
    }

    /// Rank 0's `flag`, on every rank.
    fn share_flag(&self, flag: bool) -> Result<bool> {
        let Ranks::World(world) = self else {
            return Ok(flag);
        };
        let data = TensorData::new(vec![f32::from(u8::from(flag))], [1]);
        let shared = world.broadcast(data, 0)?;
        Ok(shared.as_slice::<f32>().map_err(|e| anyhow!("{e:?}"))?[0] == 1.0)
    }

    fn barrier(&self) -> Result<()> {
        if let Ranks::World(world) = self {
            world.barrier()?;
        }
        Ok(())
    }
}

/// The CPU training device every case runs on.
fn device() -> Device {
    Device::flex().autodiff()
}

/// The weights a run of `cfg` starts from. Every layout builds each parameter whole from the
/// seed and keeps its shard, so they are the one-process model's, whatever the layout.
fn initial_weights(cfg: &PretrainConfig) -> Result<Vec<NamedValues>> {
    let model = cfg
        .in_one_process()
        .model
        .init(cfg.seed, &Device::flex())
        .map_err(anyhow::Error::msg)?;
    Ok(named_parameters(&model))
}

/// How far a run moved each weight by the latest checkpoint under `root`: its fp32 main
/// weights (shards joined) minus the `initial` ones.
fn saved_updates(root: &Path, initial: &[NamedValues]) -> Result<Vec<WeightUpdate>> {
    let (model, _) = load_model(root, &Device::flex())
        .with_context(|| format!("reading the checkpoint under {}", root.display()))?;
    let saved = named_parameters(&model);
    anyhow::ensure!(
        saved.len() == initial.len(),
        "{}: {} weights, the model has {}",
        root.display(),
        saved.len(),
        initial.len()
    );
    saved
        .into_iter()
        .zip(initial)
        .map(|(w, w0)| {
            anyhow::ensure!(
                w.name == w0.name && w.shape == w0.shape,
                "{}: {} {:?} where the model has {} {:?}",
                root.display(),
                w.name,
                w.shape,
                w0.name,
                w0.shape
            );
            let weight_norm = w
                .values
                .iter()
                .map(|&v| f64::from(v).powi(2))
                .sum::<f64>()
                .sqrt();
            let update = w
                .values
                .iter()
                .zip(&w0.values)
                .map(|(v, v0)| v - v0)
                .collect();
            Ok(WeightUpdate {
                name: w.name,
                shape: w.shape,
                update,
                weight_norm,
            })
        })
        .collect()
}

/// Runs `cfg` on this rank of `world`, saving under `cfg.save`: what it showed, on world
/// rank 0 (once every rank has finished, so the checkpoint is whole).
fn observe_on(cfg: &PretrainConfig, world: Arc<dyn Communicator>) -> Result<Option<Observation>> {
    let rank0 = world.rank() == 0;
    let out = pretrain_on(cfg, &device(), world.clone())?;
    world.barrier()?;
    if !rank0 {
        return Ok(None);
    }
    let save = cfg.save.as_ref().expect("the fuzzer's runs save");
    Ok(Some(Observation {
        losses: out.losses,
        grad_norms: out.grad_norms,
        validation: out.validation,
        skipped: out.skipped_iterations,
        updates: saved_updates(save, &initial_weights(cfg)?)?,
    }))
}

/// Runs `cfg` on `ranks` (a world of `world_size`): the observation on rank 0.
fn observe(cfg: &PretrainConfig, world_size: usize, ranks: &Ranks) -> Result<Option<Observation>> {
    match ranks {
        Ranks::Threads if world_size == 1 => observe_on(cfg, World::single().comm()),
        Ranks::Threads => {
            let mut all = run_ranks(world_size, |world| observe_on(cfg, world))?;
            Ok(all.swap_remove(0))
        }
        Ranks::World(world) => observe_on(cfg, world.clone()),
    }
}

/// Why the trainer refuses a generated case before any rank starts (the generator then
/// moves on: the case is not a layout ferrotron claims to run), or `None`.
pub fn refusal(case: &FuzzCase) -> Option<String> {
    let cfg = &case.config;
    let refused = cfg
        .validate(&device())
        .and_then(|()| BatchPlan::new(cfg, case.data_parallel, 0).map(|_| ()))
        .and_then(|()| {
            (0..cfg.parallel.pipeline_model_parallel_size)
                .try_for_each(|r| cfg.stage_layers(r).map(|_| ()))
        });
    refused.err().map(|e| format!("{e:#}"))
}

/// The single-process runs already made, by their configuration (cases often share one).
#[derive(Default)]
pub struct References(HashMap<String, Observation>);

/// What became of one case.
#[derive(Clone, Debug)]
pub struct Verdict {
    /// The case.
    pub case: FuzzCase,
    /// How close it came, or where it first differed.
    pub result: std::result::Result<Closeness, Difference>,
    /// For a failing case, the first iteration after which a weight differed (from a run
    /// saving every iteration), if any did.
    pub first_weight_difference: Option<Difference>,
}

impl Verdict {
    /// Whether the layout reproduced the single process.
    pub fn passed(&self) -> bool {
        self.result.is_ok()
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "case {} [{}]: ", self.case.index, self.case.describe())?;
        match &self.result {
            Ok(c) => write!(
                f,
                "same as one process (worst relative difference: loss {:.1e}, grad norm {:.1e}, updates {:.1e})",
                c.loss, c.grad_norm, c.updates
            ),
            Err(d) => {
                write!(f, "DIFFERS at {d}")?;
                match &self.first_weight_difference {
                    Some(w) => write!(f, "; the updates first differ after {w}"),
                    None => write!(f, "; no weight's update differs after any iteration"),
                }
            }
        }
    }
}

/// The case's two runs, saving under `dir`: the layout's and the single process's.
fn case_runs(case: &FuzzCase, dir: &Path, save_interval: Option<u64>) -> [PretrainConfig; 2] {
    let with_save = |cfg: PretrainConfig, name: &str| PretrainConfig {
        save: Some(dir.join(name)),
        save_interval,
        ..cfg
    };
    [
        with_save(case.config.clone(), "layout"),
        with_save(case.single_process(), "single"),
    ]
}

/// Runs `case` on `ranks` and its single-process reference, in `dir`, and compares them;
/// on a difference runs both again saving every iteration, to find the first weight that
/// differed. `Some` on world rank 0 (the one that compares).
pub fn check_case(
    case: &FuzzCase,
    ranks: &Ranks,
    dir: &Path,
    references: &mut References,
) -> Result<Option<Verdict>> {
    let [layout, single] = case_runs(case, dir, None);
    let key = format!("{:?}", case.single_process());
    let reference = match (ranks.is_rank0(), references.0.get(&key)) {
        (false, _) => None,
        (true, Some(known)) => Some(known.clone()),
        (true, None) => {
            let made = observe(&single, 1, &Ranks::Threads)?.expect("one rank");
            references.0.insert(key, made.clone());
            Some(made)
        }
    };
    ranks.barrier()?;
    let observed = observe(&layout, case.world_size(), ranks)
        .with_context(|| format!("case {} ({}) failed to run", case.index, case.describe()))?;
    let (Some(observed), Some(reference)) = (observed, reference) else {
        locate_if_rank_asks(case, ranks, dir)?;
        return Ok(None);
    };
    let tol = Tolerance::for_run(&case.config);
    let result = compare(&observed, &reference, &case.config.model, tol);
    // The other ranks follow rank 0 into the locating runs, or not.
    ranks.share_flag(result.is_err())?;
    let first_weight_difference = match &result {
        Ok(_) => None,
        Err(_) => locate(case, ranks, dir, tol)?,
    };
    Ok(Some(Verdict {
        case: case.clone(),
        result,
        first_weight_difference,
    }))
}

/// On the ranks other than 0 of an MPI world: joins the locating runs when rank 0 found a
/// difference.
fn locate_if_rank_asks(case: &FuzzCase, ranks: &Ranks, dir: &Path) -> Result<()> {
    if !matches!(ranks, Ranks::World(_)) {
        return Ok(());
    }
    if ranks.share_flag(false)? {
        locate(case, ranks, dir, Tolerance::for_run(&case.config))?;
    }
    Ok(())
}

/// Runs the case and its reference again saving every iteration, and compares their updates
/// iteration by iteration: the first weight that left the single process, and after which
/// iteration. On rank 0; `None` elsewhere, or when none did.
fn locate(
    case: &FuzzCase,
    ranks: &Ranks,
    dir: &Path,
    tol: Tolerance,
) -> Result<Option<Difference>> {
    let [layout, single] = case_runs(case, &dir.join("every_iteration"), Some(1));
    first_weight_difference(&layout, case.world_size(), &single, ranks, tol)
}

/// Runs `layout` (on `world_size` ranks) and `single` (in one process), each saving every
/// iteration, and compares their updates after each: the first weight, in the model's
/// order, whose update is beyond `tol.updates`, and the iteration after which it was. On
/// rank 0; `None` elsewhere, or when no weight differs.
pub fn first_weight_difference(
    layout: &PretrainConfig,
    world_size: usize,
    single: &PretrainConfig,
    ranks: &Ranks,
    tol: Tolerance,
) -> Result<Option<Difference>> {
    if ranks.is_rank0() {
        observe(single, 1, &Ranks::Threads)?;
    }
    ranks.barrier()?;
    observe(layout, world_size, ranks)?;
    if !ranks.is_rank0() {
        return Ok(None);
    }
    // Both runs start from the same weights (the layout's are the one-process model's).
    let initial = initial_weights(single)?;
    for iteration in 1..=single.train_iters {
        let got = updates_after(layout, iteration, &initial)?;
        let want = updates_after(single, iteration, &initial)?;
        let compared = compare_updates(iteration, &got, &want, &single.model, tol.updates);
        if let Err(d) = compared {
            return Ok(Some(d));
        }
    }
    Ok(None)
}

/// The updates from `initial` by checkpoint `iteration` of the run of `cfg` (which saved
/// every iteration), read by pointing the tracker file at it.
fn updates_after(
    cfg: &PretrainConfig,
    iteration: u64,
    initial: &[NamedValues],
) -> Result<Vec<WeightUpdate>> {
    let root = cfg.save.as_ref().expect("the runs save");
    std::fs::write(root.join(TRACKER_FILE), iteration.to_string())?;
    saved_updates(root, initial)
}

/// A draw the trainer refused: its index and the trainer's reason.
pub type Refused = (u64, String);

/// The cases `first..first + count` of `seed`'s stream that the trainer accepts, on `world`
/// ranks when given, and the draws it refused (their index and the trainer's reason); an
/// error when the packed cases' corpus cannot be written.
pub fn generate(
    seed: u64,
    first: u64,
    count: usize,
    world: Option<usize>,
    data: &Path,
    cache: &Path,
) -> Result<(Vec<FuzzCase>, Vec<Refused>)> {
    // The packed cases' corpus, made before any case needs it.
    generate::short_documents(data, cache).context("the packed documents' corpus")?;
    let mut cases = Vec::with_capacity(count);
    let mut refused = Vec::new();
    let mut index = first;
    while cases.len() < count {
        let case = draw_case(seed, index, world, data, cache);
        match refusal(&case) {
            None => cases.push(case),
            Some(why) => refused.push((index, why)),
        }
        index += 1;
    }
    Ok((cases, refused))
}

/// A fresh directory for case `index` under `root` (emptied when a previous run left one).
pub fn case_dir(root: &Path, index: u64) -> Result<PathBuf> {
    let dir = root.join(format!("case_{index:05}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)
            .map_err(|e| anyhow!("cannot empty {}: {e}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
