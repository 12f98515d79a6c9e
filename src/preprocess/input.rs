//! Finding the input files and cutting them into chunks of whole lines.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::PreprocessError;

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// Expands `--input` paths into the files to read, in order: a file is itself, a directory
/// is its visible regular files sorted by name.
pub fn resolve_inputs(paths: &[PathBuf]) -> Result<Vec<PathBuf>, PreprocessError> {
    let mut files = Vec::new();
    for path in paths {
        let meta = std::fs::metadata(path).map_err(|cause| PreprocessError::Input {
            path: path.clone(),
            cause,
        })?;
        if meta.is_dir() {
            let mut in_dir = Vec::new();
            let entries = std::fs::read_dir(path).map_err(|cause| PreprocessError::Input {
                path: path.clone(),
                cause,
            })?;
            for entry in entries {
                let entry = entry.map_err(|cause| PreprocessError::Input {
                    path: path.clone(),
                    cause,
                })?;
                let hidden = entry.file_name().to_string_lossy().starts_with('.');
                if !hidden && entry.path().is_file() {
                    in_dir.push(entry.path());
                }
            }
            if in_dir.is_empty() {
                return Err(PreprocessError::Config(format!(
                    "input directory {} holds no files",
                    path.display()
                )));
            }
            in_dir.sort();
            files.extend(in_dir);
        } else {
            files.push(path.clone());
        }
    }
    if files.is_empty() {
        return Err(PreprocessError::Config("no --input given".into()));
    }
    Ok(files)
}

/// The output prefix used when `--output-prefix` is not given: the one input path without its
/// extension (`data.jsonl` → `data`, so outputs are `data_text_document.*`).
pub fn default_output_prefix(inputs: &[PathBuf]) -> Option<PathBuf> {
    match inputs {
        [one] if one.is_dir() => Some(PathBuf::from(one.to_string_lossy().trim_end_matches('/'))),
        [one] => Some(one.with_extension("")),
        _ => None,
    }
}

/// A run of whole lines from one input file.
pub(crate) struct Chunk {
    /// Position in the input, for putting results back in order.
    pub seq: u64,
    /// The file the lines come from.
    pub file: Arc<Path>,
    /// 1-based number of the chunk's first line in its file.
    pub first_line: u64,
    /// The lines, each ending in `\n` except possibly a file's last.
    pub data: Vec<u8>,
}

/// Reads files as chunks of about `chunk_bytes` (never splitting a line).
pub(crate) struct ChunkReader {
    files: std::vec::IntoIter<PathBuf>,
    current: Option<OpenFile>,
    chunk_bytes: usize,
    next_seq: u64,
}

struct OpenFile {
    path: Arc<Path>,
    reader: BufReader<File>,
    next_line: u64,
}

impl ChunkReader {
    pub fn new(files: Vec<PathBuf>, chunk_bytes: usize) -> Self {
        Self {
            files: files.into_iter(),
            current: None,
            chunk_bytes: chunk_bytes.max(1),
            next_seq: 0,
        }
    }

    /// Whether another chunk exists, opening the next file when one ends.
    pub fn has_more(&mut self) -> Result<bool, PreprocessError> {
        loop {
            if let Some(open) = &mut self.current {
                let buf = open
                    .reader
                    .fill_buf()
                    .map_err(|cause| PreprocessError::Input {
                        path: open.path.to_path_buf(),
                        cause,
                    })?;
                if !buf.is_empty() {
                    return Ok(true);
                }
                self.current = None;
            }
            let Some(path) = self.files.next() else {
                return Ok(false);
            };
            let file = File::open(&path).map_err(|cause| PreprocessError::Input {
                path: path.clone(),
                cause,
            })?;
            let mut reader = BufReader::with_capacity(1 << 20, file);
            let buf = reader.fill_buf().map_err(|cause| PreprocessError::Input {
                path: path.clone(),
                cause,
            })?;
            if buf.starts_with(UTF8_BOM) {
                reader.consume(UTF8_BOM.len());
            }
            self.current = Some(OpenFile {
                path: path.into(),
                reader,
                next_line: 1,
            });
        }
    }

    /// Reads the next chunk; call only after [`has_more`](Self::has_more) returned true.
    pub fn next_chunk(&mut self) -> Result<Chunk, PreprocessError> {
        let open = self.current.as_mut().expect("has_more() opened a file");
        let mut data = Vec::with_capacity(self.chunk_bytes + 4096);
        let first_line = open.next_line;
        while data.len() < self.chunk_bytes {
            let n = open.reader.read_until(b'\n', &mut data).map_err(|cause| {
                PreprocessError::Input {
                    path: open.path.to_path_buf(),
                    cause,
                }
            })?;
            if n == 0 {
                break;
            }
            open.next_line += 1;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        Ok(Chunk {
            seq,
            file: open.path.clone(),
            first_line,
            data,
        })
    }
}
