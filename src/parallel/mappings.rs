//! Megatron's four region operators (`tensor_parallel/mappings.py`), each a custom autodiff op
//! whose backward is another region's forward:
//!
//! | operator             | forward                 | backward                |
//! |----------------------|-------------------------|-------------------------|
//! | copy to region       | identity                | all-reduce (sum)        |
//! | reduce from region   | all-reduce (sum)        | identity                |
//! | scatter to region    | keep own last-dim chunk | all-gather last dim     |
//! | gather from region   | all-gather last dim     | keep own last-dim chunk |
//!
//! and the three of sequence parallelism, on the sequence dimension (1 of `[batch, seq,
//! hidden]`):
//!
//! | operator                       | forward                 | backward               |
//! |--------------------------------|-------------------------|------------------------|
//! | scatter to sequence region     | keep own sequence chunk | all-gather sequence    |
//! | gather from sequence region    | all-gather sequence     | reduce-scatter sequence|
//! | reduce-scatter to seq. region  | reduce-scatter sequence | all-gather sequence    |
//!
//! They are a burn backend extension (`#[backend_extension]`) with a hand-written `Backward`
//! for `Autodiff<B>`, so gradients communicate exactly where Megatron's do. On a single-rank
//! group every operator is the identity and never reaches the backend.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, Flex, TensorMetadata};
use burn::tensor::Tensor;

use crate::comm::buffer::split;
use crate::comm::tensor::through_host;
use crate::comm::{Group, ReduceOp};

/// Which of Megatron's region operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionKind {
    /// Identity forward, all-reduce backward (`copy_to_tensor_model_parallel_region`).
    Copy,
    /// All-reduce forward, identity backward (`reduce_from_tensor_model_parallel_region`).
    Reduce,
    /// Split forward, all-gather backward (`scatter_to_tensor_model_parallel_region`).
    Scatter,
    /// All-gather forward, split backward (`gather_from_tensor_model_parallel_region`).
    Gather,
    /// Own sequence chunk forward, all-gather backward
    /// (`scatter_to_sequence_parallel_region`).
    SequenceScatter,
    /// All-gather of the sequence forward, reduce-scatter backward
    /// (`gather_from_sequence_parallel_region` before a column-parallel layer).
    SequenceGather,
    /// Reduce-scatter of the sequence forward, all-gather backward
    /// (`reduce_scatter_to_sequence_parallel_region` after a row-parallel layer).
    SequenceReduceScatter,
    /// [`Self::SequenceGather`] by blocks passed around the ring (context parallelism's
    /// `p2p` exchange of keys and values), backward [`Self::RingReduceScatter`].
    RingGather,
    /// [`Self::SequenceReduceScatter`] around the ring, backward [`Self::RingGather`].
    RingReduceScatter,
}

/// The sequence dimension of `[batch, seq, hidden]` activations.
const SEQUENCE_DIM: usize = 1;

impl RegionKind {
    /// The operator whose forward is this one's backward.
    pub fn transpose(self) -> Self {
        match self {
            Self::Copy => Self::Reduce,
            Self::Reduce => Self::Copy,
            Self::Scatter => Self::Gather,
            Self::Gather => Self::Scatter,
            // A backward only runs its transpose's forward: the all-gather of a gather.
            Self::SequenceScatter | Self::SequenceReduceScatter => Self::SequenceGather,
            Self::SequenceGather => Self::SequenceReduceScatter,
            Self::RingGather => Self::RingReduceScatter,
            Self::RingReduceScatter => Self::RingGather,
        }
    }
}

/// A region operator bound to its group: the extension op's non-tensor argument.
#[derive(Clone, Debug)]
pub struct Region {
    /// The operator.
    pub kind: RegionKind,
    /// The tensor-parallel group.
    pub group: Group,
}

/// The backend extension carrying the region operators.
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait RegionOps: Backend {
    /// Applies `region`'s forward to `x` (the split/gather dimension is the last one).
    fn tensor_parallel_region(x: FloatTensor<Self>, region: Region) -> FloatTensor<Self>;
}

/// The forward of `region` on any backend, through host memory.
fn region_forward<B: Backend>(x: FloatTensor<B>, region: &Region) -> FloatTensor<B> {
    let group = &region.group;
    if group.size() == 1 || region.kind == RegionKind::Copy {
        return x;
    }
    let last = x.shape().num_dims() - 1;
    group.timed(|| {
        through_host::<B>(x, |data| match region.kind {
            RegionKind::Copy => unreachable!(),
            RegionKind::Reduce => group.all_reduce_or_panic(data, ReduceOp::Sum),
            RegionKind::Scatter => split(&data, last, group.size())
                .map(|mut parts| parts.swap_remove(group.rank()))
                .unwrap_or_else(|e| panic!("scatter to tensor-parallel region: {e}")),
            RegionKind::Gather => group.all_gather_or_panic(data, last),
            RegionKind::SequenceScatter => split(&data, SEQUENCE_DIM, group.size())
                .map(|mut parts| parts.swap_remove(group.rank()))
                .unwrap_or_else(|e| panic!("scatter to sequence-parallel region: {e}")),
            RegionKind::SequenceGather => group.all_gather_or_panic(data, SEQUENCE_DIM),
            RegionKind::SequenceReduceScatter => {
                group.reduce_scatter_or_panic(data, SEQUENCE_DIM, ReduceOp::Sum)
            }
            RegionKind::RingGather => group.ring_all_gather_or_panic(data, SEQUENCE_DIM),
            RegionKind::RingReduceScatter => group.ring_reduce_scatter_or_panic(data, SEQUENCE_DIM),
        })
    })
}

impl RegionOps for Flex {
    fn tensor_parallel_region(x: FloatTensor<Self>, region: Region) -> FloatTensor<Self> {
        region_forward::<Self>(x, &region)
    }
}

/// The CubeCL backend (CUDA, wgpu): the same host-staged collectives.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl RegionOps for burn_cubecl::CubeBackend {
    fn tensor_parallel_region(x: FloatTensor<Self>, region: Region) -> FloatTensor<Self> {
        region_forward::<Self>(x, &region)
    }
}

#[derive(Debug)]
struct RegionBackward;

impl<B: RegionOps> Backward<B, 1> for RegionBackward {
    /// The transposed region.
    type State = Region;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            grads.register::<B>(parent.id, B::tensor_parallel_region(grad, ops.state));
        }
    }
}

impl<B: RegionOps, C: CheckpointStrategy> RegionOps for Autodiff<B, C> {
    fn tensor_parallel_region(x: FloatTensor<Self>, region: Region) -> FloatTensor<Self> {
        let (primitive, node) = x.into_parts();
        match RegionBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let transposed = Region {
                    kind: region.kind.transpose(),
                    group: region.group.clone(),
                };
                prep.finish(transposed, B::tensor_parallel_region(primitive, region))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::tensor_parallel_region(primitive, region)),
        }
    }
}

/// `kind`'s operator over `group` on `x` (the identity on a group of one).
pub(crate) fn apply<const D: usize>(x: Tensor<D>, kind: RegionKind, group: &Group) -> Tensor<D> {
    if group.size() == 1 {
        return x;
    }
    let region = Region {
        kind,
        group: group.clone(),
    };
    Tensor::from_dispatch(<Dispatch as RegionOps>::tensor_parallel_region(
        x.into_dispatch(),
        region,
    ))
}

/// Identity forward, all-reduce of the gradient backward: the input of a column-parallel layer.
pub fn copy_to_region<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    apply(x, RegionKind::Copy, group)
}

/// All-reduce (sum) forward, identity backward: the output of a row-parallel layer.
pub fn reduce_from_region<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    apply(x, RegionKind::Reduce, group)
}

/// This rank's chunk of the last dimension forward, all-gather backward.
pub fn scatter_to_region<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    apply(x, RegionKind::Scatter, group)
}

/// All-gather along the last dimension forward, own chunk backward.
pub fn gather_from_region<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    apply(x, RegionKind::Gather, group)
}

/// This rank's chunk of the sequence forward, all-gather backward: activations entering the
/// sequence-parallel region (after the embeddings).
pub fn scatter_to_sequence_region(x: Tensor<3>, group: &Group) -> Tensor<3> {
    apply(x, RegionKind::SequenceScatter, group)
}

/// All-gather of the sequence forward, reduce-scatter backward: the input of a
/// column-parallel layer under sequence parallelism.
pub fn gather_from_sequence_region<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    apply(x, RegionKind::SequenceGather, group)
}

/// Reduce-scatter of the sequence forward, all-gather backward: the output of a row-parallel
/// layer under sequence parallelism.
pub fn reduce_scatter_to_sequence_region<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    apply(x, RegionKind::SequenceReduceScatter, group)
}
