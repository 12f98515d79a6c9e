//! Megatron's vocab-parallel cross-entropy (`tensor_parallel/cross_entropy.py`), which is also
//! ferrotron's fused cross-entropy on one rank.
//!
//! Each rank holds the logits of its vocabulary shard `[tokens, V/N]`. Forward: the row max
//! is all-reduced (max), the target logit (found on exactly one rank) and the sum of
//! exponentials are all-reduced (sum), and `loss = log Σ exp − target`. The shard's logits and
//! the global log-sum-exp are kept, and the backward writes `(softmax − one-hot) · dloss` for
//! the own partition in one pass, without communication. The full logits are never gathered,
//! and on one rank this replaces the ~10 elementwise passes autodiff would make over the
//! logits.
//!
//! [`CrossEntropyKernels`] is how a backend runs the two halves: composed of tensor ops (the
//! CPU backend, and the forward under tensor parallelism, whose collectives sit between its
//! reductions), or one fused kernel each way on CubeCL devices (`ferrotron-kernels`'
//! `cross_entropy`).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::{FloatTensor, IndexingUpdateOp, IntTensor};
use burn::backend::{backend_extension, Backend, Dispatch, Flex, TensorMetadata};
use burn::tensor::{Int, Tensor};

use super::sharding::vocab_shard_index;
use crate::comm::buffer::{join, split};
use crate::comm::tensor::{primitive_from_host, primitive_to_host, through_host};
use crate::comm::{Group, ReduceOp};

/// The backend extension carrying the fused cross-entropy.
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait CrossEntropyOps: Backend {
    /// Per-token loss `[tokens, 1]` of `logits` `[tokens, V/N]`; `target_index` `[tokens, 1]`
    /// is the target's column in this shard (0 when outside) and `target_inside` `[tokens, 1]`
    /// is 1 where the target lies in this shard, else 0.
    fn vocab_parallel_cross_entropy(
        logits: FloatTensor<Self>,
        target_index: IntTensor<Self>,
        target_inside: FloatTensor<Self>,
        group: Group,
    ) -> FloatTensor<Self>;
}

/// What the cross-entropy's backward needs from its forward, besides the targets.
#[derive(Clone, Debug)]
pub enum Residual<B: Backend> {
    /// The shard's softmax `[tokens, V/N]` (the CPU backend: nothing recomputed).
    Softmax(FloatTensor<B>),
    /// The logits and their log-sum-exp over the whole vocabulary `[tokens, 1]` (the kernels
    /// recompute the softmax in the backward's one pass).
    LogSumExp {
        logits: FloatTensor<B>,
        log_sum_exp: FloatTensor<B>,
    },
}

/// Loss `[tokens, 1]` over the whole vocabulary and the residual (`softmax` or not), composed
/// of tensor ops (with the collectives between them).
fn composed_forward<B: Backend>(
    logits: FloatTensor<B>,
    target_index: IntTensor<B>,
    target_inside: FloatTensor<B>,
    group: &Group,
    softmax: bool,
) -> (FloatTensor<B>, Residual<B>) {
    let mut max = B::float_max_dim(logits.clone(), 1);
    if group.size() > 1 {
        max =
            group.timed(|| through_host::<B>(max, |d| group.all_reduce_or_panic(d, ReduceOp::Max)));
    }
    let shifted = B::float_sub(logits.clone(), max.clone());
    let mut predicted = B::float_mul(
        B::float_gather(1, shifted.clone(), target_index),
        target_inside,
    );
    let exp = B::float_exp(shifted);
    let mut sum_exp = B::float_sum_dim(exp.clone(), 1);
    if group.size() > 1 {
        // One all-reduce for both [tokens, 1] columns.
        (predicted, sum_exp) = group.timed(|| {
            let device = predicted.device();
            let both = join(
                &[
                    primitive_to_host::<B>(predicted),
                    primitive_to_host::<B>(sum_exp),
                ],
                1,
            )
            .expect("two [tokens, 1] columns");
            let both = group.all_reduce_or_panic(both, ReduceOp::Sum);
            let mut columns = split(&both, 1, 2).expect("[tokens, 2]").into_iter();
            let mut next = || primitive_from_host::<B>(columns.next().unwrap(), &device);
            (next(), next())
        });
    }
    // The loss in shifted terms (log Σ exp(x − max) − (x_target − max)), as Megatron's.
    let shifted_log_sum_exp = B::float_log(sum_exp.clone());
    let loss = B::float_sub(shifted_log_sum_exp.clone(), predicted);
    let residual = if softmax {
        Residual::Softmax(B::float_div(exp, sum_exp))
    } else {
        Residual::LogSumExp {
            logits,
            log_sum_exp: B::float_add(shifted_log_sum_exp, max),
        }
    };
    (loss, residual)
}

/// `(softmax − inside · one-hot(index)) · dloss`, composed of tensor ops.
fn composed_backward<B: Backend>(
    residual: Residual<B>,
    target_index: IntTensor<B>,
    target_inside: FloatTensor<B>,
    grad_loss: FloatTensor<B>,
) -> FloatTensor<B> {
    let softmax = match residual {
        Residual::Softmax(softmax) => softmax,
        Residual::LogSumExp {
            logits,
            log_sum_exp,
        } => B::float_exp(B::float_sub(logits, log_sum_exp)),
    };
    let scaled = B::float_mul(softmax, grad_loss.clone());
    let one_hot = B::float_neg(B::float_mul(grad_loss, target_inside));
    B::float_scatter(1, scaled, target_index, one_hot, IndexingUpdateOp::Add)
}

/// The cross-entropy's two halves on one backend.
pub trait CrossEntropyKernels: Backend {
    /// Loss `[tokens, 1]` over the whole vocabulary of the shard's logits `[tokens, V/N]`
    /// (arguments as [`CrossEntropyOps`]'), and what the backward needs.
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        target_index: IntTensor<Self>,
        target_inside: FloatTensor<Self>,
        group: &Group,
    ) -> (FloatTensor<Self>, Residual<Self>);

    /// The logits' gradient `(softmax − inside · one-hot(index)) · grad_loss`; no
    /// communication.
    fn cross_entropy_backward(
        residual: Residual<Self>,
        target_index: IntTensor<Self>,
        target_inside: FloatTensor<Self>,
        grad_loss: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl CrossEntropyKernels for Flex {
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        target_index: IntTensor<Self>,
        target_inside: FloatTensor<Self>,
        group: &Group,
    ) -> (FloatTensor<Self>, Residual<Self>) {
        composed_forward::<Self>(logits, target_index, target_inside, group, true)
    }

    fn cross_entropy_backward(
        residual: Residual<Self>,
        target_index: IntTensor<Self>,
        target_inside: FloatTensor<Self>,
        grad_loss: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        composed_backward::<Self>(residual, target_index, target_inside, grad_loss)
    }
}

/// The CubeCL backend (CUDA, wgpu): one kernel each way; under tensor parallelism the
/// forward is composed, its collectives host-staged.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl CrossEntropyKernels for burn_cubecl::CubeBackend {
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        target_index: IntTensor<Self>,
        target_inside: FloatTensor<Self>,
        group: &Group,
    ) -> (FloatTensor<Self>, Residual<Self>) {
        if group.size() > 1 {
            return composed_forward::<Self>(logits, target_index, target_inside, group, false);
        }
        let [loss, logits, log_sum_exp] =
            super::cross_entropy_kernels::forward(logits, target_index, target_inside);
        let residual = Residual::LogSumExp {
            logits,
            log_sum_exp,
        };
        (loss, residual)
    }

    fn cross_entropy_backward(
        residual: Residual<Self>,
        target_index: IntTensor<Self>,
        target_inside: FloatTensor<Self>,
        grad_loss: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match residual {
            Residual::LogSumExp {
                logits,
                log_sum_exp,
            } => super::cross_entropy_kernels::backward(
                logits,
                log_sum_exp,
                target_index,
                target_inside,
                grad_loss,
            ),
            softmax => composed_backward::<Self>(softmax, target_index, target_inside, grad_loss),
        }
    }
}

impl CrossEntropyOps for Flex {
    fn vocab_parallel_cross_entropy(
        logits: FloatTensor<Self>,
        target_index: IntTensor<Self>,
        target_inside: FloatTensor<Self>,
        group: Group,
    ) -> FloatTensor<Self> {
        Self::cross_entropy_forward(logits, target_index, target_inside, &group).0
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl CrossEntropyOps for burn_cubecl::CubeBackend {
    fn vocab_parallel_cross_entropy(
        logits: FloatTensor<Self>,
        target_index: IntTensor<Self>,
        target_inside: FloatTensor<Self>,
        group: Group,
    ) -> FloatTensor<Self> {
        Self::cross_entropy_forward(logits, target_index, target_inside, &group).0
    }
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: CrossEntropyKernels> Backward<B, 1> for CrossEntropyBackward {
    /// The forward's residual, target column, target-inside flag.
    type State = (Residual<B>, IntTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node); // [tokens, 1]
        let Some(parent) = parent else { return };
        let (residual, index, inside) = ops.state;
        let grad_logits = B::cross_entropy_backward(residual, index, inside, grad);
        grads.register::<B>(parent.id, grad_logits);
    }
}

impl<B: CrossEntropyOps + CrossEntropyKernels, C: CheckpointStrategy> CrossEntropyOps
    for Autodiff<B, C>
{
    fn vocab_parallel_cross_entropy(
        logits: FloatTensor<Self>,
        target_index: IntTensor<Self>,
        target_inside: FloatTensor<Self>,
        group: Group,
    ) -> FloatTensor<Self> {
        let (logits, node) = logits.into_parts();
        let inside = target_inside.into_primitive();
        match CrossEntropyBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (loss, residual) =
                    B::cross_entropy_forward(logits, target_index.clone(), inside.clone(), &group);
                prep.finish((residual, target_index, inside), loss)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::vocab_parallel_cross_entropy(
                logits,
                target_index,
                inside,
                group,
            )),
        }
    }
}

/// Per-token cross-entropy `[batch, seq]` of this rank's vocabulary shard of the logits
/// (`[batch, seq, V/N]`, columns `vocab_start..vocab_start + V/N`) against `labels`
/// (global ids). With a single-rank group, `vocab_start` is 0 and this is the fused
/// cross-entropy over the whole vocabulary.
pub fn vocab_parallel_cross_entropy(
    logits: Tensor<3>,
    labels: Tensor<2, Int>,
    vocab_start: usize,
    group: &Group,
) -> Tensor<2> {
    // In fp32 whatever the model computes in (Megatron's `vocab_parallel_cross_entropy(
    // logits.float(), ...)`): half-precision logsumexp over 50k columns loses the loss. The
    // kernels (one rank on a CubeCL device) read half-precision logits as they are and
    // compute in f32, which gives the numbers of logits upcast first (the conversion is
    // exact; the gradient is rounded back to the logits' dtype, as the upcast's backward
    // rounds it) without an fp32 copy of the `[tokens, vocabulary]` logits and of their
    // gradient; the composed ops take the upcast.
    let kernels = group.size() == 1 && !crate::util::device::is_flex(&logits.device());
    let logits = if kernels {
        logits
    } else {
        crate::util::device::at_least_f32(logits)
    };
    let [b, s, v] = logits.dims();
    let labels = labels.reshape([b * s, 1]);
    let (index, inside) = if kernels {
        // One rank on a CubeCL device: the labels are the columns, and the kernels skip a
        // target outside the row themselves (seven launches fewer than the shard index).
        let inside = Tensor::<2>::ones([b * s, 1], &logits.device());
        (labels, inside)
    } else {
        let (index, outside) = vocab_shard_index(labels, vocab_start, v);
        (index, outside.bool_not().float())
    };
    let loss = <Dispatch as CrossEntropyOps>::vocab_parallel_cross_entropy(
        logits.reshape([b * s, v]).into_dispatch(),
        index.into_dispatch(),
        inside.into_dispatch(),
        group.clone(),
    );
    Tensor::<2>::from_dispatch(loss).reshape([b, s])
}

/// The single-rank cross-entropy composed of plain burn ops (autodiff derives its backward):
/// `logsumexp(logits) − logits[label]`, `[batch, seq]`. The reference the fused op is tested
/// against, and the path on backends without the fused op.
pub fn composed_cross_entropy(logits: Tensor<3>, labels: Tensor<2, Int>) -> Tensor<2> {
    let max = logits.clone().max_dim(2).detach();
    let target = logits.clone().gather(2, labels.unsqueeze_dim::<3>(2));
    let log_sum_exp = (logits - max.clone()).exp().sum_dim(2).log() + max;
    (log_sum_exp - target).squeeze_dim::<2>(2)
}
