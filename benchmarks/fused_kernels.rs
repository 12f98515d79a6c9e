//! Fused CubeCL kernels against the same operations composed of burn tensor ops, on the same
//! wgpu device and in the same run (forward + backward through autodiff).
//!
//! ```text
//! cargo bench --bench fused_kernels          # lavapipe on a machine without a GPU
//! FERROTRON_BENCH_DEVICE=wgpu cargo bench --bench fused_kernels   # a real GPU
//! ```
//!
//! Shapes: softmax over 16 heads × 1024 × 1024 scores (batch 1), LayerNorm over 8192 × 1024,
//! attention of 16 heads × 1024 positions × 64 (batch 1, dropout 0.1): the fused
//! FlashAttention-style kernel against matmul → fused softmax → dropout → matmul, with the
//! device memory the autodiff graph holds after the forward (what the backward keeps); the
//! cross-entropy of f16 logits `[512, 50304]` read as they are against upcast first.
//! Reports the median milliseconds (fused and composed runs interleaved) for the forward alone
//! (no autodiff) and for forward + backward (through autodiff, with a `Σ y ⊙ dy` loss around
//! it that both versions share), the ratio, and the bytes the fused kernels move (each tensor
//! read or written once per direction). The attention's two `dq` must agree, so a launch the
//! device refused cannot pass for a fast one.

use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use ferrotron::model::attention::CausalSelfAttention;
use ferrotron::model::ops::{layer_norm, scaled_causal_masked_softmax};
use ferrotron::model::GptConfig;
use ferrotron::util::device::parse_device;

/// Median milliseconds of `f(true)` (fused) and `f(false)` (composed) over `reps` runs each,
/// after a warm-up of each, the two interleaved run by run: on a shared, noisy machine a slow
/// stretch then slows both sides rather than one.
fn time_pair(mut f: impl FnMut(bool), reps: usize) -> (f64, f64) {
    f(true);
    f(false);
    let mut times = [Vec::new(), Vec::new()];
    for _ in 0..reps {
        for (side, fused) in [(0, true), (1, false)] {
            let start = Instant::now();
            f(fused);
            times[side].push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [fused, composed] = times;
    (median(fused), median(composed))
}

fn main() {
    let name = std::env::var("FERROTRON_BENCH_DEVICE").unwrap_or_else(|_| "wgpu-cpu".into());
    let device: Device = parse_device(&name).expect("device").autodiff();
    let reps = std::env::var("FERROTRON_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    println!("device {name}, median of {reps} interleaved repetitions after a warm-up");
    println!("| op | fused ms | composed ms | composed / fused | fused MB moved |");
    println!("|---|---|---|---|---|");
    let in_use = || {
        device
            .memory_pool_usage()
            .map_or(f64::NAN, |u| u.bytes_in_use as f64 / 1e6)
    };
    softmax_rows(&device, reps);
    layer_norm_rows(&device, reps);
    attention_core_rows(&device, reps, in_use);
    half_logits_cross_entropy(&device, reps, in_use);
    core_from_rows_recomputed(&device, reps, in_use);
}

/// One row of the table: fused and composed milliseconds, their ratio, the fused MB moved.
fn row(label: &str, f: f64, c: f64, mb: f64) {
    println!("| {label} | {f:.1} | {c:.1} | {:.2}x | {mb:.0} |", c / f);
}

/// The causal softmax's rows, forward alone and forward + backward.
fn softmax_rows(device: &Device, reps: usize) {
    let inner = device.clone().inner();
    // Softmax: forward reads x and writes y; backward reads y and dy and writes dx.
    let shape = [1, 16, 1024, 1024];
    let mb = 16.0 * 1024.0 * 1024.0 * 4.0 / 1e6;
    let scores = Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), device);
    let grad = Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), device);
    let scores_inner = scores.clone().inner();
    let forward = |fused: bool| {
        let _y = scaled_causal_masked_softmax(scores_inner.clone(), 0.125, fused);
        inner.sync().expect("device sync");
    };
    let (f, c) = time_pair(forward, reps);
    row("causal softmax 16×1024×1024, forward", f, c, 2.0 * mb);
    let both = |fused: bool| {
        let x = scores.clone().require_grad();
        let y = scaled_causal_masked_softmax(x.clone(), 0.125, fused);
        let grads = (y * grad.clone()).sum().backward();
        let _dx = x.grad(&grads).expect("gradient");
        device.sync().expect("device sync");
    };
    let (f, c) = time_pair(both, reps);
    row("causal softmax, forward + backward", f, c, 5.0 * mb);
}

/// LayerNorm's rows, forward alone and forward + backward.
fn layer_norm_rows(device: &Device, reps: usize) {
    let inner = device.clone().inner();
    // LayerNorm: forward reads x, writes y; backward reads x and dy twice (dx, then dγ/dβ)
    // and writes dx.
    let mb = 8192.0 * 1024.0 * 4.0 / 1e6;
    let x = Tensor::<3>::random([8, 1024, 1024], Distribution::Normal(1.0, 2.0), device);
    let dy = Tensor::<3>::random([8, 1024, 1024], Distribution::Normal(0.0, 1.0), device);
    let gamma = Tensor::<1>::ones([1024], device);
    let beta = Tensor::<1>::zeros([1024], device);
    let (xi, gi, bi) = (
        x.clone().inner(),
        gamma.clone().inner(),
        beta.clone().inner(),
    );
    let forward = |fused: bool| {
        let _y = layer_norm(xi.clone(), gi.clone(), bi.clone(), 1e-5, fused);
        inner.sync().expect("device sync");
    };
    let (f, c) = time_pair(forward, reps);
    row("layernorm 8192×1024, forward", f, c, 2.0 * mb);
    let both = |fused: bool| {
        let xs = x.clone().require_grad();
        let (g, b) = (gamma.clone().require_grad(), beta.clone().require_grad());
        let y = layer_norm(xs.clone(), g.clone(), b.clone(), 1e-5, fused);
        let grads = (y * dy.clone()).sum().backward();
        let _dx = xs.grad(&grads).expect("gradient");
        let _dg = g.grad(&grads).expect("gradient");
        device.sync().expect("device sync");
    };
    let (f, c) = time_pair(both, reps);
    row("layernorm, forward + backward", f, c, 7.0 * mb);
}

/// The attention core's row (fused kernel against the composed ops), and the memory each
/// holds after the forward.
fn attention_core_rows(device: &Device, reps: usize, in_use: impl Fn() -> f64) {
    // Both with dropout 0.1.
    let (heads, seq, head_dim) = (16, 1024, 64);
    let qkv = [0; 3].map(|_| {
        Tensor::<4>::random(
            [1, heads, seq, head_dim],
            Distribution::Normal(0.0, 1.0),
            device,
        )
    });
    let dy = Tensor::<4>::random(
        [1, heads, seq, head_dim],
        Distribution::Normal(0.0, 1.0),
        device,
    );
    let attention = |flash: bool| {
        let config = GptConfig::new(1, heads * head_dim, heads, seq, 64)
            .with_attention_dropout(0.1)
            .with_flash_attention(flash);
        CausalSelfAttention::new(
            &config,
            1,
            "layers.0.self_attention",
            &ferrotron::comm::Group::single(),
            device,
        )
    };
    // Per side (fused, composed): the memory held after the forward, and the last `dq`.
    let held = [std::cell::Cell::new(0.0), std::cell::Cell::new(0.0)];
    let last_dq: [std::cell::RefCell<Option<Tensor<4>>>; 2] = Default::default();
    let both = |flash: bool| {
        let side = usize::from(!flash);
        let layer = attention(flash);
        // The same dropout draw on both sides (the stream restarts), so their `dq` compare.
        ferrotron::parallel::random::seed_micro_batch(1, 1, 0);
        ferrotron::parallel::random::enter_layer(0);
        let [q, k, v] = qkv.clone().map(|t| t.require_grad());
        device.sync().expect("device sync");
        let before = in_use();
        let y = layer.core_heads(q.clone(), k.clone(), v.clone(), None);
        device.sync().expect("device sync");
        held[side].set(in_use() - before);
        let grads = (y * dy.clone()).sum().backward();
        *last_dq[side].borrow_mut() = Some(q.grad(&grads).expect("gradient"));
        device.sync().expect("device sync");
    };
    let (f, c) = time_pair(both, reps);
    // A launch the device refused (too much shared memory for a forced block size) leaves
    // its output unwritten and the timing meaningless: the two sides must agree.
    let [fused_dq, composed_dq] = last_dq.map(|dq| {
        let dq = dq.into_inner().expect("timed at least once");
        dq.try_into_vec_as::<f32>().expect("dq")
    });
    let worst = fused_dq
        .iter()
        .zip(&composed_dq)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-3, "fused and composed dq differ by {worst}");
    // q, k, v, o, do, dq, dk, dv once each (k and v are re-read per query row: a lower bound).
    let mb = 8.0 * (heads * seq * head_dim * 4) as f64 / 1e6;
    row(
        "attention 16×1024×64, dropout 0.1, forward + backward",
        f,
        c,
        mb,
    );
    print_held("attention", ["fused", "composed"], &held);
}

/// The attention core from the QKV rows (16 heads × 1024 × 64, batch 1, dropout 0.1) keeping
/// only its inputs, the backward forming the probabilities again (selective recomputation
/// inside the op), against keeping the probabilities before and after dropout: forward +
/// backward, the device memory the graph holds after the forward, and the rows' gradients,
/// which must be the same bits.
fn core_from_rows_recomputed(device: &Device, reps: usize, in_use: impl Fn() -> f64) {
    use ferrotron::comm::Group;
    use ferrotron::model::attention::{CausalSelfAttention, CoreInputs, CoreKeeps};
    let (heads, seq, head_dim) = (16, 1024, 64);
    let config = GptConfig::new(1, heads * head_dim, heads, seq, 64).with_attention_dropout(0.1);
    let attention = CausalSelfAttention::new(
        &config,
        1,
        "layers.0.self_attention",
        &Group::single(),
        device,
    );
    let rows = Tensor::<3>::random(
        [1, seq, 3 * heads * head_dim],
        Distribution::Normal(0.0, 1.0),
        device,
    );
    let dy = Tensor::<3>::random(
        [1, seq, heads * head_dim],
        Distribution::Normal(0.0, 1.0),
        device,
    );
    let held = [std::cell::Cell::new(0.0), std::cell::Cell::new(0.0)];
    let grads: [std::cell::RefCell<Vec<f32>>; 2] = Default::default();
    let both = |recompute: bool| {
        let side = usize::from(!recompute);
        let keeps = if recompute {
            CoreKeeps::Inputs
        } else {
            CoreKeeps::Everything
        };
        ferrotron::parallel::random::seed_micro_batch(1, 1, 0);
        ferrotron::parallel::random::enter_layer(0);
        let x = rows.clone().require_grad();
        device.sync().expect("device sync");
        let before = in_use();
        let inputs = CoreInputs::Rows {
            rows: x.clone(),
            bias: None,
        };
        let y = attention.core(inputs, keeps, &ferrotron::model::Documents::none());
        device.sync().expect("device sync");
        held[side].set(in_use() - before);
        let g = (y * dy.clone()).sum().backward();
        *grads[side].borrow_mut() = x
            .grad(&g)
            .expect("gradient")
            .try_into_vec_as::<f32>()
            .expect("gradient");
    };
    let (r, k) = time_pair(both, reps);
    let [recomputed, kept] = grads.map(|g| g.into_inner());
    assert!(
        recomputed == kept,
        "recomputing the probabilities changed the gradient"
    );
    println!(
        "| attention core from the QKV rows 16×1024×64, dropout 0.1, forward + backward: only q, k, v kept (fused column) against the probabilities (composed column) | {r:.1} | {k:.1} | {:.2}x | – |",
        k / r
    );
    print_held(
        "attention core from the QKV rows",
        ["only q, k, v", "the probabilities"],
        &held,
    );
}

/// The device memory the two sides' graphs held after the forward.
fn print_held(op: &str, sides: [&str; 2], held: &[std::cell::Cell<f64>; 2]) {
    println!(
        "{op}: device memory held after the forward: {} {:.1} MB, {} {:.1} MB",
        sides[0],
        held[0].get(),
        sides[1],
        held[1].get()
    );
}

/// The cross-entropy kernels on f16 logits `[512, 50304]` read as they are, against the
/// logits upcast to f32 first (the path before: a cast, and its backward's): forward +
/// backward, and the device memory the graph holds after the forward.
fn half_logits_cross_entropy(device: &Device, reps: usize, in_use: impl Fn() -> f64) {
    use burn::tensor::{FloatDType, Int};
    use ferrotron::comm::Group;
    use ferrotron::parallel::cross_entropy::vocab_parallel_cross_entropy;
    let (tokens, vocab) = (512, 50_304);
    let logits = Tensor::<3>::random([1, tokens, vocab], Distribution::Normal(0.0, 2.0), device)
        .inner()
        .cast(FloatDType::F16);
    let labels = Tensor::<2, Int>::from_data(
        burn::tensor::TensorData::new(
            (0..tokens as i64).map(|t| t * 97 % vocab as i64).collect(),
            [1, tokens],
        ),
        device,
    );
    let held = [std::cell::Cell::new(0.0), std::cell::Cell::new(0.0)];
    let both = |direct: bool| {
        let x = logits.clone().autodiff().require_grad();
        device.sync().expect("device sync");
        let before = in_use();
        let input = if direct {
            x.clone()
        } else {
            x.clone().cast(FloatDType::F32)
        };
        let loss = vocab_parallel_cross_entropy(input, labels.clone(), 0, &Group::single());
        device.sync().expect("device sync");
        held[usize::from(!direct)].set(in_use() - before);
        let grads = loss.mean().backward();
        let _dx = x.grad(&grads).expect("gradient");
        device.sync().expect("device sync");
    };
    let (f, c) = time_pair(both, reps);
    // f16 logits read twice and their f16 gradient written once.
    let mb = 3.0 * (tokens * vocab * 2) as f64 / 1e6;
    println!(
        "| cross-entropy of f16 logits 512×50304 (composed = upcast to f32 first), forward + backward | {f:.1} | {c:.1} | {:.2}x | {mb:.0} |",
        c / f
    );
    print_held(
        "cross-entropy",
        ["f16 logits read as they are", "upcast first"],
        &held,
    );
}
