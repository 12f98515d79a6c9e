//! TensorBoard scalars (`--tensorboard-dir`), in TensorFlow's event-file format, which
//! TensorBoard and every TF-record reader read.
//!
//! A file is a sequence of records: the payload length (u64, little-endian), the masked
//! CRC-32C of those 8 bytes, the payload, the masked CRC-32C of the payload. Each payload is
//! an `Event` protobuf: the first carries `file_version = "brain.Event:2"`, the others a
//! `Summary` with one `simple_value` scalar under a tag. Only those few protobuf fields are
//! written, so they are encoded here rather than through a protobuf code generator; the
//! checksum comes from the `crc32c` crate.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// TFRecord's checksum: CRC-32C, rotated and offset so that a CRC of data holding CRCs is
/// not trivially zero.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited protobuf field.
fn bytes_field(field: u64, bytes: &[u8], out: &mut Vec<u8>) {
    varint(field << 3 | 2, out);
    varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

fn seconds_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `Event { wall_time = 1, step = 2, file_version = 3 | summary = 5 }`.
fn event(step: i64, body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::new();
    varint(1 << 3 | 1, &mut out);
    out.extend_from_slice(&seconds_now().to_le_bytes());
    varint(2 << 3, &mut out);
    varint(step as u64, &mut out);
    body(&mut out);
    out
}

/// Appends scalars to one event file in a TensorBoard log directory.
pub struct TensorBoardWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl TensorBoardWriter {
    /// A new event file in `dir` (created if missing), named as TensorFlow names them
    /// (`events.out.tfevents.<seconds>.<host>`), so TensorBoard finds it.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_owned())
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{host}.{}",
            seconds_now() as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let mut writer = Self {
            file: BufWriter::new(File::create(&path)?),
            path,
        };
        let first = event(0, |out| bytes_field(3, b"brain.Event:2", out));
        writer.record(&first)?;
        writer.file.flush()?;
        Ok(writer)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn record(&mut self, payload: &[u8]) -> std::io::Result<()> {
        let len = (payload.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked_crc(&len).to_le_bytes())?;
        self.file.write_all(payload)?;
        self.file.write_all(&masked_crc(payload).to_le_bytes())
    }

    /// Writes `value` under `tag` at `step`.
    pub fn add_scalar(&mut self, tag: &str, value: f64, step: u64) -> std::io::Result<()> {
        // Summary.Value { tag = 1, simple_value = 2 (float) }.
        let mut value_msg = Vec::new();
        bytes_field(1, tag.as_bytes(), &mut value_msg);
        varint(2 << 3 | 5, &mut value_msg);
        value_msg.extend_from_slice(&(value as f32).to_le_bytes());
        // Summary { value = 1 (repeated) }.
        let mut summary = Vec::new();
        bytes_field(1, &value_msg, &mut summary);
        let payload = event(step as i64, |out| bytes_field(5, &summary, out));
        self.record(&payload)
    }

    /// Pushes what was written to the file, so a running TensorBoard sees it.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_masked_crc_of_the_crc32c_check_value() {
        // CRC-32C("123456789") = 0xE3069283 (its standard check value), then TFRecord's mask.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(
            masked_crc(b"123456789"),
            0xE306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }
}
