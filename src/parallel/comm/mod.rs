//! Collectives for tensor parallelism: the [`ProcessGroup`] trait the layers talk to, and its
//! first implementation, [`ThreadGroup`] (N ranks as N threads of one process).
//!
//! burn 0.22's own collectives are all-reduce only, CUDA/NCCL only, and differentiate the way
//! data parallelism wants, so tensor parallelism brings its own. Collectives are matched by
//! call order: every rank must issue the same sequence of calls with the same shapes. A
//! mismatch, or a rank that fails or leaves early, turns into a [`CommError`] on every rank
//! rather than a hang.

mod thread_group;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub use thread_group::{run_ranks, ThreadGroup};

use crate::host_tensor::HostTensor;

/// Element-wise reduction of an all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
}

/// Why a collective failed; every rank of the group gets one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    /// Ranks issued different collectives (or shapes) at the same position in the sequence.
    #[error("collective mismatch at call #{call}: {detail}")]
    Mismatch {
        /// Position of the call in the sequence (from 0).
        call: u64,
        /// What each rank called.
        detail: String,
    },
    /// Another rank failed or returned while this one waited.
    #[error("rank {rank} is gone ({reason}) while rank {waiting} waits in call #{call} ({op})")]
    RankGone {
        /// The rank that is gone.
        rank: usize,
        /// Its error, panic message, or "finished".
        reason: String,
        /// The rank reporting.
        waiting: usize,
        /// Position of the waiting call.
        call: u64,
        /// The waiting call.
        op: String,
    },
    /// A bad argument (root out of range, shapes that cannot be gathered).
    #[error("{0}")]
    Invalid(String),
}

/// A group of ranks that run collectives together.
///
/// Tensors cross it as [`HostTensor`]s. Results are identical on every rank and reductions
/// run in rank order, so runs are bitwise reproducible. A device-side implementation (NCCL)
/// fits behind the same calls; the layers only see this trait through [`TpGroup`].
pub trait ProcessGroup: Send + Sync + fmt::Debug {
    /// This rank, `0..size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// The element-wise `op` of `tensor` over all ranks.
    fn all_reduce(&self, tensor: HostTensor, op: ReduceOp) -> Result<HostTensor, CommError>;
    /// Every rank's `tensor`, joined along `dim` in rank order.
    fn all_gather(&self, tensor: HostTensor, dim: usize) -> Result<HostTensor, CommError>;
    /// Rank `root`'s `tensor` on every rank (other ranks pass a tensor of the same shape).
    fn broadcast(&self, tensor: HostTensor, root: usize) -> Result<HostTensor, CommError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CommError>;
}

/// A cheap, clonable handle on this rank's tensor-parallel group, stored in the parallel
/// layers. The default is a group of one rank, where every collective is the identity.
///
/// It also clocks the time this rank spends communicating (see [`Self::timed`]), shared by
/// all clones, for the benchmarks.
#[derive(Clone, Debug, Default)]
pub struct TpGroup {
    group: Option<Arc<dyn ProcessGroup>>,
    comm_nanos: Arc<AtomicU64>,
}

impl TpGroup {
    /// A single-rank group (no communication at all).
    pub fn single() -> Self {
        Self::default()
    }

    /// A handle on `group`.
    pub fn new(group: Arc<dyn ProcessGroup>) -> Self {
        Self {
            group: Some(group),
            comm_nanos: Arc::default(),
        }
    }

    /// Runs `f`, adding its wall time to this rank's communication clock.
    pub fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.comm_nanos
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Seconds spent in [`Self::timed`] sections (collectives, with their host transfers and
    /// the wait for the other ranks) since this group was made.
    pub fn comm_seconds(&self) -> f64 {
        self.comm_nanos.load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.group.as_ref().map_or(0, |g| g.rank())
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.group.as_ref().map_or(1, |g| g.size())
    }

    /// The group, when there is more than one rank.
    pub fn process_group(&self) -> Option<&Arc<dyn ProcessGroup>> {
        self.group.as_ref().filter(|g| g.size() > 1)
    }

    /// Waits for every rank (no-op on one rank).
    pub fn barrier(&self) -> Result<(), CommError> {
        self.process_group().map_or(Ok(()), |g| g.barrier())
    }

    /// All-reduce of host values (identity on one rank).
    pub fn all_reduce(&self, tensor: HostTensor, op: ReduceOp) -> Result<HostTensor, CommError> {
        match self.process_group() {
            Some(g) => g.all_reduce(tensor, op),
            None => Ok(tensor),
        }
    }

    /// All-reduce that panics on a communication failure: for use inside autodiff, where
    /// errors cannot be returned. The panic message names the failure on every rank.
    pub fn all_reduce_or_panic(&self, tensor: HostTensor, op: ReduceOp) -> HostTensor {
        match self.process_group() {
            None => tensor,
            Some(g) => g
                .all_reduce(tensor, op)
                .unwrap_or_else(|e| comm_panic(g, e)),
        }
    }

    /// All-gather along `dim`, panicking on failure (see [`Self::all_reduce_or_panic`]).
    pub fn all_gather_or_panic(&self, tensor: HostTensor, dim: usize) -> HostTensor {
        match self.process_group() {
            None => tensor,
            Some(g) => g
                .all_gather(tensor, dim)
                .unwrap_or_else(|e| comm_panic(g, e)),
        }
    }
}

fn comm_panic(group: &Arc<dyn ProcessGroup>, error: CommError) -> ! {
    std::panic::panic_any(format!("tensor-parallel rank {}: {error}", group.rank()))
}
