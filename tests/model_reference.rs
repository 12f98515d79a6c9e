//! The GPT forward pass against an independent naive implementation in f64, on a tiny
//! configuration with every parameter set to random values.

use std::collections::HashMap;

use burn::tensor::{Device, Int, Tensor, TensorData};
use ferrotron::model::named_parameters::{load_named_parameters, named_parameters};
use ferrotron::model::{lm_loss, GptConfig};
use ferrotron::util::init::{master_values, Init};

type Params = HashMap<String, (Vec<usize>, Vec<f32>)>;

fn tiny_config(openai_gelu: bool) -> GptConfig {
    GptConfig::new(2, 16, 4, 12, 40)
        .with_ffn_hidden_size(Some(24))
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
        .with_openai_gelu(openai_gelu)
}

/// Random values for every parameter (LayerNorm γ around 1), so that no term is trivial.
fn random_params(model: &ferrotron::model::Gpt) -> Params {
    named_parameters(model)
        .into_iter()
        .map(|p| {
            let mut v = master_values(Init::Normal(0.3), &p.shape, 99, &p.name);
            if p.name.ends_with("layernorm.weight") {
                v.iter_mut().for_each(|x| *x += 1.0);
            }
            (p.name, (p.shape, v))
        })
        .collect()
}

fn erf(x: f64) -> f64 {
    if x.abs() > 3.0 {
        // Abramowitz–Stegun 7.1.26 (error < 1.5e-7); only reached for large pre-activations.
        let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
        let y = 1.0
            - (((((1.061_405_429 * t - 1.453_152_027) * t) + 1.421_413_741) * t - 0.284_496_736)
                * t
                + 0.254_829_592)
                * t
                * (-x * x).exp();
        return y.copysign(x);
    }
    // Maclaurin series, exact to double precision for |x| ≤ 3.
    let mut sum = 0.0;
    let mut term = x;
    let mut n = 0.0;
    while term.abs() > 1e-17 {
        sum += term / (2.0 * n + 1.0);
        n += 1.0;
        term *= -x * x / n;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

fn gelu(x: f64, tanh: bool) -> f64 {
    if tanh {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
    } else {
        0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
    }
}

struct Naive<'a> {
    p: &'a Params,
    c: &'a GptConfig,
}

impl Naive<'_> {
    fn w(&self, name: &str) -> (&[usize], Vec<f64>) {
        let (s, v) = &self.p[name];
        (s, v.iter().map(|&x| x as f64).collect())
    }

    fn linear(&self, x: &[f64], name: &str) -> Vec<f64> {
        let (s, w) = self.w(&format!("{name}.weight"));
        let (_, b) = self.w(&format!("{name}.bias"));
        let (n_in, n_out) = (s[0], s[1]);
        (0..n_out)
            .map(|o| b[o] + (0..n_in).map(|i| x[i] * w[i * n_out + o]).sum::<f64>())
            .collect()
    }

    fn layer_norm(&self, x: &[f64], name: &str) -> Vec<f64> {
        let (_, g) = self.w(&format!("{name}.weight"));
        let (_, b) = self.w(&format!("{name}.bias"));
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        x.iter()
            .enumerate()
            .map(|(i, v)| (v - mean) / (var + self.c.layernorm_epsilon).sqrt() * g[i] + b[i])
            .collect()
    }

    fn logits(&self, tokens: &[usize]) -> Vec<Vec<f64>> {
        let (h, heads) = (self.c.hidden_size, self.c.num_attention_heads);
        let hd = h / heads;
        let (_, wte) = self.w("word_embeddings.weight");
        let (_, wpe) = self.w("position_embeddings");
        let mut x: Vec<Vec<f64>> = tokens
            .iter()
            .enumerate()
            .map(|(t, &tok)| (0..h).map(|i| wte[tok * h + i] + wpe[t * h + i]).collect())
            .collect();
        for l in 0..self.c.num_layers {
            let pre = format!("layers.{l}");
            let qkv: Vec<Vec<f64>> = x
                .iter()
                .map(|xt| {
                    self.linear(
                        &self.layer_norm(xt, &format!("{pre}.input_layernorm")),
                        &format!("{pre}.self_attention.query_key_value"),
                    )
                })
                .collect();
            for i in 0..x.len() {
                let mut ctx = vec![0.0; h];
                for j in 0..heads {
                    let q = &qkv[i][j * 3 * hd..j * 3 * hd + hd];
                    let scores: Vec<f64> = (0..=i)
                        .map(|t| {
                            q.iter()
                                .zip(&qkv[t][j * 3 * hd + hd..j * 3 * hd + 2 * hd])
                                .map(|(a, b)| a * b)
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                    for (t, s) in scores.iter().enumerate() {
                        let p = (s - max).exp() / z;
                        for d in 0..hd {
                            ctx[j * hd + d] += p * qkv[t][j * 3 * hd + 2 * hd + d];
                        }
                    }
                }
                // Safe to add in place: every position's q, k, v were computed above.
                let out = self.linear(&ctx, &format!("{pre}.self_attention.dense"));
                x[i] = x[i].iter().zip(&out).map(|(a, b)| a + b).collect();
            }
            for xt in x.iter_mut() {
                let m = self.layer_norm(xt, &format!("{pre}.post_attention_layernorm"));
                let a: Vec<f64> = self
                    .linear(&m, &format!("{pre}.mlp.dense_h_to_4h"))
                    .into_iter()
                    .map(|v| gelu(v, self.c.openai_gelu))
                    .collect();
                let out = self.linear(&a, &format!("{pre}.mlp.dense_4h_to_h"));
                *xt = xt.iter().zip(&out).map(|(a, b)| a + b).collect();
            }
        }
        x.iter()
            .map(|xt| {
                let f = self.layer_norm(xt, "final_layernorm");
                (0..self.c.padded_vocab_size)
                    .map(|v| (0..h).map(|i| f[i] * wte[v * h + i]).sum())
                    .collect()
            })
            .collect()
    }
}

fn check(openai_gelu: bool) {
    let device = Device::flex();
    let config = tiny_config(openai_gelu);
    let model = config.init(7, &device).unwrap();
    let params = random_params(&model);
    let (model, missing) = load_named_parameters(model, &params);
    assert!(missing.is_empty(), "{missing:?}");
    let batch: Vec<Vec<usize>> = vec![
        vec![3, 17, 39, 0, 5, 5, 22, 11, 30, 1],
        vec![39, 38, 2, 9, 14, 27, 6, 33, 18, 4],
    ];
    let (b, s) = (batch.len(), batch[0].len());
    let flat: Vec<i64> = batch.iter().flatten().map(|&t| t as i64).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(flat, [b, s]), &device);
    let logits: Vec<f32> = model.forward(tokens).try_into_vec_as::<f32>().unwrap();
    let naive = Naive {
        p: &params,
        c: &config,
    };
    let mut worst = 0.0f64;
    let mut scale = 0.0f64;
    for (bi, seq) in batch.iter().enumerate() {
        let reference = naive.logits(seq);
        for (t, row) in reference.iter().enumerate() {
            for (v, &r) in row.iter().enumerate() {
                let ours = logits[(bi * s + t) * config.padded_vocab_size + v] as f64;
                worst = worst.max((ours - r).abs());
                scale = scale.max(r.abs());
            }
        }
    }
    assert!(scale > 1.0, "logits are not trivially small ({scale})");
    assert!(
        worst <= 2e-5 * scale,
        "max |burn − naive| = {worst} (logit scale {scale})"
    );
}

#[test]
fn forward_matches_a_naive_f64_implementation_exact_gelu() {
    check(false);
}

#[test]
fn forward_matches_a_naive_f64_implementation_tanh_gelu() {
    check(true);
}

#[test]
fn loss_is_the_masked_mean_of_token_cross_entropy() {
    let device = Device::flex();
    let logits = Tensor::<3>::from_data(
        TensorData::new(vec![1.0f32, 2.0, 3.0, 0.5, 0.5, 0.5], [1, 2, 3]),
        &device,
    );
    let labels = Tensor::<2, Int>::from_data(TensorData::new(vec![2i64, 0], [1, 2]), &device);
    let ce0 = -(3.0f64.exp() / (1.0f64.exp() + 2.0f64.exp() + 3.0f64.exp())).ln();
    let ce1 = (3.0f64).ln();
    let both = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 1.0], [1, 2]), &device);
    let first = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 0.0], [1, 2]), &device);
    let l: f32 = lm_loss(logits.clone(), labels.clone(), both).into_scalar();
    assert!((l as f64 - (ce0 + ce1) / 2.0).abs() < 1e-6);
    let l: f32 = lm_loss(logits, labels, first).into_scalar();
    assert!((l as f64 - ce0).abs() < 1e-6);
}

#[test]
fn invalid_shapes_are_rejected_with_a_reason() {
    let bad = GptConfig::new(2, 10, 3, 8, 40);
    let err = bad.init(1, &Device::flex()).unwrap_err();
    assert!(
        err.contains("not divisible by --num-attention-heads"),
        "{err}"
    );
    assert!(GptConfig::new(0, 16, 4, 8, 40)
        .validate()
        .unwrap_err()
        .contains("--num-layers"));
    assert!(GptConfig::new(1, 16, 4, 8, 40)
        .with_hidden_dropout(1.0)
        .validate()
        .is_err());
}
