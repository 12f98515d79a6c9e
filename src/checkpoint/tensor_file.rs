//! Named f32 tensors in a `.safetensors` file, written atomically.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use safetensors::tensor::{Dtype, SafeTensors};

pub use crate::util::host_tensor::HostTensor;

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
    let tmp = crate::util::atomic_file::temp_file_beside(path)
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

/// A `.safetensors` file mapped into memory, read a tensor at a time: a 345M model's
/// checkpoint shards are gigabytes, and a loading rank needs one tensor of each at a time.
pub struct TensorFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl TensorFile {
    /// Maps the file at `path` and checks its header.
    pub fn open(path: &Path) -> Result<Self> {
        let file =
            std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
        // SAFETY: checkpoints are written to a temporary name and renamed into place, never
        // modified afterwards, so the mapped bytes do not change under us.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("mapping {}", path.display()))?;
        let opened = Self {
            path: path.to_path_buf(),
            map,
        };
        opened.parsed()?;
        Ok(opened)
    }

    fn parsed(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.map)
            .with_context(|| format!("{}: not a safetensors file", self.path.display()))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The string metadata of the header.
    pub fn metadata(&self) -> Result<HashMap<String, String>> {
        let (_, header) = SafeTensors::read_metadata(&self.map)
            .with_context(|| format!("{}: not a safetensors file", self.path.display()))?;
        Ok(header.metadata().clone().unwrap_or_default())
    }

    /// The names of the tensors, sorted.
    pub fn names(&self) -> Result<Vec<String>> {
        let mut names: Vec<String> = self
            .parsed()?
            .names()
            .into_iter()
            .map(str::to_owned)
            .collect();
        names.sort();
        Ok(names)
    }

    /// The shape of tensor `name`, if the file has it.
    pub fn shape(&self, name: &str) -> Result<Option<Vec<usize>>> {
        Ok(self.parsed()?.tensor(name).ok().map(|v| v.shape().to_vec()))
    }

    /// Tensor `name` (f32), if the file has it.
    pub fn read(&self, name: &str) -> Result<Option<HostTensor>> {
        let file = self.parsed()?;
        let Ok(view) = file.tensor(name) else {
            return Ok(None);
        };
        anyhow::ensure!(
            view.dtype() == Dtype::F32,
            "{}: tensor {name} is {:?}, expected F32",
            self.path.display(),
            view.dtype()
        );
        let values = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Some(HostTensor {
            shape: view.shape().to_vec(),
            values,
        }))
    }
}

/// Every tensor and the string metadata of the `.safetensors` file at `path`.
pub fn read_tensors(path: &Path) -> Result<(HashMap<String, HostTensor>, HashMap<String, String>)> {
    let file = TensorFile::open(path)?;
    let mut tensors = HashMap::new();
    for name in file.names()? {
        let t = file.read(&name)?.expect("a listed tensor");
        tensors.insert(name, t);
    }
    Ok((tensors, file.metadata()?))
}
