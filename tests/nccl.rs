//! The NCCL group (CUDA builds; needs a GPU and the NCCL library, see README "GPU"): the
//! collective conformance suite that the thread and MPI groups pass, run on an NCCL group.
//!
//! ```text
//! cargo test --release --features cuda --test nccl                 # one rank, one GPU
//! mpirun -np 2 target/release/deps/nccl-<hash> --test-threads 1    # one rank per GPU
//! ```
//!
//! CI has no GPU: it compiles these tests (`cargo check --features cuda --all-targets`); on a
//! one-GPU machine only a one-rank group can run (NCCL refuses two ranks on one GPU), and
//! multi-rank correctness rests on the same suite run on the MPI group.
#![cfg(feature = "cuda")]

use ferrotron::comm::world::{local_rank, World};
use ferrotron::comm::{conformance, ReduceOp};

#[test]
fn nccl_group_passes_the_conformance_suite() {
    let world = World::from_environment().unwrap();
    let nccl = world.nccl(local_rank()).unwrap();
    assert_eq!((nccl.rank(), nccl.size()), (world.rank(), world.size()));
    conformance::run_all(nccl.as_ref()).unwrap_or_else(|e| panic!("rank {}: {e:#}", world.rank()));
}

#[test]
fn nccl_sums_large_buffers_in_device_memory() {
    // 16 MiB of f32, bigger than NCCL's small-message paths.
    let world = World::from_environment().unwrap();
    let nccl = world.nccl(local_rank()).unwrap();
    let n = 4 << 20;
    let mine: Vec<f32> = (0..n).map(|i| ((i + nccl.rank()) % 13) as f32).collect();
    let summed = nccl
        .all_reduce(burn::tensor::TensorData::new(mine, [n]), ReduceOp::Sum)
        .unwrap()
        .try_to_vec::<f32>()
        .unwrap();
    for (i, v) in summed.iter().enumerate().step_by(4099) {
        let want: f32 = (0..nccl.size()).map(|r| ((i + r) % 13) as f32).sum();
        assert_eq!(*v, want, "element {i}");
    }
}
