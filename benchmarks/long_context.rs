//! Attention at growing sequence lengths, as packed documents and sliding windows see it: the
//! fused attention (`--use-flash-attn`) forward + backward causal over the whole sequence
//! against the same kernels given each query's first visible key (documents of 256 tokens,
//! `--reset-attention-mask`; a window of 256 keys, `--window-size 256,0`), which skip the
//! tiles no query of a block sees, and the composed core over the same documents (its mask
//! built from the first keys, its `s × s` probabilities kept for the backward). Reports the
//! median milliseconds (the sides interleaved run by run) and the device memory the autodiff
//! graph holds after the forward.
//!
//! ```text
//! cargo bench --bench long_context                       # lavapipe without a GPU
//! FERROTRON_BENCH_DEVICE=wgpu FERROTRON_BENCH_SEQS=4096,16384,32768 cargo bench --bench long_context
//! ```

use std::time::Instant;

use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
use ferrotron::model::attention::CausalSelfAttention;
use ferrotron::model::GptConfig;
use ferrotron::util::device::parse_device;

const HEADS: usize = 4;
const HEAD_DIM: usize = 64;
/// Tokens per packed document, and keys per window.
const SPAN: usize = 256;

/// The sides of a row: what attends to what, and in which core.
#[derive(Clone, Copy, PartialEq)]
enum Side {
    FusedCausal,
    FusedDocuments,
    FusedWindow,
    ComposedDocuments,
}

const SIDES: [(Side, &str); 4] = [
    (Side::FusedCausal, "fused, causal"),
    (Side::FusedDocuments, "fused, documents of 256"),
    (Side::FusedWindow, "fused, window of 256"),
    (Side::ComposedDocuments, "composed, documents of 256"),
];

fn main() {
    let name = std::env::var("FERROTRON_BENCH_DEVICE").unwrap_or_else(|_| "wgpu-cpu".into());
    let device: Device = parse_device(&name).expect("device").autodiff();
    let reps: usize = std::env::var("FERROTRON_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let seqs: Vec<usize> = std::env::var("FERROTRON_BENCH_SEQS")
        .unwrap_or_else(|_| "1024,2048,4096".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("FERROTRON_BENCH_SEQS: comma-separated lengths")
        })
        .collect();
    println!(
        "device {name}, {HEADS} heads × {HEAD_DIM}, batch 1, no dropout; median of {reps} \
         interleaved repetitions after a warm-up; ms forward + backward (MB held after the forward)"
    );
    let header: Vec<&str> = SIDES.iter().map(|(_, name)| *name).collect();
    println!(
        "| seq | {} | causal / documents | causal / window |",
        header.join(" | ")
    );
    println!("|---|---|---|---|---|---|---|");
    for seq in seqs {
        let (ms, held) = measure(&device, seq, reps);
        let cells: Vec<String> = (0..SIDES.len())
            .map(|i| format!("{:.1} ({:.1})", ms[i], held[i]))
            .collect();
        println!(
            "| {seq} | {} | {:.2}x | {:.2}x |",
            cells.join(" | "),
            ms[0] / ms[1],
            ms[0] / ms[2]
        );
    }
}

/// Each side's median milliseconds and the MB it holds after the forward, at `seq`.
fn measure(device: &Device, seq: usize, reps: usize) -> ([f64; 4], [f64; 4]) {
    let random = || {
        Tensor::<4>::random(
            [1, HEADS, seq, HEAD_DIM],
            Distribution::Normal(0.0, 1.0),
            device,
        )
    };
    let qkv = [random(), random(), random()];
    let dy = random();
    let starts: Vec<i64> = (0..seq).map(|i| (i - i % SPAN) as i64).collect();
    let documents = Tensor::<2, Int>::from_data(TensorData::new(starts, [1, seq]), device);
    let layer = |flash: bool, window: Option<usize>| {
        let config = GptConfig::new(1, HEADS * HEAD_DIM, HEADS, seq, 64)
            .with_attention_dropout(0.0)
            .with_flash_attention(flash);
        let group = ferrotron::comm::Group::single();
        CausalSelfAttention::new(&config, 1, "layers.0.self_attention", &group, device)
            .with_window(window)
    };
    let layers = [
        layer(true, None),
        layer(true, None),
        layer(true, Some(SPAN)),
        layer(false, None),
    ];
    let in_use = || {
        device
            .memory_pool_usage()
            .map_or(f64::NAN, |u| u.bytes_in_use as f64 / 1e6)
    };
    let mut held = [0.0; 4];
    // The last `dq` of each side: the fused and composed cores over the same documents must
    // agree, so a side the device could not run (a buffer past its binding limit) shows.
    let mut dq: [Option<Vec<f32>>; 4] = Default::default();
    let mut run = |i: usize| {
        let (side, attention) = (SIDES[i].0, &layers[i]);
        let [q, k, v] = qkv.clone().map(|t| t.require_grad());
        let given = matches!(side, Side::FusedDocuments | Side::ComposedDocuments);
        let first_keys =
            attention.visible_first_keys(given.then_some(&documents), [1, seq], device);
        device.sync().expect("device sync");
        let before = in_use();
        let y = attention.core_heads(q.clone(), k, v, first_keys.as_ref());
        device.sync().expect("device sync");
        held[i] = in_use() - before;
        let grads = (y * dy.clone()).sum().backward();
        let grad = q.grad(&grads).expect("gradient");
        // A side the device failed to run reads back an error, not a panic.
        dq[i] = grad
            .try_into_data()
            .ok()
            .and_then(|d| d.try_to_vec::<f32>().ok());
    };
    // The composed core's `s × s` scores (4 · s² floats) are not even tried past
    // `FERROTRON_BENCH_COMPOSED_MAX` positions (default 8192): on a CPU device they are host
    // memory, which this machine does not have at the longest lengths.
    let composed_max: usize = std::env::var("FERROTRON_BENCH_COMPOSED_MAX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8192);
    let sides = if seq > composed_max { 3 } else { 4 };
    let mut times: [Vec<f64>; 4] = Default::default();
    for i in 0..sides {
        run(i);
    }
    for _ in 0..reps {
        for (i, side_times) in times.iter_mut().enumerate().take(sides) {
            let start = Instant::now();
            run(i);
            side_times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    let mut ms = times.map(|mut v| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    });
    if sides == 3 {
        println!("(seq {seq}: the composed core not run, past FERROTRON_BENCH_COMPOSED_MAX)");
        held[3] = f64::NAN;
        return (ms, held);
    }
    let fused = dq[1].as_ref().expect("the fused core runs at every length");
    let worst = dq[3].as_ref().map_or(f32::INFINITY, |composed| {
        fused
            .iter()
            .zip(composed)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
    });
    if worst.is_nan() || worst >= 1e-3 {
        println!("(seq {seq}: the composed core failed here (dq {worst} off the fused core's): its s × s scores pass the device's buffer limit)");
        ms[3] = f64::NAN;
        held[3] = f64::NAN;
    }
    (ms, held)
}
