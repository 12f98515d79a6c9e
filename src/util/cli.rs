//! What every command-line tool does at the end.

use std::process::ExitCode;

/// Prints `tool: error: ...` with the whole context chain and returns exit code 1 on error
/// (no panic, no backtrace), 0 on success.
pub fn finish(tool: &str, result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{tool}: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
