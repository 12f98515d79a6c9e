//! [`MpiComm`]: one rank per process over MPI (Open MPI, MPICH), through the `mpi` crate.
//!
//! Messages travel as bytes, so any dtype crosses unchanged. Sums and maxima of f32/f64 use
//! MPI's own reductions (`MPI_Allreduce`, `MPI_Reduce_scatter_block`); dtypes MPI has no type
//! for (bf16, f16) are gathered and reduced here in rank order, accumulating in f32. Calls on
//! one communicator are serialized by a lock: MPI forbids two collectives at once on one
//! communicator, and ranks may call from several threads (the training loop and autodiff).
//!
//! Errors inside MPI are fatal (MPI's default handler): a failed or killed rank ends the job
//! through the launcher, so no rank hangs waiting for a dead one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use burn::tensor::{DType, TensorData};
use mpi::collective::SystemOperation;
use mpi::request::StaticScope;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::Communicator as _;
use mpi::traits::*;

use super::buffer::{join, reduce, reduce_own_part, split};
use super::{shape_of, CommError, Communicator, Expect, ReduceOp};

/// An MPI communicator handle that may move between threads.
struct Raw(SimpleCommunicator);

// SAFETY: the MPI library is initialised with `MPI_THREAD_MULTIPLE` (checked in
// `world::init_mpi`), so any thread may call MPI; `MpiComm` serialises the calls on each
// communicator with its lock. rsmpi marks Open MPI's handle type `!Send` only because it is
// a raw pointer.
unsafe impl Send for Raw {}

/// One rank's handle on an MPI communicator.
///
/// `recv` holds the communicator's lock while it waits, so a rank must not expect another of
/// its threads to send on the same communicator meanwhile: give such a thread its own
/// communicator (`split`).
pub struct MpiComm {
    raw: Mutex<Raw>,
    /// Sends not yet known to be complete (see [`Communicator::send`] here).
    pending: Mutex<Vec<PendingSend>>,
    rank: usize,
    size: usize,
    /// Collectives issued so far, for error messages.
    calls: AtomicU64,
}

/// A send in flight: MPI's request and the buffer it reads, owned here until it completes.
struct PendingSend {
    request: Option<mpi::request::Request<'static, [u8], StaticScope>>,
    buffer: *mut [u8],
}

// SAFETY: as for `Raw`: MPI is initialised with `MPI_THREAD_MULTIPLE`, and the buffer is
// owned by this value alone (leaked from a `Box` for MPI to read, reclaimed once done).
unsafe impl Send for PendingSend {}

impl PendingSend {
    /// Whether the send is complete (then the buffer is freed).
    fn try_finish(&mut self) -> bool {
        let Some(request) = self.request.take() else {
            return true;
        };
        match request.test() {
            Ok(_) => {
                self.free();
                true
            }
            Err(request) => {
                self.request = Some(request);
                false
            }
        }
    }

    /// Waits for the send to complete and frees the buffer.
    fn finish(mut self) {
        if let Some(request) = self.request.take() {
            request.wait();
            self.free();
        }
    }

    fn free(&mut self) {
        // SAFETY: `buffer` came from `Box::leak` in `send`, and MPI no longer reads it.
        drop(unsafe { Box::from_raw(self.buffer) });
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        self.finish_sends();
    }
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiComm(rank {} of {})", self.rank, self.size)
    }
}

fn op_of(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
    }
}

impl MpiComm {
    /// Wraps `comm` (for example `universe.world()`).
    pub fn new(comm: SimpleCommunicator) -> Self {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Self {
            raw: Mutex::new(Raw(comm)),
            pending: Mutex::new(Vec::new()),
            rank,
            size,
            calls: AtomicU64::new(0),
        }
    }

    /// Waits for every send in flight.
    fn finish_sends(&self) {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        for send in pending {
            send.finish();
        }
    }

    fn lock(&self) -> MutexGuard<'_, Raw> {
        self.raw.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every rank's bytes, in rank order (all the same length).
    fn gather_bytes(&self, bytes: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; bytes.len() * self.size];
        self.lock().0.all_gather_into(bytes, &mut out[..]);
        out
    }

    /// Every rank's `data` (all the same shape and dtype), in rank order.
    fn gather_parts(&self, data: &TensorData) -> Vec<TensorData> {
        let all = self.gather_bytes(data.as_bytes());
        let n = data.as_bytes().len();
        (0..self.size)
            .map(|r| {
                TensorData::from_bytes_vec(
                    all[r * n..(r + 1) * n].to_vec(),
                    shape_of(data),
                    data.dtype(),
                )
            })
            .collect()
    }

    /// Checks on every rank that all ranks called with the same shape and dtype, so a
    /// mismatch is an error rather than MPI reading past a buffer.
    fn agree(&self, what: &str, data: &TensorData) -> Result<(), CommError> {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let mut sig: Vec<i64> = vec![dtype_code(data.dtype()), data.shape().len() as i64];
        sig.extend(data.shape().iter().map(|&d| d as i64));
        sig.resize(10, -1);
        let mine: Vec<u8> = sig.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self.gather_bytes(&mine);
        if all.chunks(mine.len()).all(|c| c == mine.as_slice()) {
            return Ok(());
        }
        let detail = all
            .chunks(mine.len())
            .enumerate()
            .map(|(r, c)| {
                let v: Vec<i64> = c
                    .chunks(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                let rank = v[1] as usize;
                format!("rank {r}: {what} of shape {:?}", &v[2..2 + rank.min(8)])
            })
            .collect::<Vec<_>>()
            .join(", ");
        Err(CommError::Mismatch { call, detail })
    }

    fn check_rank(&self, what: &str, rank: usize) -> Result<(), CommError> {
        if rank < self.size {
            Ok(())
        } else {
            Err(CommError::Invalid(format!(
                "{what} rank {rank} out of range for {} ranks",
                self.size
            )))
        }
    }
}

fn dtype_code(dtype: DType) -> i64 {
    match dtype {
        DType::F64 => 1,
        DType::F32 => 2,
        DType::F16 => 3,
        DType::BF16 => 4,
        DType::I64 => 5,
        DType::I32 => 6,
        _ => 0,
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, data: TensorData, op: ReduceOp) -> Result<TensorData, CommError> {
        self.agree("all_reduce", &data)?;
        let shape = shape_of(&data);
        match data.dtype() {
            DType::F32 => {
                let send = data.as_slice::<f32>().expect("f32");
                let mut out = vec![0f32; send.len()];
                self.lock().0.all_reduce_into(send, &mut out[..], op_of(op));
                Ok(TensorData::new(out, shape))
            }
            DType::F64 => {
                let send = data.as_slice::<f64>().expect("f64");
                let mut out = vec![0f64; send.len()];
                self.lock().0.all_reduce_into(send, &mut out[..], op_of(op));
                Ok(TensorData::new(out, shape))
            }
            _ => reduce(&self.gather_parts(&data), op),
        }
    }

    fn all_gather(&self, data: TensorData, dim: usize) -> Result<TensorData, CommError> {
        self.agree("all_gather", &data)?;
        if dim >= data.shape().len() {
            return Err(CommError::Invalid(format!(
                "all_gather: dimension {dim} out of range for {:?}",
                shape_of(&data)
            )));
        }
        join(&self.gather_parts(&data), dim)
    }

    fn reduce_scatter(
        &self,
        data: TensorData,
        dim: usize,
        op: ReduceOp,
    ) -> Result<TensorData, CommError> {
        self.agree("reduce_scatter", &data)?;
        let pieces = split(&data, dim, self.size)?;
        let piece_shape = shape_of(&pieces[0]);
        match data.dtype() {
            DType::F32 | DType::F64 => {
                // Piece k contiguous, so MPI's block k is this dimension's chunk k.
                let bytes: Vec<u8> = pieces.iter().flat_map(|p| p.as_bytes().to_vec()).collect();
                let flat = TensorData::from_bytes_vec(
                    bytes,
                    vec![data.shape().num_elements()],
                    data.dtype(),
                );
                let n = pieces[0].num_elements();
                let out = if data.dtype() == DType::F32 {
                    let mut out = vec![0f32; n];
                    self.lock().0.reduce_scatter_block_into(
                        flat.as_slice::<f32>().expect("f32"),
                        &mut out[..],
                        op_of(op),
                    );
                    TensorData::new(out, piece_shape)
                } else {
                    let mut out = vec![0f64; n];
                    self.lock().0.reduce_scatter_block_into(
                        flat.as_slice::<f64>().expect("f64"),
                        &mut out[..],
                        op_of(op),
                    );
                    TensorData::new(out, piece_shape)
                };
                Ok(out)
            }
            _ => reduce_own_part(&self.gather_parts(&data), dim, self.rank, op),
        }
    }

    fn broadcast(&self, data: TensorData, root: usize) -> Result<TensorData, CommError> {
        self.check_rank("broadcast root", root)?;
        self.agree("broadcast", &data)?;
        let (shape, dtype) = (shape_of(&data), data.dtype());
        let mut bytes = data.as_bytes().to_vec();
        self.lock()
            .0
            .process_at_rank(root as i32)
            .broadcast_into(&mut bytes[..]);
        Ok(TensorData::from_bytes_vec(bytes, shape, dtype))
    }

    /// Returns without waiting for the receiver (an `MPI_Isend` of a copy of the bytes): two
    /// pipeline stages that send to each other and then receive, as the 1F1B schedule's
    /// steady state does, would deadlock on blocking sends of large messages.
    fn send(&self, data: TensorData, dst: usize) -> Result<(), CommError> {
        self.check_rank("send destination", dst)?;
        let buffer: &'static mut [u8] = Box::leak(data.as_bytes().to_vec().into_boxed_slice());
        let ptr: *mut [u8] = buffer;
        // SAFETY: the buffer lives until `PendingSend::free`, after the request completes.
        let readable: &'static [u8] = unsafe { &*ptr };
        let request = self
            .lock()
            .0
            .process_at_rank(dst as i32)
            .immediate_send(StaticScope, readable);
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.retain_mut(|p| !p.try_finish());
        pending.push(PendingSend {
            request: Some(request),
            buffer: ptr,
        });
        Ok(())
    }

    fn recv(&self, expect: &Expect, src: usize) -> Result<TensorData, CommError> {
        self.check_rank("recv source", src)?;
        let n = expect.shape.iter().product::<usize>() * expect.dtype.size();
        let (bytes, _status) = self
            .lock()
            .0
            .process_at_rank(src as i32)
            .receive_vec::<u8>();
        if bytes.len() != n {
            return Err(CommError::Mismatch {
                call: self.calls.load(Ordering::Relaxed),
                detail: format!(
                    "rank {} expected {:?} {:?} ({n} bytes) from rank {src}, which sent {} bytes",
                    self.rank,
                    expect.shape,
                    expect.dtype,
                    bytes.len()
                ),
            });
        }
        Ok(TensorData::from_bytes_vec(
            bytes,
            expect.shape.clone(),
            expect.dtype,
        ))
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.finish_sends();
        self.lock().0.barrier();
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>, CommError> {
        let sub = self
            .lock()
            .0
            .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            .ok_or_else(|| CommError::Invalid(format!("MPI split by color {color} failed")))?;
        Ok(Arc::new(MpiComm::new(sub)))
    }
}
