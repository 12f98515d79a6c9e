//! A `torch.save` file written without Python: what Megatron's `--ckpt-format torch` loader
//! (`torch.load`) reads back.
//!
//! The file is a zip whose root folder is the archive name (`model_optim_rng/`): `data.pkl`
//! (the object, pickle protocol 2), `data/N` (each tensor's raw little-endian storage, stored
//! uncompressed and 64-byte aligned as PyTorch writes them), `byteorder` and `version`. No crate
//! writes PyTorch's tensor pickles (the survey is in `tests/fixtures/megatron_ckpt/README.md`),
//! so this module emits the small opcode subset `torch.save` itself uses for a checkpoint; the
//! zip side is the `zip` crate. Only what `torch.load(weights_only=True)` accepts with Megatron's
//! safe globals is written: `collections.OrderedDict`, `argparse.Namespace`,
//! `torch._utils._rebuild_tensor_v2` and the storage classes.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use zip::write::SimpleFileOptions;

/// A Python value as `torch.save` pickles it.
#[derive(Clone, Debug, PartialEq)]
pub enum PyValue {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An `int`.
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `list`.
    List(Vec<PyValue>),
    /// A `tuple`.
    Tuple(Vec<PyValue>),
    /// A `dict` with string keys, in this order.
    Dict(Vec<(String, PyValue)>),
    /// A `dict` with int keys, in this order (an optimizer's `state`).
    IntDict(Vec<(i64, PyValue)>),
    /// A `collections.OrderedDict` (a state dict).
    OrderedDict(Vec<(String, PyValue)>),
    /// An `argparse.Namespace` with these attributes (Megatron's saved `args`).
    Namespace(Vec<(String, PyValue)>),
    /// A contiguous float32 tensor: the index of its values in the storages passed to
    /// [`write_torch_file`], and its shape.
    Tensor { storage: usize, shape: Vec<usize> },
}

/// The float32 storages a file's [`PyValue::Tensor`]s index, gathered while its value is
/// built.
#[derive(Default)]
pub struct TensorStorages<'a>(pub Vec<&'a [f32]>);

impl<'a> TensorStorages<'a> {
    /// A tensor of `shape` over `values` (a storage of its own).
    pub fn tensor(&mut self, values: &'a [f32], shape: &[usize]) -> PyValue {
        self.0.push(values);
        PyValue::Tensor {
            storage: self.0.len() - 1,
            shape: shape.to_vec(),
        }
    }
}

/// Pickle opcodes (protocol 2), as named in CPython's `pickletools`.
mod op {
    pub const PROTO: u8 = 0x80;
    pub const STOP: u8 = b'.';
    pub const NONE: u8 = b'N';
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const LONG1: u8 = 0x8a;
    pub const BINFLOAT: u8 = b'G';
    pub const BINUNICODE: u8 = b'X';
    pub const EMPTY_LIST: u8 = b']';
    pub const APPENDS: u8 = b'e';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_DICT: u8 = b'}';
    pub const SETITEMS: u8 = b'u';
    pub const MARK: u8 = b'(';
    pub const GLOBAL: u8 = b'c';
    pub const REDUCE: u8 = b'R';
    pub const NEWOBJ: u8 = 0x81;
    pub const BUILD: u8 = b'b';
    pub const BINPERSID: u8 = b'Q';
}

/// A protocol-2 pickle of one value, the way CPython's pickler lays these types out (minus
/// the memo, which only shares repeated objects and which no loader needs).
struct Pickler {
    out: Vec<u8>,
}

impl Pickler {
    fn value(&mut self, v: &PyValue) {
        match v {
            PyValue::None => self.out.push(op::NONE),
            PyValue::Bool(b) => self.out.push(if *b { op::NEWTRUE } else { op::NEWFALSE }),
            PyValue::Int(i) => self.int(*i),
            PyValue::Float(f) => {
                self.out.push(op::BINFLOAT);
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            PyValue::Str(s) => self.str(s),
            PyValue::List(items) => {
                self.out.push(op::EMPTY_LIST);
                if !items.is_empty() {
                    self.out.push(op::MARK);
                    items.iter().for_each(|i| self.value(i));
                    self.out.push(op::APPENDS);
                }
            }
            PyValue::Tuple(items) => self.tuple(items.iter(), |p, i| p.value(i)),
            PyValue::Dict(items) => {
                self.out.push(op::EMPTY_DICT);
                self.items(items);
            }
            PyValue::IntDict(items) => {
                self.out.push(op::EMPTY_DICT);
                if !items.is_empty() {
                    self.out.push(op::MARK);
                    for (k, v) in items {
                        self.int(*k);
                        self.value(v);
                    }
                    self.out.push(op::SETITEMS);
                }
            }
            PyValue::OrderedDict(items) => {
                self.global("collections", "OrderedDict");
                self.out.extend([op::EMPTY_TUPLE, op::REDUCE]);
                self.items(items);
            }
            PyValue::Namespace(attrs) => {
                // copyreg.__reduce_ex__(2): cls.__new__(cls), then the __dict__ as BUILD state.
                self.global("argparse", "Namespace");
                self.out
                    .extend([op::EMPTY_TUPLE, op::NEWOBJ, op::EMPTY_DICT]);
                self.items(attrs);
                self.out.push(op::BUILD);
            }
            PyValue::Tensor { storage, shape } => self.tensor(*storage, shape),
        }
    }

    fn int(&mut self, i: i64) {
        if (0..=0xff).contains(&i) {
            self.out.extend([op::BININT1, i as u8]);
        } else if (0..=0xffff).contains(&i) {
            self.out.push(op::BININT2);
            self.out.extend_from_slice(&(i as u16).to_le_bytes());
        } else if let Ok(small) = i32::try_from(i) {
            self.out.push(op::BININT);
            self.out.extend_from_slice(&small.to_le_bytes());
        } else {
            // LONG1: little-endian two's complement, 8 bytes (always enough for an i64).
            self.out.extend([op::LONG1, 8]);
            self.out.extend_from_slice(&i.to_le_bytes());
        }
    }

    fn str(&mut self, s: &str) {
        self.out.push(op::BINUNICODE);
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }

    fn global(&mut self, module: &str, name: &str) {
        self.out.push(op::GLOBAL);
        for part in [module, name] {
            self.out.extend_from_slice(part.as_bytes());
            self.out.push(b'\n');
        }
    }

    fn tuple<T>(&mut self, items: impl Iterator<Item = T>, mut each: impl FnMut(&mut Self, T)) {
        self.out.push(op::MARK);
        items.for_each(|i| each(self, i));
        self.out.push(op::TUPLE);
    }

    /// `SETITEMS` for the dict-like object on top of the stack.
    fn items(&mut self, items: &[(String, PyValue)]) {
        if items.is_empty() {
            return;
        }
        self.out.push(op::MARK);
        for (k, v) in items {
            self.str(k);
            self.value(v);
        }
        self.out.push(op::SETITEMS);
    }

    /// `torch._utils._rebuild_tensor_v2(storage, 0, shape, contiguous strides, False,
    /// OrderedDict())`, the storage a persistent id `('storage', torch.FloatStorage, key,
    /// 'cpu', numel)` that `torch.load` resolves to the zip entry `data/key`.
    fn tensor(&mut self, storage: usize, shape: &[usize]) {
        let numel: usize = shape.iter().product();
        let mut strides = vec![1usize; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        self.global("torch._utils", "_rebuild_tensor_v2");
        self.out.push(op::MARK);
        self.out.push(op::MARK);
        self.str("storage");
        self.global("torch", "FloatStorage");
        self.str(&storage.to_string());
        self.str("cpu");
        self.int(numel as i64);
        self.out.extend([op::TUPLE, op::BINPERSID]);
        self.int(0);
        self.tuple(shape.iter(), |p, &d| p.int(d as i64));
        self.tuple(strides.iter(), |p, &s| p.int(s as i64));
        self.out.push(op::NEWFALSE);
        self.global("collections", "OrderedDict");
        self.out.extend([op::EMPTY_TUPLE, op::REDUCE]);
        self.out.extend([op::TUPLE, op::REDUCE]);
    }
}

/// The pickle (protocol 2) of `value`.
pub fn pickle(value: &PyValue) -> Vec<u8> {
    let mut p = Pickler {
        out: vec![op::PROTO, 2],
    };
    p.value(value);
    p.out.push(op::STOP);
    p.out
}

/// Writes `value` to `path` as `torch.save` would under the archive name `archive`
/// (`model_optim_rng` for Megatron), the float32 `storages` being what its
/// [`PyValue::Tensor`]s index. Written to a temporary file renamed into place, so a
/// failure never leaves half a file.
pub fn write_torch_file(
    path: &Path,
    archive: &str,
    value: &PyValue,
    storages: &[&[f32]],
) -> Result<()> {
    let file = crate::util::atomic_file::temp_file_beside(path)?;
    let mut zip = zip::ZipWriter::new(file);
    // Fixed timestamps: the same checkpoint gives the same bytes.
    let stored = SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .last_modified_time(zip::DateTime::default())
        .with_alignment(64);
    let mut entry = |name: &str, bytes: &[u8]| -> Result<()> {
        zip.start_file(format!("{archive}/{name}"), stored)?;
        zip.write_all(bytes)?;
        Ok(())
    };
    entry("data.pkl", &pickle(value))?;
    entry("byteorder", b"little")?;
    for (key, values) in storages.iter().enumerate() {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        entry(&format!("data/{key}"), &bytes)?;
    }
    entry("version", b"3\n")?;
    let file = zip
        .finish()
        .with_context(|| format!("writing {}", path.display()))?;
    file.persist(path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
