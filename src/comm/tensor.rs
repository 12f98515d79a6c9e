//! Burn device tensors through a communicator: read to host bytes (dtype kept), communicate,
//! upload to the same device. This is what the host-staging communicators (threads, MPI) do
//! on every backend; an NCCL group communicates CUDA tensors in their device memory instead.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, BackendTypes, TensorMetadata};
use burn::tensor::{Tensor, TensorData};

use super::{CommError, Group, ReduceOp};

/// A backend primitive's values on the host, in its own dtype.
pub fn primitive_to_host<B: Backend>(x: FloatTensor<B>) -> TensorData {
    burn::tensor::read_sync(B::float_into_data(x)).expect("reading a tensor for a collective")
}

/// Host values as a backend primitive on `device`.
pub fn primitive_from_host<B: Backend>(
    data: TensorData,
    device: &<B as BackendTypes>::Device,
) -> FloatTensor<B> {
    B::float_from_data(data, device)
}

/// Applies `f` to `x`'s host values and puts the result on `x`'s device.
pub fn through_host<B: Backend>(
    x: FloatTensor<B>,
    f: impl FnOnce(TensorData) -> TensorData,
) -> FloatTensor<B> {
    let device = x.device();
    primitive_from_host::<B>(f(primitive_to_host::<B>(x)), &device)
}

fn staged<const D: usize>(
    x: Tensor<D>,
    f: impl FnOnce(TensorData) -> Result<TensorData, CommError>,
) -> Result<Tensor<D>, CommError> {
    let device = x.device();
    let out = f(x.into_data())?;
    let dtype = out.dtype();
    Ok(Tensor::from_data(out, (&device, dtype)))
}

/// `collective` run by `group`'s NCCL communicator on `x` in CUDA memory; `Ok(Err(x))` when
/// the group is not an NCCL group or `x` is not a CUDA tensor.
#[cfg(feature = "cuda")]
fn in_device_memory<const D: usize>(
    group: &Group,
    x: Tensor<D>,
    collective: impl FnOnce(&super::nccl::NcclComm, Tensor<D>) -> super::nccl::InDeviceMemory<D>,
) -> super::nccl::InDeviceMemory<D> {
    match group.communicator().and_then(|c| c.as_nccl()) {
        Some(nccl) => collective(nccl, x),
        None => Ok(Err(x)),
    }
}

/// The element-wise `op` of `x` over `group`, on `x`'s device and in its dtype.
pub fn all_reduce<const D: usize>(
    group: &Group,
    x: Tensor<D>,
    op: ReduceOp,
) -> Result<Tensor<D>, CommError> {
    if group.size() == 1 {
        return Ok(x);
    }
    group.timed(|| {
        #[cfg(feature = "cuda")]
        let x = match in_device_memory(group, x, |nccl, x| nccl.all_reduce_in_device_memory(x, op))?
        {
            Ok(reduced) => return Ok(reduced),
            Err(x) => x,
        };
        staged(x, |d| group.all_reduce(d, op))
    })
}

/// Every rank's `x` joined along `dim`.
pub fn all_gather<const D: usize>(
    group: &Group,
    x: Tensor<D>,
    dim: usize,
) -> Result<Tensor<D>, CommError> {
    if group.size() == 1 {
        return Ok(x);
    }
    group.timed(|| {
        #[cfg(feature = "cuda")]
        let x =
            match in_device_memory(group, x, |nccl, x| nccl.all_gather_in_device_memory(x, dim))? {
                Ok(gathered) => return Ok(gathered),
                Err(x) => x,
            };
        staged(x, |d| group.all_gather(d, dim))
    })
}

/// This rank's part (along `dim`) of the element-wise `op` over `group`.
pub fn reduce_scatter<const D: usize>(
    group: &Group,
    x: Tensor<D>,
    dim: usize,
    op: ReduceOp,
) -> Result<Tensor<D>, CommError> {
    if group.size() == 1 {
        return Ok(x);
    }
    group.timed(|| {
        #[cfg(feature = "cuda")]
        let x = match in_device_memory(group, x, |nccl, x| {
            nccl.reduce_scatter_in_device_memory(x, dim, op)
        })? {
            Ok(part) => return Ok(part),
            Err(x) => x,
        };
        staged(x, |d| group.reduce_scatter(d, dim, op))
    })
}

/// Rank `root`'s `x` on every rank.
pub fn broadcast<const D: usize>(
    group: &Group,
    x: Tensor<D>,
    root: usize,
) -> Result<Tensor<D>, CommError> {
    if group.size() == 1 {
        return Ok(x);
    }
    group.timed(|| {
        #[cfg(feature = "cuda")]
        let x =
            match in_device_memory(group, x, |nccl, x| nccl.broadcast_in_device_memory(x, root))? {
                Ok(root_x) => return Ok(root_x),
                Err(x) => x,
            };
        staged(x, |d| group.broadcast(d, root))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::run_ranks;
    use burn::tensor::{DType, Device};

    #[test]
    fn device_tensors_keep_their_dtype_through_the_collectives() {
        for dtype in [DType::F32, DType::BF16] {
            let results = run_ranks(2, |world| {
                let group = Group::new(world);
                let device = Device::flex();
                let r = group.rank() as f32;
                let x = Tensor::<2>::from_data(
                    TensorData::new(vec![r, 1.0, 2.0 * r, 3.0], [2, 2]),
                    (&device, dtype),
                );
                assert_eq!(x.dtype(), dtype);
                let sum = all_reduce(&group, x.clone(), ReduceOp::Sum)?;
                let gathered = all_gather(&group, x.clone(), 1)?;
                let part = reduce_scatter(&group, x.clone(), 0, ReduceOp::Sum)?;
                let root = broadcast(&group, x, 1)?;
                Ok([sum, gathered, part, root].map(|t| t.into_data()))
            })
            .unwrap();
            for (rank, [sum, gathered, part, root]) in results.into_iter().enumerate() {
                for d in [&sum, &gathered, &part, &root] {
                    assert_eq!(d.dtype(), dtype);
                }
                let f = |d: TensorData| d.convert::<f32>().try_to_vec::<f32>().unwrap();
                assert_eq!(f(sum), vec![1.0, 2.0, 2.0, 6.0]);
                assert_eq!(gathered.shape().to_vec(), vec![2, 4]);
                assert_eq!(f(gathered), vec![0.0, 1.0, 1.0, 1.0, 0.0, 3.0, 2.0, 3.0]);
                let rows = [[1.0, 2.0], [2.0, 6.0]];
                assert_eq!(f(part), rows[rank].to_vec());
                assert_eq!(f(root), vec![1.0, 1.0, 2.0, 3.0]);
            }
        }
    }
}
