//! The fused CubeCL kernels inside the model, on wgpu (lavapipe's CPU Vulkan device in CI):
//! each fused op against the composed reference ops (values and autodiff gradients), and a few
//! training steps with and without fusion giving the same losses.
//!
//! `cargo test --test integration fused_kernels::` (needs a Vulkan device, e.g.
//! `apt-get install mesa-vulkan-drivers libvulkan1`).
#![cfg(feature = "wgpu")]

use std::sync::Arc;

use burn::tensor::{Device, Tensor, TensorData};
use ferrotron::data::{DataSources, MockDocuments};
use ferrotron::model::ops::{layer_norm, rms_norm, scaled_causal_masked_softmax, swiglu};
use ferrotron::model::GptConfig;
use ferrotron::training::{pretrain, LrDecayStyle, LrSchedule, ParallelConfig, PretrainConfig};
use ferrotron::util::device::parse_device;

// Most tests run in a process of their own (one CubeCL device per process: see the module);
// the two that compare against `fused_losses_at_tp_1` share that run in this one.
// Their shapes are small and their steps few, so compiling kernel variants is most of their
// time: lavapipe compiles them unoptimised (measured: docs/testing.md, "Shaders compiled
// unoptimised").
use crate::common::own_process::ran_in_own_process_unoptimised;

fn device() -> Device {
    parse_device("wgpu-cpu").unwrap().autodiff()
}

fn random<const D: usize>(shape: [usize; D], seed: u64, scale: f32, device: &Device) -> Tensor<D> {
    let n = shape.iter().product();
    let mut s = seed;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            scale * (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.try_into_vec_as::<f32>().unwrap()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= tol * scale,
        "{what}: max |diff| {worst} > {tol} × {scale}"
    );
}

/// The cross-entropy's kernels (one rank) against the cross-entropy composed of burn ops on
/// the same device: per-token losses and the logits' gradient of their mean, over a vocabulary
/// wider than a cube's lanes, targets at both ends of it; f16 logits as if upcast first.
#[test]
fn fused_cross_entropy_matches_the_composed_ops_with_gradients() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use burn::tensor::{DType, FloatDType, Int};
    use ferrotron::comm::Group;
    use ferrotron::parallel::cross_entropy::{
        composed_cross_entropy, vocab_parallel_cross_entropy,
    };
    let d = device();
    let (b, s, v) = (2, 7, 300);
    let labels: Vec<i64> = (0..b * s)
        .map(|t| [0, v - 1, (t * 37) % v][t % 3] as i64)
        .collect();
    let labels = Tensor::<2, Int>::from_data(TensorData::new(labels, [b, s]), &d);
    let run = |fused: bool| {
        let x = random([b, s, v], 11, 6.0, &d).require_grad();
        let loss = if fused {
            vocab_parallel_cross_entropy(x.clone(), labels.clone(), 0, &Group::single())
        } else {
            composed_cross_entropy(x.clone(), labels.clone())
        };
        let grads = loss.clone().mean().backward();
        (values(loss), values(x.grad(&grads).unwrap()))
    };
    let (fused, composed) = (run(true), run(false));
    assert_close("cross-entropy", &fused.0, &composed.0, 1e-6);
    assert_close("cross-entropy gradient", &fused.1, &composed.1, 1e-5);
    // f16 logits go into the kernels as they are: the losses and the f16 gradient are, bit
    // for bit, those of the logits upcast to f32 first (Megatron's `logits.float()`), whose
    // backward rounds the f32 gradient to f16.
    let half = |upcast: bool| {
        let x = random([b, s, v], 12, 6.0, &d)
            .inner()
            .cast(FloatDType::F16)
            .autodiff()
            .require_grad();
        let input = if upcast {
            x.clone().cast(FloatDType::F32)
        } else {
            x.clone()
        };
        let loss = vocab_parallel_cross_entropy(input, labels.clone(), 0, &Group::single());
        let grads = loss.clone().mean().backward();
        let grad = x.grad(&grads).unwrap();
        assert_eq!(grad.dtype(), DType::F16);
        (values(loss), values(grad))
    };
    let (direct, upcast) = (half(false), half(true));
    assert_eq!(direct.0, upcast.0, "losses of f16 logits");
    assert_eq!(direct.1, upcast.1, "the f16 logits' gradient");
}

#[test]
fn fused_causal_softmax_matches_the_composed_ops_with_gradients() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    let d = device();
    for shape in [[1, 1, 1, 1], [2, 3, 17, 17], [3, 1, 7, 7], [2, 4, 128, 128]] {
        let x = random(shape, 1, 8.0, &d);
        let r = random(shape, 2, 1.0, &d);
        let run = |fused: bool| {
            let x = x.clone().require_grad();
            let y = scaled_causal_masked_softmax(x.clone(), 0.3, fused);
            let grads = (y.clone() * r.clone()).sum().backward();
            (values(y), values(x.grad(&grads).unwrap()))
        };
        let (y_fused, g_fused) = run(true);
        let (y_ref, g_ref) = run(false);
        assert_close(&format!("softmax {shape:?}"), &y_fused, &y_ref, 1e-5);
        assert_close(&format!("softmax grad {shape:?}"), &g_fused, &g_ref, 1e-5);
    }
}

/// The product extension (cuBLAS on CUDA) differentiates as burn's matmul: its backward
/// pass is two more products of transposed views, checked here on batched, 2-D and
/// transposed operands (on lavapipe the extension runs CubeCL's matmul inside).
#[test]
fn matmul_extension_matches_burns_matmul_with_gradients() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::util::matmul::extension;
    let d = device();
    let cases: [([usize; 4], [usize; 4], bool); 3] = [
        ([2, 3, 17, 9], [2, 3, 9, 13], false),
        ([2, 3, 17, 9], [2, 3, 13, 9], true),
        ([1, 1, 33, 20], [1, 1, 20, 7], false),
    ];
    for (sa, sb, transpose_b) in cases {
        let a = random(sa, 3, 1.0, &d);
        let b = random(sb, 4, 1.0, &d);
        let run = |ext: bool| {
            let (a, b) = (a.clone().require_grad(), b.clone().require_grad());
            let rhs = if transpose_b {
                b.clone().swap_dims(2, 3)
            } else {
                b.clone()
            };
            let c = if ext {
                extension::matmul(a.clone(), rhs)
            } else {
                a.clone().matmul(rhs)
            };
            let r = random(c.dims(), 5, 1.0, &c.device());
            let grads = (c.clone() * r).sum().backward();
            let ga = values(a.grad(&grads).unwrap());
            let gb = values(b.grad(&grads).unwrap());
            (values(c), ga, gb)
        };
        let (c, ga, gb) = run(true);
        let (c_ref, ga_ref, gb_ref) = run(false);
        assert_close(&format!("matmul {sa:?}·{sb:?}"), &c, &c_ref, 1e-5);
        assert_close(&format!("matmul da {sa:?}"), &ga, &ga_ref, 1e-5);
        assert_close(&format!("matmul db {sb:?}"), &gb, &gb_ref, 1e-5);
    }
    // The 2-D weight product of the linear layers: x [rows, in] · wᵀ (a transposed view).
    let x = random([5, 24], 6, 1.0, &d);
    let w = random([16, 24], 7, 1.0, &d);
    let run = |ext: bool| {
        let (x, w) = (x.clone().require_grad(), w.clone().require_grad());
        let c = if ext {
            extension::matmul(x.clone(), w.clone().transpose())
        } else {
            x.clone().matmul(w.clone().transpose())
        };
        let grads = c.clone().sum().backward();
        (
            values(c),
            values(x.grad(&grads).unwrap()),
            values(w.grad(&grads).unwrap()),
        )
    };
    let (c, gx, gw) = run(true);
    let (c_ref, gx_ref, gw_ref) = run(false);
    assert_close("linear", &c, &c_ref, 1e-5);
    assert_close("linear dx", &gx, &gx_ref, 1e-5);
    assert_close("linear dw", &gw, &gw_ref, 1e-5);
}

#[test]
fn fused_layer_norm_matches_the_composed_ops_with_gradients() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    let d = device();
    for (b, s, h) in [(1, 1, 1), (2, 3, 17), (4, 64, 256), (1, 5, 1000)] {
        let x = random([b, s, h], 3, 4.0, &d).add_scalar(10.0);
        let gamma = random([h], 4, 1.0, &d).add_scalar(1.0);
        let beta = random([h], 5, 1.0, &d);
        let r = random([b, s, h], 6, 1.0, &d);
        let run = |fused: bool| {
            let (x, gamma, beta) = (
                x.clone().require_grad(),
                gamma.clone().require_grad(),
                beta.clone().require_grad(),
            );
            let y = layer_norm(x.clone(), gamma.clone(), beta.clone(), 1e-5, fused);
            let grads = (y.clone() * r.clone()).sum().backward();
            (
                values(y),
                values(x.grad(&grads).unwrap()),
                values(gamma.grad(&grads).unwrap()),
                values(beta.grad(&grads).unwrap()),
            )
        };
        let fused = run(true);
        let reference = run(false);
        let what = format!("layer norm {b}×{s}×{h}");
        assert_close(&format!("{what} y"), &fused.0, &reference.0, 1e-5);
        assert_close(&format!("{what} dx"), &fused.1, &reference.1, 1e-4);
        assert_close(&format!("{what} dgamma"), &fused.2, &reference.2, 1e-4);
        assert_close(&format!("{what} dbeta"), &fused.3, &reference.3, 1e-5);
    }
}

/// `t` in f16 when `half`.
fn stored<const D: usize>(t: Tensor<D>, half: bool) -> Tensor<D> {
    if half {
        t.cast(burn::tensor::FloatDType::F16)
    } else {
        t
    }
}

fn f32_values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    values(t.cast(burn::tensor::FloatDType::F32))
}

/// The fused RMSNorm against the composed one: output and the gradients of x and γ, in f32
/// and f16 storage.
#[test]
fn fused_rms_norm_matches_the_composed_ops_with_gradients() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    let d = device();
    for half in [false, true] {
        let mut differs = false;
        for (b, s, h) in [(1, 1, 1), (2, 3, 17), (4, 64, 256), (1, 5, 1000)] {
            let x = stored(random([b, s, h], 3, 4.0, &d).add_scalar(1.0), half);
            let gamma = random([h], 4, 1.0, &d).add_scalar(1.0);
            let gamma = if half {
                gamma.cast(burn::tensor::FloatDType::F16)
            } else {
                gamma
            };
            let r = stored(random([b, s, h], 6, 1.0, &d), half);
            let run = |fused: bool| {
                let (x, gamma) = (x.clone().require_grad(), gamma.clone().require_grad());
                let y = rms_norm(x.clone(), gamma.clone(), 1e-5, fused);
                let grads = (y.clone() * r.clone()).sum().backward();
                [
                    f32_values(y),
                    f32_values(x.grad(&grads).unwrap()),
                    f32_values(gamma.grad(&grads).unwrap()),
                ]
            };
            let (fused, reference) = (run(true), run(false));
            differs |= fused != reference;
            // f16: both compute in f32 and round the output once, but the gradients take
            // different f16 roundings on the way (the composed graph's casts).
            let tol = if half { 1e-2 } else { 1e-5 };
            let what = format!("rms norm {b}×{s}×{h}, f16 {half}");
            assert_close(&format!("{what} y"), &fused[0], &reference[0], tol);
            assert_close(&format!("{what} dx"), &fused[1], &reference[1], tol * 10.0);
            assert_close(
                &format!("{what} dgamma"),
                &fused[2],
                &reference[2],
                tol * 10.0,
            );
        }
        // The sums run in another order: some bits differ when the fused kernel really ran.
        assert!(differs || half, "the fused RMSNorm did not run");
    }
}

/// The fused SwiGLU activation against `silu(gate) ⊙ up` composed: output and both
/// gradients, in f32 and f16 storage.
#[test]
fn fused_swiglu_matches_the_composed_ops_with_gradients() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    let d = device();
    for half in [false, true] {
        for (b, s, f) in [(1, 1, 1), (2, 3, 17), (2, 16, 4 * 64 + 3)] {
            let gate = stored(random([b, s, f], 7, 8.0, &d), half);
            let up = stored(random([b, s, f], 8, 2.0, &d), half);
            let r = stored(random([b, s, f], 9, 1.0, &d), half);
            let run = |fused: bool| {
                let (gate, up) = (gate.clone().require_grad(), up.clone().require_grad());
                let y = swiglu(gate.clone(), up.clone(), fused);
                let grads = (y.clone() * r.clone()).sum().backward();
                [
                    f32_values(y),
                    f32_values(gate.grad(&grads).unwrap()),
                    f32_values(up.grad(&grads).unwrap()),
                ]
            };
            let (fused, reference) = (run(true), run(false));
            if half && b * s * f > 100 {
                // The composed ops round silu(gate) to f16 before the product; the kernel
                // rounds once.
                assert_ne!(fused[0], reference[0], "the fused SwiGLU did not run");
            }
            let tol = if half { 1e-2 } else { 1e-5 };
            let what = format!("swiglu {b}×{s}×{f}, f16 {half}");
            assert_close(&format!("{what} y"), &fused[0], &reference[0], tol);
            assert_close(&format!("{what} d_gate"), &fused[1], &reference[1], tol);
            assert_close(&format!("{what} d_up"), &fused[2], &reference[2], tol);
        }
    }
}

/// The fused GELU, exact and tanh, against a float64 transcription of both (burn's composed
/// GELU on CubeCL differentiates the exact form as the tanh one): output and gradient, in
/// f32 and f16 storage, over inputs far into both tails.
#[test]
fn fused_gelu_matches_float64_with_gradients() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::model::ops::gelu;
    let d = device();
    let exact = |x: f64| {
        let cdf = 0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2));
        let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
        (x * cdf, cdf + x * pdf)
    };
    let tanh_form = |x: f64| {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let t = (c * (x + 0.044715 * x * x * x)).tanh();
        let du = c * (1.0 + 3.0 * 0.044715 * x * x);
        (
            0.5 * x * (1.0 + t),
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du,
        )
    };
    for tanh in [false, true] {
        for half in [false, true] {
            for (b, s, f) in [(1, 1, 1), (2, 3, 17), (2, 16, 4 * 64 + 3)] {
                let x = stored(random([b, s, f], 11, 12.0, &d), half);
                let r = stored(random([b, s, f], 12, 1.0, &d), half);
                let xg = x.clone().require_grad();
                let y = gelu(xg.clone(), tanh, true);
                let grads = (y.clone() * r.clone()).sum().backward();
                let (y, dx) = (f32_values(y), f32_values(xg.grad(&grads).unwrap()));
                let (xs, rs) = (f32_values(x.clone()), f32_values(r.clone()));
                let want: Vec<(f64, f64)> = xs
                    .iter()
                    .map(|&v| {
                        if tanh {
                            tanh_form(v as f64)
                        } else {
                            exact(v as f64)
                        }
                    })
                    .collect();
                let want_y: Vec<f64> = want.iter().map(|w| w.0).collect();
                let want_dx: Vec<f64> =
                    want.iter().zip(&rs).map(|(w, &r)| w.1 * r as f64).collect();
                let abs = if half { 2e-2 } else { 2e-5 };
                let what = format!("gelu (tanh {tanh}) {b}×{s}×{f}, f16 {half}");
                assert_close_f64(&format!("{what} y"), &y, &want_y, abs * 12.0);
                assert_close_f64(&format!("{what} dx"), &dx, &want_dx, abs);
                if !tanh && !half && b * s * f > 100 {
                    // burn's composed GELU on this device: its gradient is the tanh form's, so
                    // the kernel (which ran) is the nearer to the exact one.
                    let xg = x.clone().require_grad();
                    let grads = (gelu(xg.clone(), false, false) * r.clone())
                        .sum()
                        .backward();
                    let composed = f32_values(xg.grad(&grads).unwrap());
                    let off = |got: &[f32]| {
                        got.iter()
                            .zip(&want_dx)
                            .map(|(&g, &w)| (g as f64 - w).abs())
                            .fold(0.0, f64::max)
                    };
                    assert!(
                        off(&dx) < off(&composed),
                        "{what}: the fused GELU did not run"
                    );
                }
            }
        }
    }
}

/// The fused rotary embedding against the composed one: both pair layouts, part of each
/// head rotated, a position offset (incremental decoding), queries laid out as attention
/// has them (not contiguous), output and gradient, in f32 and f16 storage.
#[test]
fn fused_rotary_embedding_matches_the_composed_ops_with_gradients() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use burn::tensor::FloatDType;
    use ferrotron::model::rotary::RotaryEmbedding;
    use ferrotron::model::PositionEmbedding;
    let d = device();
    for (interleaved, percent, start) in [(false, 1.0, 0), (true, 1.0, 5), (false, 0.5, 3)] {
        let config = GptConfig::new(1, 64, 4, 64, 64)
            .with_position_embedding_type(PositionEmbedding::Rope)
            .with_rotary_interleaved(interleaved)
            .with_rotary_percent(percent);
        let rope = RotaryEmbedding::new(&config);
        for half in [false, true] {
            let (b, heads, s, head_dim) = (2, 4, 19, 16);
            let to = |t: Tensor<4>| if half { t.cast(FloatDType::F16) } else { t };
            // [b, s, heads, head_dim] seen as [b, heads, s, head_dim], as attention's q.
            let x = to(random([b, s, heads, head_dim], 10, 2.0, &d)).swap_dims(1, 2);
            let r = to(random([b, heads, s, head_dim], 11, 1.0, &d));
            let run = |fused: bool| {
                let x = x.clone().require_grad();
                let y = rope.clone().with_fusion(fused).apply(x.clone(), start);
                let grads = (y.clone() * r.clone()).sum().backward();
                [f32_values(y), f32_values(x.grad(&grads).unwrap())]
            };
            let (fused, reference) = (run(true), run(false));
            if half {
                // The composed ops round the tables and each product to f16; the kernel
                // keeps f32 tables and rounds once.
                assert_ne!(
                    fused[0], reference[0],
                    "the fused rotary embedding did not run"
                );
            }
            let tol = if half { 2e-3 } else { 1e-6 };
            let what = format!("rotary, interleaved {interleaved}, {percent} of each head, from {start}, f16 {half}");
            assert_close(&format!("{what}: y"), &fused[0], &reference[0], tol);
            assert_close(&format!("{what}: dx"), &fused[1], &reference[1], tol);
        }
    }
}

/// The fused (FlashAttention-style) attention core against the composed one (scores,
/// softmax, dropout on the materialised probabilities, matmul): the same output and q, k, v
/// gradients, with dropout dropping the same probabilities for the same seed, in f32 and f16.
#[test]
fn fused_attention_matches_the_composed_attention_with_dropout_and_gradients() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use burn::tensor::FloatDType;
    use ferrotron::comm::Group;
    use ferrotron::model::attention::CausalSelfAttention;
    use ferrotron::parallel::random::{enter_layer, seed_micro_batch};
    let d = device();
    for (b, heads, s, head_dim, p) in [
        (1, 1, 1, 4, 0.0),
        (2, 3, 17, 8, 0.0),
        (2, 3, 17, 8, 0.3),
        (1, 2, 70, 16, 0.1),
    ] {
        for half in [false, true] {
            let config =
                GptConfig::new(1, heads * head_dim, heads, s, 64).with_attention_dropout(p);
            let inputs = [11, 12, 13, 14].map(|seed| {
                let t = random([b, heads, s, head_dim], seed, 1.5, &d);
                if half {
                    t.cast(FloatDType::F16)
                } else {
                    t
                }
            });
            let run = |flash: bool| {
                let attention = CausalSelfAttention::new(
                    &config.clone().with_flash_attention(flash),
                    5,
                    "layers.0.self_attention",
                    &Group::single(),
                    &d,
                );
                let [q, k, v] = [0, 1, 2].map(|i| inputs[i].clone().require_grad());
                seed_micro_batch(3, 1, 0);
                enter_layer(0);
                let out = attention.core_heads(q.clone(), k.clone(), v.clone(), None);
                let grads = (out.clone() * inputs[3].clone()).sum().backward();
                let mut all = vec![values(out.cast(FloatDType::F32))];
                for x in [q, k, v] {
                    all.push(values(x.grad(&grads).unwrap().cast(FloatDType::F32)));
                }
                all
            };
            let (fused, composed) = (run(true), run(false));
            if s > 1 && !half {
                // The online softmax sums in another order: some bits differ when the fused
                // kernel really ran.
                assert_ne!(fused[0], composed[0], "the fused attention did not run");
            }
            // f16: both round q kᵀ, the probabilities and their products differently.
            let tol = if half { 2e-2 } else { 1e-5 };
            for (name, (f, c)) in ["output", "dq", "dk", "dv"]
                .iter()
                .zip(fused.iter().zip(&composed))
            {
                assert_close(
                    &format!(
                        "attention {name}, [{b}, {heads}, {s}, {head_dim}], p {p}, f16 {half}"
                    ),
                    f,
                    c,
                    tol,
                );
            }
        }
    }
}

/// One layout of [`attention_from_the_qkv_rows_matches_the_composed_split`]: rotary is
/// `(interleaved, percent)`; `half` stores the inputs in f16; a bias comes with batch 2.
#[derive(Clone, Copy, Debug)]
struct QkvRowsCase {
    batch: usize,
    heads: usize,
    groups: usize,
    seq: usize,
    head_dim: usize,
    dropout: f64,
    rotary: Option<(bool, f64)>,
    flash: bool,
    half: bool,
}

/// The attention core's context, rows gradient and bias gradient (as f32) of `attention`
/// fed `rows` (and `bias`) through the fused split or the composed one, its output weighted
/// by `weight` before the sum that is differentiated.
fn qkv_rows_core_run(
    attention: &ferrotron::model::attention::CausalSelfAttention,
    rows: &Tensor<3>,
    bias: &Option<Tensor<1>>,
    weight: &Tensor<3>,
    fused_split: bool,
    keeps: ferrotron::model::attention::CoreKeeps,
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    use burn::tensor::FloatDType;
    use ferrotron::model::attention::CoreInputs;
    use ferrotron::parallel::random::{enter_layer, seed_micro_batch};
    let rows = rows.clone().require_grad();
    let bias = bias.clone().map(|b| b.require_grad());
    let inputs = if fused_split {
        CoreInputs::Rows {
            rows: rows.clone(),
            bias: bias.clone(),
        }
    } else {
        let biased = match &bias {
            Some(bias) => rows.clone() + bias.clone().unsqueeze(),
            None => rows.clone(),
        };
        CoreInputs::Heads(attention.heads_of(biased, 0))
    };
    seed_micro_batch(3, 1, 0);
    enter_layer(0);
    let out = attention.core(inputs, keeps, &ferrotron::model::Documents::none());
    let grads = (out.clone() * weight.clone()).sum().backward();
    let grad = rows.grad(&grads).unwrap();
    let bias_grad = bias.map(|b| values(b.grad(&grads).unwrap().cast(FloatDType::F32)));
    let [out, grad] = [out.cast(FloatDType::F32), grad.cast(FloatDType::F32)].map(values);
    (out, grad, bias_grad)
}

/// The core kernels each request runs: the model's switch (`--attention-backend fused`,
/// `auto` on CUDA in half precision) keeps only the inputs whatever the chunk asks.
fn assert_core_kernel_choice(
    attention: &ferrotron::model::attention::CausalSelfAttention,
    flash: bool,
    what: &str,
) {
    use ferrotron::model::attention::{CausalSelfAttention, CoreKeeps};
    use ferrotron::model::fused::CoreKernels;
    let only_inputs = CausalSelfAttention {
        core_keeps_only_inputs: true,
        ..attention.clone()
    };
    let (want_kept, want_inputs) = if flash {
        (CoreKernels::Flash, CoreKernels::Flash)
    } else {
        (CoreKernels::Composed, CoreKernels::Recomputed)
    };
    let chosen = [
        attention.core_kernels(CoreKeeps::Everything),
        attention.core_kernels(CoreKeeps::Inputs),
        only_inputs.core_kernels(CoreKeeps::Everything),
    ];
    assert_eq!(chosen, [want_kept, want_inputs, want_inputs], "{what}");
}

/// The fused split against the composed one for one [`QkvRowsCase`].
fn check_qkv_rows_case(case: QkvRowsCase) {
    use burn::tensor::FloatDType;
    use ferrotron::comm::Group;
    use ferrotron::model::attention::{CausalSelfAttention, CoreKeeps};
    use ferrotron::model::PositionEmbedding;
    let d = device();
    let QkvRowsCase {
        batch: b,
        heads,
        groups,
        seq: s,
        head_dim,
        half,
        ..
    } = case;
    let mut config = GptConfig::new(1, heads * head_dim, heads, s, 64)
        .with_attention_dropout(case.dropout)
        .with_num_query_groups(Some(groups))
        .with_flash_attention(case.flash);
    if let Some((interleaved, percent)) = case.rotary {
        config = config
            .with_position_embedding_type(PositionEmbedding::Rope)
            .with_rotary_interleaved(interleaved)
            .with_rotary_percent(percent);
    }
    let attention =
        CausalSelfAttention::new(&config, 5, "layers.0.self_attention", &Group::single(), &d);
    let width = (heads + 2 * groups) * head_dim;
    let rows = random([b, s, width], 21, 1.5, &d);
    let weight = random([b, s, heads * head_dim], 22, 1.0, &d);
    // The projection's bias (GPT-2 has one, Llama none): the fused split adds it, the
    // composed path adds it to the rows before splitting them.
    let bias = (b == 2).then(|| random([width], 23, 1.0, &d));
    let (rows, weight, bias) = if half {
        let f16 = FloatDType::F16;
        (rows.cast(f16), weight.cast(f16), bias.map(|b| b.cast(f16)))
    } else {
        (rows, weight, bias)
    };
    let run = |fused_split, keeps| {
        qkv_rows_core_run(&attention, &rows, &bias, &weight, fused_split, keeps)
    };
    let fused = run(true, CoreKeeps::Everything);
    let composed = run(false, CoreKeeps::Everything);
    // The same kernels in the same order, but a product may take another path for
    // other strides; f16 rounds the probabilities and products.
    let tol = if half { 1e-2 } else { 1e-5 };
    let what = format!("{case:?}, bias {}", bias.is_some());
    assert_close(&format!("{what}: context"), &fused.0, &composed.0, tol);
    assert_close(
        &format!("{what}: rows gradient"),
        &fused.1,
        &composed.1,
        tol,
    );
    assert_eq!(fused.2.is_some(), bias.is_some(), "{what}");
    if let (Some(fused), Some(composed)) = (&fused.2, &composed.2) {
        // Summed over b · s rows: f16 sums the rounded row gradients.
        let tol = if half { 5e-2 } else { 1e-4 };
        assert_close(&format!("{what}: bias gradient"), fused, composed, tol);
    }
    let recomputed = run(true, CoreKeeps::Inputs);
    assert!(
        recomputed == fused,
        "{what}: the core keeping only its inputs changed the context or the gradient"
    );
    assert_core_kernel_choice(&attention, case.flash, &what);
}

/// The attention core from the fused QKV projection's rows (one op: split kernel, core,
/// merge kernel backward) against the per-head core fed by the composed split (slices,
/// reshapes; autodiff's slice backward): the same context and rows gradient, for multi-head
/// and grouped-query layouts, the composed and the fused (flash) core, with dropout dropping
/// the same probabilities, in f32 and f16; with rotary embeddings (halves and interleaved
/// pairs, all or half of the channels) rotated inside the op against the per-head path's
/// rotary op after the composed split. Keeping only its inputs (selective recomputation
/// inside the op) gives the same bits as keeping the probabilities.
#[test]
fn attention_from_the_qkv_rows_matches_the_composed_split() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    // Rotary: none, the two halves of all channels, interleaved pairs of half the channels.
    for (batch, heads, groups, seq, head_dim, dropout, rotary) in [
        (2, 3, 3, 17, 8, 0.3, None),
        (1, 4, 2, 9, 16, 0.0, None),
        (2, 4, 1, 33, 8, 0.1, None),
        (2, 4, 2, 19, 16, 0.1, Some((false, 1.0))),
        (1, 2, 1, 23, 16, 0.0, Some((true, 0.5))),
    ] {
        for (flash, half) in [(false, false), (true, false), (false, true)] {
            check_qkv_rows_case(QkvRowsCase {
                batch,
                heads,
                groups,
                seq,
                head_dim,
                dropout,
                rotary,
                flash,
                half,
            });
        }
    }
}

/// The fused bias-GELU against the bias added by a composed add before the fused GELU: the
/// same output and input and bias gradients (the bias's summed over rows), f32 and f16.
#[test]
fn fused_bias_gelu_matches_the_bias_added_before_the_gelu() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::model::ops::{bias_gelu, gelu};
    let d = device();
    for half in [false, true] {
        let run = |fused_bias: bool| {
            let x = stored(random([2, 5, 24], 51, 3.0, &d), half).require_grad();
            let bias = random([24], 52, 1.0, &d).require_grad();
            let r = stored(random([2, 5, 24], 53, 1.0, &d), half);
            let y = if fused_bias {
                bias_gelu(x.clone(), Some(bias.clone()), false, true)
            } else {
                gelu(
                    x.clone() + bias.clone().cast(x.dtype()).unsqueeze(),
                    false,
                    true,
                )
            };
            let grads = (y.clone() * r).sum().backward();
            let dx = f32_values(x.grad(&grads).unwrap());
            [f32_values(y), dx, f32_values(bias.grad(&grads).unwrap())]
        };
        let (fused, composed) = (run(true), run(false));
        let tol = if half { 1e-2 } else { 1e-6 };
        for (name, (f, c)) in ["y", "dx", "d bias"]
            .iter()
            .zip(fused.iter().zip(&composed))
        {
            assert_close(&format!("bias-GELU {name}, f16 {half}"), f, c, tol);
        }
    }
}

/// The fused bias-dropout-add against the bias add, dropout and residual add composed, on
/// the same device and dropout stream: output and the residual's, input's and bias's
/// gradients, with and without bias and dropout.
#[test]
fn fused_bias_dropout_add_matches_the_composed_ops_with_gradients() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::model::dropout::Dropout;
    use ferrotron::parallel::random::{enter_layer, seed_micro_batch, RngRegion};
    let d = device();
    for (p, with_bias) in [(0.3, true), (0.3, false), (0.0, true)] {
        let dropout = Dropout::new(p, RngRegion::Replicated);
        let run = |fused: bool| {
            let residual = random([2, 9, 24], 41, 1.0, &d).require_grad();
            let y = random([2, 9, 24], 42, 1.0, &d).require_grad();
            let bias = random([24], 43, 1.0, &d).require_grad();
            seed_micro_batch(3, 1, 0);
            enter_layer(0);
            let b = with_bias.then(|| bias.clone());
            let out = dropout.bias_dropout_add(residual.clone(), y.clone(), b, fused);
            let weight = random([2, 9, 24], 44, 1.0, &d);
            let grads = (out.clone() * weight).sum().backward();
            let mut all = vec![values(out), values(residual.grad(&grads).unwrap())];
            all.push(values(y.grad(&grads).unwrap()));
            if with_bias {
                all.push(values(bias.grad(&grads).unwrap()));
            }
            all
        };
        let (fused, composed) = (run(true), run(false));
        for (name, (f, c)) in ["output", "d residual", "d y", "d bias"]
            .iter()
            .zip(fused.iter().zip(&composed))
        {
            let what = format!("bias-dropout-add {name}, p {p}, bias {with_bias}");
            assert_close(&what, f, c, 1e-6);
        }
    }
}

/// The residual's gradient joined inside the norm's backward kernel, where the norm and the
/// fused bias-dropout-add read the same tensor `x`, against the same norm and the composed
/// residual add, whose two gradients of `x` autodiff sums: `x`'s gradient for LayerNorm and
/// RMSNorm, in f32 and f16, with the add after the norm's sublayer (a layer's order: the add's
/// backward runs first) and beside the norm (the same depth in the graph).
#[test]
fn the_residual_gradient_joined_in_the_norm_kernel_matches_autodiff_s_sum() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::model::dropout::Dropout;
    use ferrotron::parallel::random::{enter_layer, seed_micro_batch, RngRegion};
    let d = device();
    let dropout = Dropout::new(0.2, RngRegion::Replicated);
    for (half, rms, after) in [
        (false, false, true),
        (false, true, true),
        (true, false, true),
        (false, false, false),
    ] {
        let x = stored(random([2, 7, 40], 51, 2.0, &d), half);
        let [w, y0, r1, r2] =
            [52, 53, 54, 55].map(|seed| stored(random([2, 7, 40], seed, 1.0, &d), half));
        let [gamma, beta, bias] =
            [56, 57, 58].map(|seed| stored(random([40], seed, 1.0, &d).add_scalar(1.0), half));
        let run = |fused_add: bool| {
            let x = x.clone().require_grad();
            let normed = match rms {
                true => rms_norm(x.clone(), gamma.clone(), 1e-5, true),
                false => layer_norm(x.clone(), gamma.clone(), beta.clone(), 1e-5, true),
            };
            seed_micro_batch(5, 1, 0);
            enter_layer(0);
            let loss = if after {
                let y = normed * w.clone();
                let out = dropout.bias_dropout_add(x.clone(), y, Some(bias.clone()), fused_add);
                (out * r1.clone()).sum()
            } else {
                let out =
                    dropout.bias_dropout_add(x.clone(), y0.clone(), Some(bias.clone()), fused_add);
                (out * r1.clone()).sum() + (normed * r2.clone()).sum()
            };
            f32_values(x.grad(&loss.backward()).unwrap())
        };
        let (joined, summed) = (run(true), run(false));
        let what = format!("residual join: f16 {half}, RMSNorm {rms}, add after the norm {after}");
        assert_close(&what, &joined, &summed, if half { 1e-3 } else { 1e-6 });
    }
}

/// The loss's masked mean on the device (one kernel each way) against float64: the mean of
/// the masked values and the gradient `mask / Σ mask` scaled by the upstream gradient.
#[test]
fn fused_masked_mean_matches_float64_with_gradients() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::util::masked_mean::masked_mean;
    let d = device();
    let (b, s) = (3, 37);
    let x = random([b, s], 31, 5.0, &d).require_grad();
    let mask_values: Vec<f32> = (0..b * s)
        .map(|i| ((i * 7) % 5 != 0) as u8 as f32)
        .collect();
    let mask = Tensor::<2>::from_data(TensorData::new(mask_values.clone(), [b, s]), &d);
    let mean = masked_mean(x.clone(), mask);
    let grads = (mean.clone() * 2.5).sum().backward();
    let xs = values(x.clone());
    let count: f64 = mask_values.iter().map(|&m| m as f64).sum();
    let want: f64 = xs
        .iter()
        .zip(&mask_values)
        .map(|(&v, &m)| v as f64 * m as f64)
        .sum::<f64>()
        / count;
    assert!((values(mean)[0] as f64 - want).abs() < 1e-5, "masked mean");
    let grad = values(x.grad(&grads).unwrap());
    let want_grad: Vec<f32> = mask_values
        .iter()
        .map(|&m| (m as f64 * 2.5 / count) as f32)
        .collect();
    assert_close("masked mean gradient", &grad, &want_grad, 1e-6);
}

/// The embedding lookup's gradient on the device (the embedding-gradient kernel, with a GPU's
/// launch shape) against burn's own `select` backward on the same device: bit for bit in f32, over 1,000 positions
/// of a 300-row table (tokens repeated up to a dozen times, some rows never named); in f16
/// it is the f32 sums of the same f16 terms rounded once (burn's adds in f16).
#[test]
fn embedding_gradient_is_burns_select_backward_bit_for_bit() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use burn::tensor::{FloatDType, Int};
    use ferrotron::parallel::embedding_lookup::{embedding_lookup_with, EmbeddingGradient};
    let d = device();
    let (rows, hidden, positions) = (300, 40, 1_000);
    let ids: Vec<i32> = (0..positions).map(|p| ((p * p) % 251) as i32).collect();
    let tokens = Tensor::<1, Int>::from_data(TensorData::new(ids, [positions]), &d);
    let upstream = random([positions, hidden], 37, 1.0, &d);
    let gradient = |dtype: FloatDType, g: Tensor<2>, kernel: bool| {
        let weight = random([rows, hidden], 41, 1.0, &d)
            .cast(dtype)
            .require_grad();
        let looked_up = if kernel {
            embedding_lookup_with(weight.clone(), tokens.clone(), EmbeddingGradient::Kernel)
        } else {
            weight.clone().select(0, tokens.clone())
        };
        let grads = (looked_up * g.cast(dtype)).sum().backward();
        values(weight.grad(&grads).unwrap().cast(FloatDType::F32))
    };
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let kernel = gradient(FloatDType::F32, upstream.clone(), true);
    let burn = gradient(FloatDType::F32, upstream.clone(), false);
    assert_eq!(bits(kernel), bits(burn), "f32 gradients");
    let rounded = upstream.cast(FloatDType::F16).cast(FloatDType::F32);
    let sums = gradient(FloatDType::F32, rounded.clone(), true);
    let once: Vec<f32> = sums
        .iter()
        .map(|&v| half::f16::from_f32(v).to_f32())
        .collect();
    assert_eq!(
        bits(gradient(FloatDType::F16, rounded, true)),
        bits(once),
        "f16 gradients"
    );
}

/// The losses of 4 iterations of a small GPT on the GPU device (dropout off).
fn train_losses(dir: &std::path::Path, fused: bool, tp: usize) -> Vec<(u64, f64)> {
    pretrain(&small_gpt(dir, fused, tp), &device())
        .unwrap()
        .losses
}

/// 4 iterations of a small GPT, dropout off, on Megatron's mock documents with a 512-token
/// vocabulary: these tests compare the GPU backend with the CPU and fused with composed ops, so
/// any data serves, and on lavapipe a GPT-2-sized output layer (50,304 columns for a hidden size
/// of 32) took most of their time (benchmarks/results/2026-12-03-figures-from-comments.md).
fn small_gpt(dir: &std::path::Path, fused: bool, tp: usize) -> PretrainConfig {
    PretrainConfig {
        seq_length: 16,
        micro_batch_size: 2,
        global_batch_size: 4,
        train_iters: 4,
        schedule: LrSchedule {
            max_lr: 2e-3,
            min_lr: 1e-4,
            warmup_steps: 4.0,
            decay_steps: 16.0,
            style: LrDecayStyle::Cosine,
            ..Default::default()
        },
        split: "100,0,0".into(),
        data_cache_path: Some(dir.to_path_buf()),
        log_interval: 1,
        eval_interval: 0,
        eval_iters: 0,
        parallel: ParallelConfig {
            tensor_model_parallel_size: tp,
            ..ParallelConfig::default()
        },
        ..PretrainConfig::new(
            GptConfig::new(2, 32, 4, 16, 512)
                .with_hidden_dropout(0.0)
                .with_attention_dropout(0.0)
                .with_masked_softmax_fusion(fused)
                .with_layer_norm_fusion(fused)
                .with_rope_fusion(fused)
                .with_bias_swiglu_fusion(fused)
                .with_bias_gelu_fusion(fused)
                .with_bias_dropout_fusion(fused),
            DataSources::Mock(Arc::new(MockDocuments::new(512, 511))),
        )
    }
}

/// The fused run at TP=1, which two tests compare against: computed once (the tests run on
/// threads of one process), its index cache under cargo's temporary directory.
fn fused_losses_at_tp_1() -> &'static [(u64, f64)] {
    static LOSSES: std::sync::OnceLock<Vec<(u64, f64)>> = std::sync::OnceLock::new();
    LOSSES.get_or_init(|| {
        let cache = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fused_tp_1");
        train_losses(&cache, true, 1)
    })
}

#[test]
fn training_with_and_without_fusion_gives_the_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    let fused = fused_losses_at_tp_1();
    let unfused = train_losses(dir.path(), false, 1);
    for ((i, a), (_, b)) in fused.iter().zip(&unfused) {
        let rel = (a - b).abs() / b.abs();
        println!("iteration {i}: fused {a:.7} unfused {b:.7} (relative {rel:.1e})");
        assert!(rel < 1e-4, "iteration {i}: {a} vs {b}");
    }
}

/// A small Llama-style model (rotary embeddings on half of each head, RMSNorm with
/// query/key norms, SwiGLU, no linear biases) trains to the same losses with the fused
/// kernels as with the composed ops.
#[test]
fn llama_style_training_with_and_without_fusion_gives_the_same_losses() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::model::{Normalization, PositionEmbedding};
    let dir = tempfile::tempdir().unwrap();
    let run = |fused: bool| {
        let base = small_gpt(dir.path(), fused, 1);
        let config = PretrainConfig {
            model: base
                .model
                .clone()
                .with_position_embedding_type(PositionEmbedding::Rope)
                .with_rotary_percent(0.5)
                .with_normalization(Normalization::RmsNorm)
                .with_qk_layernorm(true)
                .with_swiglu(true)
                .with_add_bias_linear(false),
            ..base
        };
        pretrain(&config, &device()).unwrap().losses
    };
    let (fused, unfused) = (run(true), run(false));
    assert_eq!(fused.len(), 4);
    for ((i, a), (_, b)) in fused.iter().zip(&unfused) {
        let rel = (a - b).abs() / b.abs();
        println!("iteration {i}: fused {a:.7} unfused {b:.7} (relative {rel:.1e})");
        assert!(rel < 1e-4, "iteration {i}: {a} vs {b}");
    }
}

/// Training with `--use-flash-attn` and dropout: the losses of the composed attention with
/// the same seed (the same masks), with and without recomputation (selective recomputation
/// also at TP = 2), and at TP = 2 the losses of TP = 1.
#[test]
fn training_with_fused_attention_and_dropout_follows_the_composed_attention() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::model::Recompute;
    let dir = tempfile::tempdir().unwrap();
    let run_keeping = |tp: usize, flash: bool, recompute, only_inputs: bool| {
        let config = PretrainConfig {
            model: GptConfig::new(2, 32, 4, 16, 512)
                .with_hidden_dropout(0.1)
                .with_attention_dropout(0.1)
                .with_flash_attention(flash)
                .with_core_keeps_only_inputs(only_inputs),
            recompute,
            ..small_gpt(dir.path(), true, tp)
        };
        pretrain(&config, &device()).unwrap().losses
    };
    let run_at = |tp: usize, flash: bool, recompute| run_keeping(tp, flash, recompute, false);
    let run = |flash: bool, recompute| run_at(1, flash, recompute);
    let composed = run(false, Recompute::None);
    let fused = run(true, Recompute::None);
    let fused_recompute = run(true, Recompute::Selective);
    assert_eq!(fused_recompute, fused, "recomputation changed the losses");
    // Selective recomputation inside the core from the rows (one graph per chunk), also
    // under tensor parallelism, where each rank's core draws its own masks.
    let composed_recompute = run(false, Recompute::Selective);
    assert_eq!(
        composed_recompute, composed,
        "recomputation changed the losses"
    );
    let composed_tp_2 = run_at(2, false, Recompute::None);
    assert_eq!(
        run_at(2, false, Recompute::Selective),
        composed_tp_2,
        "recomputation changed the losses at TP = 2"
    );
    // The core keeping only its inputs without recomputation asked for (the `fused` backend,
    // and `auto` on CUDA in half precision).
    assert_eq!(
        run_keeping(1, false, Recompute::None, true),
        composed,
        "the core keeping only its inputs changed the losses"
    );
    for ((i, a), (_, b)) in fused.iter().zip(&composed) {
        let rel = (a - b).abs() / b.abs();
        println!("iteration {i}: fused attention {a:.7} composed {b:.7} (relative {rel:.1e})");
        assert!(rel < 1e-4, "iteration {i}: {a} vs {b}");
    }
    // At TP = 2 each rank's fused kernels drop their heads' part of the mask over every head
    // (the flash kernels, and the composed core's softmax kernels): the one-process losses
    // but for the order of the row-parallel sums. A rank drawing the whole-tensor mask for its
    // heads is ~1e-3 off from the first iteration.
    for (what, split, whole) in [
        ("fused attention", run_at(2, true, Recompute::None), &fused),
        ("composed core", composed_tp_2, &composed),
    ] {
        for ((i, a), (_, b)) in split.iter().zip(whole) {
            let rel = (a - b).abs() / b.abs();
            println!("iteration {i}: {what} at TP=2 {a:.7}, TP=1 {b:.7} (relative {rel:.1e})");
            assert!(rel < 1e-5, "{what}, iteration {i}: TP=2 {a} vs TP=1 {b}");
        }
    }
}

#[test]
fn tensor_parallel_training_on_the_gpu_backend_follows_tp_1() {
    let dir = tempfile::tempdir().unwrap();
    // Tensor parallelism's collectives run on the CubeCL backend too (host-staged).
    let split = train_losses(dir.path(), true, 2);
    let whole = fused_losses_at_tp_1();
    for ((i, a), (_, b)) in split.iter().zip(whole) {
        let rel = (a - b).abs() / b.abs();
        println!("iteration {i}: TP=2 {a:.7} TP=1 {b:.7} (relative {rel:.1e})");
        assert!(rel < 1e-4, "iteration {i}: {a} vs {b}");
    }
}

/// The device's dropout (mask derived in the kernel from the draw's key) against the host's
/// (mask drawn on the CPU, uploaded): the same kept elements and values, forward and
/// backward, in f32 and f16 (WGSL has no bf16; the kernel is generic over the storage type).
#[test]
fn dropout_on_the_device_draws_the_host_masks() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use burn::tensor::FloatDType;
    use ferrotron::model::dropout::Dropout;
    use ferrotron::parallel::random::{enter_layer, seed_micro_batch, RngRegion};
    let cpu = Device::flex().autodiff();
    let gpu = device();
    let run = |device: &Device, half: bool, region: RngRegion| {
        let x = random([2, 3, 37, 19], 5, 2.0, device);
        let r = random([2, 3, 37, 19], 6, 1.0, device);
        let (x, r) = if half {
            (x.cast(FloatDType::F16), r.cast(FloatDType::F16))
        } else {
            (x, r)
        };
        let x = x.require_grad();
        seed_micro_batch(77, 3, 1);
        enter_layer(4);
        let dropout = Dropout::new(0.25, region);
        let first = dropout.forward(x.clone());
        // A second draw of the same stream differs from the first.
        let second = dropout.forward(x.clone());
        let grads = (first.clone() * r).sum().backward();
        let dx = x.grad(&grads).unwrap();
        (values(first), values(second), values(dx))
    };
    for half in [false, true] {
        for region in [RngRegion::Replicated, RngRegion::AttentionHeads] {
            let host = run(&cpu, half, region);
            let dev = run(&gpu, half, region);
            let what = format!("f16 {half}, {region:?}");
            assert_eq!(dev.0, host.0, "{what}: forward");
            assert_eq!(dev.1, host.1, "{what}: second draw");
            assert_eq!(dev.2, host.2, "{what}: backward");
            assert_ne!(dev.0, dev.1, "{what}: two draws");
            let kept = dev.0.iter().filter(|v| **v != 0.0).count() as f64 / dev.0.len() as f64;
            assert!((kept - 0.75).abs() < 0.03, "{what}: kept {kept}");
        }
    }
}

/// Under sequence parallelism each rank drops its chunk (along the sequence) of the whole
/// sequence's mask: on the device the kernel derives that chunk's bits itself (no mask
/// uploaded), equal to the chunk the host draws, forward and backward, on every rank.
#[test]
fn sequence_parallel_dropout_on_the_device_draws_the_host_chunks() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::comm::{run_ranks, Group};
    use ferrotron::model::dropout::Dropout;
    use ferrotron::parallel::random::{enter_layer, seed_micro_batch, RngRegion};
    let runs = run_ranks(3, |world| {
        let group = Group::new(world);
        let run = |device: &Device| {
            let x = random([2, 5, 3, 7], 8, 2.0, device).require_grad();
            let r = random([2, 5, 3, 7], 9, 1.0, device);
            seed_micro_batch(77, 3, 1);
            enter_layer(2);
            let dropout = Dropout::new(0.3, RngRegion::Replicated).with_chunk_of(&group);
            let y = dropout.forward(x.clone());
            let grads = (y.clone() * r).sum().backward();
            (values(y), values(x.grad(&grads).unwrap()))
        };
        Ok((run(&Device::flex().autodiff()), run(&device())))
    })
    .unwrap();
    for (rank, (host, dev)) in runs.iter().enumerate() {
        assert_eq!(dev.0, host.0, "rank {rank}: forward");
        assert_eq!(dev.1, host.1, "rank {rank}: backward");
    }
    // The same input on every rank: different chunks of the mask drop different elements.
    assert_ne!(runs[0].0 .0, runs[1].0 .0);
    assert_ne!(runs[1].0 .0, runs[2].0 .0);
}

/// Training with dropout on the device: the losses of the CPU run with the same seed (the
/// same masks), and activation recomputation re-derives the masks from their keys, giving
/// the losses of keeping the activations.
#[test]
fn training_with_device_dropout_follows_the_cpu_and_survives_recompute() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::model::Recompute;
    let dir = tempfile::tempdir().unwrap();
    let with_dropout = |recompute| PretrainConfig {
        model: GptConfig::new(2, 32, 4, 16, 512)
            .with_hidden_dropout(0.1)
            .with_attention_dropout(0.1),
        recompute,
        ..small_gpt(dir.path(), true, 1)
    };
    let gpu = pretrain(&with_dropout(Recompute::None), &device())
        .unwrap()
        .losses;
    let gpu_recompute = pretrain(&with_dropout(Recompute::Uniform(1)), &device())
        .unwrap()
        .losses;
    let cpu = pretrain(&with_dropout(Recompute::None), &Device::flex().autodiff())
        .unwrap()
        .losses;
    assert_eq!(gpu_recompute, gpu, "recomputation changed the losses");
    for ((i, a), (_, b)) in gpu.iter().zip(&cpu) {
        let rel = (a - b).abs() / b.abs();
        println!("iteration {i}: wgpu {a:.7} CPU {b:.7} (relative {rel:.1e})");
        assert!(rel < 1e-4, "iteration {i}: {a} vs {b}");
    }
}

/// `--fp16` on the device: the mixed-precision step (fp32 main weights, f16 model copy, matmuls
/// and the fused kernels on f16 tensors with f32 math inside, the dynamic loss scaler) with
/// fused attention and dropout follows the CPU's fp16 run of the composed ops, and half
/// precision really ran (the losses are not the fp32 run's); from a loss scale that overflows,
/// the same steps are skipped (the device finds the overflow in the flat buffer's norm). WGSL has no bf16; bf16 takes the
/// same path with another storage type.
#[test]
fn fp16_training_on_the_device_follows_the_cpu() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use ferrotron::optim::grad_scaler::DynamicGradScalerConfig;
    use ferrotron::optim::mixed_precision::Precision;
    let dir = tempfile::tempdir().unwrap();
    let config = |precision, flash, initial_scale| PretrainConfig {
        model: GptConfig::new(2, 32, 4, 16, 512)
            .with_hidden_dropout(0.1)
            .with_attention_dropout(0.1)
            .with_flash_attention(flash),
        precision,
        dynamic_loss_scale: DynamicGradScalerConfig {
            initial_scale,
            ..DynamicGradScalerConfig::default()
        },
        train_iters: 6,
        ..small_gpt(dir.path(), true, 1)
    };
    // From 2¹⁶ the first steps are taken (Megatron's 2³² skips the first few).
    let taken = 2f64.powi(16);
    let cpu = pretrain(
        &config(Precision::Fp16, false, taken),
        &Device::flex().autodiff(),
    )
    .unwrap();
    let fp32 = pretrain(&config(Precision::Fp32, true, taken), &device()).unwrap();
    // From 2²⁰ the first steps overflow and are skipped, found on the device by the flat
    // buffer's norm (the CPU checks every gradient).
    let overflows = 2f64.powi(20);
    let cpu_skips = pretrain(
        &config(Precision::Fp16, false, overflows),
        &Device::flex().autodiff(),
    )
    .unwrap();
    assert!(
        (1..4).contains(&cpu_skips.skipped_iterations.len()),
        "steps {:?} of 6 skipped from 2²⁰",
        cpu_skips.skipped_iterations
    );
    let runs = [
        (false, taken, &cpu),
        (true, taken, &cpu),
        (false, overflows, &cpu_skips),
    ];
    for (flash, initial_scale, cpu) in runs {
        let gpu = pretrain(&config(Precision::Fp16, flash, initial_scale), &device()).unwrap();
        assert_eq!(gpu.skipped_iterations, cpu.skipped_iterations);
        assert_eq!(gpu.loss_scales, cpu.loss_scales);
        assert_ne!(gpu.losses, fp32.losses, "fp16 gave fp32's losses");
        // The norms of the unscaled gradients (Adam and clipping would hide a scale).
        assert_eq!(gpu.grad_norms.len(), 6 - cpu.skipped_iterations.len());
        for ((i, a), (_, b)) in gpu.grad_norms.iter().zip(&cpu.grad_norms) {
            assert!(
                (a - b).abs() < 1e-3 * b,
                "iteration {i}: grad norm {a} vs {b}"
            );
        }
        assert_eq!(gpu.losses.len(), 6);
        for ((i, a), (_, b)) in gpu.losses.iter().zip(&cpu.losses) {
            let rel = (a - b).abs() / b.abs();
            println!("iteration {i}: wgpu fp16 (flash {flash}) {a:.6} CPU fp16 {b:.6} ({rel:.1e})");
            // Both round to f16, at different points (the fused kernels keep f32 inside), so
            // the losses differ by rounding alone, well inside the bound (measured:
            // benchmarks/results/2026-11-27-lavapipe-fused-kernels.md).
            assert!(rel < 1e-4, "iteration {i}: {a} vs {b}");
        }
    }
}

/// `--bf16` on a device that cannot store bf16 (wgpu: WGSL has no such type) is refused with
/// the way out before anything runs, where the shader compiler used to panic.
#[test]
fn bf16_is_refused_where_the_device_has_none() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use burn::tensor::FloatDType;
    use ferrotron::optim::mixed_precision::Precision;
    let dir = tempfile::tempdir().unwrap();
    assert!(
        !device().supports_dtype(FloatDType::BF16),
        "wgpu stores bf16 now"
    );
    let config = PretrainConfig {
        precision: Precision::Bf16,
        ..small_gpt(dir.path(), true, 1)
    };
    let err = pretrain(&config, &device()).unwrap_err().to_string();
    assert!(err.contains("--bf16") && err.contains("--fp16"), "{err}");
}

/// A run whose logits are larger than the device allocates in one buffer (lavapipe: 128 MiB)
/// is refused before it starts, naming the tensor and what to change, where the step's first
/// read used to panic ("An error happened during execution").
#[test]
fn a_run_with_logits_over_the_device_s_largest_buffer_is_refused() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = PretrainConfig {
        micro_batch_size: 40,
        global_batch_size: 40,
        model: GptConfig::new(2, 32, 4, 16, 65536),
        ..small_gpt(dir.path(), true, 1)
    };
    let err = pretrain(&config, &device()).unwrap_err().to_string();
    assert!(
        err.starts_with(
            "the logits of a micro-batch ([40, 16, 65536], 167.8 MB) is larger than the largest \
             buffer this device allocates ("
        ) && err.ends_with(
            "lower --micro-batch-size or --seq-length, or raise --tensor-model-parallel-size"
        ),
        "{err}"
    );
}

/// The optimizer setup of [`flat_adam_follows_the_composed_adam`]: Megatron's betas, weight
/// decay, clipping that binds, and a decoupled learning rate for the first parameter.
fn adam_test_setup(model: &ferrotron::model::Gpt) -> ferrotron::optim::OptimizerSetup {
    use ferrotron::model::named_parameters::named_parameters;
    use ferrotron::optim::{AdamWConfig, OptimizerSetup};
    let params = named_parameters(model);
    OptimizerSetup {
        adam: AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        clip_grad: 0.5,
        names: params.iter().map(|p| (p.id, p.name.clone())).collect(),
        not_counted: Default::default(),
        decoupled_lr: [params[0].id].into_iter().collect(),
        count_zeros: false,
    }
}

/// The same gradients for both optimizers, parameter by parameter in declaration order. In
/// step 2 every other one is in f16, as a half-precision model's backward pass gives it: the
/// accumulator keeps it so, and the flat buffer's copy casts it (two runs of copies).
fn adam_test_gradients(
    model: &ferrotron::model::Gpt,
    step: u64,
    device: &Device,
) -> ferrotron::optim::GradientAccumulator {
    use burn::tensor::FloatDType;
    use ferrotron::model::named_parameters::named_parameters;
    let mut acc = ferrotron::optim::GradientAccumulator::default();
    let device = device.clone().inner();
    for (k, p) in named_parameters(model).iter().enumerate() {
        let g = random([p.values.len()], 100 * step + k as u64, 0.05, &device);
        let g = if step == 2 && k % 2 == 0 {
            g.cast(FloatDType::F16)
        } else {
            g
        };
        acc.insert(p.id, g);
    }
    acc
}

/// A model's parameters by name, as f32 values.
fn named_weights(model: &ferrotron::model::Gpt) -> Vec<(String, Vec<f32>)> {
    ferrotron::model::named_parameters::named_parameters(model)
        .into_iter()
        .map(|p| (p.name, p.values))
        .collect()
}

/// The flat-buffer Adam on the GPU device against the composed per-parameter Adam on the CPU
/// (burn's tensor ops): three steps of a small GPT from the same gradients, with clipping
/// active, weight decay and a decoupled learning rate, give the same weights, gradient norms
/// and moments, also from f16 gradients (step 2); an optimizer resumed from the exported
/// moments takes the same third step; the f16 working copy is the main weights cast.
#[test]
fn flat_adam_follows_the_composed_adam() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    use burn::tensor::FloatDType;
    use ferrotron::comm::Group;
    use ferrotron::optim::{FlatAdamW, GradNorm, LearningRates, Optimizer, ReplicatedAdamW};
    let cpu = Device::flex().autodiff();
    let gpu = device();
    let config = GptConfig::new(2, 32, 4, 16, 256);
    let (setup, grads, weights) = (adam_test_setup, adam_test_gradients, named_weights);
    let norm = |n: GradNorm| match n {
        GradNorm::Read(x) => x,
        GradNorm::OnDevice(t) => f64::from(t.into_scalar::<f32>()),
    };
    let lr = LearningRates {
        base: 1e-3,
        decoupled: 3e-3,
    };
    let mut cpu_model = config.init(3, &cpu).unwrap();
    let mut gpu_model = config.init(3, &gpu).unwrap();
    assert_eq!(
        weights(&cpu_model),
        weights(&gpu_model),
        "the two inits differ"
    );
    let cpu_inner = cpu.clone().inner();
    let mut composed = ReplicatedAdamW::new(setup(&cpu_model), Group::single(), None, &cpu_inner);
    let mut flat = FlatAdamW::new(setup(&gpu_model), None);
    for step in 1..=3u64 {
        let resumed = (step == 3).then(|| {
            // What a checkpoint keeps; this must step before `flat` steps its buffers in place.
            let saved = Optimizer::<ferrotron::model::Gpt>::moments(&flat).unwrap();
            let mut resumed = FlatAdamW::new(setup(&gpu_model), Some((2, saved)));
            let mut acc = grads(&gpu_model, step, &gpu);
            weights(&resumed.step(gpu_model.clone(), &mut acc, lr).unwrap().0)
        });
        let mut acc = grads(&gpu_model, step, &gpu);
        let (model, n_flat) = flat.step(gpu_model, &mut acc, lr).unwrap();
        gpu_model = model;
        let mut acc = grads(&cpu_model, step, &cpu);
        let (model, n_composed) = composed.step(cpu_model, &mut acc, lr).unwrap();
        cpu_model = model;
        let (a, b) = (norm(n_flat), norm(n_composed));
        assert!(
            b > 0.5 && (a - b).abs() <= 1e-5 * b,
            "step {step}: norm {a} vs {b}"
        );
        if let Some(resumed) = resumed {
            assert_eq!(resumed, weights(&gpu_model), "the resumed step");
        }
    }
    for ((name, got), (_, want)) in weights(&gpu_model).iter().zip(weights(&cpu_model)) {
        let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
        assert_close_f64(&format!("weight {name}"), got, &want, 1e-6);
    }
    let moments = |o: &dyn Optimizer<ferrotron::model::Gpt>| o.moments().unwrap();
    for (a, b) in moments(&flat).iter().zip(moments(&composed)) {
        assert_eq!(a.name, b.name);
        let (bm, bv): (Vec<f64>, Vec<f64>) = (
            b.m.iter().map(|&x| x as f64).collect(),
            b.v.iter().map(|&x| x as f64).collect(),
        );
        assert_close_f64(&format!("m of {}", a.name), &a.m, &bm, 1e-7);
        assert_close_f64(&format!("v of {}", a.name), &a.v, &bv, 1e-9);
    }
    let half = Optimizer::working_copy(&flat, &gpu_model, FloatDType::F16, None).unwrap();
    let cast = ferrotron::optim::cast_parameters(gpu_model.clone(), FloatDType::F16);
    assert_eq!(weights(&half), weights(&cast), "the f16 working copy");
}

fn assert_close_f64(what: &str, got: &[f32], want: &[f64], abs: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= abs + 1e-5 * w.abs(),
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

/// The log's kernel line says what the layers run: on the device the fused attention core (in
/// the layout the kernels choose for the device) or the composed one, from the QKV rows where
/// nothing but a fused rotary embedding comes between the projection and the core (not with
/// query/key norms), composed where a flag turns a fusion off; nothing on the CPU, whose
/// backend runs burn's composed ops.
#[test]
fn the_kernel_line_says_what_the_layers_run() {
    use burn::tensor::DType;
    use ferrotron::model::PositionEmbedding;
    let line = |config: GptConfig, device: &Device| {
        let model = config.init(1, device).unwrap();
        model.kernels_in_words(device, DType::F32)
    };
    let gpu = device();
    let base = || GptConfig::new(1, 32, 4, 16, 512);
    let flash = line(base().with_flash_attention(true), &gpu).unwrap();
    println!("{flash}");
    assert!(
        flash.starts_with("kernels: attention: fused core (--use-flash-attn) ")
            && ["on matrix units", "in planes of", "in shared-memory tiles"]
                .iter()
                .any(|layout| flash.contains(layout))
            && flash.contains("from the QKV rows (split and bias inside)")
            && flash.contains("norms fused")
            && flash.contains("MLP GELU fused"),
        "{flash}"
    );
    let composed = line(base().with_layer_norm_fusion(false), &gpu).unwrap();
    assert!(
        composed.contains(
            "composed core: products, fused causal softmax with its dropout, from the QKV rows"
        ) && composed.contains("norms composed"),
        "{composed}"
    );
    let qk_norms = line(base().with_qk_layernorm(true), &gpu).unwrap();
    assert!(
        qk_norms.contains("composed core: products, fused causal softmax;"),
        "{qk_norms}"
    );
    let llama = base()
        .with_position_embedding_type(PositionEmbedding::Rope)
        .with_add_bias_linear(false);
    let rotary = line(llama, &gpu).unwrap();
    assert!(
        rotary.contains("from the QKV rows (split and rotary embedding inside)"),
        "{rotary}"
    );
    let cpu = Device::flex();
    assert_eq!(line(base().with_flash_attention(true), &cpu), None);
}
