//! Minimal `.npy` (NumPy array file, format 1.0) reading and writing for index caches.
//!
//! The cached GPT dataset indices are plain `.npy` files so that they can be inspected with
//! `numpy.load`, as Megatron's can.

use std::io::Write;
use std::path::Path;

use super::DatasetError;

const MAGIC: &[u8] = b"\x93NUMPY\x01\x00";

/// Element types the caches use.
pub trait NpyElement: Copy {
    /// numpy's `descr` string.
    const DESCR: &'static str;
    /// Little-endian bytes.
    fn write_le(self, out: &mut Vec<u8>);
    /// From little-endian bytes of the right length.
    fn read_le(bytes: &[u8]) -> Self;
}

/// `NpyElement` for a primitive integer with numpy's `descr` for it.
macro_rules! npy_element {
    ($($t:ty => $descr:literal),* $(,)?) => {$(
        impl NpyElement for $t {
            const DESCR: &'static str = $descr;
            fn write_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn read_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("one element's bytes"))
            }
        }
    )*};
}

npy_element!(i16 => "<i2", i32 => "<i4", i64 => "<i8");

fn header(descr: &str, shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut dict =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Pad so that the data starts on a 64-byte boundary, ending the header with '\n'.
    let unpadded = MAGIC.len() + 2 + dict.len() + 1;
    dict.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    dict.push('\n');
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

/// Writes `values` with `shape` to `path` atomically (temporary file + rename).
pub fn write_npy<T: NpyElement>(
    path: &Path,
    values: &[T],
    shape: &[usize],
) -> Result<(), DatasetError> {
    assert_eq!(
        shape.iter().product::<usize>(),
        values.len(),
        "npy shape does not match the data"
    );
    let mut bytes = header(T::DESCR, shape);
    bytes.reserve(std::mem::size_of_val(values));
    for &v in values {
        v.write_le(&mut bytes);
    }
    let mut tmp =
        crate::util::atomic_file::temp_file_beside(path).map_err(|e| DatasetError::io(path, e))?;
    tmp.write_all(&bytes)
        .map_err(|e| DatasetError::io(path, e))?;
    tmp.persist(path)
        .map_err(|e| DatasetError::io(path, e.error))?;
    Ok(())
}

/// Reads a `.npy` written by [`write_npy`], checking its dtype and shape.
pub fn read_npy<T: NpyElement>(path: &Path, shape: &[usize]) -> Result<Vec<T>, DatasetError> {
    let bytes = std::fs::read(path).map_err(|e| DatasetError::io(path, e))?;
    let expected = header(T::DESCR, shape);
    let corrupt = |reason: &str| DatasetError::Corrupt {
        path: path.to_path_buf(),
        reason: reason.into(),
    };
    if bytes.len() < expected.len() || bytes[..expected.len()] != expected[..] {
        return Err(corrupt(
            "not the expected .npy header (dtype or shape differ)",
        ));
    }
    let data = &bytes[expected.len()..];
    let item = std::mem::size_of::<T>();
    if data.len() != shape.iter().product::<usize>() * item {
        return Err(corrupt("wrong data size for its shape"));
    }
    Ok(data.chunks_exact(item).map(T::read_le).collect())
}
