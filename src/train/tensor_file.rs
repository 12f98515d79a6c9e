//! Named f32 tensors in a `.safetensors` file, written atomically.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use safetensors::tensor::{Dtype, SafeTensors};

pub use crate::host_tensor::HostTensor;

/// Writes `tensors` and string `metadata` to `path` through a temporary file and a rename.
pub fn write_tensors(
    path: &Path,
    tensors: &[(String, HostTensor)],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let refs: Vec<TensorRef<'_>> = tensors
        .iter()
        .map(|(name, t)| TensorRef {
            name: name.clone(),
            shape: t.shape.clone(),
            values: &t.values,
        })
        .collect();
    write_tensor_refs(path, &refs, metadata)
}

/// A named f32 tensor borrowed for writing.
pub struct TensorRef<'a> {
    /// Name in the file.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub values: &'a [f32],
}

impl safetensors::View for &TensorRef<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // One tensor's bytes at a time: the file is written tensor by tensor.
        Cow::Owned(self.values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
    fn data_len(&self) -> usize {
        self.values.len() * 4
    }
}

/// [`write_tensors`] for borrowed values, streamed to the file one tensor at a time: a
/// checkpoint never holds a second copy of the weights and optimizer state in memory.
pub fn write_tensor_refs(
    path: &Path,
    tensors: &[TensorRef<'_>],
    metadata: HashMap<String, String>,
) -> Result<()> {
    for t in tensors {
        anyhow::ensure!(
            t.shape.iter().product::<usize>() == t.values.len(),
            "{}: tensor {} has {} values for shape {:?}",
            path.display(),
            t.name,
            t.values.len(),
            t.shape
        );
    }
    let tmp = crate::atomic_file::temp_file_beside(path)
        .with_context(|| format!("creating {}", path.display()))?;
    safetensors::serialize_to_file(
        tensors.iter().map(|t| (t.name.as_str(), t)),
        Some(metadata),
        tmp.path(),
    )
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
