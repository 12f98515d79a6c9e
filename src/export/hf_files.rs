//! A HuggingFace model directory's files: `config.json`, and the weights in one
//! `model.safetensors` or in shards listed by `model.safetensors.index.json` (how
//! `save_pretrained` writes models over its shard size).

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use anyhow::{bail, Context, Result};
use burn::tensor::{DType, TensorData};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

use crate::util::host_tensor::HostTensor;

/// The single-file weights' name.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The shard index's name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// `config.json` of the model in `dir`, parsed.
pub fn read_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))
}

/// Every tensor of the model in `dir` as f32, by HF name: from `model.safetensors`, or from
/// the shards `model.safetensors.index.json` names.
pub fn read_weights(dir: &Path) -> Result<HashMap<String, HostTensor>> {
    let index = dir.join(INDEX_FILE);
    if !index.exists() {
        return read_any_float(&dir.join(WEIGHTS_FILE));
    }
    let text =
        std::fs::read_to_string(&index).with_context(|| format!("reading {}", index.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", index.display()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| {
            format!(
                "{}: expected an object under \"weight_map\"",
                index.display()
            )
        })?;
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .with_context(|| format!("{}: {name}: expected a file name", index.display()))?;
        if file.contains('/') || file.contains("..") {
            bail!(
                "{}: {name}: {file:?} is not a file in the model's directory",
                index.display()
            );
        }
        files.insert(file.to_owned());
    }
    let mut out = HashMap::new();
    for file in files {
        out.extend(read_any_float(&dir.join(file))?);
    }
    for name in map.keys() {
        if !out.contains_key(name) {
            bail!(
                "{}: lists {name}, which none of its files holds",
                index.display()
            );
        }
    }
    Ok(out)
}

/// Every tensor of a safetensors file as f32 (F32, F16 and BF16 files are read).
pub fn read_any_float(path: &Path) -> Result<HashMap<String, HostTensor>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file = SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{}: not a safetensors file", path.display()))?;
    let mut out = HashMap::new();
    for (name, view) in file.tensors() {
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => bail!(
                "{}: tensor {name} is {other:?}, expected F32, F16 or BF16",
                path.display()
            ),
        };
        let shape = view.shape().to_vec();
        let values = TensorData::from_bytes_vec(view.data().to_vec(), shape.clone(), dtype)
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| anyhow::anyhow!("{}: {name}: {e:?}", path.display()))?;
        out.insert(name, HostTensor { shape, values });
    }
    Ok(out)
}
