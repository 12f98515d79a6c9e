//! Runs every rank's schedule against the pipeline's data dependencies with fixed pass
//! durations: whether the schedules can complete together (no rank waits on a pass that
//! waits on it), how long each rank idles (the bubble), and how many micro-batches' activations
//! each rank holds at most.
//!
//! Dependencies: the forward of a micro-batch at virtual stage `s = chunk · PP + rank` needs
//! its forward at stage `s − 1`; its backward needs the backward at `s + 1` (the last stage's
//! needs its own forward: the loss) and its own forward. Sends never block.

use std::collections::HashMap;

use super::schedule::Step;

/// What a simulated step shows.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    /// Time the last pass ends.
    pub makespan: f64,
    /// Per rank: the share of the makespan it was idle.
    pub bubble: Vec<f64>,
    /// Per rank: the most (micro-batch, chunk) forwards whose backward had not run yet.
    pub peak_in_flight: Vec<usize>,
}

/// Simulates `schedules[rank]` for a pipeline of `schedules.len()` ranks with `chunks` model
/// chunks each, a forward pass of one chunk taking `forward` and a backward `backward`.
/// `Err` names a rank and step that can never start (the schedules deadlock).
pub fn simulate(
    schedules: &[Vec<Step>],
    chunks: usize,
    forward: f64,
    backward: f64,
) -> Result<Simulation, String> {
    let ranks = schedules.len();
    let stages = ranks * chunks;
    let stage = |rank: usize, chunk: usize| chunk * ranks + rank;
    // Finish time of (forward?, microbatch, virtual stage).
    let mut done: HashMap<(bool, usize, usize), f64> = HashMap::new();
    let mut next = vec![0usize; ranks];
    let mut clock = vec![0.0f64; ranks];
    let mut busy = vec![0.0f64; ranks];
    let mut in_flight = vec![0usize; ranks];
    let mut peak = vec![0usize; ranks];
    loop {
        let mut progressed = false;
        for rank in 0..ranks {
            while let Some(&step) = schedules[rank].get(next[rank]) {
                let (microbatch, chunk) = step.key();
                let s = stage(rank, chunk);
                let needs: Vec<(bool, usize, usize)> = if step.is_forward() {
                    if s == 0 {
                        vec![]
                    } else {
                        vec![(true, microbatch, s - 1)]
                    }
                } else if s + 1 == stages {
                    vec![(true, microbatch, s)]
                } else {
                    vec![(true, microbatch, s), (false, microbatch, s + 1)]
                };
                let Some(ready) = needs
                    .iter()
                    .map(|k| done.get(k).copied())
                    .try_fold(0.0f64, |t, d| d.map(|d| t.max(d)))
                else {
                    break;
                };
                let start = clock[rank].max(ready);
                let duration = if step.is_forward() { forward } else { backward };
                clock[rank] = start + duration;
                busy[rank] += duration;
                done.insert((step.is_forward(), microbatch, s), clock[rank]);
                if step.is_forward() {
                    in_flight[rank] += 1;
                    peak[rank] = peak[rank].max(in_flight[rank]);
                } else {
                    in_flight[rank] -= 1;
                }
                next[rank] += 1;
                progressed = true;
            }
        }
        if (0..ranks).all(|r| next[r] == schedules[r].len()) {
            break;
        }
        if !progressed {
            let rank = (0..ranks)
                .find(|&r| next[r] < schedules[r].len())
                .expect("a rank is unfinished");
            return Err(format!(
                "deadlock: rank {rank} waits forever at {:?}",
                schedules[rank][next[rank]]
            ));
        }
    }
    let makespan = clock.iter().copied().fold(0.0, f64::max);
    Ok(Simulation {
        makespan,
        bubble: busy.iter().map(|b| 1.0 - b / makespan).collect(),
        peak_in_flight: peak,
    })
}

#[cfg(test)]
mod tests {
    use super::super::schedule::*;
    use super::*;

    fn one_f_one_b(p: usize, m: usize) -> Vec<Vec<Step>> {
        (0..p).map(|r| one_forward_one_backward(r, p, m)).collect()
    }

    fn interleaved(p: usize, m: usize, v: usize) -> Vec<Vec<Step>> {
        (0..p)
            .map(|r| interleaved_one_forward_one_backward(r, p, m, v).unwrap())
            .collect()
    }

    /// Each rank runs every (micro-batch, chunk) forward and backward exactly once, backwards
    /// after their forwards.
    fn assert_complete(schedule: &[Step], microbatches: usize, chunks: usize) {
        let mut seen = std::collections::HashSet::new();
        for (i, step) in schedule.iter().enumerate() {
            assert!(seen.insert(*step), "{step:?} twice");
            if !step.is_forward() {
                let (m, c) = step.key();
                let f = Step::Forward {
                    microbatch: m,
                    chunk: c,
                };
                assert!(schedule[..i].contains(&f), "{step:?} before its forward");
            }
        }
        assert_eq!(seen.len(), 2 * microbatches * chunks);
    }

    #[test]
    fn one_f_one_b_follows_the_rule() {
        for p in [1, 2, 4] {
            for m in [1, 3, 4, 8] {
                for (rank, steps) in one_f_one_b(p, m).iter().enumerate() {
                    assert_complete(steps, m, 1);
                    let warmup = (p - rank - 1).min(m);
                    // Warm-up forwards, then strictly alternating F/B, then the backwards.
                    assert!(steps[..warmup].iter().all(|s| s.is_forward()));
                    let steady = &steps[warmup..warmup + 2 * (m - warmup)];
                    for pair in steady.chunks(2) {
                        assert!(pair[0].is_forward() && !pair[1].is_forward(), "{steps:?}");
                    }
                    assert!(steps[warmup + 2 * (m - warmup)..]
                        .iter()
                        .all(|s| !s.is_forward()));
                    // Backwards in forward order.
                    let order = |f: bool| -> Vec<usize> {
                        steps
                            .iter()
                            .filter(|s| s.is_forward() == f)
                            .map(|s| s.key().0)
                            .collect()
                    };
                    assert_eq!(order(true), order(false));
                    assert_eq!(order(true), (0..m).collect::<Vec<_>>());
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_bounds_activations_and_meets_the_bubble_theory() {
        for (p, m) in [(2, 4), (4, 4), (4, 8), (4, 16)] {
            let sim = simulate(&one_f_one_b(p, m), 1, 1.0, 2.0).unwrap();
            for (rank, &peak) in sim.peak_in_flight.iter().enumerate() {
                assert!(
                    peak <= p - rank && peak <= p,
                    "rank {rank}: {peak} in flight"
                );
            }
            let theory = (p - 1) as f64 / (m + p - 1) as f64;
            for b in &sim.bubble {
                assert!((b - theory).abs() < 1e-12, "p{p} m{m}: {b} vs {theory}");
            }
            // GPipe-style: the same bubble, but every micro-batch in flight at once.
            let gpipe: Vec<Vec<Step>> = (0..p)
                .map(|_| all_forward_then_backward(m, false))
                .collect();
            let sim = simulate(&gpipe, 1, 1.0, 2.0).unwrap();
            assert!(sim.peak_in_flight.iter().all(|&n| n == m));
        }
    }

    #[test]
    fn interleaving_runs_every_chunk_and_shrinks_the_bubble_v_fold() {
        for (p, m, v) in [(2, 4, 2), (4, 8, 2), (4, 16, 3), (2, 2, 2)] {
            let schedules = interleaved(p, m, v);
            for steps in &schedules {
                assert_complete(steps, m, v);
            }
            // Each chunk is 1/v of the rank's layers.
            let sim = simulate(&schedules, v, 1.0 / v as f64, 2.0 / v as f64).unwrap();
            let plain = simulate(&one_f_one_b(p, m), 1, 1.0, 2.0).unwrap();
            let theory = (p - 1) as f64 / (v * m + p - 1) as f64;
            // Megatron's paper: the bubble shrinks v-fold, (p − 1) / (v·m + p − 1).
            for b in &sim.bubble {
                assert!(
                    (b - theory).abs() < 1e-9 && *b < plain.bubble[0],
                    "p{p} m{m} v{v}: interleaved {b}, 1F1B {}, theory {theory}",
                    plain.bubble[0]
                );
            }
        }
        assert!(interleaved_one_forward_one_backward(0, 4, 6, 2).is_err());
    }

    #[test]
    fn an_inconsistent_order_is_reported_as_a_deadlock() {
        // Rank 1 (the last stage) puts a backward before the forward it needs.
        let mut schedules = one_f_one_b(2, 2);
        schedules[1] = vec![
            Step::Backward {
                microbatch: 0,
                chunk: 0,
            },
            Step::Forward {
                microbatch: 0,
                chunk: 0,
            },
        ];
        let err = simulate(&schedules, 1, 1.0, 2.0).unwrap_err();
        assert!(err.contains("deadlock: rank"), "{err}");
    }
}
