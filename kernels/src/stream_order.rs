//! Ordering CubeCL's stream against another stream's work on the device, without the host.
//!
//! Why: a product computed by cuBLAS on its own CUDA stream has to start after the CubeCL
//! kernels that wrote its operands, and CubeCL's next kernels after it; CubeCL does not lend
//! its stream, and two host waits per product cost ≈ 50 µs each. With a pair of counters in
//! device memory: [`signal`] (on CubeCL's stream) raises `flags[slot]` once everything before
//! it has run, which the other stream waits for (`cuStreamWaitValue32`); the other stream
//! raises another counter when its work is done (`cuStreamWriteValue32`, fenced), and
//! [`wait_for`] (on CubeCL's stream) holds the stream until it sees that value. One unit
//! spins in `wait_for`; the rest of the device stays free for the other stream's kernels.
//! Counters only grow, so a wait is "at least this value".

use cubecl::prelude::*;

/// `flags[slot] = value`.
#[cube(launch)]
pub fn signal(flags: &mut [Atomic<u32>], slot: u32, value: u32) {
    if UNIT_POS == 0 {
        flags[slot as usize].store(value);
    }
}

/// Spins until `flags[slot] ≥ value` (one unit).
#[cube]
fn spin_until(flags: &mut [Atomic<u32>], slot: u32, value: u32) {
    if UNIT_POS == 0 {
        loop {
            if flags[slot as usize].load() >= value {
                break;
            }
        }
    }
}

/// Returns once `flags[slot] ≥ value` (`flags` mutable: WGSL keeps atomics in read-write
/// storage). `written` is the buffer the other stream fills: bound here so that CubeCL counts
/// it as written on this stream by this launch.
#[cube(launch)]
pub fn wait_for<F: Float>(flags: &mut [Atomic<u32>], slot: u32, value: u32, written: &mut [F]) {
    spin_until(flags, slot, value);
    let _ = written;
}

/// [`wait_for`] for two buffers the other stream fills in one ordering window (the two
/// gradient products of a backward pass).
#[cube(launch)]
pub fn wait_for_both<F: Float>(
    flags: &mut [Atomic<u32>],
    slot: u32,
    value: u32,
    first: &mut [F],
    second: &mut [F],
) {
    spin_until(flags, slot, value);
    let _ = first;
    let _ = second;
}

/// [`wait_for`] for three buffers the other stream fills in one ordering window (the composed
/// attention core's three last gradient products).
#[cube(launch)]
pub fn wait_for_three<F: Float>(
    flags: &mut [Atomic<u32>],
    slot: u32,
    value: u32,
    first: &mut [F],
    second: &mut [F],
    third: &mut [F],
) {
    spin_until(flags, slot, value);
    let _ = first;
    let _ = second;
    let _ = third;
}
