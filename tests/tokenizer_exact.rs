//! The fast GPT-2 encoder must give exactly the ids of the plain HuggingFace `tokenizers`
//! pipeline (ByteLevel pre-tokenizer with the GPT-2 regex + BPE) on all text.

use std::sync::{Arc, OnceLock};

use ferrotron::tokenizer::{Gpt2Encoder, Gpt2PreTokens, Gpt2Vocabulary, TextTokenizer};
use proptest::prelude::*;
use tokenizers::Tokenizer;

use crate::common::*;

/// The vocabulary and the reference pipeline, built once for all cases.
fn setup() -> (Arc<Gpt2Vocabulary>, &'static Tokenizer) {
    static SHARED: OnceLock<(Arc<Gpt2Vocabulary>, Tokenizer)> = OnceLock::new();
    let (vocab, reference) = SHARED.get_or_init(|| {
        let vocab = Arc::new(Gpt2Vocabulary::embedded().unwrap());
        let reference = vocab.reference_tokenizer();
        (vocab, reference)
    });
    (vocab.clone(), reference)
}

fn reference_ids(reference: &Tokenizer, text: &str) -> Vec<u32> {
    reference.encode(text, false).unwrap().get_ids().to_vec()
}

fn fast_ids(encoder: &mut Gpt2Encoder, text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    encoder.encode(text, &mut out).unwrap();
    out
}

#[test]
fn fast_encoder_matches_tokenizers_on_every_document_of_every_corpus() {
    let (vocab, reference) = setup();
    let mut encoder = Gpt2Encoder::new(vocab, false);
    let mut documents = 0;
    for name in CORPORA {
        let text = std::fs::read_to_string(corpus(name)).unwrap();
        for line in text.lines() {
            let value: serde_json::Value = serde_json::from_str(line).unwrap();
            for (_, field) in value.as_object().unwrap() {
                let Some(doc) = field.as_str() else { continue };
                assert_eq!(
                    fast_ids(&mut encoder, doc),
                    reference_ids(reference, doc),
                    "{name}: {:.80}",
                    doc
                );
                documents += 1;
            }
        }
    }
    assert!(documents > 600);
}

#[test]
fn documented_edge_cases() {
    let (vocab, _) = setup();
    let mut legacy = Gpt2Encoder::new(vocab.clone(), false);
    assert_eq!(
        fast_ids(&mut legacy, "<|endoftext|>"),
        [27, 91, 437, 1659, 5239, 91, 29]
    );
    assert_eq!(fast_ids(&mut legacy, " "), [220]);
    assert_eq!(fast_ids(&mut legacy, "\n"), [198]);
    assert_eq!(fast_ids(&mut legacy, ""), Vec::<u32>::new());
    let mut special = Gpt2Encoder::new(vocab, true);
    assert_eq!(fast_ids(&mut special, "a<|endoftext|>b"), [64, 50256, 65]);
    assert_eq!(fast_ids(&mut special, "<|endoftext|>"), [50256]);
}

#[test]
fn decode_inverts_encode() {
    let tokenizer = TextTokenizer::gpt2_embedded().unwrap();
    let mut encoder = tokenizer.encoder();
    let text = "Hello  world!\n\nIt's 2024 — naïve café, 東京 🙂 <|endoftext|>\t";
    let mut ids = Vec::new();
    encoder.encode(text, &mut ids).unwrap();
    assert_eq!(tokenizer.decode(&ids).unwrap(), text);
}

/// Characters that stress each branch of the GPT-2 pattern: ASCII classes, apostrophes and
/// contraction letters, every kind of Unicode white space, letters and numbers outside ASCII,
/// combining marks (not letters), symbols, emoji, CJK.
fn interesting_char() -> impl Strategy<Value = char> {
    prop_oneof![
        4 => prop::sample::select(vec![
            'a', 'b', 's', 't', 'r', 'e', 'v', 'm', 'l', 'd', 'S', 'T', '0', '7', ' ', ' ', '\'', '\n',
            '\r', '\t', '.', ',', '-', '!', '"', '<', '|', '>',
        ]),
        1 => prop::sample::select(vec![
            '\u{0b}', '\u{0c}', '\u{85}', '\u{a0}', '\u{1680}', '\u{2000}', '\u{2009}', '\u{200a}',
            '\u{2028}', '\u{2029}', '\u{202f}', '\u{205f}', '\u{3000}', '\u{1c}', '\u{200b}',
            'é', 'ß', 'Ω', 'ж', 'ا', 'न', '\u{93f}', '\u{301}', '\u{300}', '²', '½', 'Ⅻ', '٣', '〇',
            '東', '京', '😀', '🙂', '€', '©', '\u{feff}', 'ǅ', 'ʰ', '\u{0}',
        ]),
        1 => any::<char>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn fast_encoder_matches_tokenizers_on_random_text(chars in prop::collection::vec(interesting_char(), 0..40)) {
        let text: String = chars.into_iter().collect();
        let (vocab, reference) = setup();
        let mut encoder = Gpt2Encoder::new(vocab, false);
        prop_assert_eq!(fast_ids(&mut encoder, &text), reference_ids(reference, &text), "{:?}", text);
    }

    #[test]
    fn pre_tokens_cover_the_text_exactly(chars in prop::collection::vec(interesting_char(), 0..60)) {
        let text: String = chars.into_iter().collect();
        let joined: String = Gpt2PreTokens::new(&text).collect();
        prop_assert_eq!(joined, text);
    }
}

/// A document of a corpus: corpus, document number, JSON key.
type DocumentKey = (String, u64, String);

/// Checks `encode` against the fixture ids of `config` (`tests/fixtures/tokenizers/ids/`):
/// every document and key of every corpus (count and hash, and the whole list for one
/// document in 20) and every edge case; a document in `other_version` must give the ids
/// there instead (another version of the reference library's).
fn check_fixture_ids(
    config: &str,
    encode: &dyn Fn(&str) -> Vec<u32>,
    other_version: &std::collections::HashMap<DocumentKey, Vec<u32>>,
) {
    let mut corpora: std::collections::HashMap<String, Vec<serde_json::Value>> = Default::default();
    let lines =
        std::fs::read_to_string(fixture(&format!("tokenizers/ids/{config}.jsonl"))).unwrap();
    let mut documents = 0;
    for line in lines.lines() {
        let want: serde_json::Value = serde_json::from_str(line).unwrap();
        let corpus_name = want["corpus"].as_str().unwrap();
        let docs = corpora.entry(corpus_name.to_owned()).or_insert_with(|| {
            std::fs::read_to_string(corpus(corpus_name))
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        });
        let doc = &docs[want["doc"].as_u64().unwrap() as usize];
        let text = doc[want["key"].as_str().unwrap()].as_str().unwrap();
        let ids = encode(text);
        let at = format!("{config} {corpus_name} doc {}", want["doc"]);
        let key = (
            corpus_name.to_owned(),
            want["doc"].as_u64().unwrap(),
            want["key"].as_str().unwrap().to_owned(),
        );
        if let Some(other) = other_version.get(&key) {
            assert_eq!(&ids, other, "{at}");
            documents += 1;
            continue;
        }
        if let Some(all) = want.get("ids") {
            assert_eq!(ids, token_ids(all), "{at}");
        }
        assert_eq!(ids.len() as u64, want["n"].as_u64().unwrap(), "{at}");
        assert_eq!(
            fnv1a_hex(ids.iter().flat_map(|id| id.to_le_bytes())),
            want["fnv"].as_str().unwrap(),
            "{at}"
        );
        documents += 1;
    }
    assert!(documents >= 600, "{documents}");
    let edge: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tokenizers/edge_cases.json")).unwrap(),
    )
    .unwrap();
    let texts = edge["texts"].as_array().unwrap();
    for (text, want) in texts.iter().zip(edge["ids"][config].as_array().unwrap()) {
        let text = text.as_str().unwrap();
        assert_eq!(encode(text), token_ids(want), "{config}: {text:?}");
    }
}

/// Megatron's `TikTokenizer` (`--tiktoken-pattern v1` and `v2`, 1000 special tokens, a
/// 4096-rank cl100k vocabulary): the ids of every document and key of every corpus (count and
/// hash, and the whole list for one document in 20) and of the edge cases, as tiktoken 0.14
/// gives them called the way current Megatron-Core calls it (`tests/fixtures/tokenizers/`,
/// cross-checked against Megatron's own classes there).
#[test]
fn tiktoken_ids_equal_tiktokens_on_every_document() {
    use ferrotron::tokenizer::tiktoken::TikToken;
    let vocab = fixture("tokenizers/tiktoken_cl100k_4096.json");
    for pattern in ["v1", "v2"] {
        let tokenizer = TikToken::load(&vocab, pattern, 5096, 1000).unwrap();
        assert_eq!((tokenizer.vocab_size(), tokenizer.eod()), (5096, 2));
        let encode = |text: &str| {
            let mut ids = Vec::new();
            tokenizer.encode(text, &mut ids).unwrap();
            ids
        };
        check_fixture_ids(&format!("tiktoken_{pattern}"), &encode, &Default::default());
        let sample = "Hello <s>world</s> <SPECIAL_999>!";
        assert_eq!(tokenizer.decode(&encode(sample)).unwrap(), sample);
    }
}

/// Megatron's SentencePiece types (`SentencePieceTokenizer`, `GPTSentencePieceTokenizer`,
/// `Llama2Tokenizer`, alike in current Megatron-Core) on a Llama-like BPE model (byte
/// fallback) and a T5-like unigram model (nmt_nfkc, unknowns): the ids of every document and
/// edge case are sentencepiece's `encode_as_ids` (`tests/fixtures/tokenizers/`: 0.2.3's, and
/// for the two long documents where the unigram Viterbi of sentencepiece <= 0.2.1, which is
/// what ferrotron links, resolves a near-tie the other way, 0.2.0's), the vocabulary is the
/// model's pieces and the end of document its `eos`; `preprocess` writes those ids with the
/// EOD appended.
#[test]
fn sentencepiece_ids_equal_sentencepieces_on_every_document() {
    use ferrotron::tokenizer::text_tokenizer::{TokenizerOptions, TokenizerType};
    let versions: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tokenizers/sentencepiece_versions.json")).unwrap(),
    )
    .unwrap();
    for (config, vocab_size, eod, megatron_type) in [
        ("spm_bpe", 3000, 2, "Llama2Tokenizer"),
        ("spm_unigram", 2000, 1, "SentencePieceTokenizer"),
    ] {
        let options = TokenizerOptions {
            tokenizer_type: megatron_type.parse().unwrap(),
            tokenizer_model: Some(fixture(&format!("tokenizers/{config}.model"))),
            ..TokenizerOptions::default()
        };
        assert_eq!(options.tokenizer_type, TokenizerType::SentencePiece);
        let tokenizer = TextTokenizer::load(&options).unwrap();
        assert_eq!(
            (tokenizer.vocab_size(), tokenizer.eod()),
            (vocab_size, Some(eod))
        );
        let encode = |text: &str| {
            let mut ids = Vec::new();
            tokenizer.encoder().encode(text, &mut ids).unwrap();
            ids
        };
        let other_version = versions["configs"][config]["differ"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                let key = (
                    d["corpus"].as_str().unwrap().to_owned(),
                    d["doc"].as_u64().unwrap(),
                    d["key"].as_str().unwrap().to_owned(),
                );
                (key, token_ids(&d["ids_0_2_0"]))
            })
            .collect();
        check_fixture_ids(config, &encode, &other_version);
        let sample = "Hello world, 12 tokens.";
        assert_eq!(tokenizer.decode(&encode(sample)).unwrap(), sample);
    }
    assert_eq!(
        "GPTSentencePieceTokenizer"
            .parse::<TokenizerType>()
            .unwrap(),
        TokenizerType::SentencePiece
    );
    // preprocess: each document's ids, then the EOD.
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("tokenizers/spm_bpe.model");
    let input = corpus("wikitext2_valid");
    let args = [
        "--input",
        input.to_str().unwrap(),
        "--output-prefix",
        "out",
        "--tokenizer-type",
        "GPTSentencePieceTokenizer",
        "--tokenizer-model",
        model.to_str().unwrap(),
        "--append-eod",
        "--workers",
        "2",
    ];
    let out = run_tool(env!("CARGO_BIN_EXE_preprocess"), &args, dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let dataset =
        ferrotron::data::IndexedDataset::open(dir.path().join("out_text_document")).unwrap();
    let lines = std::fs::read_to_string(fixture("tokenizers/ids/spm_bpe.jsonl")).unwrap();
    let want: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["corpus"] == "wikitext2_valid")
        .collect();
    assert_eq!(dataset.document_count(), want.len());
    for (d, want) in want.iter().enumerate() {
        let ids = dataset.document(d).unwrap().to_u32_vec();
        let (text, last) = ids.split_at(ids.len() - 1);
        assert_eq!(last, [2], "document {d} ends with the EOD");
        assert_eq!(
            fnv1a_hex(text.iter().flat_map(|id| id.to_le_bytes())),
            want["fnv"].as_str().unwrap(),
            "document {d}"
        );
    }
}
