//! The pipeline bubble on the machine it runs on: each stage's measured idle share of a step (time
//! waiting for its neighbours' activations and gradients, as `pretrain` reports it in
//! `metrics.jsonl`) beside the theory, (p − 1)/(m + p − 1) for 1F1B with m micro-batches
//! and (p − 1)/(v·m + p − 1) for the interleaved schedule with v model chunks per rank.
//!
//! ```text
//! cargo bench --bench pipeline_bubble
//! ```
//!
//! 1. Stages that sleep for their pass (forward 8 ms per stage, backward 16 ms, split over the
//!    chunks): the schedule, the executor and the p2p transfers (64 KiB activations through
//!    the thread communicator) exactly, at PP = 2 and 4 whatever the core count.
//! 2. The same with real compute (a single-threaded arithmetic loop calibrated to the same
//!    durations) at PP = 2: one rank per core here.
//! 3. The GPT itself: tokens/s and each stage's idle share at PP = 1 and PP = 2 (threads),
//!    where the last stage also runs the output layer and the loss over a 50 k vocabulary,
//!    so the stages are unequal and the first stage waits for the last; and PP = 2 with 6 + 2
//!    layers (`--decoder-last-pipeline-num-layers 2`), which evens them out.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use burn::tensor::{DType, Device, TensorData};
use ferrotron::comm::{run_ranks, Expect, Group};
use ferrotron::data::DataSources;
use ferrotron::model::GptConfig;
use ferrotron::pipeline::{run_schedule, PipelineP2p, StageWork};
use ferrotron::training::forward_backward::training_schedule;
use ferrotron::training::pretrain::pretrain;
use ferrotron::training::{LrDecayStyle, LrSchedule, ParallelConfig, PretrainConfig};

#[global_allocator]
static ALLOCATOR: ferrotron::util::allocator::TrainingAllocator =
    ferrotron::util::allocator::TrainingAllocator;

const FORWARD: Duration = Duration::from_millis(8);
const ACTIVATION: [usize; 3] = [1, 64, 256];

/// How a synthetic pass spends its time.
#[derive(Clone, Copy)]
enum Work {
    Sleep,
    /// Iterations of the arithmetic loop per second (calibrated).
    Compute(f64),
}

fn busy(iterations: u64) -> f32 {
    let mut x = 1.0f32;
    for i in 0..iterations {
        x = x.mul_add(0.999_999, (i & 7) as f32 * 1e-7);
    }
    x
}

impl Work {
    fn spend(self, d: Duration) {
        match self {
            Work::Sleep => std::thread::sleep(d),
            Work::Compute(rate) => {
                std::hint::black_box(busy((rate * d.as_secs_f64()) as u64));
            }
        }
    }

    fn calibrated() -> Self {
        let n = 50_000_000;
        let t = Instant::now();
        std::hint::black_box(busy(n));
        Work::Compute(n as f64 / t.elapsed().as_secs_f64())
    }
}

/// A stage whose forward of one chunk takes `FORWARD / chunks` and backward twice that.
struct Synthetic {
    work: Work,
    rank: usize,
    pp: usize,
    chunks: usize,
    pass: Duration,
    in_flight: HashMap<(usize, usize), ()>,
}

impl Synthetic {
    fn stage(&self, chunk: usize) -> usize {
        chunk * self.pp + self.rank
    }
}

fn activation() -> TensorData {
    TensorData::new(vec![0.5f32; ACTIVATION.iter().product()], ACTIVATION)
}

impl StageWork for Synthetic {
    fn forward(
        &mut self,
        m: usize,
        c: usize,
        _input: Option<TensorData>,
    ) -> Result<Option<TensorData>> {
        self.work.spend(self.pass);
        self.in_flight.insert((m, c), ());
        Ok((self.stage(c) + 1 < self.pp * self.chunks).then(activation))
    }

    fn backward(
        &mut self,
        m: usize,
        c: usize,
        _g: Option<TensorData>,
    ) -> Result<Option<TensorData>> {
        self.in_flight.remove(&(m, c));
        self.work.spend(2 * self.pass);
        Ok((self.stage(c) > 0).then(activation))
    }
}

/// Stage 0's idle share (its window is the whole pipeline step: it runs the first forward
/// and the last backward) and the mean over stages, over 3 steps after a warm-up step, with
/// the theory beside them.
fn measure(work: Work, pp: usize, chunks: usize, m: usize) -> (f64, f64, f64) {
    let steps = 3;
    let idle = run_ranks(pp, move |world| {
        let rank = world.rank();
        let group = Group::new(world);
        let p2p = PipelineP2p::new(
            &group,
            chunks,
            Expect {
                shape: ACTIVATION.to_vec(),
                dtype: DType::F32,
            },
        )?;
        let schedule = training_schedule(rank, pp, m, chunks)?;
        let mut stage = Synthetic {
            work,
            rank,
            pp,
            chunks,
            pass: FORWARD / chunks as u32,
            in_flight: HashMap::new(),
        };
        let mut idle = Vec::new();
        for step in 0..=steps {
            group.barrier()?;
            let timing = run_schedule(&schedule, &p2p, &mut stage)?;
            if step > 0 {
                idle.push(timing.idle_fraction());
            }
        }
        Ok(idle.iter().sum::<f64>() / idle.len() as f64)
    })
    .expect("pipeline ranks");
    let mean = idle.iter().sum::<f64>() / idle.len() as f64;
    let first = idle[0];
    let theory = (pp - 1) as f64 / ((chunks * m) + pp - 1) as f64;
    (first, mean, theory)
}

fn gpt_config(pp: usize, last_stage_layers: Option<usize>) -> PretrainConfig {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let data = root.join("tests/fixtures/golden/wikitext2_valid_text_document");
    PretrainConfig {
        seq_length: 256,
        micro_batch_size: 2,
        global_batch_size: 16,
        train_iters: 6,
        schedule: LrSchedule {
            max_lr: 1e-4,
            min_lr: 1e-5,
            warmup_steps: 16.0,
            decay_steps: 96.0,
            style: LrDecayStyle::Cosine,
            ..Default::default()
        },
        split: "100,0,0".into(),
        data_cache_path: Some(std::env::temp_dir().join("ferrotron_pipeline_bubble_cache")),
        eval_interval: 0,
        eval_iters: 0,
        parallel: ParallelConfig {
            pipeline_model_parallel_size: pp,
            decoder_last_pipeline_num_layers: last_stage_layers,
            ..ParallelConfig::default()
        },
        ..PretrainConfig::new(
            GptConfig::new(8, 256, 8, 256, 50304),
            DataSources::single(data),
        )
    }
}

fn main() {
    println!("## 1. Sleeping stages (forward {FORWARD:?} per stage, backward twice that)\n");
    println!(
        "| PP | schedule | micro-batches m | measured idle stage 0 / mean over stages | theory |"
    );
    println!("|---|---|---|---|---|");
    for pp in [2, 4] {
        for m in [4, 8, 16] {
            for chunks in [1, 2] {
                let (first, mean, theory) = measure(Work::Sleep, pp, chunks, m);
                let name = if chunks == 1 {
                    "1F1B"
                } else {
                    "interleaved, v = 2"
                };
                println!("| {pp} | {name} | {m} | {first:.3} / {mean:.3} | {theory:.3} |");
            }
        }
    }
    let work = Work::calibrated();
    println!("\n## 2. Computing stages (single-threaded loop, same durations), PP = 2\n");
    println!("| schedule | micro-batches m | measured idle stage 0 / mean | theory |");
    println!("|---|---|---|---|");
    for m in [4, 8, 16] {
        for chunks in [1, 2] {
            let (first, mean, theory) = measure(work, 2, chunks, m);
            let name = if chunks == 1 {
                "1F1B"
            } else {
                "interleaved, v = 2"
            };
            println!("| {name} | {m} | {first:.3} / {mean:.3} | {theory:.3} |");
        }
    }
    println!("\n## 3. GPT (8 layers, hidden 256, seq 256, micro-batch 2, global batch 16: m = 8), threads\n");
    let device = Device::flex().autodiff();
    let mut rows = Vec::new();
    for (pp, last) in [(1, None), (2, None), (2, Some(2))] {
        let start = Instant::now();
        let out = pretrain(&gpt_config(pp, last), &device).expect("training");
        let seconds = start.elapsed().as_secs_f64();
        let tokens_per_second = 6.0 * 16.0 * 256.0 / seconds;
        let idle: Vec<f64> = if pp > 1 {
            (0..pp)
                .map(|s| {
                    let v = &out.pipeline_idle_fractions[1..];
                    v.iter().map(|it| it[s]).sum::<f64>() / v.len() as f64
                })
                .collect()
        } else {
            Vec::new()
        };
        rows.push((pp, last, tokens_per_second, idle));
    }
    println!("| PP | layers per stage | tokens/s (whole run incl. set-up) | vs PP=1 | idle share per stage |");
    println!("|---|---|---|---|---|");
    let base = rows[0].2;
    for (pp, last, tps, idle) in rows {
        let split = match (pp, last) {
            (1, _) => "8".to_owned(),
            (_, Some(n)) => format!("{} + {n} (--decoder-last-pipeline-num-layers {n})", 8 - n),
            _ => "4 + 4".to_owned(),
        };
        println!(
            "| {pp} | {split} | {tps:.0} | {:.2}× | {idle:.3?} |",
            tps / base
        );
    }
}
