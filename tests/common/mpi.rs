//! Tests that run their own test binary under `mpirun` (Open MPI, see docs/parallelism.md): the parent
//! process starts `mpirun -np N <this test binary> --exact <module::test>`, and each child, finding
//! itself launched by MPI, runs as one rank of the test.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferrotron::comm::world::{launcher_variable, World};

use super::own_process::{current_test, one_test_args, ran_a_test};

/// `mpirun -np ranks` allowed to run as root and to put more ranks than cores on this
/// machine; with `FERROTRON_TEST_LAUNCHER=srun`, Slurm's `srun -n ranks` instead (PMIx,
/// tasks may share cores, a failed task ends the job), to run the same tests on a Slurm
/// cluster (see docs/parallelism.md).
pub fn mpirun_command(ranks: usize) -> Command {
    if std::env::var("FERROTRON_TEST_LAUNCHER").is_ok_and(|l| l == "srun") {
        let mut cmd = Command::new("srun");
        cmd.args([
            "-n",
            &ranks.to_string(),
            "--overcommit",
            "--kill-on-bad-exit=1",
        ])
        .arg("--mpi=pmix");
        return cmd;
    }
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", &ranks.to_string()])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1");
    cmd
}

/// Runs the calling test again under `mpirun -np ranks` (this test binary, that test alone),
/// with `env`, and returns (success, stdout + stderr). Fails the test when `mpirun` cannot be
/// started.
pub fn mpirun(ranks: usize, env: &[(&str, &Path)], limit: Duration) -> (bool, String) {
    let test = current_test().expect("mpirun is called from a test");
    let exe = std::env::current_exe().unwrap();
    let mut cmd = mpirun_command(ranks);
    cmd.arg(&exe)
        .args(one_test_args(&test))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| {
        panic!(
            "cannot start mpirun ({e}): install Open MPI (apt-get install openmpi-bin), see docs/parallelism.md"
        )
    });
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The ranks must have run the test.
    (out.status.success() && ran_a_test(&text), text)
}

/// The MPI world when this process is an MPI rank.
pub fn mpi_rank() -> Option<World> {
    launcher_variable()?;
    Some(World::from_environment().expect("MPI world"))
}

pub fn dir_from_env() -> PathBuf {
    PathBuf::from(std::env::var_os("FERROTRON_TEST_DIR").expect("FERROTRON_TEST_DIR"))
}
