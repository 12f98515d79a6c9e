//! Megatron's data flags: one blend cut by `--split`, a blend per split, or mock data.

use anyhow::{bail, Context, Result};

use super::PretrainArgs;
use crate::data::{Blend, DataSources, MockDocuments};
use crate::tokenizer::TextTokenizer;

/// Megatron's `get_blend_and_blend_per_split`: `--data-path` / `--data-args-path` (one blend
/// cut by `--split`) or the per-split flags (a blend per split, each used whole).
pub(super) fn data_sources(args: &PretrainArgs, tokenizer: &TextTokenizer) -> Result<DataSources> {
    let per_split_flags = [
        &args.train_data_path,
        &args.valid_data_path,
        &args.test_data_path,
    ];
    let per_split =
        per_split_flags.iter().any(|v| !v.is_empty()) || args.per_split_data_args_path.is_some();
    let whole = !args.data_path.is_empty() || args.data_args_path.is_some();
    if args.mock_data {
        if whole || per_split {
            bail!("--mock-data replaces the data flags: give it or --data-path (or the per-split flags), not both");
        }
        let eod = tokenizer
            .eod()
            .context("--mock-data: the tokenizer has no end-of-document token")?;
        return Ok(DataSources::Mock(std::sync::Arc::new(MockDocuments::new(
            tokenizer.vocab_size() as u32,
            eod,
        ))));
    }
    if whole && per_split {
        bail!("give either --data-path (or --data-args-path) or the per-split data flags (--train-data-path, --valid-data-path, --test-data-path, --per-split-data-args-path), not both");
    }
    if let Some(path) = &args.data_args_path {
        return Ok(DataSources::Blend(
            Blend::from_args_file(path).map_err(anyhow::Error::msg)?,
        ));
    }
    if !args.data_path.is_empty() {
        return Ok(DataSources::Blend(
            Blend::from_args("--data-path", &args.data_path).map_err(anyhow::Error::msg)?,
        ));
    }
    if !per_split {
        bail!("no training data: give --data-path PREFIX (from `preprocess`), a weighted blend --data-path W1 PREFIX1 W2 PREFIX2, --train-data-path, or --mock-data");
    }
    let names = ["train", "valid", "test"];
    let lists: [Vec<String>; 3] = match &args.per_split_data_args_path {
        Some(path) => {
            if per_split_flags.iter().any(|v| !v.is_empty()) {
                bail!("--per-split-data-args-path replaces --train-data-path, --valid-data-path and --test-data-path: give one or the other");
            }
            per_split_lists(path)?
        }
        None => per_split_flags.map(|v| v.clone()),
    };
    let mut blends = [None, None, None];
    for ((blend, list), name) in blends.iter_mut().zip(&lists).zip(names) {
        if !list.is_empty() {
            *blend = Some(
                Blend::from_args(&format!("--{name}-data-path"), list)
                    .map_err(anyhow::Error::msg)?,
            );
        }
    }
    Ok(DataSources::PerSplit(blends))
}

/// Reads `--per-split-data-args-path`.
fn per_split_lists(path: &std::path::Path) -> Result<[Vec<String>; 3]> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--per-split-data-args-path {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "--per-split-data-args-path {}: not JSON like {{\"train\": [\"0.3\", \"a\", \"0.7\", \"b\"], \"valid\": \"c\", \"test\": \"c\"}}",
            path.display()
        )
    })?;
    let mut out: [Vec<String>; 3] = Default::default();
    for (list, key) in out.iter_mut().zip(["train", "valid", "test"]) {
        *list = match &json[key] {
            serde_json::Value::Null => vec![],
            serde_json::Value::String(s) => s.split_whitespace().map(str::to_owned).collect(),
            serde_json::Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    serde_json::Value::String(s) => Ok(s.clone()),
                    serde_json::Value::Number(n) => Ok(n.to_string()),
                    other => bail!(
                        "{}: \"{key}\" holds {other}, expected strings",
                        path.display()
                    ),
                })
                .collect::<Result<_>>()?,
            other => bail!(
                "{}: \"{key}\" is {other}, expected a list of words or a string",
                path.display()
            ),
        };
    }
    Ok(out)
}
