//! [`Group`]: the cheap, clonable handle on a communicator that layers and the training step
//! keep (a tensor-parallel group, a data-parallel group, ...).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use burn::tensor::TensorData;

use super::{CommError, Communicator, ReduceOp};

/// A handle on this rank's group. The default is a group of one rank, where every collective
/// is the identity and nothing is communicated.
///
/// It also clocks the time this rank spends communicating (see [`Self::timed`]), shared by
/// all clones, for the benchmarks and the logs.
#[derive(Clone, Debug, Default)]
pub struct Group {
    comm: Option<Arc<dyn Communicator>>,
    comm_nanos: Arc<AtomicU64>,
}

impl Group {
    /// A single-rank group (no communication at all).
    pub fn single() -> Self {
        Self::default()
    }

    /// A handle on `comm`.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self {
            comm: Some(comm),
            comm_nanos: Arc::default(),
        }
    }

    /// Runs `f`, adding its wall time to this group's communication clock.
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
        self.comm.as_ref().map_or(0, |g| g.rank())
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.comm.as_ref().map_or(1, |g| g.size())
    }

    /// How many of the group's ranks share this process (see
    /// [`Communicator::ranks_in_process`]).
    pub fn ranks_in_process(&self) -> usize {
        self.comm.as_ref().map_or(1, |g| g.ranks_in_process())
    }

    /// The communicator, when there is more than one rank.
    pub fn communicator(&self) -> Option<&Arc<dyn Communicator>> {
        self.comm.as_ref().filter(|g| g.size() > 1)
    }

    /// Waits for every rank (no-op on one rank).
    pub fn barrier(&self) -> Result<(), CommError> {
        self.communicator().map_or(Ok(()), |g| g.barrier())
    }

    /// All-reduce of host values (identity on one rank); untimed, callers time what they count.
    pub fn all_reduce(&self, data: TensorData, op: ReduceOp) -> Result<TensorData, CommError> {
        match self.communicator() {
            Some(g) => g.all_reduce(data, op),
            None => Ok(data),
        }
    }

    /// All-reduce of one number (a loss sum, an overflow flag, a norm's squares).
    pub fn all_reduce_scalar(&self, value: f64, op: ReduceOp) -> Result<f64, CommError> {
        let reduced = self.all_reduce(TensorData::new(vec![value], [1]), op)?;
        first_f64(&reduced)
    }

    /// All-gather of one number per rank, in rank order.
    pub fn all_gather_scalars(&self, value: f64) -> Result<Vec<f64>, CommError> {
        let gathered = self.all_gather(TensorData::new(vec![value], [1]), 0)?;
        gathered
            .try_to_vec::<f64>()
            .map_err(|e| CommError::Invalid(format!("gathered scalars: {e:?}")))
    }

    /// All-gather along `dim` (identity on one rank); untimed, callers time what they count.
    pub fn all_gather(&self, data: TensorData, dim: usize) -> Result<TensorData, CommError> {
        match self.communicator() {
            Some(g) => g.all_gather(data, dim),
            None => Ok(data),
        }
    }

    /// Reduce-scatter along `dim` (identity on one rank); untimed, callers time what they count.
    pub fn reduce_scatter(
        &self,
        data: TensorData,
        dim: usize,
        op: ReduceOp,
    ) -> Result<TensorData, CommError> {
        match self.communicator() {
            Some(g) => g.reduce_scatter(data, dim, op),
            None => Ok(data),
        }
    }

    /// Broadcast from `root` (identity on one rank); untimed, callers time what they count.
    pub fn broadcast(&self, data: TensorData, root: usize) -> Result<TensorData, CommError> {
        match self.communicator() {
            Some(g) => g.broadcast(data, root),
            None => Ok(data),
        }
    }

    /// All-reduce that panics on a communication failure: for use inside autodiff, where
    /// errors cannot be returned. The panic message names the failure on every rank.
    pub fn all_reduce_or_panic(&self, data: TensorData, op: ReduceOp) -> TensorData {
        self.all_reduce(data, op)
            .unwrap_or_else(|e| self.comm_panic(e))
    }

    /// All-gather along `dim`, panicking on failure (see [`Self::all_reduce_or_panic`]).
    pub fn all_gather_or_panic(&self, data: TensorData, dim: usize) -> TensorData {
        self.all_gather(data, dim)
            .unwrap_or_else(|e| self.comm_panic(e))
    }

    /// Reduce-scatter along `dim`, panicking on failure (see [`Self::all_reduce_or_panic`]).
    pub fn reduce_scatter_or_panic(
        &self,
        data: TensorData,
        dim: usize,
        op: ReduceOp,
    ) -> TensorData {
        self.reduce_scatter(data, dim, op)
            .unwrap_or_else(|e| self.comm_panic(e))
    }

    /// All-gather along `dim` around the ring ([`super::ring::ring_all_gather`]).
    pub fn ring_all_gather(&self, data: TensorData, dim: usize) -> Result<TensorData, CommError> {
        match self.communicator() {
            Some(g) => super::ring::ring_all_gather(g.as_ref(), data, dim),
            None => Ok(data),
        }
    }

    /// Sum-reduce-scatter along `dim` around the ring ([`super::ring::ring_reduce_scatter`]).
    pub fn ring_reduce_scatter(
        &self,
        data: TensorData,
        dim: usize,
    ) -> Result<TensorData, CommError> {
        match self.communicator() {
            Some(g) => super::ring::ring_reduce_scatter(g.as_ref(), data, dim),
            None => Ok(data),
        }
    }

    /// [`Self::ring_all_gather`], panicking on failure (see [`Self::all_reduce_or_panic`]).
    pub fn ring_all_gather_or_panic(&self, data: TensorData, dim: usize) -> TensorData {
        self.ring_all_gather(data, dim)
            .unwrap_or_else(|e| self.comm_panic(e))
    }

    /// [`Self::ring_reduce_scatter`], panicking on failure (see
    /// [`Self::all_reduce_or_panic`]).
    pub fn ring_reduce_scatter_or_panic(&self, data: TensorData, dim: usize) -> TensorData {
        self.ring_reduce_scatter(data, dim)
            .unwrap_or_else(|e| self.comm_panic(e))
    }

    fn comm_panic(&self, error: CommError) -> ! {
        std::panic::panic_any(format!("rank {} of a parallel group: {error}", self.rank()))
    }
}

/// The one f64 of a reduced scalar.
fn first_f64(data: &TensorData) -> Result<f64, CommError> {
    data.as_slice::<f64>()
        .ok()
        .and_then(|v| v.first().copied())
        .ok_or_else(|| CommError::Invalid("a reduced scalar is not one f64".into()))
}
