//! N ranks as N threads of one process, exchanging host messages through shared memory.
//!
//! Every collective is one "round": each rank deposits its call and message; the last to
//! arrive checks that all calls agree and publishes every contribution; each rank then
//! computes the result from the contributions in rank order (so all ranks get the same bits).
//! Point-to-point messages go through per-pair mailboxes. A rank that returns or fails is
//! marked gone in every group it belongs to, so nobody waits for it forever.

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use burn::tensor::TensorData;

use super::buffer::{join, reduce, reduce_own_part, split};
use super::{shape_of, CommError, Communicator, Expect, ReduceOp};

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

/// Which threads of the process are gone, by world rank, and every group to wake when one
/// goes.
#[derive(Default)]
struct Liveness {
    gone: Mutex<Vec<Option<String>>>,
    groups: Mutex<Vec<Weak<Shared>>>,
}

impl Liveness {
    fn gone(&self, world_rank: usize) -> Option<String> {
        self.gone.lock().unwrap_or_else(|e| e.into_inner())[world_rank].clone()
    }

    fn leave(&self, world_rank: usize, reason: String) {
        self.gone.lock().unwrap_or_else(|e| e.into_inner())[world_rank] = Some(reason);
        let groups: Vec<Arc<Shared>> = self
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for g in groups {
            // Taking the lock orders this wake-up after any waiter's check.
            drop(g.lock());
            g.changed.notify_all();
        }
    }
}

#[derive(Default)]
struct State {
    /// Completed rounds.
    round: u64,
    /// This round's deposits, by rank.
    deposits: Vec<Option<(Call, TensorData)>>,
    /// The last completed round's contributions, in rank order.
    published: Arc<Vec<TensorData>>,
    /// Set once, when the group cannot continue.
    failure: Option<CommError>,
    /// Point-to-point messages in flight, by (source, destination).
    mail: HashMap<(usize, usize), VecDeque<TensorData>>,
    /// Sub-groups made by `split`, by (round of the split, color).
    children: HashMap<(u64, usize), Arc<Shared>>,
}

/// The shared side of one group.
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    /// World rank of each group rank.
    members: Vec<usize>,
    liveness: Arc<Liveness>,
}

impl Shared {
    fn new(members: Vec<usize>, liveness: Arc<Liveness>) -> Arc<Self> {
        let size = members.len();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                deposits: vec![None; size],
                ..State::default()
            }),
            changed: Condvar::new(),
            members,
            liveness: liveness.clone(),
        });
        liveness
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(&shared));
        shared
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock leaves consistent state (every write is
        // a single assignment), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(state).unwrap_or_else(|e| e.into_inner())
    }

    /// The first group rank that is gone, with its reason, among those `pending` selects.
    fn first_gone(&self, pending: impl Fn(usize) -> bool) -> Option<(usize, String)> {
        (0..self.members.len())
            .filter(|&r| pending(r))
            .find_map(|r| Some((r, self.liveness.gone(self.members[r])?)))
    }
}

/// One rank's handle on an in-process group.
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ThreadComm(rank {} of {})",
            self.rank,
            self.shared.members.len()
        )
    }
}

impl ThreadComm {
    /// `size` connected handles, one per rank, forming a new world.
    pub fn world(size: usize) -> Vec<ThreadComm> {
        let liveness = Arc::new(Liveness {
            gone: Mutex::new(vec![None; size]),
            groups: Mutex::default(),
        });
        let shared = Shared::new((0..size).collect(), liveness);
        (0..size)
            .map(|rank| ThreadComm {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Marks this rank's thread gone (returned or failed) in every group of its world.
    pub fn leave(&self, reason: String) {
        self.shared
            .liveness
            .leave(self.shared.members[self.rank], reason);
    }

    /// Deposits `data` for `call` and returns every rank's contribution, and the round,
    /// once all arrived.
    fn exchange(
        &self,
        call: Call,
        data: TensorData,
    ) -> Result<(u64, Arc<Vec<TensorData>>), CommError> {
        let shared = &self.shared;
        let mut state = shared.lock();
        if let Some(e) = &state.failure {
            return Err(e.clone());
        }
        let my_round = state.round;
        state.deposits[self.rank] = Some((call.clone(), data));
        if state.deposits.iter().all(Option::is_some) {
            let deposits: Vec<(Call, TensorData)> = state
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
                shared.changed.notify_all();
                return Err(e);
            }
            state.published = Arc::new(deposits.into_iter().map(|(_, t)| t).collect());
            state.round += 1;
            let published = state.published.clone();
            drop(state);
            shared.changed.notify_all();
            return Ok((my_round, published));
        }
        loop {
            if state.round != my_round {
                return Ok((my_round, state.published.clone()));
            }
            if let Some(e) = &state.failure {
                return Err(e.clone());
            }
            if let Some((rank, reason)) = shared.first_gone(|r| state.deposits[r].is_none()) {
                let e = CommError::RankGone {
                    rank,
                    reason,
                    waiting: self.rank,
                    call: my_round,
                    op: call.to_string(),
                };
                state.failure = Some(e.clone());
                drop(state);
                shared.changed.notify_all();
                return Err(e);
            }
            state = shared.wait(state);
        }
    }

    fn check_rank(&self, what: &str, rank: usize) -> Result<(), CommError> {
        if rank < self.size() {
            Ok(())
        } else {
            Err(CommError::Invalid(format!(
                "{what} rank {rank} out of range for {} ranks",
                self.size()
            )))
        }
    }
}

fn call(op: String, data: &TensorData) -> Call {
    Call {
        op: format!("{op} {:?}", data.dtype()),
        shape: shape_of(data),
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.members.len()
    }

    fn ranks_in_process(&self) -> usize {
        self.size()
    }

    fn all_reduce(&self, data: TensorData, op: ReduceOp) -> Result<TensorData, CommError> {
        let (_, parts) = self.exchange(call(format!("all_reduce({op:?})"), &data), data)?;
        reduce(&parts, op)
    }

    fn all_gather(&self, data: TensorData, dim: usize) -> Result<TensorData, CommError> {
        let (_, parts) = self.exchange(call(format!("all_gather(dim {dim})"), &data), data)?;
        join(&parts, dim)
    }

    fn reduce_scatter(
        &self,
        data: TensorData,
        dim: usize,
        op: ReduceOp,
    ) -> Result<TensorData, CommError> {
        // Check the split before the exchange, so a bad shape fails on every rank alike.
        split(&data, dim, self.size())?;
        let c = call(format!("reduce_scatter({op:?}, dim {dim})"), &data);
        let (_, parts) = self.exchange(c, data)?;
        reduce_own_part(&parts, dim, self.rank, op)
    }

    fn broadcast(&self, data: TensorData, root: usize) -> Result<TensorData, CommError> {
        self.check_rank("broadcast root", root)?;
        let (_, parts) = self.exchange(call(format!("broadcast(root {root})"), &data), data)?;
        Ok(parts[root].clone())
    }

    fn send(&self, data: TensorData, dst: usize) -> Result<(), CommError> {
        self.check_rank("send destination", dst)?;
        let mut state = self.shared.lock();
        state
            .mail
            .entry((self.rank, dst))
            .or_default()
            .push_back(data);
        drop(state);
        self.shared.changed.notify_all();
        Ok(())
    }

    fn recv(&self, expect: &Expect, src: usize) -> Result<TensorData, CommError> {
        self.check_rank("recv source", src)?;
        let shared = &self.shared;
        let mut state = shared.lock();
        loop {
            if let Some(data) = state
                .mail
                .get_mut(&(src, self.rank))
                .and_then(VecDeque::pop_front)
            {
                if shape_of(&data) != expect.shape || data.dtype() != expect.dtype {
                    return Err(CommError::Mismatch {
                        call: state.round,
                        detail: format!(
                            "rank {} expected {:?} {:?} from rank {src}, which sent {:?} {:?}",
                            self.rank,
                            expect.shape,
                            expect.dtype,
                            shape_of(&data),
                            data.dtype()
                        ),
                    });
                }
                return Ok(data);
            }
            if let Some((rank, reason)) = shared.first_gone(|r| r == src) {
                return Err(CommError::RankGone {
                    rank,
                    reason,
                    waiting: self.rank,
                    call: state.round,
                    op: format!("recv of {:?} from rank {src}", expect.shape),
                });
            }
            state = shared.wait(state);
        }
    }

    fn barrier(&self) -> Result<(), CommError> {
        let empty = TensorData::new(Vec::<f32>::new(), [0]);
        self.exchange(call("barrier".into(), &empty), empty)
            .map(|_| ())
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>, CommError> {
        let mine = TensorData::new(vec![color as i64, key as i64], [2]);
        let (round, parts) = self.exchange(call("split".into(), &mine), mine)?;
        let wanted: Vec<(usize, usize)> = parts
            .iter()
            .map(|p| {
                let v = p.as_slice::<i64>().expect("i64 split message");
                (v[0] as usize, v[1] as usize)
            })
            .collect();
        let mut members: Vec<usize> = (0..self.size()).filter(|&r| wanted[r].0 == color).collect();
        members.sort_by_key(|&r| (wanted[r].1, r));
        let rank = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("a rank is a member of its own color");
        let world_members: Vec<usize> = members.iter().map(|&r| self.shared.members[r]).collect();
        let mut state = self.shared.lock();
        let child = state
            .children
            .entry((round, color))
            .or_insert_with(|| Shared::new(world_members, self.shared.liveness.clone()))
            .clone();
        Ok(Arc::new(ThreadComm {
            rank,
            shared: child,
        }))
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

/// Runs `body(world)` on `size` threads (`rank-N`), one per rank of a new thread world, and
/// returns each rank's result in rank order.
///
/// A rank that returns an error or panics is marked gone, so ranks waiting on it fail instead
/// of hanging; the error then lists every rank's outcome, the root cause first.
pub fn run_ranks<T, F>(size: usize, body: F) -> anyhow::Result<Vec<T>>
where
    T: Send,
    F: Fn(Arc<dyn Communicator>) -> anyhow::Result<T> + Sync,
{
    let handles = ThreadComm::world(size);
    let outcomes: Vec<Result<T, String>> = std::thread::scope(|scope| {
        let threads: Vec<_> = handles
            .into_iter()
            .map(|handle| {
                let rank = handle.rank;
                let body = &body;
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let handle = Arc::new(handle);
                        let world: Arc<dyn Communicator> = handle.clone();
                        let outcome = match catch_unwind(AssertUnwindSafe(|| body(world))) {
                            Ok(Ok(v)) => Ok(v),
                            Ok(Err(e)) => Err(format!("{e:#}")),
                            Err(p) => Err(format!("panicked: {}", panic_message(p.as_ref()))),
                        };
                        handle.leave(match &outcome {
                            Ok(_) => "finished".to_string(),
                            Err(e) => e.clone(),
                        });
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
    // Ranks failing the same way (a bad argument every rank sees) make one line.
    let mut lines: Vec<(Vec<usize>, String)> = Vec::new();
    for (r, e) in errors {
        match lines.iter_mut().find(|(_, m)| *m == e) {
            Some((ranks, _)) => ranks.push(r),
            None => lines.push((vec![r], e)),
        }
    }
    let lines: Vec<String> = lines
        .into_iter()
        .map(|(ranks, e)| match ranks.as_slice() {
            [r] => format!("rank {r}: {e}"),
            _ if ranks.len() == size => format!("every rank: {e}"),
            _ => format!("ranks {ranks:?}: {e}"),
        })
        .collect();
    anyhow::bail!("{}", lines.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conformance_suite_passes_on_thread_worlds() {
        for size in [1, 2, 3, 4] {
            run_ranks(size, |world| {
                super::super::conformance::run_all(world.as_ref())
            })
            .unwrap_or_else(|e| panic!("{size} ranks: {e}"));
        }
    }

    #[test]
    fn a_shape_mismatch_fails_on_every_rank() {
        let err = run_ranks(2, |g| {
            let n = 2 + g.rank();
            g.all_reduce(TensorData::new(vec![0f32; n], [n]), ReduceOp::Sum)?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
        // Both ranks fail the same way: one line says so.
        assert!(
            err.starts_with("every rank: collective mismatch at call #0"),
            "{err}"
        );
        assert!(
            err.contains("rank 1 called all_reduce(Sum) F32 of shape [3]"),
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
            g.all_gather(TensorData::new(vec![1f32], [1]), 0)?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("rank 0: panicked: boom"), "{err}");
        assert!(err.contains("rank 1: rank 0 is gone"), "{err}");
    }

    #[test]
    fn a_rank_gone_releases_sub_groups_and_receivers() {
        // Ranks 0 and 2 share a sub-group; rank 2 fails, rank 0 waits in the sub-group.
        let err = run_ranks(4, |g| {
            let sub = g.split(g.rank() % 2, 0)?;
            match g.rank() {
                2 => anyhow::bail!("out of memory"),
                0 => sub.barrier()?,
                // Rank 1 waits for a message rank 3 never sends.
                1 => {
                    let expect = Expect {
                        shape: vec![1],
                        dtype: burn::tensor::DType::F32,
                    };
                    sub.recv(&expect, 1)?;
                }
                _ => {}
            }
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("rank 2: out of memory"), "{err}");
        assert!(
            err.contains("rank 0: rank 1 is gone (out of memory)"),
            "{err}"
        );
        assert!(err.contains("rank 1: rank 1 is gone (finished)"), "{err}");
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
