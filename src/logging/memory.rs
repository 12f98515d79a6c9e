//! Memory a run can see: the process's peak resident set, for the log and the metrics.

/// The peak resident set size of this process in bytes (`VmHWM` of `/proc/self/status`), or
/// `None` where the kernel does not say (not Linux).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Megatron's one-time memory report line, with what the CPU can tell:
/// `[Rank 0] (after 10 iterations) memory (MB) | max RSS: 1234.5`.
pub fn memory_report_line(rank: usize, iteration: u64, peak_bytes: u64) -> String {
    format!(
        "[Rank {rank}] (after {iteration} iterations) memory (MB) | max RSS: {:.1}",
        peak_bytes as f64 / (1024.0 * 1024.0)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_grows_with_a_touched_allocation() {
        let before = peak_rss_bytes().expect("Linux reports VmHWM");
        let block = vec![1u8; 64 << 20];
        let after = peak_rss_bytes().unwrap();
        assert!(block.iter().step_by(4096).all(|&b| b == 1));
        assert!(after >= before && after >= 64 << 20, "{before} → {after}");
        assert_eq!(
            memory_report_line(0, 10, 3 << 20),
            "[Rank 0] (after 10 iterations) memory (MB) | max RSS: 3.0"
        );
    }
}
