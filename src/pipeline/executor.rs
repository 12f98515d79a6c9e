//! Runs one rank's schedule: for each step, receive what it needs, run the model's part,
//! send what it produced. The model side is a [`StageWork`] (Megatron's forward-step
//! function), so the executor knows nothing of GPT, losses or optimizers.

use std::time::Instant;

use anyhow::Result;
use burn::tensor::TensorData;

use super::p2p::PipelineP2p;
use super::schedule::Step;

/// A pipeline stage's part of one step, called by [`run_schedule`].
pub trait StageWork {
    /// Forward of `microbatch` through model chunk `chunk`. `input` is the previous virtual
    /// stage's activation (`None` on the first virtual stage, which embeds its tokens).
    /// Returns the activation for the next virtual stage (`None` on the last, which keeps
    /// the loss).
    fn forward(
        &mut self,
        microbatch: usize,
        chunk: usize,
        input: Option<TensorData>,
    ) -> Result<Option<TensorData>>;

    /// Backward of `microbatch` through `chunk`. `output_grad` is the gradient of the
    /// chunk's output from the next virtual stage (`None` on the last, which starts from
    /// the loss). Returns the gradient of the chunk's input (`None` on the first virtual
    /// stage).
    fn backward(
        &mut self,
        microbatch: usize,
        chunk: usize,
        output_grad: Option<TensorData>,
    ) -> Result<Option<TensorData>>;
}

/// Where a rank's time went during one schedule.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScheduleTiming {
    /// Wall time of the whole schedule.
    pub seconds: f64,
    /// Time spent waiting for activations and gradients from the neighbours (with their
    /// transfer): the rank's share of the pipeline bubble.
    pub waiting_seconds: f64,
}

impl ScheduleTiming {
    /// The fraction of the schedule this rank was idle.
    pub fn idle_fraction(&self) -> f64 {
        if self.seconds > 0.0 {
            self.waiting_seconds / self.seconds
        } else {
            0.0
        }
    }
}

/// Runs `steps` on this rank: the forward of a chunk receives its input from the previous
/// virtual stage and sends its output to the next; a backward receives the output's gradient
/// and sends the input's. Forward-only schedules (evaluation) are lists of forwards.
pub fn run_schedule(
    steps: &[Step],
    p2p: &PipelineP2p,
    work: &mut dyn StageWork,
) -> Result<ScheduleTiming> {
    let start = Instant::now();
    let mut waiting = 0.0;
    let mut wait = |f: &mut dyn FnMut() -> Result<TensorData>| -> Result<TensorData> {
        let t = Instant::now();
        let out = f();
        waiting += t.elapsed().as_secs_f64();
        out
    };
    for &step in steps {
        match step {
            Step::Forward { microbatch, chunk } => {
                let input = if p2p.is_first(chunk) {
                    None
                } else {
                    Some(wait(&mut || Ok(p2p.recv_forward()?))?)
                };
                if let Some(output) = work.forward(microbatch, chunk, input)? {
                    p2p.send_forward(output)?;
                }
            }
            Step::Backward { microbatch, chunk } => {
                let output_grad = if p2p.is_last(chunk) {
                    None
                } else {
                    Some(wait(&mut || Ok(p2p.recv_backward()?))?)
                };
                if let Some(input_grad) = work.backward(microbatch, chunk, output_grad)? {
                    p2p.send_backward(input_grad)?;
                }
            }
        }
    }
    Ok(ScheduleTiming {
        seconds: start.elapsed().as_secs_f64(),
        waiting_seconds: waiting,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{run_ranks, Expect, Group};
    use crate::pipeline::{interleaved_one_forward_one_backward, one_forward_one_backward};
    use burn::tensor::DType;

    /// A pipeline of scalar stages: virtual stage `s` computes `y = w_s · x` with
    /// `w_s = s + 2`, the loss is `y`, so the gradient reaching stage `s`'s input is the
    /// product of the weights after it, and each weight's gradient is the product of all
    /// other weights times the micro-batch's input.
    struct Scalars {
        p2p_size: usize,
        rank: usize,
        inputs: Vec<f64>,
        saved: std::collections::HashMap<(usize, usize), f64>,
        /// The most forwards kept for their backward at once.
        peak_saved: usize,
        weight_grads: Vec<f64>,
        losses: Vec<(usize, f64)>,
        chunks: usize,
    }

    impl Scalars {
        fn weight(&self, chunk: usize) -> f64 {
            (chunk * self.p2p_size + self.rank + 2) as f64
        }
        fn last(&self, chunk: usize) -> bool {
            chunk * self.p2p_size + self.rank + 1 == self.p2p_size * self.chunks
        }
    }

    fn value(d: TensorData) -> f64 {
        d.try_to_vec::<f64>().unwrap()[0]
    }

    impl StageWork for Scalars {
        fn forward(
            &mut self,
            m: usize,
            c: usize,
            input: Option<TensorData>,
        ) -> Result<Option<TensorData>> {
            let x = input.map_or(self.inputs[m], value);
            self.saved.insert((m, c), x);
            self.peak_saved = self.peak_saved.max(self.saved.len());
            let y = self.weight(c) * x;
            if self.last(c) {
                self.losses.push((m, y));
                return Ok(None);
            }
            Ok(Some(TensorData::new(vec![y], [1])))
        }
        fn backward(
            &mut self,
            m: usize,
            c: usize,
            g: Option<TensorData>,
        ) -> Result<Option<TensorData>> {
            let g = g.map_or(1.0, value);
            let x = self.saved.remove(&(m, c)).expect("forward before backward");
            self.weight_grads[c] += g * x;
            let first = c == 0 && self.rank == 0;
            Ok((!first).then(|| TensorData::new(vec![g * self.weight(c)], [1])))
        }
    }

    /// Per rank: each chunk's weight gradient, and the losses `(micro-batch, loss)`.
    type RankResult = (Vec<f64>, Vec<(usize, f64)>);

    fn run(pp: usize, chunks: usize, microbatches: usize) -> Vec<RankResult> {
        run_ranks(pp, move |world| {
            let rank = world.rank();
            let group = Group::new(world);
            let p2p = PipelineP2p::new(
                &group,
                chunks,
                Expect {
                    shape: vec![1],
                    dtype: DType::F64,
                },
            )?;
            let steps = if chunks == 1 {
                one_forward_one_backward(rank, pp, microbatches)
            } else {
                interleaved_one_forward_one_backward(rank, pp, microbatches, chunks)?
            };
            let mut work = Scalars {
                p2p_size: pp,
                rank,
                inputs: (0..microbatches).map(|m| 1.0 + m as f64).collect(),
                saved: Default::default(),
                peak_saved: 0,
                weight_grads: vec![0.0; chunks],
                losses: Vec::new(),
                chunks,
            };
            run_schedule(&steps, &p2p, &mut work)?;
            assert!(work.saved.is_empty(), "every forward had its backward");
            if chunks == 1 {
                // 1F1B keeps at most PP − rank micro-batches' activations (all m for GPipe).
                assert!(work.peak_saved <= (pp - rank).min(microbatches));
            }
            Ok((work.weight_grads, work.losses))
        })
        .unwrap()
    }

    #[test]
    fn a_scalar_pipeline_gets_the_chain_rule_right() {
        for (pp, chunks, m) in [(2, 1, 5), (4, 1, 3), (3, 1, 8), (2, 2, 4), (4, 2, 8)] {
            let stages = pp * chunks;
            let w: Vec<f64> = (0..stages).map(|s| (s + 2) as f64).collect();
            let product: f64 = w.iter().product();
            let inputs_sum: f64 = (0..m).map(|k| 1.0 + k as f64).sum();
            let results = run(pp, chunks, m);
            for (rank, (grads, losses)) in results.iter().enumerate() {
                for (c, g) in grads.iter().enumerate() {
                    let s = c * pp + rank;
                    // d(Σ_m w_0 ⋯ w_{S−1} x_m)/d w_s = (Π w / w_s) Σ x_m.
                    let expected = product / w[s] * inputs_sum;
                    assert!(
                        (g - expected).abs() < 1e-9 * expected,
                        "pp {pp} v {chunks} stage {s}: {g} vs {expected}"
                    );
                }
                if rank + 1 == pp {
                    let mut losses = losses.clone();
                    losses.sort_by_key(|l| l.0);
                    assert_eq!(losses.len(), m);
                    for (k, l) in losses {
                        assert_eq!(l, product * (1.0 + k as f64));
                    }
                } else {
                    assert!(losses.is_empty());
                }
            }
        }
    }
}
