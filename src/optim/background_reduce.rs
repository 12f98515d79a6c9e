//! `--overlap-grad-reduce`: the data-parallel gradient all-reduce runs on a communication
//! thread while the backward pass goes on (Megatron's overlapped DDP buckets).
//!
//! burn's autodiff has no per-parameter gradient hooks, so the step runs each model chunk's
//! last backward a piece at a time instead (the head, then each layer from the last to the
//! first, then the embeddings: [`crate::model::recompute::ChunkForward`]). After
//! each piece, the gradients of the parameters that no later piece touches are final; they
//! are [`BackgroundAllReduce::push`]ed, in the order they become final, into buckets of at
//! least `--ddp-bucket-size` elements, and each full bucket is handed to the thread, which
//! all-reduces it while the main thread computes the next pieces. [`BackgroundAllReduce::finish`]
//! waits for what is still in flight. Sums are element-wise, so the result does not depend
//! on how parameters were grouped into buckets.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::module::ParamId;
use burn::tensor::Tensor;

use crate::comm::{tensor as comm_tensor, CommError, Group, ReduceOp};

/// Parameters laid end to end, to be summed in one collective.
struct Bucket {
    ids: Vec<ParamId>,
    sizes: Vec<usize>,
    flat: Tensor<1>,
}

/// A bucket after the all-reduce (or the failure that stopped the thread).
type Reduced = Result<(Vec<ParamId>, Vec<usize>, Tensor<1>), CommError>;

/// Gradients all-reduced over a group by a background thread, bucket by bucket, as they are
/// pushed.
pub struct BackgroundAllReduce {
    bucket_elements: usize,
    filling: Vec<(ParamId, Tensor<1>)>,
    filled: usize,
    to_thread: Option<Sender<Bucket>>,
    from_thread: Receiver<Reduced>,
    thread: Option<JoinHandle<()>>,
    submitted: usize,
    completed: Arc<AtomicUsize>,
}

/// What [`BackgroundAllReduce::finish`] gives back.
pub struct ReducedGradients {
    /// Every pushed gradient, summed over the group.
    pub grads: Vec<(ParamId, Tensor<1>)>,
    /// Time `finish` waited for collectives still in flight: the communication the backward
    /// pass did not hide.
    pub exposed: Duration,
}

impl BackgroundAllReduce {
    /// Starts the communication thread for `group` (one collective at a time on it, in the
    /// order buckets are submitted; every rank must push the same parameters in the same
    /// order, as every rank runs the same backward pieces).
    pub fn start(group: &Group, bucket_elements: usize) -> Self {
        let (to_thread, requests) = channel::<Bucket>();
        let (replies, from_thread) = channel::<Reduced>();
        let completed = Arc::new(AtomicUsize::new(0));
        let thread = {
            let group = group.clone();
            let completed = completed.clone();
            std::thread::Builder::new()
                .name("grad-all-reduce".into())
                .spawn(move || {
                    for bucket in requests {
                        let reduced = comm_tensor::all_reduce(&group, bucket.flat, ReduceOp::Sum)
                            // Materialised here, not lazily by the reader on the main thread.
                            .map(|t| {
                                let device = t.device();
                                Tensor::from_data(t.into_data(), &device)
                            });
                        let failed = reduced.is_err();
                        completed.fetch_add(1, Ordering::Release);
                        let sent = replies.send(reduced.map(|t| (bucket.ids, bucket.sizes, t)));
                        if failed || sent.is_err() {
                            break;
                        }
                    }
                })
                .expect("starting the gradient all-reduce thread")
        };
        Self {
            bucket_elements: bucket_elements.max(1),
            filling: Vec::new(),
            filled: 0,
            to_thread: Some(to_thread),
            from_thread,
            thread: Some(thread),
            submitted: 0,
            completed,
        }
    }

    /// Adds a final gradient; hands the bucket to the thread once it holds at least
    /// `bucket_elements` elements.
    pub fn push(&mut self, id: ParamId, grad: Tensor<1>) {
        self.filled += grad.dims()[0];
        self.filling.push((id, grad));
        if self.filled >= self.bucket_elements {
            self.submit();
        }
    }

    /// How many buckets the thread has finished so far.
    pub fn completed(&self) -> usize {
        self.completed.load(Ordering::Acquire)
    }

    /// How many buckets were handed to the thread so far.
    pub fn submitted(&self) -> usize {
        self.submitted
    }

    fn submit(&mut self) {
        if self.filling.is_empty() {
            return;
        }
        let (ids, parts): (Vec<ParamId>, Vec<Tensor<1>>) = self.filling.drain(..).unzip();
        let sizes = parts.iter().map(|p| p.dims()[0]).collect();
        let flat = Tensor::cat(parts, 0);
        self.filled = 0;
        self.submitted += 1;
        if let Some(to_thread) = &self.to_thread {
            // A closed channel means the thread stopped on a failure: `finish` reports it.
            let _ = to_thread.send(Bucket { ids, sizes, flat });
        }
    }

    /// Submits the last, partly filled bucket, waits for every bucket, and returns the sums.
    pub fn finish(mut self) -> Result<ReducedGradients, CommError> {
        self.submit();
        drop(self.to_thread.take());
        let start = Instant::now();
        let mut grads = Vec::new();
        let mut failure = None;
        for _ in 0..self.submitted {
            match self.from_thread.recv() {
                Ok(Ok((ids, sizes, summed))) => {
                    let mut offset = 0;
                    for (id, n) in ids.into_iter().zip(sizes) {
                        grads.push((id, summed.clone().narrow(0, offset, n)));
                        offset += n;
                    }
                }
                Ok(Err(e)) => {
                    failure = Some(e);
                    break;
                }
                Err(_) => {
                    failure = Some(CommError::Invalid(
                        "the gradient all-reduce thread stopped".into(),
                    ));
                    break;
                }
            }
        }
        let exposed = start.elapsed();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(ReducedGradients { grads, exposed }),
        }
    }
}

impl Drop for BackgroundAllReduce {
    fn drop(&mut self) {
        drop(self.to_thread.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::run_ranks;
    use burn::tensor::{Device, TensorData};

    fn param_ids(n: usize) -> Vec<ParamId> {
        // Ids agree across ranks only through their position here.
        (0..n).map(|_| ParamId::new()).collect()
    }

    /// Rank r's gradient of parameter p: distinct per rank and parameter.
    fn grad(rank: usize, p: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (rank * 1000 + p * 10 + i) as f32 * 0.25)
            .collect()
    }

    #[test]
    fn sums_equal_the_sequential_reference_whatever_the_bucket_size() {
        let lens = [3usize, 1, 5, 2, 4];
        for bucket in [1, 4, 6, 100] {
            let results = run_ranks(3, |world| {
                let group = Group::new(world);
                let device = Device::flex();
                let ids = param_ids(lens.len());
                let mut reducer = BackgroundAllReduce::start(&group, bucket);
                for (p, &len) in lens.iter().enumerate().rev() {
                    let g = Tensor::<1>::from_data(
                        TensorData::new(grad(group.rank(), p, len), [len]),
                        &device,
                    );
                    reducer.push(ids[p], g);
                }
                let reduced = reducer.finish()?;
                let mut out = Vec::new();
                for (p, id) in ids.iter().enumerate() {
                    let (_, g) = reduced.grads.iter().find(|(i, _)| i == id).unwrap();
                    out.push((p, g.clone().into_data().try_to_vec::<f32>().unwrap()));
                }
                Ok(out)
            })
            .unwrap();
            for per_rank in results {
                for (p, got) in per_rank {
                    let want: Vec<f32> = (0..lens[p])
                        .map(|i| (0..3).map(|r| grad(r, p, lens[p])[i]).sum())
                        .collect();
                    assert_eq!(got, want, "parameter {p}, bucket {bucket}");
                }
            }
        }
    }

    #[test]
    fn a_full_bucket_is_reduced_before_finish_is_called() {
        // Each rank waits, after pushing one full bucket, until the thread reports it done:
        // if the all-reduce only ran in `finish`, this would time out.
        let results = run_ranks(2, |world| {
            let group = Group::new(world);
            let device = Device::flex();
            let mut reducer = BackgroundAllReduce::start(&group, 4);
            let id = ParamId::new();
            reducer.push(id, Tensor::<1>::ones([4], &device));
            assert_eq!(reducer.submitted(), 1);
            let start = Instant::now();
            while reducer.completed() < 1 && start.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let done_before_finish = reducer.completed();
            let reduced = reducer.finish()?;
            Ok((done_before_finish, reduced.grads.len()))
        })
        .unwrap();
        for (done, n) in results {
            assert_eq!((done, n), (1, 1));
        }
    }
}
