//! N ranks as N threads of one process, exchanging host tensors through shared memory.
//!
//! Every collective is one "round": each rank deposits its call and tensor; the last to
//! arrive checks that all calls agree and publishes every contribution; each rank then
//! computes the result from the contributions in rank order (so all ranks get the same bits).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::{CommError, ProcessGroup, ReduceOp};
use crate::host_tensor::HostTensor;

/// What a rank asked for in one round; all ranks must ask for the same.
#[derive(Clone, Debug, PartialEq)]
struct Call {
    op: String,
    shape: Vec<usize>,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} of shape {:?}", self.op, self.shape)
    }
}

#[derive(Default)]
struct State {
    /// Completed rounds.
    round: u64,
    /// This round's deposits, by rank.
    deposits: Vec<Option<(Call, HostTensor)>>,
    /// The last completed round's contributions, in rank order.
    published: Arc<Vec<HostTensor>>,
    /// Set once, when the group cannot continue.
    failure: Option<CommError>,
    /// Ranks that returned or failed, with the reason.
    gone: Vec<Option<String>>,
}

/// The shared side of a thread group.
#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock leaves consistent state (every write is
        // a single assignment), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn leave(&self, rank: usize, reason: String) {
        let mut state = self.lock();
        state.gone[rank] = Some(reason);
        drop(state);
        self.changed.notify_all();
    }
}

/// One rank's handle on an in-process group.
pub struct ThreadGroup {
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ThreadGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadGroup(rank {} of {})", self.rank, self.size)
    }
}

impl ThreadGroup {
    /// `size` connected handles, one per rank.
    pub fn new(size: usize) -> Vec<ThreadGroup> {
        let shared = Arc::new(Shared::default());
        {
            let mut state = shared.lock();
            state.deposits = vec![None; size];
            state.gone = vec![None; size];
        }
        (0..size)
            .map(|rank| ThreadGroup {
                rank,
                size,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Deposits `tensor` for `call` and returns every rank's contribution once all arrived.
    fn exchange(&self, call: Call, tensor: HostTensor) -> Result<Arc<Vec<HostTensor>>, CommError> {
        let mut state = self.shared.lock();
        if let Some(e) = &state.failure {
            return Err(e.clone());
        }
        let my_round = state.round;
        state.deposits[self.rank] = Some((call.clone(), tensor));
        if state.deposits.iter().all(Option::is_some) {
            let deposits: Vec<(Call, HostTensor)> = state
                .deposits
                .iter_mut()
                .map(|d| d.take().unwrap())
                .collect();
            if deposits.iter().any(|(c, _)| *c != deposits[0].0) {
                let detail = deposits
                    .iter()
                    .enumerate()
                    .map(|(r, (c, _))| format!("rank {r} called {c}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                let e = CommError::Mismatch {
                    call: my_round,
                    detail,
                };
                state.failure = Some(e.clone());
                drop(state);
                self.shared.changed.notify_all();
                return Err(e);
            }
            state.published = Arc::new(deposits.into_iter().map(|(_, t)| t).collect());
            state.round += 1;
            let published = state.published.clone();
            drop(state);
            self.shared.changed.notify_all();
            return Ok(published);
        }
        loop {
            if state.round != my_round {
                return Ok(state.published.clone());
            }
            if let Some(e) = &state.failure {
                return Err(e.clone());
            }
            let missing = (0..self.size).find_map(|r| {
                let reason = state.gone[r].as_ref()?;
                state.deposits[r].is_none().then(|| (r, reason.clone()))
            });
            if let Some((rank, reason)) = missing {
                let e = CommError::RankGone {
                    rank,
                    reason,
                    waiting: self.rank,
                    call: my_round,
                    op: call.to_string(),
                };
                state.failure = Some(e.clone());
                drop(state);
                self.shared.changed.notify_all();
                return Err(e);
            }
            state = self
                .shared
                .changed
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl ProcessGroup for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, tensor: HostTensor, op: ReduceOp) -> Result<HostTensor, CommError> {
        let call = Call {
            op: format!("all_reduce({op:?})"),
            shape: tensor.shape.clone(),
        };
        let parts = self.exchange(call, tensor)?;
        let mut out = parts[0].clone();
        for part in &parts[1..] {
            for (o, &v) in out.values.iter_mut().zip(&part.values) {
                *o = match op {
                    ReduceOp::Sum => *o + v,
                    ReduceOp::Max => o.max(v),
                };
            }
        }
        Ok(out)
    }

    fn all_gather(&self, tensor: HostTensor, dim: usize) -> Result<HostTensor, CommError> {
        let call = Call {
            op: format!("all_gather(dim {dim})"),
            shape: tensor.shape.clone(),
        };
        let parts = self.exchange(call, tensor)?;
        HostTensor::concat(&parts, dim).map_err(CommError::Invalid)
    }

    fn broadcast(&self, tensor: HostTensor, root: usize) -> Result<HostTensor, CommError> {
        if root >= self.size {
            return Err(CommError::Invalid(format!(
                "broadcast root {root} out of range for {} ranks",
                self.size
            )));
        }
        let call = Call {
            op: format!("broadcast(root {root})"),
            shape: tensor.shape.clone(),
        };
        Ok(self.exchange(call, tensor)?[root].clone())
    }

    fn barrier(&self) -> Result<(), CommError> {
        let call = Call {
            op: "barrier".into(),
            shape: vec![],
        };
        self.exchange(call, HostTensor::new(vec![], vec![0.0]))
            .map(|_| ())
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

/// Runs `body(rank, group)` on `size` threads (`tp-rank-N`), one per rank, and returns each
/// rank's result in rank order.
///
/// A rank that returns an error or panics is marked gone, so ranks waiting on it fail instead
/// of hanging; the error then lists every rank's outcome, the root cause first.
pub fn run_ranks<T, F>(size: usize, body: F) -> anyhow::Result<Vec<T>>
where
    T: Send,
    F: Fn(Arc<dyn ProcessGroup>) -> anyhow::Result<T> + Sync,
{
    let handles = ThreadGroup::new(size);
    let shared = handles[0].shared.clone();
    let outcomes: Vec<Result<T, String>> = std::thread::scope(|scope| {
        let threads: Vec<_> = handles
            .into_iter()
            .map(|handle| {
                let rank = handle.rank;
                let (body, shared) = (&body, shared.clone());
                std::thread::Builder::new()
                    .name(format!("tp-rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let group: Arc<dyn ProcessGroup> = Arc::new(handle);
                        let outcome = match catch_unwind(AssertUnwindSafe(|| body(group))) {
                            Ok(Ok(v)) => Ok(v),
                            Ok(Err(e)) => Err(format!("{e:#}")),
                            Err(p) => Err(format!("panicked: {}", panic_message(p.as_ref()))),
                        };
                        let reason = match &outcome {
                            Ok(_) => "finished".to_string(),
                            Err(e) => e.clone(),
                        };
                        shared.leave(rank, reason);
                        outcome
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|_| Err("thread panicked".into())))
            .collect()
    });
    if outcomes.iter().all(Result::is_ok) {
        return Ok(outcomes.into_iter().map(|o| o.ok().unwrap()).collect());
    }
    // The root cause is an error that is not a communication failure caused by another rank.
    let mut errors: Vec<(usize, String)> = outcomes
        .into_iter()
        .enumerate()
        .filter_map(|(r, o)| o.err().map(|e| (r, e)))
        .collect();
    errors.sort_by_key(|(r, e)| (e.contains("is gone (") || e.contains("mismatch"), *r));
    let lines: Vec<String> = errors
        .iter()
        .map(|(r, e)| format!("rank {r}: {e}"))
        .collect();
    anyhow::bail!("{}", lines.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(values: &[f32]) -> HostTensor {
        HostTensor::new(vec![values.len()], values.to_vec())
    }

    #[test]
    fn collectives_combine_every_rank_in_rank_order() {
        let results = run_ranks(3, |g| {
            let r = g.rank() as f32;
            let sum = g.all_reduce(t(&[r, 1.0]), ReduceOp::Sum)?;
            let max = g.all_reduce(t(&[r, -r]), ReduceOp::Max)?;
            let gathered = g.all_gather(HostTensor::new(vec![1, 2], vec![r, 10.0 + r]), 1)?;
            let root = g.broadcast(t(&[r * 7.0]), 2)?;
            g.barrier()?;
            Ok((sum.values, max.values, gathered, root.values))
        })
        .unwrap();
        for (sum, max, gathered, root) in results {
            assert_eq!(sum, vec![3.0, 3.0]);
            assert_eq!(max, vec![2.0, 0.0]);
            assert_eq!(gathered.shape, vec![1, 6]);
            assert_eq!(gathered.values, vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
            assert_eq!(root, vec![14.0]);
        }
    }

    #[test]
    fn a_shape_mismatch_fails_on_every_rank() {
        let err = run_ranks(2, |g| {
            let n = 2 + g.rank();
            g.all_reduce(HostTensor::new(vec![n], vec![0.0; n]), ReduceOp::Sum)?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("rank 0: collective mismatch at call #0"),
            "{err}"
        );
        assert!(err.contains("rank 1: collective mismatch"), "{err}");
        assert!(
            err.contains("rank 1 called all_reduce(Sum) of shape [3]"),
            "{err}"
        );
    }

    #[test]
    fn a_failing_or_panicking_rank_releases_the_others() {
        let err = run_ranks(3, |g| {
            if g.rank() == 1 {
                anyhow::bail!("disk full");
            }
            g.barrier()?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("rank 1: disk full"), "{err}");
        assert!(err.contains("rank 1 is gone (disk full)"), "{err}");

        let err = run_ranks(2, |g| {
            if g.rank() == 0 {
                std::panic::panic_any("boom".to_string());
            }
            g.all_gather(t(&[1.0]), 0)?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("rank 0: panicked: boom"), "{err}");
        assert!(err.contains("rank 1: rank 0 is gone"), "{err}");
    }

    #[test]
    fn a_rank_that_finishes_early_is_reported() {
        let err = run_ranks(2, |g| {
            if g.rank() == 0 {
                g.barrier()?;
            }
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("rank 1 is gone (finished)"), "{err}");
    }
}
