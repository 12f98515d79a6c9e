//! `--exit-signal-handler`: SIGTERM, SIGINT or SIGHUP asks the run to stop after the current
//! iteration (a checkpoint, then exit 0), as a cluster scheduler's pre-emption notice does.
//!
//! The handler only raises a process-wide flag; the training loop reads it between
//! iterations and agrees on it with every rank (a collective), so all ranks stop at the same
//! iteration whichever of them received the signal. A second signal ends the process at once.

use std::sync::atomic::{AtomicBool, Ordering};

static RECEIVED: AtomicBool = AtomicBool::new(false);

/// Installs the handler (once per process; later calls change nothing).
pub fn install() -> Result<(), String> {
    match ctrlc::set_handler(|| {
        if RECEIVED.swap(true, Ordering::SeqCst) {
            std::process::exit(143);
        }
    }) {
        Ok(()) | Err(ctrlc::Error::MultipleHandlers) => Ok(()),
        Err(e) => Err(format!(
            "--exit-signal-handler: cannot install the handler: {e}"
        )),
    }
}

/// Whether a stop signal has arrived.
pub fn received() -> bool {
    RECEIVED.load(Ordering::SeqCst)
}
