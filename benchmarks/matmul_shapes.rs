//! The GPT's matmuls, forward and backward, on a CUDA device: CubeCL's default kernel
//! (`MatmulStrategy::Cube`, what a build without burn's `autotune` feature runs) and the kernel
//! autotune picks (what CUDA builds run), in the same run. Beside it,
//! `benchmarks/torch_matmul_shapes.py` times `torch.matmul` (cuBLAS) on the same shapes and
//! layouts, so the ratio says how far the matmuls alone are from PyTorch's.
//!
//! ```text
//! cargo build --release --features cuda --example matmul_shapes
//! matmul_shapes [TOKENS] [HIDDEN] [VOCAB]     # default GPT-2 345M at micro-batch 4: 4096 1024 50304
//! ```
//!
//! Shapes: a linear layer stores its weight `[in, out]`, so the forward is `x[T, in] @ W`, the
//! input gradient `dy[T, out] @ Wᵀ` (a transposed view, as autodiff passes it) and the weight
//! gradient `xᵀ[in, T] @ dy`; the output layer multiplies by the embedding's transposed view.
//! bf16 inputs and output, as `--bf16` trains. Prints one line per shape: milliseconds and
//! TFLOP/s of each strategy.

use std::time::Instant;

use burn::tensor::{DType, Distribution, FloatDType, Tensor};
use burn_cubecl::kernel::matmul::{matmul, MatmulStrategy};
use burn_cubecl::CubeBackend;
use ferrotron::util::device::parse_device;

const REPS: usize = 20;

/// A labelled way to pick the matmul kernel (a function: `MatmulStrategy` is not `Clone`).
type Strategy = fn() -> MatmulStrategy;

/// One product `a @ b` as the training step runs it: `a` is `[m, k]`, `b` is `[k, n]`, either
/// stored transposed (a view) when its flag says so.
struct Case {
    name: String,
    m: usize,
    k: usize,
    n: usize,
    a_transposed: bool,
    b_transposed: bool,
}

fn cases(tokens: usize, hidden: usize, vocab: usize) -> Vec<Case> {
    let (t, h) = (tokens, hidden);
    let mut out = Vec::new();
    for (layer, d_in, d_out) in [
        ("qkv", h, 3 * h),
        ("attn-proj", h, h),
        ("fc1", h, 4 * h),
        ("fc2", 4 * h, h),
    ] {
        out.push(case(layer, "fwd", t, d_in, d_out, false, false));
        out.push(case(layer, "dgrad", t, d_out, d_in, false, true));
        out.push(case(layer, "wgrad", d_in, t, d_out, true, false));
    }
    // Output layer over the embedding [vocab, h]: logits = x @ Eᵀ.
    out.push(case("logits", "fwd", t, h, vocab, false, true));
    out.push(case("logits", "dgrad", t, vocab, h, false, false));
    out.push(case("logits", "wgrad", vocab, t, h, true, false));
    out
}

fn case(layer: &str, pass: &str, m: usize, k: usize, n: usize, at: bool, bt: bool) -> Case {
    Case {
        name: format!("{layer} {pass}"),
        m,
        k,
        n,
        a_transposed: at,
        b_transposed: bt,
    }
}

/// A bf16 operand of logical shape `[rows, cols]`, stored transposed when asked.
fn operand(rows: usize, cols: usize, transposed: bool, device: &burn::tensor::Device) -> Tensor<2> {
    let shape = if transposed {
        [cols, rows]
    } else {
        [rows, cols]
    };
    let x =
        Tensor::<2>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(FloatDType::BF16);
    if transposed {
        x.transpose()
    } else {
        x
    }
}

/// Milliseconds per product with `strategy` (after one untimed call, which autotunes).
fn time(a: &Tensor<2>, b: &Tensor<2>, strategy: Strategy, device: &burn::tensor::Device) -> f64 {
    let run = || {
        let lhs = a
            .clone()
            .try_into_primitive::<CubeBackend>()
            .expect("a CUDA tensor");
        let rhs = b
            .clone()
            .try_into_primitive::<CubeBackend>()
            .expect("a CUDA tensor");
        matmul(lhs, rhs, None, strategy(), DType::BF16).expect("matmul launch");
    };
    run();
    device.sync().expect("device sync");
    let start = Instant::now();
    for _ in 0..REPS {
        run();
    }
    device.sync().expect("device sync");
    start.elapsed().as_secs_f64() * 1e3 / REPS as f64
}

fn main() {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .map(|v| v.parse().expect("TOKENS HIDDEN VOCAB are integers"))
            .unwrap_or(default)
    };
    let (tokens, hidden, vocab) = (arg(1, 4096), arg(2, 1024), arg(3, 50304));
    let device = parse_device("cuda").expect("a CUDA build");
    let strategies: [(&str, Strategy); 2] = [
        ("cube", || MatmulStrategy::Cube),
        ("autotune", || MatmulStrategy::Autotune),
    ];
    println!("matmul_shapes: bf16, {REPS} repetitions after a warm-up; tokens {tokens}, hidden {hidden}, vocab {vocab}");
    let mut totals = vec![0.0; strategies.len()];
    for c in cases(tokens, hidden, vocab) {
        let a = operand(c.m, c.k, c.a_transposed, &device);
        let b = operand(c.k, c.n, c.b_transposed, &device);
        let flop = 2.0 * (c.m * c.k * c.n) as f64;
        let mut line = format!("{:<16} m {:>6} k {:>6} n {:>6}", c.name, c.m, c.k, c.n);
        for (i, (label, strategy)) in strategies.iter().enumerate() {
            let ms = time(&a, &b, *strategy, &device);
            totals[i] += ms;
            line += &format!(" | {label} ms: {ms:.3} TFLOP/s: {:.1}", flop / ms / 1e9);
        }
        println!("{line}");
    }
    let summary: Vec<String> = strategies
        .iter()
        .zip(&totals)
        .map(|((label, _), ms)| format!("{label} ms: {ms:.3}"))
        .collect();
    println!(
        "one layer's and the output layer's matmuls, summed | {}",
        summary.join(" | ")
    );
}
