//! `export-hf`'s tensor mapping and `evaluate`'s windows, checked against the raw data and
//! the model's own weights.

mod common;

use burn::tensor::Device;
use common::*;
use ferrotron::data::IndexedDataset;
use ferrotron::model::named_parameters::named_parameters;
use ferrotron::model::GptConfig;
use ferrotron::train::hf_export::{hf_gpt2_config, hf_gpt2_tensors};
use ferrotron::train::window_eval::{contiguous_windows, mean_window_loss};

#[test]
fn hf_tensors_have_gpt2_names_and_carry_the_same_weights() {
    let config = GptConfig::new(2, 8, 2, 16, 64).with_ffn_hidden_size(Some(12));
    let model = config.init(5, &Device::flex()).unwrap();
    let ours: std::collections::HashMap<String, Vec<f32>> = named_parameters(&model)
        .into_iter()
        .map(|p| (p.name, p.values))
        .collect();
    let hf: std::collections::HashMap<String, (Vec<usize>, Vec<f32>)> =
        hf_gpt2_tensors(&model, &config, 50)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, (t.shape, t.values)))
            .collect();
    assert_eq!(hf.len(), ours.len());
    assert_eq!(
        hf["transformer.wte.weight"].0,
        [50, 8],
        "padding rows are dropped"
    );
    assert_eq!(
        hf["transformer.wte.weight"].1,
        ours["word_embeddings.weight"][..50 * 8]
    );
    assert_eq!(hf["transformer.h.1.mlp.c_fc.weight"].0, [8, 12]);
    assert_eq!(
        hf["transformer.h.1.mlp.c_proj.weight"].1,
        ours["layers.1.mlp.dense_4h_to_h.weight"]
    );
    assert_eq!(hf["transformer.ln_f.bias"].1, ours["final_layernorm.bias"]);
    // c_attn: HF column p·h + head·hd + d is ours head·3·hd + p·hd + d (p = q, k, v).
    let (h, hd) = (8, 4);
    let theirs = &hf["transformer.h.0.attn.c_attn.weight"].1;
    let mine = &ours["layers.0.self_attention.query_key_value.weight"];
    for row in 0..h {
        for p in 0..3 {
            for head in 0..2 {
                for d in 0..hd {
                    assert_eq!(
                        theirs[row * 3 * h + p * h + head * hd + d],
                        mine[row * 3 * h + head * 3 * hd + p * hd + d]
                    );
                }
            }
        }
    }
    let json = hf_gpt2_config(&config, 50, 49);
    assert_eq!(json["n_inner"], 12);
    assert_eq!(json["activation_function"], "gelu");
    assert_eq!(
        hf_gpt2_config(&config.clone().with_openai_gelu(true), 50, 49)["activation_function"],
        "gelu_new"
    );
}

#[test]
fn evaluate_scores_contiguous_windows_of_the_token_stream() {
    let data = IndexedDataset::open(golden("wikitext2_valid", "text")).unwrap();
    let windows = contiguous_windows(&data, 32, 5).unwrap();
    let stream: Vec<u32> = (0..data.document_count())
        .flat_map(|d| data.document(d).unwrap().to_u32_vec())
        .collect();
    for (i, w) in windows.iter().enumerate() {
        assert_eq!(w[..], stream[i * 32..i * 32 + 33]);
    }
    assert!(contiguous_windows(&data, 1000, 1000).is_err());
    // An untrained model scores close to ln(vocab) over the real vocabulary.
    let config = GptConfig::new(1, 16, 2, 32, 50304);
    let model = config.init(1, &Device::flex()).unwrap();
    let loss = mean_window_loss(&model, &windows, 50257, 2, &Device::flex());
    assert!((loss - (50257f64).ln()).abs() < 0.1, "{loss}");
}
