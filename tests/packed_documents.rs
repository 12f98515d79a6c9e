//! Packed documents (`--reset-position-ids`, `--reset-attention-mask`, `--eod-mask-loss`):
//! the samples' masks and positions against real Megatron-Core's
//! `_get_ltor_masks_and_position_ids` on real token windows, and the model on a packed row
//! against the same model reading each document alone.

use burn::tensor::{Device, Int, Tensor, TensorData};
use ferrotron::data::SampleMasks;
use ferrotron::model::named_parameters::named_parameters;
use ferrotron::model::{lm_loss, Documents, GptConfig, Normalization, PositionEmbedding};
use ferrotron::training::GradientAccumulator;

use crate::common::*;

/// Megatron's outputs for each window (tests/fixtures/megatron_ltor_masks.py wrote them), for
/// each of the eight combinations of the three switches.
#[test]
fn masks_and_positions_are_megatrons() {
    let text = std::fs::read_to_string(fixture("megatron_ltor_masks.json")).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
    let eod = fixture["eod"].as_u64().unwrap() as u32;
    let ints = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let mut checked = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let tokens = ints(&case["tokens"]);
        let s = tokens.len() as u32;
        for key in ["000", "001", "010", "011", "100", "101", "110", "111"] {
            let on = |i: usize| key.as_bytes()[i] == b'1';
            let masks = SampleMasks {
                eod,
                reset_position_ids: on(0),
                reset_attention_mask: on(1),
                eod_mask_loss: on(2),
            };
            let want = &case[key];
            let context = format!("window at {} with switches {key}", case["start"]);
            let positions = masks.positions(&tokens).unwrap_or((0..s).collect());
            assert_eq!(positions, ints(&want["positions"]), "{context}");
            let first_keys = masks.first_keys(&tokens).unwrap_or(vec![0; tokens.len()]);
            assert_eq!(first_keys, ints(&want["first_keys"]), "{context}");
            let loss_mask: Vec<u32> = masks.loss_mask(&tokens).iter().map(|&m| m as u32).collect();
            assert_eq!(loss_mask, ints(&want["loss_mask"]), "{context}");
            checked += 1;
        }
    }
    assert_eq!(checked, 7 * 8);
}

/// A row of `docs` packed one after another, each ending in the end-of-document id.
fn packed(docs: &[Vec<u32>], eod: u32) -> Vec<u32> {
    docs.iter()
        .flat_map(|d| d.iter().copied().chain([eod]))
        .collect()
}

fn ids(v: &[u32], rows: usize, device: &Device) -> Tensor<2, Int> {
    let data: Vec<i64> = v.iter().map(|&x| x as i64).collect();
    Tensor::from_data(TensorData::new(data, [rows, v.len() / rows]), device)
}

/// The model's logits at each token of a packed micro-batch equal its logits for that
/// token's document read alone from position 0, in GPT-2's form (learned positions) and the
/// Llama family's (rotary, RMSNorm, SwiGLU, grouped queries); without the switches they do
/// not (so the test can tell).
#[test]
fn a_packed_row_scores_each_document_as_if_alone() {
    packed_row_against_each_document_alone(&Device::flex(), &[gpt2(), llama()]);
}

/// The same on a CubeCL device (wgpu on lavapipe), where the layers run the fused kernels:
/// the composed attention core with the documents' mask, and the fused attention
/// (`--use-flash-attn`) taking the documents' first keys; and the fused attention's
/// gradients over packed documents (and under a sliding window) equal the composed core's.
#[test]
fn a_packed_row_scores_each_document_as_if_alone_on_a_cubecl_device() {
    if crate::common::own_process::ran_in_own_process_unoptimised() {
        return;
    }
    let device = ferrotron::util::device::parse_device("wgpu-cpu").unwrap();
    let flash = [gpt2(), llama()].map(|c| c.with_flash_attention(true));
    packed_row_against_each_document_alone(&device, &[gpt2(), llama(), flash[0].clone()]);
    packed_row_against_each_document_alone(&device, &flash[1..]);
    // And with a sliding window inside the documents (`--window-size 3,0`).
    for config in [gpt2(), llama(), llama().with_window_size(Some(3))] {
        fused_attention_gradients_equal_the_composed_cores(&device, config);
    }
}

fn gpt2() -> GptConfig {
    GptConfig::new(2, 32, 4, 32, 50_048)
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
}

pub(crate) fn llama() -> GptConfig {
    gpt2()
        .with_position_embedding_type(PositionEmbedding::Rope)
        .with_normalization(Normalization::RmsNorm)
        .with_swiglu(true)
        .with_ffn_hidden_size(Some(48))
        .with_num_query_groups(Some(2))
        .with_add_bias_linear(false)
}

/// Every parameter's gradient of the loss over a packed micro-batch with the fused attention
/// (`--use-flash-attn`, its backward kernels reading the documents' first keys) equals the
/// composed core's with the documents' mask (within 1e-4 of the largest), on `device`.
fn fused_attention_gradients_equal_the_composed_cores(device: &Device, config: GptConfig) {
    let eod = 50_000;
    let (tokens, documents) = packed_batch(eod, device);
    let autodiff = device.clone().autodiff();
    let documents = Documents {
        positions: documents.positions.map(|p| p.to_device(&autodiff)),
        first_keys: documents.first_keys.map(|p| p.to_device(&autodiff)),
    };
    let labels: Vec<u32> = tokens.iter().map(|t| (t * 7 + 3) % 50_000).collect();
    let gradients = |flash: bool| {
        let model = config
            .clone()
            .with_reset_position_ids(true)
            .with_reset_attention_mask(true)
            .with_flash_attention(flash)
            .init(7, &autodiff)
            .unwrap();
        let logits = model.forward_documents(ids(&tokens, 2, &autodiff), &documents);
        let mask = Tensor::<2>::ones([2, 16], &autodiff);
        let loss = lm_loss(logits, ids(&labels, 2, &autodiff), mask);
        let mut grads = GradientAccumulator::default();
        grads.add(&model, loss.backward());
        named_parameters(&model)
            .into_iter()
            .map(|p| {
                let g = grads.get(&p.id).expect("every parameter has a gradient");
                (p.name, g.clone().try_into_vec_as::<f32>().unwrap())
            })
            .collect::<Vec<_>>()
    };
    let (fused, composed) = (gradients(true), gradients(false));
    for ((name, got), (_, want)) in fused.iter().zip(&composed) {
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = got
            .iter()
            .zip(want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst <= 1e-4 * scale.max(1e-3),
            "{name}: fused attention's gradient {worst} off the composed core's (largest {scale})"
        );
    }
}

/// Two rows of 16 tokens: documents of 5, 1, 7 and 0 tokens (each with its EOD), then a last
/// one cut off by the window; and one of 3 and a long cut-off one. With their documents'
/// positions and first keys.
fn packed_batch(eod: u32, device: &Device) -> (Vec<u32>, Documents) {
    let rows = [
        vec![
            vec![11, 12, 13, 14, 15],
            vec![21],
            vec![31, 32, 33, 34, 35, 36, 37],
            vec![],
        ],
        vec![vec![41, 42, 43], (51..63).collect()],
    ];
    let mut tokens = Vec::new();
    for row in &rows {
        let mut t = packed(row, eod);
        t.truncate(16);
        tokens.extend(t);
    }
    let masks = SampleMasks {
        reset_position_ids: true,
        reset_attention_mask: true,
        ..SampleMasks::plain(eod)
    };
    let per_row = |f: &dyn Fn(&[u32]) -> Option<Vec<u32>>| -> Vec<u32> {
        tokens.chunks(16).flat_map(|row| f(row).unwrap()).collect()
    };
    let documents = Documents {
        positions: Some(ids(&per_row(&|r| masks.positions(r)), 2, device)),
        first_keys: Some(ids(&per_row(&|r| masks.first_keys(r)), 2, device)),
    };
    (tokens, documents)
}

fn packed_row_against_each_document_alone(device: &Device, configs: &[GptConfig]) {
    let eod = 50_000;
    let (tokens, documents) = packed_batch(eod, device);
    for config in configs {
        let model = config
            .clone()
            .with_reset_position_ids(true)
            .with_reset_attention_mask(true)
            .init(7, device)
            .unwrap();
        let logits = |t: &[u32], rows: usize, docs: &Documents| -> Vec<f32> {
            let out = model.forward_documents(ids(t, rows, device), docs);
            out.into_data().try_into_vec_as::<f32>().unwrap()
        };
        let vocab = 50_048;
        let together = logits(&tokens, 2, &documents);
        let unmasked = logits(&tokens, 2, &Documents::none());
        let (mut worst, mut worst_unmasked) = (0f32, 0f32);
        for (r, row) in tokens.chunks(16).enumerate() {
            let starts = ferrotron::data::sample_masks::document_starts(row, eod);
            for (i, &start) in starts.iter().enumerate() {
                let end = (start as usize..16)
                    .find(|&j| row[j] == eod)
                    .map_or(16, |j| j + 1);
                let alone = logits(&row[start as usize..end], 1, &Documents::none());
                let at = |v: &[f32], k: usize| v[k * vocab..(k + 1) * vocab].to_vec();
                let want = at(&alone, i - start as usize);
                let got = at(&together, r * 16 + i);
                let off = at(&unmasked, r * 16 + i);
                for c in 0..vocab {
                    worst = worst.max((got[c] - want[c]).abs());
                    worst_unmasked = worst_unmasked.max((off[c] - want[c]).abs());
                }
            }
        }
        assert!(
            worst < 1e-5,
            "{}: packed logits {worst} off",
            config_name(&model)
        );
        assert!(
            worst_unmasked > 1e-3,
            "without the masks the documents see each other"
        );
    }
}

fn config_name(model: &ferrotron::model::Gpt) -> &'static str {
    if model.position_embeddings.is_some() {
        "GPT-2"
    } else {
        "Llama"
    }
}

/// `pretrain --reset-position-ids --reset-attention-mask --eod-mask-loss` on a corpus of short
/// documents trains, and `evaluate` with the same switches prints the loss of the trained
/// model scoring each document of each window on its own, from position 0, over the targets
/// whose input is not an end-of-document.
#[test]
fn pretrain_and_evaluate_score_packed_documents_alone() {
    use ferrotron::data::sample_masks::document_starts;
    use ferrotron::data::IndexedDataset;
    use ferrotron::inference::next_token_scores::{score_rows, OutputColumns};
    use ferrotron::inference::window_eval::contiguous_windows;

    let dir = tempfile::tempdir().unwrap();
    let short = ferrotron::training::layout_fuzz::generate::short_documents(
        &golden("wikitext2_valid", "text"),
        &dir.path().join("data"),
    )
    .unwrap();
    let short = short.to_str().unwrap();
    let switches = [
        "--reset-position-ids",
        "--reset-attention-mask",
        "--eod-mask-loss",
    ];
    let tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50257"];
    let mut args: Vec<&str> = "--num-layers 1 --hidden-size 16 --num-attention-heads 2 \
        --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 \
        --global-batch-size 2 --train-iters 3 --lr 1e-2 --min-lr 1e-3 --lr-decay-style cosine \
        --split 100,0,0 --eval-iters 0 --log-interval 1 --save ckpt --save-interval 3"
        .split_whitespace()
        .collect();
    args.extend(["--data-path", short]);
    args.extend(tokenizer.iter().chain(&switches));
    let out = run_tool(env!("CARGO_BIN_EXE_pretrain"), &args, dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        logged_losses(&String::from_utf8_lossy(&out.stdout)).len(),
        3
    );

    let evaluate = |with_switches: bool| -> f64 {
        let mut args = vec!["--load", "ckpt", "--data-path", short, "--seq-length", "16"];
        args.extend(["--num-samples", "6"].iter().chain(&tokenizer));
        if with_switches {
            args.extend(switches);
        }
        let out = run_tool(env!("CARGO_BIN_EXE_evaluate"), &args, dir.path());
        assert!(out.status.success(), "{}", stderr(&out));
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let line = stdout
            .lines()
            .find(|l| l.starts_with("mean lm loss: "))
            .unwrap();
        line["mean lm loss: ".len()..].parse().unwrap()
    };
    let (model, _) =
        ferrotron::checkpoint::load_model(&dir.path().join("ckpt"), &Device::flex()).unwrap();
    let data = IndexedDataset::open(short).unwrap();
    let (mut total, mut counted) = (0.0, 0usize);
    for window in contiguous_windows(&data, 16, 6).unwrap() {
        let inputs = &window[..16];
        let starts = document_starts(inputs, 50256);
        let mut begin = 0;
        while begin < 16 {
            let end = (begin..16)
                .find(|&i| starts[i] != begin as u32)
                .unwrap_or(16);
            // The document's inputs and the target after its last one.
            let row = window[begin..=end].to_vec();
            let scores = score_rows(
                &model,
                std::slice::from_ref(&row),
                OutputColumns::Real(50257),
                1,
                &Device::flex(),
            )
            .unwrap();
            for (j, log_prob) in scores[0].log_probs.iter().enumerate() {
                if row[j] != 50256 {
                    total -= log_prob;
                    counted += 1;
                }
            }
            begin = end;
        }
    }
    let alone = total / counted as f64;
    let packed = evaluate(true);
    assert!(
        (packed - alone).abs() < 2e-6,
        "evaluate {packed}, each document alone {alone}"
    );
    assert!(
        (evaluate(false) - alone).abs() > 1e-3,
        "the switches change the loss"
    );
}
