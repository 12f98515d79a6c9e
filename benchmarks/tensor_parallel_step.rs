//! Training step time at tensor-parallel sizes 1, 2 and 4 on the machine it runs on, and the share of
//! each step spent communicating (collectives with their host transfers and the wait for the
//! other ranks), measured in the same run.
//!
//! ```text
//! cargo bench --bench tensor_parallel_step
//! FERROTRON_BENCH_STEPS=5 FERROTRON_BENCH_TP=1,2 cargo bench --bench tensor_parallel_step
//! ```
//!
//! Config: the training benchmark's GPT (4 layers, hidden 256, 4 heads, seq 256, micro-batch
//! 8, padded vocabulary 50304, dropout 0.1, AdamW, fp32, CPU). Every rank is a thread sharing
//! the machine's cores, so on 2 cores N > 1 cannot be faster than N = 1: the numbers show
//! the overhead the split adds, not a speed-up.

use std::time::Instant;

use burn::tensor::{Device, Int, Tensor, TensorData};
use ferrotron::comm::{run_ranks, Group};
use ferrotron::model::GptConfig;
use ferrotron::parallel::random::seed_micro_batch;
use ferrotron::parallel::{holdings::parameter_holdings, sharding::Holding};
use ferrotron::training::{AdamW, AdamWConfig, GradientAccumulator};

#[global_allocator]
static ALLOCATOR: ferrotron::util::allocator::TrainingAllocator =
    ferrotron::util::allocator::TrainingAllocator;

const BATCH: usize = 8;
const SEQ: usize = 256;

/// (seconds per step, communication seconds per step) of one rank.
fn rank_steps(config: &GptConfig, group: &Group, steps: usize) -> (f64, f64) {
    let device = Device::flex().autodiff();
    let mut model = config
        .init_parallel(0, group, &device)
        .expect("valid config");
    let mut optimizer = AdamW::new(AdamWConfig::default());
    let mut state = 12345u64;
    let ids: Vec<i64> = (0..BATCH * (SEQ + 1))
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((state >> 33) % 50257) as i64
        })
        .collect();
    let data = Tensor::<2, Int>::from_data(TensorData::new(ids, [BATCH, SEQ + 1]), &device);
    let tokens = data.clone().narrow(1, 0, SEQ);
    let labels = data.narrow(1, 1, SEQ);
    let mask = Tensor::<2>::ones([BATCH, SEQ], &device);
    let replicated = parameter_holdings(&model)
        .into_iter()
        .filter(|p| p.holding == Holding::Duplicated)
        .map(|p| p.id)
        .collect();
    let mut step = |model: ferrotron::model::Gpt, i: usize| {
        seed_micro_batch(0, i as u64, 0);
        let loss = model.lm_loss(tokens.clone(), labels.clone(), mask.clone());
        let mut grads = GradientAccumulator::default();
        grads.add(&model, loss.backward());
        grads
            .clip_global_norm_parallel(1.0, &replicated, group)
            .expect("collective");
        optimizer.step(model, &grads, 1e-4)
    };
    model = step(model, 0);
    let (comm_before, start) = (group.comm_seconds(), Instant::now());
    for i in 1..=steps {
        model = step(model, i);
    }
    let _ = model;
    let elapsed = start.elapsed().as_secs_f64();
    (
        elapsed / steps as f64,
        (group.comm_seconds() - comm_before) / steps as f64,
    )
}

fn main() {
    ferrotron::util::allocator::retain_freed_memory();
    let steps = std::env::var("FERROTRON_BENCH_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let sizes: Vec<usize> = std::env::var("FERROTRON_BENCH_TP")
        .unwrap_or_else(|_| "1,2,4".into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let config = GptConfig::new(4, 256, 4, SEQ, 50304);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "GPT 4 layers, hidden 256, 4 heads, seq {SEQ}, micro-batch {BATCH}, vocab 50304; \
         {steps} steps after 1 warm-up; {cores} cores"
    );
    let mut baseline = None;
    for n in sizes {
        let per_rank = run_ranks(n, |pg| {
            let group = if n == 1 {
                Group::single()
            } else {
                Group::new(pg)
            };
            Ok(rank_steps(&config, &group, steps))
        })
        .expect("benchmark run");
        let step = per_rank.iter().map(|r| r.0).fold(0.0, f64::max);
        let comm = per_rank.iter().map(|r| r.1).sum::<f64>() / n as f64;
        let base = *baseline.get_or_insert(step);
        println!(
            "TP={n}: {:8.1} ms/step, {:6.0} tokens/s, communication {:7.1} ms/step ({:4.1} %), time vs TP=1: {:.2}x",
            1e3 * step,
            (BATCH * SEQ) as f64 / step,
            1e3 * comm,
            100.0 * comm / step,
            step / base
        );
    }
}
