//! The memory allocator of the training binaries, and how it is tuned.
//!
//! burn frees and allocates the same large tensors every step (the logits alone are
//! `tokens × vocab × 4` bytes, hundreds of MB for GPT-2 at the benchmark's batch). glibc's malloc returns such
//! blocks to the kernel on every free, so each step page-faults them back in and the kernel
//! zeroes every page: that was a large share of a training run. mimalloc keeps them, but by
//! default still *purges* (decommits) memory that stayed free for a second, and a training
//! step on a CPU outlasts that; perf then still showed the kernel's `clear_page` in the step
//! (docs/benchmarks.md, "Training throughput vs PyTorch"). [`retain_freed_memory`]
//! turns purging off, so steady-state steps reuse resident memory, as PyTorch's caching
//! allocator does on GPUs. The cost: the process keeps its peak footprint until it exits.

use std::ffi::{c_int, c_long};

/// The allocator every ferrotron binary declares as `#[global_allocator]`.
pub use mimalloc::MiMalloc as TrainingAllocator;

/// Index of `mi_option_purge_delay` in mimalloc's `mi_option_t` (the same in its v2 and v3
/// headers; `libmimalloc-sys` exports no constant for it). A unit test checks it against the
/// option's documented default.
const MI_OPTION_PURGE_DELAY: c_int = 15;

unsafe extern "C" {
    fn mi_option_get(option: c_int) -> c_long;
    fn mi_option_set(option: c_int, value: c_long);
}

/// Tells mimalloc never to hand freed memory back to the OS (purge delay −1). Harmless when
/// mimalloc is not the global allocator: it only sets one of mimalloc's own options.
pub fn retain_freed_memory() {
    // SAFETY: both are plain setters/getters of mimalloc's option table, valid at any time
    // from any thread; the index is checked by the test below.
    unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

/// mimalloc's current purge delay in milliseconds (−1: never purge).
pub fn purge_delay_ms() -> c_long {
    // SAFETY: see `retain_freed_memory`.
    unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_option_index_is_the_purge_delay() {
        // mimalloc's `purge_delay` defaults to 1000 ms (v3, built here) or 10 ms (v2); its
        // neighbours in the enum default to 1 (eager_commit_delay) and 0 (use_numa_nodes).
        let before = purge_delay_ms();
        assert!(
            [1000, 10, -1].contains(&before),
            "option 15 reads {before}, not a purge delay"
        );
        retain_freed_memory();
        assert_eq!(purge_delay_ms(), -1);
    }
}
