//! The NCCL group (CUDA builds; needs a GPU and the NCCL library, see docs/gpu.md): the
//! collective conformance suite that the thread and MPI groups pass, run on an NCCL group.
//!
//! ```text
//! cargo test --release --features cuda --test integration nccl::  # one rank, one GPU
//! mpirun -np 2 target/release/deps/integration-<hash> nccl:: --test-threads 1  # one per GPU
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

/// The collectives on burn tensors in CUDA memory (NCCL on burn's buffers, no host copy)
/// against the same collectives staged through the host, in f32 and bf16, along every
/// dimension of a 3-D tensor.
#[test]
fn nccl_collectives_on_cuda_tensors_equal_the_host_staged_ones() {
    use burn::tensor::{DType, Tensor, TensorData};
    let world = World::from_environment().unwrap();
    let nccl = world.nccl(local_rank()).unwrap();
    let group = nccl.as_nccl().expect("an NCCL group");
    let (rank, size) = (nccl.rank(), nccl.size());
    let device = ferrotron::util::device::parse_device(&format!("cuda:{}", local_rank())).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let dims = [2 * size, 3 * size, 4 * size];
        let n: usize = dims.iter().product();
        let values: Vec<f32> = (0..n).map(|i| ((i * 7 + rank) % 23) as f32).collect();
        let x = Tensor::<3>::from_data(TensorData::new(values.clone(), dims), (&device, dtype));
        let host = |t: Tensor<3>| {
            (
                t.dims().to_vec(),
                t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap(),
            )
        };
        let staged = |d: TensorData| d.convert::<f32>().try_to_vec::<f32>().unwrap();
        let data = TensorData::new(values, dims).convert_dtype(dtype);

        let got = group
            .all_reduce_in_device_memory(x.clone(), ReduceOp::Sum)
            .unwrap()
            .expect("a CUDA tensor");
        assert_eq!(
            host(got).1,
            staged(nccl.all_reduce(data.clone(), ReduceOp::Sum).unwrap()),
            "{dtype:?} all_reduce"
        );
        let got = group
            .broadcast_in_device_memory(x.clone(), 0)
            .unwrap()
            .expect("a CUDA tensor");
        assert_eq!(
            host(got).1,
            staged(nccl.broadcast(data.clone(), 0).unwrap()),
            "{dtype:?} broadcast"
        );
        for dim in 0..3 {
            let got = group
                .all_gather_in_device_memory(x.clone(), dim)
                .unwrap()
                .expect("a CUDA tensor");
            let want = nccl.all_gather(data.clone(), dim).unwrap();
            let (shape, values) = host(got);
            assert_eq!(
                shape,
                want.shape().to_vec(),
                "{dtype:?} all_gather {dim}: shape"
            );
            assert_eq!(values, staged(want), "{dtype:?} all_gather {dim}");
            let got = group
                .reduce_scatter_in_device_memory(x.clone(), dim, ReduceOp::Sum)
                .unwrap()
                .expect("a CUDA tensor");
            let want = nccl
                .reduce_scatter(data.clone(), dim, ReduceOp::Sum)
                .unwrap();
            let (shape, values) = host(got);
            assert_eq!(
                shape,
                want.shape().to_vec(),
                "{dtype:?} reduce_scatter {dim}: shape"
            );
            assert_eq!(values, staged(want), "{dtype:?} reduce_scatter {dim}");
        }
    }
}
