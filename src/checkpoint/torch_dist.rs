//! Megatron's `--ckpt-format torch_dist` (its default format): PyTorch's distributed
//! checkpoint, read as the same [`MegatronCheckpoint`] as a `torch` one.
//!
//! The layout (Megatron-Core 0.16, checked against a checkpoint its own converter wrote,
//! `tests/fixtures/megatron_ckpt/llama_tp1_torch_dist/`): `iter_NNNNNNN/metadata.json` says
//! `"sharded_backend": "torch_dist"`; `common.pt` is a `torch.save` zip with Megatron's
//! `args` and `iteration`; `.metadata` pickles `torch.distributed.checkpoint`'s `Metadata`:
//! per tensor its global size and chunks (offsets and sizes), and per chunk
//! (`MetadataIndex(fqn, offset)`) the file, byte offset and length of its item in the
//! `__R_S.distcp` files. Each item is a complete `torch.save` zip of one tensor. Tensors are
//! global, whatever layout saved them: the layers are stacked along a first dimension
//! (`decoder.layers.mlp.linear_fc1.weight` is `[layers, 2·ffn, hidden]`, SwiGLU's `[gate; up]`
//! as at tensor-parallel size 1), and the names are the Transformer-Engine spec's. Byte items
//! (`_extra_state`, the RNG state) and optimizer state are not read.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};

use super::format::iteration_dir;
use super::megatron_args::MegatronArgs;
use super::megatron_checkpoint::MegatronCheckpoint;
use super::megatron_optimizer::MegatronAdam;
use super::megatron_tensors::{ferrotron_tensors, ParameterValues};
use super::pickle::{parse_pickle, Unpickled};
use crate::model::GptConfig;
use crate::util::host_tensor::HostTensor;

/// The arguments Megatron saved with the `torch_dist` checkpoint in `root` (`common.pt`).
pub fn torch_dist_args(root: &Path) -> Result<MegatronArgs> {
    let (dir, _) = iteration_dir(root)?;
    MegatronArgs::read(&dir.join("common.pt"))
}

/// The model of the `torch_dist` checkpoint in `root`: the one its arguments describe, or
/// `config`, which must describe the same model.
pub fn read_torch_dist(
    root: &Path,
    config: Option<&GptConfig>,
) -> Result<(MegatronCheckpoint, GptConfig)> {
    let (dir, iteration) = iteration_dir(root)?;
    let args = MegatronArgs::read(&dir.join("common.pt"))?;
    let config = args.model_for(root, config)?;
    let metadata = std::fs::read(dir.join(".metadata"))
        .with_context(|| format!("reading {}", dir.join(".metadata").display()))?;
    let metadata =
        parse_pickle(&metadata).with_context(|| format!("{}/.metadata", dir.display()))?;
    let tensors = global_tensors(&dir, &metadata)?;
    let mut values = ParameterValues::new();
    let mut optimizer = false;
    for (key, tensor) in tensors {
        if key.starts_with("optimizer.") {
            optimizer = true;
            continue;
        }
        for (key, tensor) in per_layer(&key, tensor, config.num_layers)? {
            for (name, t) in ferrotron_tensors(&key, vec![tensor], &config)
                .with_context(|| format!("{}: {key}", dir.display()))?
            {
                values.insert(name, (t.shape, t.values));
            }
        }
    }
    let checkpoint = MegatronCheckpoint {
        iteration,
        tensor_parallel: args.count("tensor_model_parallel_size")?.unwrap_or(1),
        pipeline_parallel: args.count("pipeline_model_parallel_size")?.unwrap_or(1),
        values,
        adam: if optimizer {
            MegatronAdam::NotRead(
                "a torch_dist checkpoint's optimizer state is not read yet".into(),
            )
        } else {
            MegatronAdam::NotSaved
        },
        args,
    };
    Ok((checkpoint, config))
}

/// `key`'s tensor as Megatron-Core's per-layer keys: a stacked `decoder.layers.X` of
/// `[layers, ...]` is `decoder.layers.N.X` for each layer N.
fn per_layer(key: &str, tensor: HostTensor, layers: usize) -> Result<Vec<(String, HostTensor)>> {
    let Some(rest) = key.strip_prefix("decoder.layers.") else {
        return Ok(vec![(key.to_owned(), tensor)]);
    };
    ensure!(
        tensor.shape.first() == Some(&layers),
        "{key}: stacked over {:?} layers, the model has {layers}",
        tensor.shape.first()
    );
    (0..layers)
        .map(|l| {
            let one = tensor.chunk(0, layers, l).map_err(anyhow::Error::msg)?;
            let shape = one.shape[1..].to_vec();
            Ok((
                format!("decoder.layers.{l}.{rest}"),
                HostTensor::new(shape, one.values),
            ))
        })
        .collect()
}

/// Every tensor of the checkpoint whole, assembled from its chunks (byte items skipped).
fn global_tensors(dir: &Path, metadata: &Unpickled) -> Result<Vec<(String, HostTensor)>> {
    let Some(Unpickled::Dict(entries)) = metadata.get("state_dict_metadata") else {
        bail!("{}/.metadata: no state_dict_metadata", dir.display());
    };
    let places = chunk_places(dir, metadata)?;
    let mut out = Vec::new();
    for (key, entry) in entries {
        let Unpickled::Str(key) = key else { continue };
        let Unpickled::Object { class, .. } = entry else {
            continue;
        };
        if !class.ends_with("TensorStorageMetadata") {
            continue;
        }
        let shape = torch_size(entry.get("size")).with_context(|| format!("{key}: its size"))?;
        let mut whole = HostTensor::new(shape.clone(), vec![0.0; shape.iter().product()]);
        let Some(Unpickled::List(chunks)) = entry.get("chunks") else {
            bail!("{key}: no chunks");
        };
        for chunk in chunks {
            let offsets = torch_size(chunk.get("offsets")).context("a chunk's offsets")?;
            let (file, at, length) = places
                .get(&(key.clone(), offsets.clone()))
                .with_context(|| format!("{key}: no item for the chunk at {offsets:?}"))?;
            let part = read_item(file, *at, *length)
                .with_context(|| format!("{}: {key} at {offsets:?}", file.display()))?;
            place(&mut whole, &part, &offsets).with_context(|| format!("{key} at {offsets:?}"))?;
        }
        out.push((key.clone(), whole));
    }
    Ok(out)
}

/// Where each tensor chunk's item is: `(key, offsets)` → (file, byte offset, length).
type ChunkPlaces = HashMap<(String, Vec<usize>), (PathBuf, u64, usize)>;

/// The [`ChunkPlaces`] of the `.metadata` pickle.
fn chunk_places(dir: &Path, metadata: &Unpickled) -> Result<ChunkPlaces> {
    let Some(Unpickled::Dict(items)) = metadata.get("storage_data") else {
        bail!("{}/.metadata: no storage_data", dir.display());
    };
    let mut places = HashMap::new();
    for (index, info) in items {
        let (Some(Unpickled::Str(fqn)), Some(offset)) = (index.get("fqn"), index.get("offset"))
        else {
            continue;
        };
        let Some(offsets) = torch_size(Some(offset)) else {
            continue; // a byte item
        };
        let (Some(Unpickled::Str(file)), Some(Unpickled::Int(at)), Some(Unpickled::Int(len))) = (
            info.get("relative_path"),
            info.get("offset"),
            info.get("length"),
        ) else {
            bail!("{fqn}: its storage record has no file, offset and length");
        };
        ensure!(
            !file.contains('/') && !file.contains(".."),
            "{fqn}: the item file {file:?} is not inside the checkpoint directory"
        );
        let (at, len) = (u64::try_from(*at)?, usize::try_from(*len)?);
        places.insert((fqn.clone(), offsets), (dir.join(file), at, len));
    }
    Ok(places)
}

/// The dimensions of a pickled `torch.Size` (a call of `torch.Size` on a tuple of ints).
fn torch_size(value: Option<&Unpickled>) -> Option<Vec<usize>> {
    let Some(Unpickled::Object { class, args, .. }) = value else {
        return None;
    };
    if class != "torch.Size" {
        return None;
    }
    let Unpickled::Tuple(outer) = args.as_ref() else {
        return None;
    };
    let Some(Unpickled::Tuple(dims)) = outer.first() else {
        return None;
    };
    dims.iter()
        .map(|d| match d {
            Unpickled::Int(n) => usize::try_from(*n).ok(),
            _ => None,
        })
        .collect()
}

/// The one tensor of the `torch.save` zip at `at..at + length` of `file`, in f32.
fn read_item(file: &Path, at: u64, length: usize) -> Result<HostTensor> {
    let mut opened = std::fs::File::open(file)?;
    opened.seek(SeekFrom::Start(at))?;
    let mut bytes = vec![0u8; length];
    opened.read_exact(&mut bytes)?;
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes)).context("not a zip")?;
    let names: Vec<String> = zip
        .file_names()
        .filter_map(|n| n.ok().map(|n| n.into_owned()))
        .collect();
    let entry = |suffix: &str| names.iter().find(|n| n.ends_with(suffix)).cloned();
    let mut read = |name: &str| -> Result<Vec<u8>> {
        let mut out = Vec::new();
        zip.by_name(name)?.read_to_end(&mut out)?;
        Ok(out)
    };
    let pickle = read(&entry("/data.pkl").context("no data.pkl")?)?;
    let tensor = parse_pickle(&pickle)?;
    let view = TensorView::of(&tensor)?;
    let storage = read(&entry(&format!("/data/{}", view.key)).context("no storage entry")?)?;
    view.gather(&storage)
}

/// A tensor as `torch._utils._rebuild_tensor_v2` describes it: its storage and the view.
struct TensorView {
    key: String,
    element: Element,
    offset: usize,
    shape: Vec<usize>,
    stride: Vec<usize>,
}

/// A storage's element type.
#[derive(Clone, Copy)]
enum Element {
    F32,
    Bf16,
    F16,
}

impl TensorView {
    fn of(tensor: &Unpickled) -> Result<TensorView> {
        let Unpickled::Object { class, args, .. } = tensor else {
            bail!("the item is not a tensor");
        };
        ensure!(
            class == "torch._utils._rebuild_tensor_v2",
            "the item is a {class}"
        );
        let Unpickled::Tuple(args) = args.as_ref() else {
            bail!("_rebuild_tensor_v2 without arguments");
        };
        let [Unpickled::Persistent(id), Unpickled::Int(offset), Unpickled::Tuple(shape), Unpickled::Tuple(stride), ..] =
            args.as_slice()
        else {
            bail!("unexpected _rebuild_tensor_v2 arguments");
        };
        let Unpickled::Tuple(id) = id.as_ref() else {
            bail!("a storage id that is not a tuple");
        };
        let (Some(Unpickled::Global(storage)), Some(Unpickled::Str(key))) = (id.get(1), id.get(2))
        else {
            bail!("a storage id without its class and key");
        };
        let element = match storage.as_str() {
            "torch.FloatStorage" => Element::F32,
            "torch.BFloat16Storage" => Element::Bf16,
            "torch.HalfStorage" => Element::F16,
            other => bail!("a {other}, not a floating-point tensor ferrotron reads"),
        };
        let dims = |t: &[Unpickled]| -> Result<Vec<usize>> {
            t.iter()
                .map(|d| match d {
                    Unpickled::Int(n) => Ok(usize::try_from(*n)?),
                    _ => bail!("a dimension that is not an int"),
                })
                .collect()
        };
        Ok(TensorView {
            key: key.clone(),
            element,
            offset: usize::try_from(*offset)?,
            shape: dims(shape)?,
            stride: dims(stride)?,
        })
    }

    /// The view's elements in row-major order, from the storage's bytes.
    fn gather(&self, storage: &[u8]) -> Result<HostTensor> {
        let width = match self.element {
            Element::F32 => 4,
            Element::Bf16 | Element::F16 => 2,
        };
        let value = |i: usize| -> Result<f32> {
            let b = storage
                .get(i * width..(i + 1) * width)
                .context("the view reaches past its storage")?;
            Ok(match self.element {
                Element::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                Element::Bf16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
                Element::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            })
        };
        let count: usize = self.shape.iter().product();
        let mut values = Vec::with_capacity(count);
        let mut index = vec![0usize; self.shape.len()];
        for _ in 0..count {
            let at = self.offset
                + index
                    .iter()
                    .zip(&self.stride)
                    .map(|(i, s)| i * s)
                    .sum::<usize>();
            values.push(value(at)?);
            advance(&mut index, &self.shape);
        }
        Ok(HostTensor::new(self.shape.clone(), values))
    }
}

/// The next row-major index of `shape` after `index`.
fn advance(index: &mut [usize], shape: &[usize]) {
    for d in (0..index.len()).rev() {
        index[d] += 1;
        if index[d] < shape[d] {
            return;
        }
        index[d] = 0;
    }
}

/// Copies `part` into `whole` at `offsets`.
fn place(whole: &mut HostTensor, part: &HostTensor, offsets: &[usize]) -> Result<()> {
    ensure!(
        part.shape.len() == whole.shape.len()
            && offsets.len() == whole.shape.len()
            && (0..offsets.len()).all(|d| offsets[d] + part.shape[d] <= whole.shape[d]),
        "a chunk of {:?} at {offsets:?} does not fit {:?}",
        part.shape,
        whole.shape
    );
    let mut strides = vec![1usize; whole.shape.len()];
    for d in (0..whole.shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * whole.shape[d + 1];
    }
    let mut index = vec![0usize; part.shape.len()];
    for &value in &part.values {
        let at: usize = (0..index.len())
            .map(|d| (offsets[d] + index[d]) * strides[d])
            .sum();
        whole.values[at] = value;
        advance(&mut index, &part.shape);
    }
    Ok(())
}
