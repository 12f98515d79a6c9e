//! The read-once environment switches of the kernel choices (`FERROTRON_ROW_VECTORS`,
//! `FERROTRON_ROW_REGISTERS`, `FERROTRON_ATTENTION_MMA`): each a baseline a benchmark or a GPU
//! profile measures the default against, without a rebuild.

use std::sync::atomic::{AtomicU8, Ordering};

/// A kernel choice switched off by an environment variable set to `0`, read once per process
/// (not on every launch) unless a benchmark or test sets it first.
pub(crate) struct EnvSwitch {
    /// 0 until first asked, then 1 (on) or 2 (off).
    state: AtomicU8,
    name: &'static str,
}

impl EnvSwitch {
    pub(crate) const fn new(name: &'static str) -> Self {
        Self {
            state: AtomicU8::new(0),
            name,
        }
    }

    pub(crate) fn on(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            0 => {
                let on = std::env::var(self.name).as_deref() != Ok("0");
                self.set(on);
                on
            }
            state => state == 1,
        }
    }

    pub(crate) fn set(&self, on: bool) {
        self.state.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }
}
