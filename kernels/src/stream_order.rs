//! Ordering CubeCL's stream against another stream's work on the device, without the host.
//!
//! Why: a product computed by cuBLAS on its own CUDA stream has to start after the CubeCL
//! kernels that wrote its operands, and CubeCL's next kernels after it; CubeCL does not lend
//! its stream, and two host waits per product leave the GPU idle while the host catches up
//! (measured: benchmarks/results/2026-11-26-h200-cublas.md). With a pair of counters in
//! device memory: [`signal`] (on CubeCL's stream) adds one to `flags[0]` once everything
//! before it has run, which the other stream waits for (`cuStreamWaitValue32`, "at least");
//! the other stream writes that count to `flags[1]` when its work is done
//! (`cuStreamWriteValue32`, fenced), and [`wait_for`] (on CubeCL's stream) holds the stream
//! until `flags[1]` has caught up with `flags[0]`. One unit spins in `wait_for`; the rest of
//! the device stays free for the other stream's kernels.
//!
//! No launch carries a count: the kernels compare the two counters with each other. So a
//! step captured into a graph orders itself the same way on every replay, the host only
//! counting the signals to tell the other stream which value to wait for. Counters wrap
//! (2³² windows), and so does the comparison: CUDA's wait compares as `(int32) (a − b) ≥ 0`,
//! and so does [`wait_for`].

use cubecl::prelude::*;

/// `flags[0] += 1`: one more window's operands are written.
#[cube(launch)]
pub fn signal(flags: &mut [Atomic<u32>]) {
    if UNIT_POS == 0 {
        flags[0].fetch_add(1);
    }
}

/// Spins until `flags[1]` has caught up with `flags[0]` (one unit).
#[cube]
fn spin_until_caught_up(flags: &mut [Atomic<u32>]) {
    if UNIT_POS == 0 {
        let raised = flags[0].load();
        loop {
            // `done − raised`, wrapping, below 2³¹: `done` is at or past `raised`.
            let ahead = flags[1].load() - raised;
            if ahead < 0x8000_0000u32 {
                break;
            }
        }
    }
}

/// Returns once `flags[1]` has caught up with `flags[0]` (`flags` mutable: WGSL keeps atomics
/// in read-write storage). `written` is the buffer the other stream fills: bound here so that
/// CubeCL counts it as written on this stream by this launch.
#[cube(launch)]
pub fn wait_for<F: Float>(flags: &mut [Atomic<u32>], written: &mut [F]) {
    spin_until_caught_up(flags);
    let _ = written;
}

/// [`wait_for`] for two buffers the other stream fills in one ordering window (the two
/// gradient products of a backward pass).
#[cube(launch)]
pub fn wait_for_both<F: Float>(flags: &mut [Atomic<u32>], first: &mut [F], second: &mut [F]) {
    spin_until_caught_up(flags);
    let _ = first;
    let _ = second;
}

/// [`wait_for`] for three buffers the other stream fills in one ordering window (the composed
/// attention core's three last gradient products).
#[cube(launch)]
pub fn wait_for_three<F: Float>(
    flags: &mut [Atomic<u32>],
    first: &mut [F],
    second: &mut [F],
    third: &mut [F],
) {
    spin_until_caught_up(flags);
    let _ = first;
    let _ = second;
    let _ = third;
}
