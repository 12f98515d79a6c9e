//! [`NcclComm`]: collectives carried by NCCL between GPUs (feature `cuda`), one rank per
//! process, as Megatron runs with `--distributed-backend nccl`.
//!
//! As in llm.c, the NCCL bootstrap is kept apart from the collectives: an NCCL group is made
//! over a host communicator (the MPI world, or threads): rank 0 draws NCCL's unique id and
//! broadcasts its 128 bytes over the host group, then every rank joins. The host group stays
//! beside it for what NCCL does not do: checking that ranks agree on shapes (a mismatch in
//! NCCL hangs or corrupts), barriers, and [`Communicator::split`], which splits the host
//! group and bootstraps a new NCCL group over each part (no `ncclCommSplit`, so no minimum
//! NCCL version).
//!
//! Burn tensors in CUDA memory are communicated where they lie (`*_in_device_memory`, which
//! [`super::tensor`] uses for every CUDA tensor): NCCL reads and writes burn's buffers by
//! their device addresses, in their own dtype (bf16 stays bf16). The [`Communicator`] calls
//! take host [`TensorData`]: the bytes go to the GPU, NCCL works on them there, and the
//! result comes back. Point-to-point
//! messages (pipeline activations) go through the host group. NCCL refuses two ranks on one
//! GPU: each process uses the GPU of its local rank.

use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::tensor::{DType, TensorData};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result, sys};

use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;

use super::buffer::{join, split};
use super::{shape_of, CommError, Communicator, Expect, ReduceOp};

/// An NCCL communicator handle (a pointer NCCL owns); used under [`NcclComm`]'s lock only.
struct RawComm(sys::ncclComm_t);

// SAFETY: NCCL communicators may be used from any thread, one call at a time; the mutex in
// `NcclComm` serialises the calls.
unsafe impl Send for RawComm {}

/// A group of GPU ranks whose collectives run in NCCL (see the module docs).
pub struct NcclComm {
    host: Arc<dyn Communicator>,
    ordinal: usize,
    stream: Arc<CudaStream>,
    comm: Mutex<RawComm>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclComm(rank {} of {}, GPU {})",
            self.host.rank(),
            self.host.size(),
            self.ordinal
        )
    }
}

fn nccl_error(what: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Invalid(format!("NCCL {what}: {e:?}"))
}

fn cuda_error(what: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Invalid(format!("CUDA {what}: {e:?}"))
}

/// NCCL's element type for `dtype`.
fn nccl_dtype(dtype: DType) -> Result<sys::ncclDataType_t, CommError> {
    use sys::ncclDataType_t as T;
    Ok(match dtype {
        DType::F64 => T::ncclFloat64,
        DType::F32 => T::ncclFloat32,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::I64 => T::ncclInt64,
        DType::I32 => T::ncclInt32,
        DType::I8 => T::ncclInt8,
        DType::U64 => T::ncclUint64,
        DType::U32 => T::ncclUint32,
        DType::U8 => T::ncclUint8,
        other => {
            return Err(CommError::Invalid(format!(
                "NCCL has no element type for {other:?}"
            )))
        }
    })
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

/// A small code per dtype for the shape agreement.
fn dtype_code(dtype: DType) -> i64 {
    [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::I8,
        DType::U64,
        DType::U32,
        DType::U8,
    ]
    .iter()
    .position(|d| *d == dtype)
    .map_or(0, |p| p as i64 + 1)
}

impl NcclComm {
    /// Joins an NCCL group with the ranks of `host` (every rank of `host` calls it), on GPU
    /// `ordinal`. A rank whose NCCL set-up fails makes every rank return the error.
    pub fn bootstrap(host: Arc<dyn Communicator>, ordinal: usize) -> Result<Self, CommError> {
        let context = CudaContext::new(ordinal).map_err(|e| cuda_error("device", e))?;
        let stream = context.default_stream();
        // Rank 0's id, or its failure (first byte 1 = a usable id follows).
        let mut message = vec![0u8; 129];
        if host.rank() == 0 {
            match result::get_uniqueid() {
                Ok(id) => {
                    message[0] = 1;
                    for (m, c) in message[1..].iter_mut().zip(id.internal.iter()) {
                        *m = *c as u8;
                    }
                }
                Err(e) => eprintln!("NCCL: no unique id on rank 0: {e:?}"),
            }
        }
        let message = host.broadcast(TensorData::new(message, [129]), 0)?;
        let message = message.as_bytes();
        if message[0] != 1 {
            return Err(CommError::Invalid(
                "NCCL: rank 0 could not create the group's unique id".into(),
            ));
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, m) in internal.iter_mut().zip(&message[1..]) {
            *c = *m as std::ffi::c_char;
        }
        let id = sys::ncclUniqueId { internal };
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL on success and read only then.
        let joined = unsafe {
            result::comm_init_rank(
                comm.as_mut_ptr(),
                host.size() as i32,
                id,
                host.rank() as i32,
            )
        };
        // Every rank learns whether every rank joined, so none waits on a missing one.
        let ok = host.all_reduce(
            TensorData::new(vec![if joined.is_ok() { 0.0f64 } else { 1.0 }], [1]),
            ReduceOp::Max,
        )?;
        if let Err(e) = joined {
            return Err(nccl_error("joining the group", e));
        }
        // SAFETY: `comm_init_rank` succeeded.
        let comm = RawComm(unsafe { comm.assume_init() });
        let failed = host_values::<f64>(ok)?[0] > 0.0;
        let me = Self {
            host,
            ordinal,
            stream,
            comm: Mutex::new(comm),
        };
        if failed {
            return Err(CommError::Invalid(
                "NCCL: another rank could not join the group".into(),
            ));
        }
        Ok(me)
    }

    fn lock(&self) -> MutexGuard<'_, RawComm> {
        self.comm.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks on the host group that every rank calls `what` with the same dtype and shape
    /// (NCCL itself would hang or mix up bytes).
    fn agree(&self, what: &str, data: &TensorData, extra: i64) -> Result<(), CommError> {
        self.agree_on(what, data.dtype(), data.shape(), extra)
    }

    /// [`Self::agree`] on a dtype and shape.
    fn agree_on(
        &self,
        what: &str,
        dtype: DType,
        shape: &[usize],
        extra: i64,
    ) -> Result<(), CommError> {
        let mut sig = vec![dtype_code(dtype), extra, shape.len() as i64];
        sig.extend(shape.iter().map(|&d| d as i64));
        sig.resize(12, -1);
        let all = self
            .host
            .all_gather(TensorData::new(sig.clone(), [1, 12]), 0)?;
        let all = host_values::<i64>(all)?;
        if all.chunks(12).all(|c| c == sig.as_slice()) {
            return Ok(());
        }
        let detail = all
            .chunks(12)
            .enumerate()
            .map(|(r, c)| {
                let dims = (c[2].max(0) as usize).min(9);
                format!("rank {r}: {what} of shape {:?}", &c[3..3 + dims])
            })
            .collect::<Vec<_>>()
            .join(", ");
        Err(CommError::Mismatch { call: 0, detail })
    }

    fn upload(&self, data: &TensorData) -> Result<CudaSlice<u8>, CommError> {
        self.stream
            .clone_htod(data.as_bytes())
            .map_err(|e| cuda_error("upload", e))
    }

    fn download(
        &self,
        buffer: &CudaSlice<u8>,
        shape: Vec<usize>,
        dtype: DType,
    ) -> Result<TensorData, CommError> {
        let bytes = self
            .stream
            .clone_dtoh(buffer)
            .map_err(|e| cuda_error("download", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda_error("download", e))?;
        Ok(TensorData::from_bytes_vec(bytes, shape, dtype))
    }

    fn zeros(&self, bytes: usize) -> Result<CudaSlice<u8>, CommError> {
        self.stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(|e| cuda_error("allocation", e))
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }
}

/// What a CUDA tensor's device memory looks like to NCCL: burn's CUDA runtime's server, whose
/// storage hands out raw device pointers. (cubecl 0.11 keeps its `Runtime` trait out of its
/// prelude; the server type is reachable only through it.)
type CudaServer =
    <burn_cubecl::cubecl::cuda::CudaRuntime as burn_cubecl::cubecl::__private::Runtime>::Server;

/// A collective on CUDA memory: the CUDA tensor it works on, or the tensor handed back
/// unchanged when it is not in CUDA memory (the caller then stages it through the host).
pub type InDeviceMemory<const D: usize> =
    Result<Result<burn::tensor::Tensor<D>, burn::tensor::Tensor<D>>, CommError>;

/// `x` as a contiguous CUDA tensor of burn's CUDA runtime, or `None` when it lives elsewhere
/// (the CPU, another CubeCL runtime). With `private`, a copy made by a kernel, so that only
/// the caller holds it and may overwrite it in place.
fn cuda_tensor<const D: usize>(x: &burn::tensor::Tensor<D>, private: bool) -> Option<CubeTensor> {
    let source = if private {
        x.clone().mul_scalar(1.0)
    } else {
        x.clone()
    };
    let cube = source.try_into_primitive::<CubeBackend>().ok()?;
    let cube: CubeTensor = burn_cubecl::kernel::into_contiguous(cube);
    cube.client
        .get_resource::<CudaServer>(cube.handle.clone())
        .ok()?;
    Some(cube)
}

/// A new contiguous CUDA tensor of `shape` like `like` (its device and dtype), unwritten.
fn empty_cuda_tensor(like: &CubeTensor, shape: Vec<usize>) -> CubeTensor {
    let shape = burn::tensor::Shape::from(shape);
    let handle = like.client.empty(shape.num_elements() * like.dtype.size());
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        shape,
        handle,
        like.dtype,
    )
}

impl NcclComm {
    /// Runs `call` with the device addresses of `tensors` once the device has finished the
    /// work queued before (burn's stream is not NCCL's), then waits for NCCL's stream, so the
    /// tensors are complete when they go back to burn. The addresses stay valid throughout:
    /// the resources are held until NCCL is done.
    fn on_device(
        &self,
        what: &str,
        tensors: &[&CubeTensor],
        call: impl FnOnce(
            &[u64],
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> Result<result::NcclStatus, result::NcclError>,
    ) -> Result<(), CommError> {
        let resources = tensors
            .iter()
            .map(|t| {
                t.client
                    .get_resource::<CudaServer>(t.handle.clone())
                    .map_err(|e| cuda_error(what, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        <CubeBackend as burn::backend::Backend>::sync(&tensors[0].device)
            .map_err(|e| cuda_error("sync", e))?;
        let pointers: Vec<u64> = resources.iter().map(|r| r.resource().ptr).collect();
        {
            let comm = self.lock();
            call(&pointers, comm.0, self.cu_stream()).map_err(|e| nccl_error(what, e))?;
            self.stream.synchronize().map_err(|e| cuda_error(what, e))?;
        }
        drop(resources);
        Ok(())
    }

    /// The element-wise `op` of `x` over the group, reduced by NCCL in place in a private
    /// copy of `x` in CUDA memory: no host copy. `Ok(Err(x))` when `x` is not a CUDA tensor.
    pub fn all_reduce_in_device_memory<const D: usize>(
        &self,
        x: burn::tensor::Tensor<D>,
        op: ReduceOp,
    ) -> InDeviceMemory<D> {
        let Some(cube) = cuda_tensor(&x, true) else {
            return Ok(Err(x));
        };
        self.agree_on("all_reduce", cube.dtype, cube.meta.shape.as_slice(), 1)?;
        let (count, dtype) = (cube.meta.shape.num_elements(), nccl_dtype(cube.dtype)?);
        self.on_device("all_reduce", &[&cube], |ptr, comm, stream| {
            // SAFETY: `ptr[0]` addresses the `count` elements of `dtype` of a buffer only
            // this call holds.
            unsafe {
                result::all_reduce(
                    ptr[0] as *const _,
                    ptr[0] as *mut _,
                    count,
                    dtype,
                    nccl_op(op),
                    comm,
                    stream,
                )
            }
        })?;
        Ok(Ok(burn::tensor::Tensor::from_primitive::<CubeBackend>(
            cube,
        )))
    }

    /// Rank `root`'s `x` on every rank, broadcast by NCCL in a private copy of `x` in CUDA
    /// memory. `Ok(Err(x))` when `x` is not a CUDA tensor.
    pub fn broadcast_in_device_memory<const D: usize>(
        &self,
        x: burn::tensor::Tensor<D>,
        root: usize,
    ) -> InDeviceMemory<D> {
        if root >= self.size() {
            return Err(CommError::Invalid(format!(
                "broadcast root rank {root} out of range for {} ranks",
                self.size()
            )));
        }
        let Some(cube) = cuda_tensor(&x, true) else {
            return Ok(Err(x));
        };
        self.agree_on(
            "broadcast",
            cube.dtype,
            cube.meta.shape.as_slice(),
            1000 + root as i64,
        )?;
        let (count, dtype) = (cube.meta.shape.num_elements(), nccl_dtype(cube.dtype)?);
        self.on_device("broadcast", &[&cube], |ptr, comm, stream| {
            // SAFETY: in-place broadcast of the `count` elements of a buffer only this call
            // holds.
            unsafe {
                result::broadcast(
                    ptr[0] as *const _,
                    ptr[0] as *mut _,
                    count,
                    dtype,
                    root as i32,
                    comm,
                    stream,
                )
            }
        })?;
        Ok(Ok(burn::tensor::Tensor::from_primitive::<CubeBackend>(
            cube,
        )))
    }

    /// Every rank's `x` joined along `dim`, gathered by NCCL in CUDA memory. NCCL lays the
    /// ranks' buffers end to end, which is a join along dimension 0; for another `dim` the
    /// tensor goes through with `dim` swapped to the front and back (kernels on the GPU).
    /// `Ok(Err(x))` when `x` is not a CUDA tensor.
    pub fn all_gather_in_device_memory<const D: usize>(
        &self,
        x: burn::tensor::Tensor<D>,
        dim: usize,
    ) -> InDeviceMemory<D> {
        let front = x.clone().swap_dims(0, dim);
        let Some(send) = cuda_tensor(&front, false) else {
            return Ok(Err(x));
        };
        let shape = send.meta.shape.as_slice().to_vec();
        self.agree_on("all_gather", send.dtype, &shape, 2 + dim as i64)?;
        let mut gathered_shape = shape.clone();
        gathered_shape[0] *= self.size();
        let recv = empty_cuda_tensor(&send, gathered_shape);
        let (count, dtype) = (send.meta.shape.num_elements(), nccl_dtype(send.dtype)?);
        self.on_device("all_gather", &[&send, &recv], |ptr, comm, stream| {
            // SAFETY: `ptr[1]` holds the group's size times the `count` elements at `ptr[0]`.
            unsafe {
                result::all_gather(
                    ptr[0] as *const _,
                    ptr[1] as *mut _,
                    count,
                    dtype,
                    comm,
                    stream,
                )
            }
        })?;
        let gathered = burn::tensor::Tensor::<D>::from_primitive::<CubeBackend>(recv);
        Ok(Ok(gathered.swap_dims(0, dim)))
    }

    /// This rank's part along `dim` of the element-wise `op` of `x` over the group, reduced
    /// and scattered by NCCL in CUDA memory (`dim` swapped to the front, as
    /// [`Self::all_gather_in_device_memory`]). `Ok(Err(x))` when `x` is not a CUDA tensor.
    pub fn reduce_scatter_in_device_memory<const D: usize>(
        &self,
        x: burn::tensor::Tensor<D>,
        dim: usize,
        op: ReduceOp,
    ) -> InDeviceMemory<D> {
        let n = self.size();
        let size = x.dims()[dim];
        if !size.is_multiple_of(n) {
            return Err(CommError::Invalid(format!(
                "reduce_scatter: dimension {dim} of size {size} does not split over {n} ranks"
            )));
        }
        let front = x.clone().swap_dims(0, dim);
        let Some(send) = cuda_tensor(&front, false) else {
            return Ok(Err(x));
        };
        let shape = send.meta.shape.as_slice().to_vec();
        self.agree_on("reduce_scatter", send.dtype, &shape, 100 + dim as i64)?;
        let mut part_shape = shape.clone();
        part_shape[0] /= n;
        let recv = empty_cuda_tensor(&send, part_shape);
        let (count, dtype) = (recv.meta.shape.num_elements(), nccl_dtype(send.dtype)?);
        self.on_device("reduce_scatter", &[&send, &recv], |ptr, comm, stream| {
            // SAFETY: `ptr[0]` holds the group's size times the `count` elements at `ptr[1]`.
            unsafe {
                result::reduce_scatter(
                    ptr[0] as *const _,
                    ptr[1] as *mut _,
                    count,
                    dtype,
                    nccl_op(op),
                    comm,
                    stream,
                )
            }
        })?;
        let part = burn::tensor::Tensor::<D>::from_primitive::<CubeBackend>(recv);
        Ok(Ok(part.swap_dims(0, dim)))
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn size(&self) -> usize {
        self.host.size()
    }

    fn all_reduce(&self, data: TensorData, op: ReduceOp) -> Result<TensorData, CommError> {
        self.agree("all_reduce", &data, 1)?;
        let (shape, dtype) = (shape_of(&data), data.dtype());
        let count = data.num_elements();
        let mut buffer = self.upload(&data)?;
        {
            let comm = self.lock();
            let (ptr, _sync) = buffer.device_ptr_mut(&self.stream);
            // SAFETY: in-place all-reduce of `count` elements of `dtype` in `buffer`.
            unsafe {
                result::all_reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    count,
                    nccl_dtype(dtype)?,
                    nccl_op(op),
                    comm.0,
                    self.cu_stream(),
                )
            }
            .map_err(|e| nccl_error("all_reduce", e))?;
        }
        self.download(&buffer, shape, dtype)
    }

    fn all_gather(&self, data: TensorData, dim: usize) -> Result<TensorData, CommError> {
        self.agree("all_gather", &data, 2 + dim as i64)?;
        let (shape, dtype) = (shape_of(&data), data.dtype());
        let n = self.size();
        let bytes = data.as_bytes().len();
        let send = self.upload(&data)?;
        let mut recv = self.zeros(bytes * n)?;
        {
            let comm = self.lock();
            let (src, _s) = send.device_ptr(&self.stream);
            let (dst, _d) = recv.device_ptr_mut(&self.stream);
            // SAFETY: `recv` holds `n` times `send`'s elements.
            unsafe {
                result::all_gather(
                    src as *const _,
                    dst as *mut _,
                    data.num_elements(),
                    nccl_dtype(dtype)?,
                    comm.0,
                    self.cu_stream(),
                )
            }
            .map_err(|e| nccl_error("all_gather", e))?;
        }
        // NCCL lays the ranks' buffers end to end: joined along dimension 0 of a stack.
        let stacked = self.download(&recv, vec![n * bytes / dtype.size().max(1)], dtype)?;
        let parts = split(&stacked, 0, n)?
            .into_iter()
            .map(|p| TensorData::from_bytes_vec(p.as_bytes().to_vec(), shape.clone(), dtype))
            .collect::<Vec<_>>();
        join(&parts, dim)
    }

    fn reduce_scatter(
        &self,
        data: TensorData,
        dim: usize,
        op: ReduceOp,
    ) -> Result<TensorData, CommError> {
        self.agree("reduce_scatter", &data, 100 + dim as i64)?;
        let n = self.size();
        let dtype = data.dtype();
        // The parts along `dim`, end to end in rank order: what NCCL scatters.
        let parts = split(&data, dim, n)?;
        let part_shape = shape_of(&parts[0]);
        let flat: Vec<u8> = parts.iter().flat_map(|p| p.as_bytes().to_vec()).collect();
        let send = self
            .stream
            .clone_htod(&flat)
            .map_err(|e| cuda_error("upload", e))?;
        let part_elements = parts[0].num_elements();
        let mut recv = self.zeros(part_elements * dtype.size())?;
        {
            let comm = self.lock();
            let (src, _s) = send.device_ptr(&self.stream);
            let (dst, _d) = recv.device_ptr_mut(&self.stream);
            // SAFETY: `send` holds `n` parts of `part_elements` elements, `recv` one.
            unsafe {
                result::reduce_scatter(
                    src as *const _,
                    dst as *mut _,
                    part_elements,
                    nccl_dtype(dtype)?,
                    nccl_op(op),
                    comm.0,
                    self.cu_stream(),
                )
            }
            .map_err(|e| nccl_error("reduce_scatter", e))?;
        }
        self.download(&recv, part_shape, dtype)
    }

    fn broadcast(&self, data: TensorData, root: usize) -> Result<TensorData, CommError> {
        if root >= self.size() {
            return Err(CommError::Invalid(format!(
                "broadcast root rank {root} out of range for {} ranks",
                self.size()
            )));
        }
        self.agree("broadcast", &data, 1000 + root as i64)?;
        let (shape, dtype) = (shape_of(&data), data.dtype());
        let mut buffer = self.upload(&data)?;
        {
            let comm = self.lock();
            let (ptr, _sync) = buffer.device_ptr_mut(&self.stream);
            // SAFETY: in-place broadcast of `buffer`'s elements.
            unsafe {
                result::broadcast(
                    ptr as *const _,
                    ptr as *mut _,
                    data.num_elements(),
                    nccl_dtype(dtype)?,
                    root as i32,
                    comm.0,
                    self.cu_stream(),
                )
            }
            .map_err(|e| nccl_error("broadcast", e))?;
        }
        self.download(&buffer, shape, dtype)
    }

    /// Through the host group: its sends return before the receiver takes the bytes, which
    /// pipeline schedules whose neighbours send to each other need (NCCL's own send would
    /// wait for the matching receive on the same stream).
    fn send(&self, data: TensorData, dst: usize) -> Result<(), CommError> {
        self.host.send(data, dst)
    }

    /// Through the host group (see [`Self::send`]).
    fn recv(&self, expect: &Expect, src: usize) -> Result<TensorData, CommError> {
        self.host.recv(expect, src)
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_error("barrier", e))?;
        self.host.barrier()
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>, CommError> {
        let host = self.host.split(color, key)?;
        Ok(Arc::new(NcclComm::bootstrap(host, self.ordinal)?))
    }

    fn ranks_in_process(&self) -> usize {
        self.host.ranks_in_process()
    }

    fn as_nccl(&self) -> Option<&NcclComm> {
        Some(self)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let comm = self.comm.get_mut().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the communicator is not used after this.
        unsafe {
            let _ = result::comm_destroy(comm.0);
        }
    }
}

/// A host group's answer as values of `E` (the type this module sent it): a mismatch is a
/// communication error, not a panic.
fn host_values<E: burn::tensor::Element>(data: TensorData) -> Result<Vec<E>, CommError> {
    data.try_to_vec::<E>()
        .map_err(|e| CommError::Invalid(format!("NCCL: the host group answered {e:?}")))
}
