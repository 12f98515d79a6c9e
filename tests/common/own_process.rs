//! Running a test in a process of its own, for tests that hold what a process has once: a
//! CubeCL device, a device's default float type.
//!
//! Why: in one process every test takes the same CubeCL device, whose one thread makes every
//! launch and, on lavapipe, has every kernel variant compiled there; so two test threads took
//! turns on one core. The kernel suite kept little more than one of two cores busy in one
//! process, and nearly both, finishing much sooner, with each test in a process of its own
//! (measured: benchmarks/results/2026-11-30-lavapipe-ci-side-by-side.md; docs/testing.md,
//! "Runs side by side").
//!
//! Used by `tests/fused_kernels.rs`, `tests/step_capture.rs`, `tests/model_gradients.rs` (the
//! Flex device's f64 default is set once per process) and the kernels package's
//! `tests/kernels.rs` (through a `#[path]` module: one file for both packages); its pieces
//! that start a test binary for one test serve `common::mpi` too.

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
    ran_in_own_process_with(&[])
}

/// [`ran_in_own_process`], with Mesa's lavapipe compiling the test's shaders without LLVM's
/// optimisation passes (`GALLIVM_PERF=nopt`, read once per process; other devices ignore it).
///
/// Why: a test of a few small shapes spends its time in lavapipe compiling kernel variants, not
/// running them; unoptimised, the fused kernels' tests and the attention kernels' take less time
/// (benchmarks/results/2026-12-03-figures-from-comments.md). The kernels compute the same (the bit-for-bit tests pass either way). Tests that
/// run long rows or replay captured steps run slower unoptimised, and keep the optimised
/// shaders (docs/testing.md, "Shaders compiled unoptimised").
pub fn ran_in_own_process_unoptimised() -> bool {
    ran_in_own_process_with(&[("GALLIVM_PERF", "nopt")])
}

/// [`ran_in_own_process`], with `env` set in the test's process: for settings a process reads
/// once (a driver's).
fn ran_in_own_process_with(env: &[(&str, &str)]) -> bool {
    let test = match current_test() {
        Some(test) if std::env::var_os(IN_OWN_PROCESS).is_none() => test,
        _ => return false,
    };
    // Without /proc (a bare chroot) the binary cannot name itself: the test runs here.
    let Ok(binary) = std::env::current_exe() else {
        return false;
    };
    let child = std::process::Command::new(binary)
        .args(one_test_args(&test))
        .env(IN_OWN_PROCESS, "1")
        .envs(env.iter().copied())
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
        ran_a_test(&stdout),
        "the test binary ran no test named {test} in its own process"
    );
    true
}

/// The calling test's full name (`module::test`), which libtest gives the thread it runs a
/// test on; `None` on the main thread.
pub fn current_test() -> Option<String> {
    let name = std::thread::current().name()?.to_owned();
    (name != "main").then_some(name)
}

/// The arguments that have a libtest binary run the one test `test`, printing as it goes.
pub fn one_test_args(test: &str) -> [&str; 5] {
    ["--exact", test, "--nocapture", "--test-threads", "1"]
}

/// Whether a libtest run's output shows that it ran its test: a filter matching nothing would
/// pass vacuously. (Several ranks' lines may interleave in one pipe, so this looks for the
/// vacuous case, not for a count of passes.)
pub fn ran_a_test(output: &str) -> bool {
    output.contains("running 1 test") && !output.contains("running 0 tests")
}
