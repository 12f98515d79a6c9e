//! Temporary files that become final outputs by a rename.

use std::io;
use std::path::{Path, PathBuf};

use tempfile::NamedTempFile;

/// The directory a file path lives in (`.` for a bare name).
pub fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// A hidden temporary file next to `final_path` (`.name.XXXXXX.tmp`), deleted if dropped and
/// renamed into place with `persist`. It is created with the usual 0666-minus-umask mode
/// rather than a temporary file's 0600, so the final file has normal permissions.
pub fn temp_file_beside(final_path: &Path) -> io::Result<NamedTempFile> {
    let dir = parent_dir(final_path);
    let name = final_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let prefix = format!(".{name}.");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    builder.tempfile_in(&dir)
}
