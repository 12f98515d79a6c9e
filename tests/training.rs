//! The optimizer against a naive Adam in f64, and a tiny model that must overfit one batch.

use burn::tensor::{Device, Int, Tensor, TensorData};
use ferrotron::model::named_parameters::named_parameters;
use ferrotron::model::{lm_loss, GptConfig};
use ferrotron::training::{AdamW, AdamWConfig, GradientAccumulator};

/// A parameter in the naive optimizer: values, first and second moments, rank.
type NaiveParam = (Vec<f64>, Vec<f64>, Vec<f64>, usize);

#[test]
fn adamw_matches_a_naive_implementation_with_global_clipping() {
    let device = Device::flex().autodiff();
    let config = GptConfig::new(1, 8, 2, 4, 16)
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0);
    let mut model = config.init(11, &device).unwrap();
    let adam = AdamWConfig {
        beta1: 0.8,
        beta2: 0.9,
        eps: 1e-6,
        weight_decay: 0.1,
    };
    let mut optimizer = AdamW::new(adam.clone());
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 5, 9, 2], [1, 4]), &device);
    let labels = Tensor::<2, Int>::from_data(TensorData::new(vec![5i64, 9, 2, 3], [1, 4]), &device);
    let mask = Tensor::<2>::ones([1, 4], &device);

    // Naive state per parameter name: values, m, v (f64).
    let mut naive: std::collections::HashMap<String, NaiveParam> = named_parameters(&model)
        .into_iter()
        .map(|p| {
            let n = p.values.len();
            let rank = p.shape.len();
            (
                p.name,
                (
                    p.values.iter().map(|&x| x as f64).collect(),
                    vec![0.0; n],
                    vec![0.0; n],
                    rank,
                ),
            )
        })
        .collect();
    for step in 1..=3 {
        let lr = 0.05 * step as f64;
        let loss = lm_loss(model.forward(tokens.clone()), labels.clone(), mask.clone());
        let mut grads = GradientAccumulator::default();
        grads.add(&model, loss.backward());
        let named = named_parameters(&model);
        let g: Vec<(String, Vec<f64>)> = named
            .iter()
            .map(|p| {
                (
                    p.name.clone(),
                    grads
                        .get(&p.id)
                        .unwrap()
                        .clone()
                        .try_into_vec_as::<f64>()
                        .unwrap(),
                )
            })
            .collect();
        let norm = g
            .iter()
            .flat_map(|(_, v)| v)
            .map(|x| x * x)
            .sum::<f64>()
            .sqrt();
        let clip = 0.5;
        let reported = grads.clip_global_norm(clip);
        assert!((reported - norm).abs() <= 1e-5 * norm);
        let k = if norm > clip {
            clip / (norm + 1e-6)
        } else {
            1.0
        };
        model = optimizer.step(model, &grads, lr);
        for (name, grad) in g {
            let (p, m, v, rank) = naive.get_mut(&name).unwrap();
            let wd = if *rank >= 2 { adam.weight_decay } else { 0.0 };
            for i in 0..p.len() {
                let gi = grad[i] * k;
                m[i] = adam.beta1 * m[i] + (1.0 - adam.beta1) * gi;
                v[i] = adam.beta2 * v[i] + (1.0 - adam.beta2) * gi * gi;
                let mh = m[i] / (1.0 - adam.beta1.powi(step));
                let vh = v[i] / (1.0 - adam.beta2.powi(step));
                p[i] = p[i] * (1.0 - lr * wd) - lr * mh / (vh.sqrt() + adam.eps);
            }
        }
        for p in named_parameters(&model) {
            let expected = &naive[&p.name].0;
            for (a, b) in p.values.iter().zip(expected) {
                assert!(
                    (*a as f64 - b).abs() <= 2e-5 * (1.0 + b.abs()),
                    "{} after step {step}: {a} vs {b}",
                    p.name
                );
            }
        }
    }
}

#[test]
fn a_tiny_gpt_overfits_one_batch() {
    let device = Device::flex().autodiff();
    device.seed(1);
    let config = GptConfig::new(2, 32, 4, 16, 64)
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0);
    let mut model = config.init(1, &device).unwrap();
    let mut optimizer = AdamW::new(AdamWConfig {
        weight_decay: 0.0,
        ..AdamWConfig::default()
    });
    let seq: Vec<i64> = (0..17).map(|i| (i * 7 + 3) % 64).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(seq[..16].to_vec(), [1, 16]), &device);
    let labels = Tensor::<2, Int>::from_data(TensorData::new(seq[1..].to_vec(), [1, 16]), &device);
    let mask = Tensor::<2>::ones([1, 16], &device);
    let mut losses = Vec::new();
    for _ in 0..60 {
        let loss = lm_loss(model.forward(tokens.clone()), labels.clone(), mask.clone());
        losses.push(loss.clone().into_scalar::<f32>());
        let mut grads = GradientAccumulator::default();
        grads.add(&model, loss.backward());
        grads.clip_global_norm(1.0);
        model = optimizer.step(model, &grads, 1e-2);
    }
    let first = losses[0];
    let last = *losses.last().unwrap();
    assert!(
        (first - (64f32).ln()).abs() < 0.3,
        "initial loss {first} should be near ln(64)"
    );
    assert!(last < 0.1 * first, "loss did not fall: {first} → {last}");
}
