//! How a run finds its ranks: from an MPI launcher (`mpirun`, `srun`) when the environment
//! says one started this process, otherwise a single process (whose tensor-parallel ranks,
//! if any, are threads, see [`super::run_ranks`]).
//!
//! MPI is initialised only when a launcher is detected: a plain `pretrain` never touches
//! MPI, so it runs on machines without it and starts no MPI daemons.

use std::sync::Arc;

use super::{Communicator, ThreadComm};

/// Environment variables by which launchers tell a process its rank: Open MPI's `mpirun`,
/// PMIx (Open MPI 5, `srun --mpi=pmix`), PMI-1/2 (MPICH's hydra, `srun --mpi=pmi2`).
const LAUNCHER_RANK_VARIABLES: [&str; 4] =
    ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"];

/// The launcher variable that is set, if a process manager started this process.
pub fn launcher_variable() -> Option<&'static str> {
    LAUNCHER_RANK_VARIABLES
        .into_iter()
        .find(|v| std::env::var_os(v).is_some())
}

/// This process's rank among the ranks on its machine, as the launcher tells it (Open MPI,
/// Slurm, MPICH), for picking "its" GPU; 0 when no launcher says.
pub fn local_rank() -> usize {
    [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_LOCALID",
        "MPI_LOCALRANKID",
        "PMIX_LOCAL_RANK",
    ]
    .into_iter()
    .find_map(|v| std::env::var(v).ok()?.parse().ok())
    .unwrap_or(0)
}

/// Under a launcher, gives this process its share of the machine's cores for its compute
/// threads (`RAYON_NUM_THREADS` = cores / ranks on this machine, at least 1), unless the user
/// set it: N ranks on one machine would otherwise each start a thread per core and fight over
/// them (Megatron users know this as `OMP_NUM_THREADS`). Call it before any tensor work.
pub fn share_cores_among_local_ranks() -> Option<usize> {
    if launcher_variable().is_none() || std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return None;
    }
    let local = [
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "SLURM_NTASKS_PER_NODE",
        "MPI_LOCALNRANKS",
    ]
    .into_iter()
    .find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok())?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / local.max(1)).max(1);
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    Some(threads)
}

/// This process's ranks: the world communicator, and what keeps MPI alive while it is used.
pub struct World {
    comm: Arc<dyn Communicator>,
    #[cfg(feature = "mpi")]
    universe: Option<mpi::environment::Universe>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "World({:?})", self.comm)
    }
}

impl World {
    /// One process, one rank.
    pub fn single() -> Self {
        let comm: Arc<dyn Communicator> = Arc::new(
            ThreadComm::world(1)
                .pop()
                .expect("a one-rank world has one handle"),
        );
        Self {
            comm,
            #[cfg(feature = "mpi")]
            universe: None,
        }
    }

    /// MPI's world when a launcher started this process, else [`Self::single`].
    pub fn from_environment() -> anyhow::Result<Self> {
        match launcher_variable() {
            None => Ok(Self::single()),
            Some(variable) => Self::init_mpi(variable),
        }
    }

    #[cfg(feature = "mpi")]
    fn init_mpi(_variable: &str) -> anyhow::Result<Self> {
        use mpi::Threading;
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| anyhow::anyhow!("MPI was already initialised"))?;
        if threading != Threading::Multiple {
            anyhow::bail!(
                "the MPI library grants {threading:?} threading, ferrotron needs Multiple \
                 (Open MPI and MPICH both provide it)"
            );
        }
        let comm: Arc<dyn Communicator> = Arc::new(super::mpi::MpiComm::new(universe.world()));
        Ok(Self {
            comm,
            universe: Some(universe),
        })
    }

    #[cfg(not(feature = "mpi"))]
    fn init_mpi(variable: &str) -> anyhow::Result<Self> {
        anyhow::bail!(
            "started by an MPI launcher ({variable} is set) but this build has no MPI support; \
             rebuild with the `mpi` feature (the default)"
        )
    }

    /// The world as an NCCL group on GPU `ordinal` (`--distributed-backend nccl`): NCCL
    /// bootstrapped over this world, which stays its host side (see [`super::nccl`]).
    #[cfg(feature = "cuda")]
    pub fn nccl(&self, ordinal: usize) -> Result<Arc<dyn Communicator>, super::CommError> {
        Ok(Arc::new(super::nccl::NcclComm::bootstrap(
            self.comm(),
            ordinal,
        )?))
    }

    /// The world communicator.
    pub fn comm(&self) -> Arc<dyn Communicator> {
        self.comm.clone()
    }

    /// This process's rank in the world.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks in the world.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// Whether the ranks are MPI processes.
    pub fn is_mpi(&self) -> bool {
        #[cfg(feature = "mpi")]
        {
            self.universe.is_some()
        }
        #[cfg(not(feature = "mpi"))]
        {
            false
        }
    }

    /// Ends every rank of the job with `code` (`MPI_Abort`): what a rank that failed does so
    /// that the others do not wait for it. In a single process, exits.
    pub fn abort(&self, code: i32) -> ! {
        #[cfg(feature = "mpi")]
        if let Some(universe) = &self.universe {
            use mpi::traits::Communicator as _;
            universe.world().abort(code)
        }
        std::process::exit(code)
    }
}

/// Runs `body` on each rank of a model split over `ranks` ranks: the processes of an MPI
/// launcher (which must have started exactly `ranks`), this process alone for one rank, or
/// `ranks` threads. What `generate` and `serve` do with `--tensor-model-parallel-size`.
pub fn run_model_ranks<F>(ranks: usize, body: F) -> anyhow::Result<()>
where
    F: Fn(Arc<dyn Communicator>) -> anyhow::Result<()> + Sync,
{
    if ranks == 0 {
        anyhow::bail!("--tensor-model-parallel-size must be at least 1");
    }
    if launcher_variable().is_some() {
        let world = World::from_environment()?;
        let started = world.comm().size();
        if started != ranks {
            anyhow::bail!(
                "started as {started} MPI ranks for --tensor-model-parallel-size {ranks}: start {ranks}"
            );
        }
        return body(world.comm());
    }
    if ranks == 1 {
        return body(World::single().comm());
    }
    super::run_ranks(ranks, body).map(|_| ())
}
