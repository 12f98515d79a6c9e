//! Fused CubeCL kernels against the same operations composed of burn tensor ops, on the same
//! wgpu device and in the same run (forward + backward through autodiff).
//!
//! ```text
//! cargo bench --features wgpu --bench fused_kernels          # lavapipe on a machine without a GPU
//! FERROTRON_BENCH_DEVICE=wgpu cargo bench --features wgpu --bench fused_kernels   # a real GPU
//! ```
//!
//! Shapes: softmax over 16 heads × 1024 × 1024 scores (batch 1), LayerNorm over 8192 × 1024.
//! Reports milliseconds per forward + backward, the ratio, and the bytes each version moves
//! (the fused kernels read and write each tensor once per direction).

use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use ferrotron::model::ops::{layer_norm, scaled_causal_masked_softmax};
use ferrotron::train::device::parse_device;

fn time(mut f: impl FnMut(), reps: usize) -> f64 {
    f();
    let start = Instant::now();
    for _ in 0..reps {
        f();
    }
    start.elapsed().as_secs_f64() * 1e3 / reps as f64
}

fn main() {
    let name = std::env::var("FERROTRON_BENCH_DEVICE").unwrap_or_else(|_| "wgpu-cpu".into());
    let device: Device = parse_device(&name).expect("device").autodiff();
    let reps = std::env::var("FERROTRON_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    println!("device {name}, {reps} repetitions after a warm-up; forward + backward");
    println!("| op | fused ms | composed ms | composed / fused | fused MB moved |");
    println!("|---|---|---|---|---|");

    let scores = Tensor::<4>::random([1, 16, 1024, 1024], Distribution::Normal(0.0, 1.0), &device);
    let grad = Tensor::<4>::random([1, 16, 1024, 1024], Distribution::Normal(0.0, 1.0), &device);
    let softmax = |fused: bool| {
        let x = scores.clone().require_grad();
        let y = scaled_causal_masked_softmax(x.clone(), 0.125, fused);
        let grads = (y * grad.clone()).sum().backward();
        let _ = x.grad(&grads).unwrap().into_data();
    };
    let (f, c) = (time(|| softmax(true), reps), time(|| softmax(false), reps));
    // Forward reads x, writes y; backward reads y and dy, writes dx: 5 tensors of 64 MiB.
    let bytes = 5.0 * 16.0 * 1024.0 * 1024.0 * 4.0 / 1e6;
    println!(
        "| causal softmax 16×1024×1024 | {f:.1} | {c:.1} | {:.2}x | {bytes:.0} |",
        c / f
    );

    let x = Tensor::<3>::random([8, 1024, 1024], Distribution::Normal(1.0, 2.0), &device);
    let dy = Tensor::<3>::random([8, 1024, 1024], Distribution::Normal(0.0, 1.0), &device);
    let gamma = Tensor::<1>::ones([1024], &device);
    let beta = Tensor::<1>::zeros([1024], &device);
    let norm = |fused: bool| {
        let xs = x.clone().require_grad();
        let (g, b) = (gamma.clone().require_grad(), beta.clone().require_grad());
        let y = layer_norm(xs.clone(), g.clone(), b.clone(), 1e-5, fused);
        let grads = (y * dy.clone()).sum().backward();
        let _ = xs.grad(&grads).unwrap().into_data();
        let _ = g.grad(&grads).unwrap().into_data();
    };
    let (f, c) = (time(|| norm(true), reps), time(|| norm(false), reps));
    // Forward reads x, writes y; backward reads x and dy (twice: dx, then dγ/dβ), writes dx.
    let bytes = 6.0 * 8192.0 * 1024.0 * 4.0 / 1e6;
    println!(
        "| layernorm 8192×1024 | {f:.1} | {c:.1} | {:.2}x | {bytes:.0} |",
        c / f
    );
}
