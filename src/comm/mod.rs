//! Communicators: the one interface every parallel layout talks to, whatever carries the bytes.
//!
//! - [`Communicator`]: rank, size and the collectives (all-reduce, all-gather, reduce-scatter,
//!   broadcast, send/recv, barrier) plus [`Communicator::split`] into sub-groups, on host
//!   [`TensorData`] of any dtype (f32, bf16, f16, f64, integers); [`tensor`] moves burn device
//!   tensors through them.
//! - [`ThreadComm`]: N ranks as N threads of one process (the zero-setup default);
//! - `MpiComm` (feature `mpi`): one rank per process, launched by `mpirun` / `srun`;
//! - `NcclComm` (feature `cuda`): collectives in NCCL between GPUs, bootstrapped over a host
//!   communicator (`--distributed-backend nccl`);
//! - [`world`]: how a run finds its ranks (threads, or MPI from the launcher's environment);
//! - [`conformance`]: the collective test suite, written once and run on every communicator.
//!
//! Collectives are matched by call order, as in MPI and NCCL: every rank of a group issues
//! the same sequence of calls with the same shapes. Reductions combine the ranks in rank
//! order wherever the communicator computes them itself (threads, and MPI for dtypes MPI has
//! no type for), so those results are bitwise reproducible.

pub mod buffer;
pub mod conformance;
mod group;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod ring;
pub mod tensor;
mod thread;
pub mod world;

use std::fmt;
use std::sync::Arc;

use burn::tensor::{DType, TensorData};

pub use group::Group;
pub use thread::{run_ranks, ThreadComm};

/// Element-wise reduction of an all-reduce or reduce-scatter.
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
    /// A bad argument (root out of range, shapes that cannot be gathered or split).
    #[error("{0}")]
    Invalid(String),
}

/// What a receiver expects from [`Communicator::recv`]: the sender's shape and dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expect {
    /// Shape of the message.
    pub shape: Vec<usize>,
    /// Element type of the message.
    pub dtype: DType,
}

/// A group of ranks that run collectives together.
///
/// Messages are host [`TensorData`]: shape, dtype and bytes travel unchanged (a bf16 tensor
/// stays bf16 on the wire). Results of collectives are the same on every rank. Device
/// tensors go through [`tensor`]; a device-side implementation (NCCL) works on the device
/// memory instead, behind the same calls.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This rank, `0..size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// The element-wise `op` of `data` over all ranks.
    fn all_reduce(&self, data: TensorData, op: ReduceOp) -> Result<TensorData, CommError>;
    /// Every rank's `data`, joined along `dim` in rank order.
    fn all_gather(&self, data: TensorData, dim: usize) -> Result<TensorData, CommError>;
    /// Part `rank` of the element-wise `op` over all ranks, `data` cut into `size` equal parts
    /// along `dim` (which must divide evenly).
    fn reduce_scatter(
        &self,
        data: TensorData,
        dim: usize,
        op: ReduceOp,
    ) -> Result<TensorData, CommError>;
    /// Rank `root`'s `data` on every rank (the others pass data of the same shape and dtype).
    fn broadcast(&self, data: TensorData, root: usize) -> Result<TensorData, CommError>;
    /// Sends `data` to rank `dst`; messages between two ranks arrive in the order sent.
    fn send(&self, data: TensorData, dst: usize) -> Result<(), CommError>;
    /// The next message from rank `src`, which must have the shape and dtype of `expect`.
    fn recv(&self, expect: &Expect, src: usize) -> Result<TensorData, CommError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CommError>;
    /// Sub-groups: every rank calls it; ranks passing the same `color` form one new group,
    /// ordered by `key` (then by rank here). Like `MPI_Comm_split`.
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>, CommError>;
    /// How many of this group's ranks share this process (and its memory): all of them for
    /// threads, one for processes.
    fn ranks_in_process(&self) -> usize {
        1
    }
    /// This group as an NCCL group, which can work on CUDA memory in place.
    #[cfg(feature = "cuda")]
    fn as_nccl(&self) -> Option<&nccl::NcclComm> {
        None
    }
}

/// The shape of `data` as a plain vector.
pub fn shape_of(data: &TensorData) -> Vec<usize> {
    data.shape().to_vec()
}
