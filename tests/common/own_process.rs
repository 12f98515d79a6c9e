//! Running a test in a process of its own, for the tests on a CubeCL device.
//!
//! Why: in one process every test takes the same CubeCL device, whose one thread makes every
//! launch and, on lavapipe, has every kernel variant compiled there; so two test threads took
//! turns on one core. The kernel suite ran at 106 % of two cores' 200 % in one process (421 s)
//! and at 192 % with each test in a process of its own (246 s; docs/testing.md, "Runs side by
//! side").
//!
//! Used by `tests/fused_kernels.rs` and the kernels package's `tests/kernels.rs` (through a
//! `#[path]` module: one file for both).

/// Set in the child process a test runs in.
const IN_OWN_PROCESS: &str = "FERROTRON_TEST_IN_OWN_PROCESS";

/// Whether the calling test has already run, and passed, in a process of its own.
///
/// In the test binary's process: starts the binary again for that one test (named after the
/// libtest thread it runs on), prints the child's output (so a failure shows it), fails if the
/// child failed or ran no such test, and returns `true`: the caller returns. In the child, on
/// a thread not named after a test, or where the binary cannot find its own path: `false`,
/// and the caller runs its body.
pub fn ran_in_own_process() -> bool {
    let thread = std::thread::current();
    let test = match thread.name() {
        Some(test) if test != "main" && std::env::var_os(IN_OWN_PROCESS).is_none() => test,
        _ => return false,
    };
    // Without /proc (a bare chroot) the binary cannot name itself: the test runs here.
    let Ok(binary) = std::env::current_exe() else {
        return false;
    };
    let child = std::process::Command::new(binary)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(IN_OWN_PROCESS, "1")
        .output()
        .expect("the test binary started again for one test");
    let stdout = String::from_utf8_lossy(&child.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&child.stderr));
    assert!(
        child.status.success(),
        "{test} failed in its own process ({})",
        child.status
    );
    assert!(
        stdout.contains("test result: ok. 1 passed"),
        "the test binary ran no test named {test} in its own process"
    );
    true
}
