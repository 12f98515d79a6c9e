//! The same fused kernels on two CPU runtimes, same run: lavapipe (wgpu over Mesa's CPU
//! Vulkan driver, the baseline) and cubecl-cpu (CubeCL's LLVM JIT), each with its own launch
//! shape ([`RowLaunch::for_client`]: 8 lanes per row on lavapipe, 1 on cubecl-cpu).
//!
//! ```text
//! .ci/llvm-bundle      # once: cubecl-cpu builds against Debian's llvm-22-dev
//! cargo bench -p ferrotron-kernels --features cpu --target-dir target/cpu --bench kernel_runtimes
//! ```

use std::time::Instant;

use cubecl::prelude::*;
use cubecl::server::Handle;
use ferrotron_kernels::launch::*;

const REPS: usize = 5;

fn time(client: &Client, mut f: impl FnMut()) -> f64 {
    f();
    cubecl::future::block_on(client.sync()).expect("device sync");
    let start = Instant::now();
    for _ in 0..REPS {
        f();
    }
    cubecl::future::block_on(client.sync()).expect("device sync");
    start.elapsed().as_secs_f64() * 1e3 / REPS as f64
}

fn upload(client: &Client, n: usize, seed: usize) -> Handle {
    let values: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 + seed) % 1000) as f32 / 250.0 - 2.0)
        .collect();
    client.create_from_slice(f32::as_bytes(&values))
}

/// Milliseconds for: softmax forward, softmax backward, LayerNorm forward, LayerNorm backward.
fn timings(client: &Client) -> [f64; 4] {
    let launch = RowLaunch::for_client(client);
    let scores = ScoresShape {
        batch: 1,
        heads: 16,
        sq: 1024,
        sk: 1024,
    };
    let (x, dy, out) = (
        upload(client, scores.len(), 1),
        upload(client, scores.len(), 2),
        client.empty(scores.len() * 4),
    );
    let softmax = time(client, || {
        softmax_forward::<f32>(client, launch, &x, SoftmaxMask::Causal, &out, scores, 0.125)
    });
    let softmax_back = time(client, || {
        softmax_backward::<f32>(
            client,
            launch,
            &out,
            &dy,
            &x,
            scores.rows(),
            scores.sk,
            0.125,
        )
    });
    let (rows, cols) = (8192, 1024);
    let (gamma, beta) = (upload(client, cols, 3), upload(client, cols, 4));
    let (mean, rstd) = (client.empty(rows * 4), client.empty(rows * 4));
    let (dgamma, dbeta) = (client.empty(cols * 4), client.empty(cols * 4));
    let y = client.empty(rows * cols * 4);
    let (x, dy) = (x.clone(), dy.clone()); // 16 Mi elements, enough for 8192 × 1024
    let norm = time(client, || {
        layer_norm_forward::<f32>(
            client, launch, &x, &gamma, &beta, &y, &mean, &rstd, rows, cols, 1e-5,
        )
    });
    let norm_back = time(client, || {
        layer_norm_backward::<f32>(
            client, launch, &x, &gamma, &dy, &mean, &rstd, &out, &dgamma, &dbeta, rows, cols,
        )
    });
    [softmax, softmax_back, norm, norm_back]
}

fn main() {
    let lavapipe = cubecl::Device::wgpu(cubecl::device::WgpuDeviceKind::Cpu)
        .expect("lavapipe (apt-get install mesa-vulkan-drivers libvulkan1)")
        .client();
    let cpu = cubecl::Device::cpu().expect("cubecl-cpu").client();
    let (base, ours) = (timings(&lavapipe), timings(&cpu));
    println!("{REPS} repetitions after a warm-up; ms per call");
    println!("| kernel | lavapipe | cubecl-cpu | lavapipe / cubecl-cpu |");
    println!("|---|---|---|---|");
    let names = [
        "causal softmax 16×1024×1024, forward",
        "softmax backward",
        "layernorm 8192×1024, forward",
        "layernorm backward (dx, dγ, dβ)",
    ];
    for (i, name) in names.iter().enumerate() {
        println!(
            "| {name} | {:.1} | {:.1} | {:.2}x |",
            base[i],
            ours[i],
            base[i] / ours[i]
        );
    }
}
