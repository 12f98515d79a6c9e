//! Named f32 tensors in a `.safetensors` file, written atomically.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

pub use crate::host_tensor::HostTensor;

/// Writes `tensors` and string `metadata` to `path` through a temporary file and a rename.
pub fn write_tensors(
    path: &Path,
    tensors: &[(String, HostTensor)],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(name, t)| {
            (
                name.clone(),
                t.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                t.shape.clone(),
            )
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, data, shape)| {
            Ok((
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), data)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .with_context(|| format!("{}: bad tensor shape", path.display()))?;
    let buffer = safetensors::serialize(views, Some(metadata))
        .with_context(|| format!("serializing {}", path.display()))?;
    let mut tmp = crate::atomic_file::temp_file_beside(path)
        .with_context(|| format!("creating {}", path.display()))?;
    tmp.write_all(&buffer)
        .with_context(|| format!("writing {}", path.display()))?;
    tmp.as_file()
        .sync_all()
        .with_context(|| format!("writing {}", path.display()))?;
    tmp.persist(path)
        .with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// Reads every f32 tensor and the metadata of a `.safetensors` file.
pub fn read_tensors(path: &Path) -> Result<(HashMap<String, HostTensor>, HashMap<String, String>)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .with_context(|| format!("{}: not a safetensors file", path.display()))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let file = SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{}: not a safetensors file", path.display()))?;
    let mut tensors = HashMap::new();
    for (name, view) in file.tensors() {
        anyhow::ensure!(
            view.dtype() == Dtype::F32,
            "{}: tensor {name} is {:?}, expected F32",
            path.display(),
            view.dtype()
        );
        let values = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        tensors.insert(
            name,
            HostTensor {
                shape: view.shape().to_vec(),
                values,
            },
        );
    }
    Ok((tensors, metadata))
}
