//! Tensor parallelism against the unsplit model: every parallel layer and the vocab-parallel
//! cross-entropy (values and gradients) for N = 1, 2, 4, whole training runs at N = 1, 2, 4
//! with every dropout on, the replicated parameters identical on every rank, and checkpoints
//! resharded across sizes.

use std::collections::HashMap;
use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};
use ferrotron::checkpoint::load_model;
use ferrotron::checkpoint::tensor_file::read_tensors;
use ferrotron::comm::{run_ranks, Group};
use ferrotron::data::DataSources;
use ferrotron::model::named_parameters::named_parameters;
use ferrotron::model::GptConfig;
use ferrotron::parallel::cross_entropy::vocab_parallel_cross_entropy;
use ferrotron::parallel::holdings::parameter_holdings;
use ferrotron::parallel::layers::{
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
};
use ferrotron::training::{pretrain, LrDecayStyle, LrSchedule, ParallelConfig, PretrainConfig};
use ferrotron::util::host_tensor::HostTensor;

use crate::common::*;

const SIZES: [usize; 3] = [1, 2, 4];

fn random(shape: &[usize], seed: u64) -> HostTensor {
    let n = shape.iter().product();
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let values = (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    HostTensor::new(shape.to_vec(), values)
}

fn tensor<const D: usize>(h: &HostTensor, device: &Device) -> Tensor<D> {
    let shape: [usize; D] = h.shape.clone().try_into().unwrap();
    Tensor::from_data(TensorData::new(h.values.clone(), shape), device)
}

fn host<const D: usize>(t: Tensor<D>) -> HostTensor {
    HostTensor::new(t.dims().to_vec(), t.try_into_vec_as::<f32>().unwrap())
}

fn assert_close(what: &str, got: &HostTensor, want: &HostTensor, tol: f32) {
    assert_eq!(got.shape, want.shape, "{what}: shape");
    let scale = want.values.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    let worst = got
        .values
        .iter()
        .zip(&want.values)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= tol * scale,
        "{what}: max |diff| {worst} > {tol} × {scale}"
    );
}

fn device() -> Device {
    Device::flex().autodiff()
}

/// Output, input gradient, weight gradient and bias gradient of a layer under
/// `loss = Σ output ⊙ r`.
type LayerResult = (HostTensor, HostTensor, HostTensor, HostTensor);

fn column_run(x: &HostTensor, r: &HostTensor, gather: bool, group: &Group) -> LayerResult {
    let d = device();
    let layer = ColumnParallelLinear::new(8, 12, 0.5, 7, "col", gather, group, &d);
    let xt = tensor::<3>(x, &d).require_grad();
    let y = layer.forward(xt.clone());
    let grads = (y.clone() * tensor::<3>(r, &d)).sum().backward();
    (
        host(y),
        host(xt.grad(&grads).unwrap()),
        host(layer.weight.val().grad(&grads).unwrap()),
        host(layer.bias.as_ref().unwrap().val().grad(&grads).unwrap()),
    )
}

#[test]
fn column_parallel_linear_matches_the_unsplit_layer() {
    let x = random(&[2, 3, 8], 1);
    let r = random(&[2, 3, 12], 2);
    for gather in [false, true] {
        let (y, gx, gw, gb) = column_run(&x, &r, gather, &Group::single());
        for n in SIZES {
            let results = run_ranks(n, |pg| {
                let group = Group::new(pg);
                let rank = group.rank();
                let r_used = if gather {
                    r.clone()
                } else {
                    r.chunk(2, n, rank).unwrap()
                };
                Ok(column_run(&x, &r_used, gather, &group))
            })
            .unwrap();
            for (rank, (yr, gxr, gwr, gbr)) in results.iter().enumerate() {
                let what = format!("column gather={gather} N={n} rank {rank}");
                let want_y = if gather {
                    y.clone()
                } else {
                    y.chunk(2, n, rank).unwrap()
                };
                assert_close(&format!("{what} output"), yr, &want_y, 1e-5);
                assert_close(&format!("{what} dx"), gxr, &gx, 1e-5);
                assert_close(
                    &format!("{what} dW"),
                    gwr,
                    &gw.chunk(1, n, rank).unwrap(),
                    1e-5,
                );
                assert_close(
                    &format!("{what} db"),
                    gbr,
                    &gb.chunk(0, n, rank).unwrap(),
                    1e-5,
                );
            }
        }
    }
}

fn row_run(x: &HostTensor, r: &HostTensor, parallel_input: bool, group: &Group) -> LayerResult {
    let d = device();
    let layer = RowParallelLinear::new(12, 8, 0.5, 9, "row", parallel_input, group, &d);
    let xt = tensor::<3>(x, &d).require_grad();
    let y = layer.forward(xt.clone());
    let grads = (y.clone() * tensor::<3>(r, &d)).sum().backward();
    (
        host(y),
        host(xt.grad(&grads).unwrap()),
        host(layer.weight.val().grad(&grads).unwrap()),
        host(layer.bias.as_ref().unwrap().val().grad(&grads).unwrap()),
    )
}

#[test]
fn row_parallel_linear_matches_the_unsplit_layer() {
    let x = random(&[2, 3, 12], 3);
    let r = random(&[2, 3, 8], 4);
    let (y, gx, gw, gb) = row_run(&x, &r, false, &Group::single());
    for parallel_input in [true, false] {
        for n in SIZES {
            let results = run_ranks(n, |pg| {
                let group = Group::new(pg);
                let x_used = if parallel_input {
                    x.chunk(2, n, group.rank()).unwrap()
                } else {
                    x.clone()
                };
                Ok(row_run(&x_used, &r, parallel_input, &group))
            })
            .unwrap();
            for (rank, (yr, gxr, gwr, gbr)) in results.iter().enumerate() {
                let what = format!("row input_is_parallel={parallel_input} N={n} rank {rank}");
                let want_gx = if parallel_input {
                    gx.chunk(2, n, rank).unwrap()
                } else {
                    gx.clone()
                };
                assert_close(&format!("{what} output"), yr, &y, 1e-5);
                assert_close(&format!("{what} dx"), gxr, &want_gx, 1e-5);
                assert_close(
                    &format!("{what} dW"),
                    gwr,
                    &gw.chunk(0, n, rank).unwrap(),
                    1e-5,
                );
                // The bias is replicated: every rank has the whole gradient.
                assert_close(&format!("{what} db"), gbr, &gb, 1e-5);
            }
        }
    }
}

fn embedding_run(tokens: &[i64], r: &HostTensor, group: &Group) -> (HostTensor, HostTensor) {
    let d = device();
    let layer = VocabParallelEmbedding::new(16, 4, 1.0, 5, "emb", group, &d);
    let ids = Tensor::<2, Int>::from_data(TensorData::new(tokens.to_vec(), [2, 5]), &d);
    let y = layer.forward(ids);
    let grads = (y.clone() * tensor::<3>(r, &d)).sum().backward();
    (host(y), host(layer.weight.val().grad(&grads).unwrap()))
}

#[test]
fn vocab_parallel_embedding_matches_the_unsplit_embedding() {
    // Ids in every rank's range, repeated ids, the first and last rows.
    let tokens = [0i64, 15, 3, 4, 4, 8, 11, 12, 7, 0];
    let r = random(&[2, 5, 4], 6);
    let (y, gw) = embedding_run(&tokens, &r, &Group::single());
    for n in SIZES {
        let results = run_ranks(n, |pg| Ok(embedding_run(&tokens, &r, &Group::new(pg)))).unwrap();
        for (rank, (yr, gwr)) in results.iter().enumerate() {
            assert_close(&format!("embedding N={n} rank {rank}"), yr, &y, 1e-6);
            assert_close(
                &format!("embedding dW N={n} rank {rank}"),
                gwr,
                &gw.chunk(0, n, rank).unwrap(),
                1e-6,
            );
        }
    }
}

/// Mean cross-entropy and its gradient in f64, written out naively.
fn naive_cross_entropy(logits: &HostTensor, labels: &[i64]) -> (f64, Vec<f64>) {
    let v = *logits.shape.last().unwrap();
    let rows = logits.values.len() / v;
    let mut loss = 0.0;
    let mut grad = vec![0.0; logits.values.len()];
    for t in 0..rows {
        let row: Vec<f64> = logits.values[t * v..(t + 1) * v]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let max = row.iter().cloned().fold(f64::MIN, f64::max);
        let sum: f64 = row.iter().map(|x| (x - max).exp()).sum();
        loss += sum.ln() + max - row[labels[t] as usize];
        for j in 0..v {
            let p = (row[j] - max).exp() / sum;
            let onehot = if j == labels[t] as usize { 1.0 } else { 0.0 };
            grad[t * v + j] = (p - onehot) / rows as f64;
        }
    }
    (loss / rows as f64, grad)
}

fn cross_entropy_run(
    logits: &HostTensor,
    labels: &[i64],
    vocab_start: usize,
    group: &Group,
) -> (f32, HostTensor) {
    let d = device();
    let x = tensor::<3>(logits, &d).require_grad();
    let [b, s, _] = x.dims();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(labels.to_vec(), [b, s]), &d);
    let loss = vocab_parallel_cross_entropy(x.clone(), ids, vocab_start, group).mean();
    let grads = loss.clone().backward();
    (loss.into_scalar::<f32>(), host(x.grad(&grads).unwrap()))
}

#[test]
fn vocab_parallel_cross_entropy_matches_float64_for_every_split() {
    let mut logits = random(&[2, 7, 24], 8);
    logits.values.iter_mut().for_each(|v| *v *= 6.0);
    // Targets in every shard, including the first and last column.
    let labels = [0i64, 23, 5, 6, 11, 12, 17, 18, 1, 22, 9, 14, 3, 20];
    let (want_loss, want_grad) = naive_cross_entropy(&logits, &labels);
    let want_grad = HostTensor::new(
        logits.shape.clone(),
        want_grad.iter().map(|&g| g as f32).collect(),
    );
    for n in SIZES {
        let results = run_ranks(n, |pg| {
            let group = Group::new(pg);
            let shard = logits.chunk(2, n, group.rank()).unwrap();
            Ok(cross_entropy_run(
                &shard,
                &labels,
                group.rank() * 24 / n,
                &group,
            ))
        })
        .unwrap();
        for (rank, (loss, grad)) in results.iter().enumerate() {
            let rel = (*loss as f64 - want_loss).abs() / want_loss;
            assert!(rel < 1e-6, "N={n} rank {rank}: loss {loss} vs {want_loss}");
            assert_close(
                &format!("cross-entropy grad N={n} rank {rank}"),
                grad,
                &want_grad.chunk(2, n, rank).unwrap(),
                1e-5,
            );
        }
    }
}

#[test]
fn every_parameter_is_its_shard_of_the_same_master_tensor() {
    let config = GptConfig::new(2, 16, 4, 8, 64);
    let whole: HashMap<String, HostTensor> =
        named_parameters(&config.init(3, &Device::flex()).unwrap())
            .into_iter()
            .map(|p| (p.name, HostTensor::new(p.shape, p.values)))
            .collect();
    for n in [2, 4] {
        let shards = run_ranks(n, |pg| {
            let model = config
                .init_parallel(3, &Group::new(pg), &Device::flex())
                .map_err(anyhow::Error::msg)?;
            // The holdings the layers declare are Megatron's.
            for p in parameter_holdings(&model) {
                assert_eq!(
                    p.holding.partition_dim(),
                    megatron_partition_dim(&p.name),
                    "{}",
                    p.name
                );
            }
            Ok(named_parameters(&model))
        })
        .unwrap();
        for (rank, params) in shards.iter().enumerate() {
            assert_eq!(params.len(), whole.len());
            for p in params {
                let full = &whole[&p.name];
                let want = match megatron_partition_dim(&p.name) {
                    Some(dim) => full.chunk(dim, n, rank).unwrap(),
                    None => full.clone(),
                };
                assert_eq!(p.shape, want.shape, "{} at N={n}", p.name);
                assert_eq!(p.values, want.values, "{} at N={n} rank {rank}", p.name);
            }
        }
    }
}

fn tiny(cache: &Path, tp: usize, train_iters: u64) -> PretrainConfig {
    PretrainConfig {
        seq_length: 16,
        micro_batch_size: 2,
        global_batch_size: 4,
        train_iters,
        schedule: LrSchedule {
            max_lr: 2e-3,
            min_lr: 1e-4,
            warmup_steps: 16.0,
            decay_steps: train_iters as f64 * 4.0,
            style: LrDecayStyle::Cosine,
            ..Default::default()
        },
        split: "100,0,0".into(),
        data_cache_path: Some(cache.to_path_buf()),
        log_interval: 10,
        eval_interval: 0,
        eval_iters: 0,
        parallel: ParallelConfig {
            tensor_model_parallel_size: tp,
            ..ParallelConfig::default()
        },
        // 50304 = 128 · 393 is divisible by 1, 2 and 4: the same padded vocabulary at every N.
        // Every dropout on: each N draws the masks of N = 1.
        ..PretrainConfig::new(
            GptConfig::new(2, 32, 4, 16, 50304)
                .with_hidden_dropout(0.1)
                .with_attention_dropout(0.1),
            DataSources::single(golden("wikitext2_valid", "text")),
        )
    }
}

#[test]
fn training_at_tp_1_2_4_follows_the_same_loss_curve() {
    let dir = tempfile::tempdir().unwrap();
    let runs: Vec<_> = SIZES
        .iter()
        .map(|&n| {
            pretrain(&tiny(dir.path(), n, 40), &device())
                .unwrap()
                .losses
        })
        .collect();
    assert_eq!(runs[0].len(), 40);
    assert!(
        runs[0][39].1 < runs[0][0].1 - 1.0,
        "loss does not fall: {:?}",
        runs[0]
    );
    for (n, run) in SIZES.iter().zip(&runs).skip(1) {
        let worst = worst_relative(run, &runs[0]);
        println!("TP={n}: worst relative loss difference to TP=1 over 40 iterations: {worst:.3e}");
        // Only the order of float sums differs.
        assert!(worst < 1e-5, "TP={n} differs from TP=1 by {worst}");
    }
}

#[test]
fn checkpoints_are_per_rank_and_reshard_to_other_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let full = pretrain(&tiny(dir.path(), 2, 6), &device()).unwrap().losses;
    let ckpt = dir.path().join("ckpt");
    pretrain(
        &PretrainConfig {
            save: Some(ckpt.clone()),
            exit_interval: Some(3),
            ..tiny(dir.path(), 2, 6)
        },
        &device(),
    )
    .unwrap();
    assert_eq!(
        list_dir(&ckpt.join("iter_0000003")),
        ["mp_rank_00", "mp_rank_01"]
    );
    let (rank0, _) =
        read_tensors(&ckpt.join("iter_0000003/mp_rank_00/model_optim_rng.safetensors")).unwrap();
    assert_eq!(
        rank0["model.word_embeddings.weight"].shape,
        vec![50304 / 2, 32]
    );
    for n in [1, 2, 4] {
        let resumed = pretrain(
            &PretrainConfig {
                load: Some(ckpt.clone()),
                ..tiny(dir.path(), n, 6)
            },
            &device(),
        )
        .unwrap()
        .losses;
        let worst = worst_relative(&resumed, &full[3..]);
        println!("TP=2 checkpoint resumed at TP={n}: worst relative difference {worst:.3e}");
        assert!(
            worst < 1e-5,
            "resumed at TP={n}: {resumed:?} vs {:?}",
            &full[3..]
        );
        if n == 2 {
            assert_eq!(resumed, full[3..], "same size resume must be exact");
        }
    }

    // evaluate and export-hf load the whole model: the TP=2 shards joined equal the weights
    // of a TP=1 run of the same 3 iterations.
    let single = dir.path().join("single");
    pretrain(
        &PretrainConfig {
            save: Some(single.clone()),
            exit_interval: Some(3),
            ..tiny(dir.path(), 1, 6)
        },
        &device(),
    )
    .unwrap();
    let joined = named_parameters(&load_model(&ckpt, &Device::flex()).unwrap().0);
    let reference = named_parameters(&load_model(&single, &Device::flex()).unwrap().0);
    assert_eq!(joined.len(), reference.len());
    for (a, b) in joined.iter().zip(&reference) {
        assert_eq!((&a.name, &a.shape), (&b.name, &b.shape));
        // Adam's normalized steps (lr 2e-3) amplify last-bit gradient differences in
        // near-zero gradients, so compare absolutely, well below one step.
        let worst = a
            .values
            .iter()
            .zip(&b.values)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst < 1e-5,
            "{}: joined TP=2 vs TP=1 differ by {worst}",
            a.name
        );
    }
    let out = run_tool(
        env!("CARGO_BIN_EXE_export-hf"),
        &["--load", ckpt.to_str().unwrap(), "--output", "hf"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let (hf, _) = read_tensors(&dir.path().join("hf/model.safetensors")).unwrap();
    assert_eq!(hf["transformer.wte.weight"].shape, vec![50257, 32]);
}

#[test]
fn with_dropout_replicated_parameters_stay_identical_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let mut cfg = PretrainConfig {
        save: Some(ckpt.clone()),
        ..tiny(dir.path(), 2, 3)
    };
    cfg.model = cfg
        .model
        .with_hidden_dropout(0.1)
        .with_attention_dropout(0.1);
    // Three iterations inside the warmup: the decay must still end after it (Megatron's rule).
    cfg.schedule.decay_steps = 24.0;
    let losses = pretrain(&cfg, &device()).unwrap().losses;
    assert!(losses.iter().all(|(_, l)| l.is_finite()));
    let read = |r: usize| {
        read_tensors(&ckpt.join(format!(
            "iter_0000003/mp_rank_0{r}/model_optim_rng.safetensors"
        )))
        .unwrap()
        .0
    };
    let (a, b) = (read(0), read(1));
    let mut replicated = 0;
    for (key, t) in &a {
        let Some(name) = key.strip_prefix("model.") else {
            continue;
        };
        if megatron_partition_dim(name).is_none() {
            // Hidden dropout draws the same masks on both ranks, so the whole replicated
            // computation, and its updates, are bitwise the same.
            assert_eq!(t.values, b[key].values, "{name} differs between ranks");
            replicated += 1;
        } else {
            assert_ne!(t.values, b[key].values, "{name} should be split");
        }
    }
    assert!(replicated >= 10, "{replicated}");
}

#[test]
fn a_tensor_parallel_run_is_bitwise_reproducible() {
    let dir = tempfile::tempdir().unwrap();
    let a = pretrain(&tiny(dir.path(), 2, 6), &device()).unwrap().losses;
    let b = pretrain(&tiny(dir.path(), 2, 6), &device()).unwrap().losses;
    assert_eq!(a, b);
}
