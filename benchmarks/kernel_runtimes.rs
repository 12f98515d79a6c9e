//! The row and element-wise kernels loading in vectors against one element at a time (the
//! baseline, `ferrotron_kernels::rows::set_vectors_on(false)`), on two CPU runtimes in the
//! same run: lavapipe (wgpu over Mesa's CPU Vulkan driver) and cubecl-cpu (CubeCL's LLVM
//! JIT), each with its own launch shape ([`RowLaunch::for_client`]: 8 lanes per row on
//! lavapipe, 1 on cubecl-cpu). The two modes alternate, three rounds each, and each figure is
//! the median round.
//!
//! ```text
//! .ci/llvm-bundle      # once: cubecl-cpu builds against Debian's llvm-22-dev
//! cargo bench -p ferrotron-kernels --features cpu --target-dir target/cpu --bench kernel_runtimes
//! ```

use std::time::Instant;

use cubecl::prelude::*;
use cubecl::server::Handle;
use ferrotron_kernels::launch::*;

/// Calls timed per kernel and round.
const REPS: usize = 3;
/// Rounds per mode (alternating); the median is reported.
const ROUNDS: usize = 3;

const KERNELS: [&str; 23] = [
    "causal softmax 16×1024×1024, forward",
    "softmax backward",
    "causal softmax with the dropout of its output, one kernel",
    "the dropout of the causal softmax alone (no probabilities written)",
    "causal softmax, then the dropout kernel on its output",
    "softmax backward through its dropout, one kernel",
    "the same, writing the dropped probabilities again (the forward keeps only the probabilities)",
    "the dropout kernel's backward, then the softmax backward",
    "a recomputed core's backward: the softmax forward, then its backward writing the dropped probabilities",
    "the same from the scores, one kernel (the probabilities formed again inside it)",
    "layernorm 8192×1024, forward",
    "layernorm backward (dx, dγ, dβ)",
    "rmsnorm 8192×1024, forward",
    "cross-entropy 512×50304, forward",
    "cross-entropy backward",
    "bias-GELU 8192×4096, forward",
    "bias-GELU backward",
    "flat Adam step in place, 33.5 M elements",
    "gradients copied into a flat buffer, 4 × 8.4 M",
    "bias-dropout-add 8192×1024",
    "bias-dropout-add, as one sequence-parallel chunk (the draw index divided)",
    "rotary embedding 64×1024×128, halves",
    "gradient norm and clipping coefficient, 33.5 M",
];

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

/// Buffers shared by the kernels: inputs of 32 Mi elements and outputs as large.
struct Buffers {
    x: Handle,
    dy: Handle,
    out: Handle,
    out2: Handle,
    out3: Handle,
    row: [Handle; 4],
    per_row: [Handle; 4],
}

impl Buffers {
    const LEN: usize = 8192 * 4096;

    fn new(client: &Client) -> Self {
        Self {
            x: upload(client, Self::LEN, 1),
            dy: upload(client, Self::LEN, 2),
            out: client.empty(Self::LEN * 4),
            out2: client.empty(Self::LEN * 4),
            out3: upload(client, Self::LEN, 8),
            row: [3, 4, 5, 6].map(|seed| upload(client, 4096, seed)),
            per_row: [0; 4].map(|_| client.empty(8192 * 4)),
        }
    }
}

/// The dropout draw every kernel that drops uses: p = 0.1.
const DRAW: DropoutDraw = DropoutDraw {
    key_lo: 1,
    key_hi: 2,
    salt: 3,
    salt_slot: 0,
    threshold: u32::MAX / 10,
    scale: 1.0 / 0.9,
    slice: DrawSlice::WHOLE,
};

/// Milliseconds per call of each of [`KERNELS`] with `client`'s launch shape.
fn timings(client: &Client, b: &Buffers) -> Vec<f64> {
    let launch = RowLaunch::for_client(client);
    let mut all = softmax_timings(client, b, launch);
    all.extend(row_timings(client, b, launch));
    all.extend(element_wise_timings(client, b, launch));
    all
}

/// The softmax rows of [`KERNELS`]: 16 heads × 1024 × 1024 scores.
fn softmax_timings(client: &Client, b: &Buffers, launch: RowLaunch) -> Vec<f64> {
    let scores = ScoresShape {
        batch: 1,
        heads: 16,
        sq: 1024,
        sk: 1024,
    };
    let (x, dy, out, out2) = (&b.x, &b.dy, &b.out, &b.out2);
    let (draw, causal) = (DRAW, SoftmaxMask::Causal);
    vec![
        time(client, || {
            softmax_forward::<f32>(client, launch, x, causal, out, None, scores, 0.125)
        }),
        time(client, || {
            softmax_backward::<f32>(
                client, launch, out, dy, out2, scores, true, 0.125, None, None,
            )
        }),
        time(client, || {
            let dropped = Some((draw, out2));
            softmax_forward::<f32>(client, launch, x, causal, out, dropped, scores, 0.125)
        }),
        time(client, || {
            causal_softmax_dropped::<f32>(client, launch, x, out2, draw, scores, 0.125)
        }),
        time(client, || {
            softmax_forward::<f32>(client, launch, x, causal, out, None, scores, 0.125);
            dropout::<f32>(client, out, out2, scores.len(), draw)
        }),
        time(client, || {
            let draw = Some(draw);
            softmax_backward::<f32>(
                client, launch, out, dy, out2, scores, true, 0.125, draw, None,
            )
        }),
        time(client, || {
            let (draw, again) = (Some(draw), Some(&b.out3));
            softmax_backward::<f32>(
                client, launch, out, dy, out2, scores, true, 0.125, draw, again,
            )
        }),
        time(client, || {
            dropout::<f32>(client, dy, &b.out3, scores.len(), draw);
            softmax_backward::<f32>(
                client, launch, out, &b.out3, out2, scores, true, 0.125, None, None,
            )
        }),
        time(client, || {
            let (draw, again) = (Some(draw), Some(&b.out3));
            softmax_forward::<f32>(client, launch, x, causal, out, None, scores, 0.125);
            softmax_backward::<f32>(
                client, launch, out, dy, out2, scores, true, 0.125, draw, again,
            )
        }),
        time(client, || {
            let (draw, dropped) = (Some(draw), &b.out3);
            softmax_backward_from_scores::<f32>(
                client, launch, x, dy, out2, dropped, scores, 0.125, draw,
            )
        }),
    ]
}

/// The normalisation and cross-entropy rows of [`KERNELS`].
fn row_timings(client: &Client, b: &Buffers, launch: RowLaunch) -> Vec<f64> {
    let (x, dy, out, out2) = (&b.x, &b.dy, &b.out, &b.out2);
    let [gamma, beta, _, _] = &b.row;
    let [mean, rstd, loss, lse] = &b.per_row;
    let (rows, cols) = (8192, 1024);
    let (tokens, vocab) = (512, 50304);
    let targets: Vec<i32> = (0..tokens as i32).map(|t| t * 97 % vocab as i32).collect();
    let targets = client.create_from_slice(i32::as_bytes(&targets));
    let inside = upload(client, tokens, 7);
    vec![
        time(client, || {
            layer_norm_forward::<f32>(
                client, launch, x, gamma, beta, out, mean, rstd, rows, cols, 1e-5,
            )
        }),
        time(client, || {
            layer_norm_backward::<f32>(
                client, launch, x, gamma, dy, mean, rstd, None, out2, out, &b.row[3], rows, cols,
            )
        }),
        time(client, || {
            rms_norm_forward::<f32>(client, launch, x, gamma, out, rstd, rows, cols, 1e-5)
        }),
        time(client, || {
            cross_entropy_forward::<f32>(
                client, launch, x, &targets, &inside, loss, lse, tokens, vocab,
            )
        }),
        time(client, || {
            cross_entropy_backward::<f32>(
                client, launch, x, &targets, &inside, lse, loss, out, tokens, vocab,
            )
        }),
    ]
}

/// The element-wise, optimizer and norm rows of [`KERNELS`].
fn element_wise_timings(client: &Client, b: &Buffers, launch: RowLaunch) -> Vec<f64> {
    let (x, dy, out, out2) = (&b.x, &b.dy, &b.out, &b.out2);
    let bias = &b.row[2];
    let (len, hidden) = (8192 * 1024, 1024);
    let bias_dropout_add_time = |slice| {
        time(client, || {
            let (inputs, draw) = ([x, dy], Some(DRAW.sliced(slice)));
            bias_dropout_add::<f32>(client, inputs, Some(bias), out, len, hidden, draw)
        })
    };
    vec![
        time(client, || {
            gelu_forward::<f32>(client, x, Some((bias, 4096)), out, Buffers::LEN, false)
        }),
        time(client, || {
            gelu_backward::<f32>(client, x, Some((bias, 4096)), dy, out, Buffers::LEN, false)
        }),
        time(client, || {
            let scalars = AdamScalars {
                beta1: 0.9,
                one_minus_beta1: 0.1,
                beta2: 0.95,
                one_minus_beta2: 0.05,
                correction1: 0.1,
                correction2: 0.05,
                eps: 1e-8,
                keep: 1.0,
                lr: 1e-4,
            };
            let range = (0, Buffers::LEN);
            adam_step_in_place::<f32>(
                client,
                out2,
                x,
                (out, &b.out3),
                &b.row[3],
                (&b.row[2], 0),
                Buffers::LEN,
                range,
                scalars,
            )
        }),
        time(client, || {
            let quarter = Buffers::LEN / 4;
            let pieces = [0, 1, 2, 3].map(|k| CopyPiece {
                source: dy,
                offset: k * quarter,
                len: quarter,
            });
            copy_at_offsets::<f32, f32>(client, &pieces, out2, Buffers::LEN, 1.0)
        }),
        bias_dropout_add_time(DrawSlice::WHOLE),
        // The same draw elements as the whole tensor's, through the general index
        // `(i / own) · row + first + i % own` that a whole tensor is compiled without.
        bias_dropout_add_time(DrawSlice::chunk(len, 1, 0)),
        time(client, || {
            let shape = AttentionShape {
                heads: 64,
                seq: 1024,
                head_dim: 128,
            };
            // (Any values serve as the angles' cosines and sines.)
            let tables = RotaryTables {
                cos: dy,
                sin: &b.out3,
                positions: 1024,
                rotary_dim: 128,
                interleaved: false,
            };
            rotary_embedding::<f32>(client, x, out, shape, tables, 0, false)
        }),
        time(client, || {
            let [partials, norm, clip, _] = &b.per_row;
            grad_norm_and_clip(client, launch, x, partials, [norm, clip], Buffers::LEN, 1.0)
        }),
    ]
}

/// Median per kernel over [`ROUNDS`] rounds of each mode, alternating: `[scalar, vectors]`.
fn both_modes(client: &Client) -> [Vec<f64>; 2] {
    let buffers = Buffers::new(client);
    let mut rounds: [Vec<Vec<f64>>; 2] = [vec![], vec![]];
    for _ in 0..ROUNDS {
        for (mode, vectors) in [(0, false), (1, true)] {
            ferrotron_kernels::rows::set_vectors_on(vectors);
            rounds[mode].push(timings(client, &buffers));
        }
    }
    rounds.map(|runs| {
        (0..KERNELS.len())
            .map(|k| {
                let mut v: Vec<f64> = runs.iter().map(|r| r[k]).collect();
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            })
            .collect()
    })
}

fn main() {
    let lavapipe = cubecl::Device::wgpu(cubecl::device::WgpuDeviceKind::Cpu)
        .expect("lavapipe (apt-get install mesa-vulkan-drivers libvulkan1)")
        .client();
    let cpu = cubecl::Device::cpu().expect("cubecl-cpu").client();
    let [lava_scalar, lava_vector] = both_modes(&lavapipe);
    let [cpu_scalar, cpu_vector] = both_modes(&cpu);
    println!("ms per call, median of {ROUNDS} alternating rounds of {REPS} calls after a warm-up");
    println!(
        "| kernel | lavapipe scalar | lavapipe vectors | speed-up | cubecl-cpu scalar | \
         cubecl-cpu vectors | speed-up |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (k, name) in KERNELS.iter().enumerate() {
        println!(
            "| {name} | {:.1} | {:.1} | {:.2}x | {:.1} | {:.1} | {:.2}x |",
            lava_scalar[k],
            lava_vector[k],
            lava_scalar[k] / lava_vector[k],
            cpu_scalar[k],
            cpu_vector[k],
            cpu_scalar[k] / cpu_vector[k],
        );
    }
}
