//! Sliding-window attention (`--window-size L,0`, `--window-attn-skip-freq`) and YaRN: the
//! keys each query sees against Megatron-Core's own `get_sliding_window_causal_mask`, YaRN's
//! frequencies against Megatron-Core's `YarnRotaryEmbedding`, a
//! one-layer model's windowed logits against the same model reading only the window, the KV
//! cache against the whole sequence, the fused attention against the composed core, and the
//! window through HuggingFace's `config.json` (Mistral, Qwen2) and back.

use burn::tensor::{Device, Int, Tensor, TensorData};
use ferrotron::export::hf_model::{export_hf, import_hf};
use ferrotron::model::{Gpt, GptConfig, KvCache};

fn ids(v: &[u32], rows: usize, device: &Device) -> Tensor<2, Int> {
    let data: Vec<i64> = v.iter().map(|&x| x as i64).collect();
    Tensor::from_data(TensorData::new(data, [rows, v.len() / rows]), device)
}

/// The Llama form of `packed_documents` (rotary, RMSNorm, SwiGLU, grouped queries) with
/// `layers` layers, 64 positions and a vocabulary of 128.
fn llama(layers: usize) -> GptConfig {
    GptConfig {
        num_layers: layers,
        max_position_embeddings: 64,
        padded_vocab_size: 128,
        ..crate::packed_documents::llama()
    }
}

fn logits(model: &Gpt, tokens: &[u32], device: &Device) -> Vec<f32> {
    let out = model.forward(ids(tokens, 1, device));
    out.into_data().try_into_vec_as::<f32>().unwrap()
}

/// Megatron-Core's own outputs (tests/fixtures/megatron_window_yarn.py wrote them).
fn megatron_fixture() -> serde_json::Value {
    let path = crate::common::fixture("megatron_window_yarn.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The keys a layer with a window of `left` keys lets each query see, from its first keys
/// ([`ferrotron::model::attention::CausalSelfAttention::visible_first_keys`]) through the
/// mask the composed core builds of them, equal Megatron-Core's own
/// `get_sliding_window_causal_mask(sq, skv, (left, 0))` for windows from 0 to past the
/// sequence, and for a KV cache's queries after cached keys (`sq < skv`, the generation
/// step's mask); under packed documents, the window's mask and the documents' both.
#[test]
fn the_window_hides_the_keys_megatrons_mask_hides() {
    let device = Device::flex();
    let documents: Vec<i64> = vec![0, 0, 0, 0, 4, 4, 4, 4, 4];
    for case in megatron_fixture()["windows"].as_array().unwrap() {
        let count = |key: &str| case[key].as_u64().unwrap() as usize;
        let (sq, skv, left) = (count("sq"), count("skv"), count("left"));
        let want: Vec<Vec<bool>> = case["hidden"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| row.as_array().unwrap().iter().map(|x| x == 1).collect())
            .collect();
        let offset = skv - sq;
        let first = ferrotron::model::documents::window_first_keys(left, offset, sq, &device);
        let hidden = ferrotron::model::documents::hidden_keys(first.unsqueeze(), skv, offset);
        let hidden: Vec<bool> = hidden.into_data().try_to_vec().unwrap();
        assert_eq!(hidden.len(), sq * skv);
        for i in 0..sq {
            assert_eq!(
                &hidden[i * skv..][..skv],
                &want[i][..],
                "{sq}×{skv}, window {left}: query {i}"
            );
        }
        if sq != skv {
            continue;
        }
        let layer = llama(1)
            .with_window_size(Some(left))
            .init(1, &device)
            .unwrap();
        let attention = &layer.layers[0].as_ref().unwrap().self_attention;
        let packed =
            Tensor::<2, Int>::from_data(TensorData::new(documents.clone(), [1, sq]), &device);
        let first = attention
            .visible_first_keys(Some(&packed), [1, sq], &device)
            .unwrap();
        let hidden = ferrotron::model::documents::hidden_keys(first, skv, 0);
        let hidden: Vec<bool> = hidden.into_data().try_to_vec().unwrap();
        for i in 0..sq {
            for j in 0..skv {
                let other_document = (j as i64) < documents[i];
                assert_eq!(
                    hidden[i * skv + j],
                    want[i][j] || other_document,
                    "window {left}, documents: query {i}, key {j}"
                );
            }
        }
    }
}

/// YaRN's inverse frequencies and concentration equal Megatron-Core's own
/// (`YarnRotaryEmbedding.get_emb` and its `_yarn_*` helpers, float32 there, so to 1e-6), with
/// the ramp's ends rounded and not, and with `mscale`/`mscale_all_dim` set.
#[test]
fn yarn_frequencies_are_megatrons() {
    for case in megatron_fixture()["yarn"].as_array().unwrap() {
        let float = |key: &str| case[key].as_f64().unwrap();
        let yarn = ferrotron::model::YarnScaling {
            factor: float("factor"),
            original_max_position_embeddings: float("original"),
            beta_fast: float("beta_fast"),
            beta_slow: float("beta_slow"),
            mscale: float("mscale"),
            mscale_all_dim: float("mscale_all_dim"),
            round_to_int: case["round_to_int"].as_bool().unwrap(),
        };
        let dim = case["dim"].as_u64().unwrap() as usize;
        let got = yarn.inverse_frequencies(float("base"), dim);
        let want: Vec<f64> = case["inv_freq"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs(),
                "{case}: pair {i}: {g} vs {w}"
            );
        }
        let concentration = yarn.concentration();
        assert!(
            (concentration - float("concentration")).abs() < 1e-12,
            "{case}: {concentration}"
        );
    }
}

/// A one-layer model with a window of 3 keys before each query gives at each position of a
/// 12-token row the logits of the same model reading only that position's window (4 tokens
/// from position 0: the rotary embedding is relative), and not those of the whole row.
#[test]
fn a_windowed_layer_reads_only_its_window() {
    let device = Device::flex();
    let left = 3;
    let tokens: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 128).collect();
    let windowed = llama(1)
        .with_window_size(Some(left))
        .init(5, &device)
        .unwrap();
    let full = llama(1).init(5, &device).unwrap();
    let vocab = 128;
    let together = logits(&windowed, &tokens, &device);
    let unwindowed = logits(&full, &tokens, &device);
    let (mut worst, mut worst_full) = (0f32, 0f32);
    for i in 0..tokens.len() {
        let start = i.saturating_sub(left);
        let alone = logits(&full, &tokens[start..=i], &device);
        let want = &alone[(i - start) * vocab..][..vocab];
        let got = &together[i * vocab..][..vocab];
        let off = &unwindowed[i * vocab..][..vocab];
        for c in 0..vocab {
            worst = worst.max((got[c] - want[c]).abs());
            worst_full = worst_full.max((off[c] - want[c]).abs());
        }
    }
    assert!(
        worst < 1e-4,
        "windowed logits {worst} off the window read alone"
    );
    assert!(worst_full > 1e-3, "without the window the logits differ");
}

/// Generation's KV cache under a window (every other layer, `--window-attn-skip-freq 2`):
/// feeding a row token by token after a prompt gives the logits of the whole row at once.
#[test]
fn the_kv_cache_keeps_to_the_window() {
    let device = Device::flex();
    let config = llama(2)
        .with_window_size(Some(2))
        .with_window_layers(Some(vec![true, false]));
    let model = config.init(9, &device).unwrap();
    let tokens: Vec<u32> = (0..10).map(|i| (i * 53 + 11) % 128).collect();
    let whole = logits(&model, &tokens, &device);
    let mut cache = KvCache::new(2);
    let mut stepped = model
        .forward_cached(ids(&tokens[..4], 1, &device), &mut cache)
        .into_data()
        .try_into_vec_as::<f32>()
        .unwrap();
    for &t in &tokens[4..] {
        let out = model.forward_cached(ids(&[t], 1, &device), &mut cache);
        stepped.extend(out.into_data().try_into_vec_as::<f32>().unwrap());
    }
    let worst = whole
        .iter()
        .zip(&stepped)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 1e-5, "cached logits {worst} off the whole row's");
}

/// A windowed Mistral and a Qwen2 windowed from its second layer (`max_window_layers`, and
/// `layer_types` as transformers 5 writes it) import with Megatron's window (HF's
/// `sliding_window` less the query itself), export with HF's, and import back the same.
#[test]
fn the_window_goes_through_huggingfaces_config() {
    let dir = tempfile::tempdir().unwrap();
    for (name, edits, layers) in [
        (
            "hf_tiny_mistral",
            serde_json::json!({"sliding_window": 5}),
            None,
        ),
        (
            "hf_tiny_qwen2",
            serde_json::json!({"use_sliding_window": true, "sliding_window": 5,
                "layer_types": ["full_attention", "sliding_attention"]}),
            Some(vec![false, true]),
        ),
        (
            "hf_tiny_qwen2",
            serde_json::json!({"use_sliding_window": true, "sliding_window": 5,
                "max_window_layers": 1, "layer_types": null}),
            Some(vec![false, true]),
        ),
    ] {
        let from = crate::common::fixture(name);
        let to = dir
            .path()
            .join(format!("{name}_{}", edits.to_string().len()));
        std::fs::create_dir_all(&to).unwrap();
        for entry in std::fs::read_dir(&from).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
        let config_path = to.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
        for (key, value) in edits.as_object().unwrap() {
            config[key] = value.clone();
        }
        std::fs::write(&config_path, config.to_string()).unwrap();
        let imported = import_hf(&to, 128).unwrap();
        assert_eq!(imported.config.window_size, Some(4), "{name}");
        assert_eq!(imported.config.window_layers, layers, "{name}");
        let model = imported.config.init(0, &Device::flex()).unwrap();
        let (model, _) =
            ferrotron::model::named_parameters::load_named_parameters(model, &imported.values);
        let (exported, tensors) = export_hf(&model, &imported.config, 250, 249).unwrap();
        assert_eq!(exported["sliding_window"], 5, "{name}");
        let again = to.with_extension("again");
        ferrotron::export::hf_model::write_hf_dir(&again, &exported, &tensors).unwrap();
        assert_eq!(
            import_hf(&again, 128).unwrap().config,
            imported.config,
            "{name}"
        );
    }
}

/// `pretrain --window-size 3,0 --window-attn-skip-freq 2 --position-embedding-type yarn`
/// trains a Llama-form model, and its checkpoint in Megatron's `torch` format carries
/// Megatron's arguments for both (`window_size`, the per-layer pattern, `yarn` and its
/// constants), read back into the same model; a window that sees later keys is refused.
#[test]
fn pretrain_saves_the_window_and_yarn_as_megatron_arguments() {
    use crate::common::*;
    use ferrotron::checkpoint::megatron_args::MegatronArgs;

    let dir = tempfile::tempdir().unwrap();
    let data = golden("wikitext2_valid", "text");
    let mut args: Vec<&str> = "--num-layers 2 --hidden-size 16 --num-attention-heads 2 \
        --seq-length 16 --max-position-embeddings 64 --micro-batch-size 2 \
        --global-batch-size 2 --train-iters 2 --lr 1e-2 --split 100,0,0 --eval-iters 0 \
        --log-interval 1 --save ckpt --save-interval 2 --ckpt-format torch \
        --tokenizer-type NullTokenizer --vocab-size 50257 --normalization RMSNorm --swiglu \
        --ffn-hidden-size 32 \
        --disable-bias-linear --window-size 3,0 --window-attn-skip-freq 2 \
        --position-embedding-type yarn --rotary-scaling-factor 4 \
        --yarn-original-max-position-embeddings 16"
        .split_whitespace()
        .collect();
    args.extend(["--data-path", data.to_str().unwrap()]);
    let out = run_tool(env!("CARGO_BIN_EXE_pretrain"), &args, dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let saved = dir
        .path()
        .join("ckpt/iter_0000002/mp_rank_00/model_optim_rng.pt");
    let config = MegatronArgs::read(&saved).unwrap().model_config().unwrap();
    assert_eq!(config.window_size, Some(3));
    assert_eq!(config.window_layers, Some(vec![true, false]));
    let yarn = config.yarn.expect("YaRN saved");
    assert_eq!(
        (yarn.factor, yarn.original_max_position_embeddings),
        (4.0, 16.0)
    );
    let (_, checkpoint) =
        ferrotron::checkpoint::load_model(&dir.path().join("ckpt"), &Device::flex()).unwrap();
    assert_eq!(checkpoint.config, config);

    let bad = args
        .iter()
        .map(|a| if *a == "3,0" { "3,2" } else { a })
        .collect::<Vec<_>>();
    let out = run_tool(env!("CARGO_BIN_EXE_pretrain"), &bad, dir.path());
    assert!(!out.status.success());
    assert!(stderr(&out).contains("causal"), "{}", stderr(&out));
}
