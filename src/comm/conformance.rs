//! The collective test suite, written once and run on every communicator: the thread world in
//! `cargo test`, the MPI world under `mpirun` (`tests/mpi.rs`).
//!
//! Each rank's contribution is a known function of its rank, so every rank computes the
//! expected result of each collective sequentially on its own and compares. Values are small
//! integers, exact in every dtype tested, so the comparison is exact too.

use anyhow::{ensure, Context, Result};
use burn::tensor::{DType, TensorData};

use super::{Communicator, Expect, ReduceOp};

/// The dtypes every collective is checked with.
pub const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Rank `rank`'s contribution: `shape` filled with small integers that differ by rank.
fn contribution(rank: usize, shape: &[usize], salt: usize) -> Vec<f32> {
    let n: usize = shape.iter().product();
    (0..n)
        .map(|i| ((rank * 7 + i * 3 + salt) % 11) as f32 - 5.0)
        .collect()
}

fn data(values: Vec<f32>, shape: &[usize], dtype: DType) -> TensorData {
    TensorData::new(values, shape.to_vec()).convert_dtype(dtype)
}

fn values(d: &TensorData) -> Vec<f32> {
    d.clone().convert::<f32>().try_to_vec::<f32>().expect("f32")
}

fn check(what: &str, got: &TensorData, shape: &[usize], dtype: DType, want: &[f32]) -> Result<()> {
    ensure!(
        got.shape().as_slice() == shape && got.dtype() == dtype,
        "{what}: got {:?} {:?}, expected {shape:?} {dtype:?}",
        got.shape().to_vec(),
        got.dtype()
    );
    let got = values(got);
    ensure!(got == want, "{what}: got {got:?}, expected {want:?}");
    Ok(())
}

/// Row-major index of `idx` in `shape`.
fn offset(shape: &[usize], idx: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |o, (&i, &s)| o * s + i)
}

/// Multi-index of row-major offset `o` in `shape`.
fn index(shape: &[usize], mut o: usize) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = o % shape[d];
        o /= shape[d];
    }
    idx
}

/// Runs every check on `comm` (every rank must call it); the first failure is the error.
pub fn run_all(comm: &dyn Communicator) -> Result<()> {
    for dtype in DTYPES {
        collectives(comm, dtype).with_context(|| format!("{dtype:?}"))?;
    }
    point_to_point(comm).context("send/recv")?;
    rings(comm).context("ring collectives")?;
    sub_groups(comm).context("split")?;
    mismatch(comm).context("mismatched shapes")?;
    Ok(())
}

/// Ranks passing different shapes to one collective get an error naming the mismatch on
/// every rank, not a crash or a hang (checked on a sub-group: a thread group that saw a
/// mismatch stays failed).
pub fn mismatch(comm: &dyn Communicator) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let sub = comm.split(0, comm.rank())?;
    let n = 2 + sub.rank();
    match sub.all_reduce(TensorData::new(vec![1f32; n], [n]), ReduceOp::Sum) {
        Err(super::CommError::Mismatch { detail, .. }) => {
            ensure!(
                detail.contains("[3]"),
                "the message names the shapes: {detail}"
            )
        }
        other => anyhow::bail!("expected a mismatch error, got {other:?}"),
    }
    comm.barrier()?;
    Ok(())
}

/// All-reduce (sum, max), all-gather and reduce-scatter along two dimensions, broadcast from
/// every root, barrier.
pub fn collectives(comm: &dyn Communicator, dtype: DType) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let shape = [2, 3 * size];
    let n = shape[0] * shape[1];
    let all: Vec<Vec<f32>> = (0..size).map(|r| contribution(r, &shape, 1)).collect();
    let mine = || data(all[rank].clone(), &shape, dtype);

    let sum: Vec<f32> = (0..n).map(|i| all.iter().map(|v| v[i]).sum()).collect();
    let got = comm.all_reduce(mine(), ReduceOp::Sum)?;
    check("all_reduce(sum)", &got, &shape, dtype, &sum)?;
    let max: Vec<f32> = (0..n)
        .map(|i| all.iter().map(|v| v[i]).fold(f32::MIN, f32::max))
        .collect();
    let got = comm.all_reduce(mine(), ReduceOp::Max)?;
    check("all_reduce(max)", &got, &shape, dtype, &max)?;

    for dim in 0..2 {
        // Gather: element idx of the result comes from rank idx[dim] / shape[dim].
        let mut gathered_shape = shape.to_vec();
        gathered_shape[dim] *= size;
        let want: Vec<f32> = (0..n * size)
            .map(|o| {
                let mut idx = index(&gathered_shape, o);
                let r = idx[dim] / shape[dim];
                idx[dim] %= shape[dim];
                all[r][offset(&shape, &idx)]
            })
            .collect();
        let got = comm.all_gather(mine(), dim)?;
        check(
            &format!("all_gather(dim {dim})"),
            &got,
            &gathered_shape,
            dtype,
            &want,
        )?;
    }
    for dim in [1, 0] {
        let mut big_shape = shape.to_vec();
        big_shape[dim] *= size;
        let big: Vec<Vec<f32>> = (0..size).map(|r| contribution(r, &big_shape, 4)).collect();
        let want: Vec<f32> = (0..n)
            .map(|o| {
                let mut idx = index(&shape, o);
                idx[dim] += rank * shape[dim];
                big.iter().map(|v| v[offset(&big_shape, &idx)]).sum()
            })
            .collect();
        let got = comm.reduce_scatter(
            data(big[rank].clone(), &big_shape, dtype),
            dim,
            ReduceOp::Sum,
        )?;
        check(
            &format!("reduce_scatter(dim {dim})"),
            &got,
            &shape,
            dtype,
            &want,
        )?;
    }
    for (root, want) in all.iter().enumerate() {
        let got = comm.broadcast(mine(), root)?;
        check(
            &format!("broadcast(root {root})"),
            &got,
            &shape,
            dtype,
            want,
        )?;
    }
    comm.barrier()?;
    Ok(())
}

/// The ring's all-gather and reduce-scatter (made of sends and receives) equal the
/// backend's own collectives, along both dimensions.
pub fn rings(comm: &dyn Communicator) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    for dim in 0..2 {
        let shape = [2, 3];
        let mine = data(contribution(rank, &shape, 7), &shape, DType::F32);
        let want = comm.all_gather(mine.clone(), dim)?;
        let got = super::ring::ring_all_gather(comm, mine, dim)?;
        let gathered = want.shape().to_vec();
        check(
            "ring_all_gather",
            &got,
            &gathered,
            DType::F32,
            &values(&want),
        )?;
        let mut big = shape.to_vec();
        big[dim] *= size;
        let mine = data(contribution(rank, &big, 8), &big, DType::F32);
        let want = comm.reduce_scatter(mine.clone(), dim, ReduceOp::Sum)?;
        let got = super::ring::ring_reduce_scatter(comm, mine, dim)?;
        check(
            "ring_reduce_scatter",
            &got,
            &shape,
            DType::F32,
            &values(&want),
        )?;
    }
    comm.barrier()?;
    Ok(())
}

/// A ring in both directions: every rank sends two tagged messages to its right neighbour and
/// one to its left, and receives them in order (the exchange a pipeline stage makes).
pub fn point_to_point(comm: &dyn Communicator) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    if size == 1 {
        return Ok(());
    }
    let right = (rank + 1) % size;
    let left = (rank + size - 1) % size;
    let shape = [3, 2];
    let msg = |from: usize, k: usize| contribution(from, &shape, 10 * k);
    // Even ranks send first, odd ranks receive first: no reliance on buffering.
    let send_all = || -> Result<()> {
        comm.send(data(msg(rank, 0), &shape, DType::F32), right)?;
        comm.send(data(msg(rank, 1), &shape, DType::BF16), right)?;
        comm.send(data(msg(rank, 2), &shape, DType::F32), left)?;
        Ok(())
    };
    let recv_all = || -> Result<()> {
        let f32_ = Expect {
            shape: shape.to_vec(),
            dtype: DType::F32,
        };
        let bf16 = Expect {
            shape: shape.to_vec(),
            dtype: DType::BF16,
        };
        let a = comm.recv(&f32_, left)?;
        check("recv #0 from left", &a, &shape, DType::F32, &msg(left, 0))?;
        let b = comm.recv(&bf16, left)?;
        check("recv #1 from left", &b, &shape, DType::BF16, &msg(left, 1))?;
        let c = comm.recv(&f32_, right)?;
        check("recv from right", &c, &shape, DType::F32, &msg(right, 2))?;
        Ok(())
    };
    if rank % 2 == 0 {
        send_all()?;
        recv_all()?;
    } else {
        recv_all()?;
        send_all()?;
    }
    comm.barrier()?;
    Ok(())
}

/// Megatron-style 2-D split: groups of consecutive ranks (`rank / 2`) and strided groups
/// (`rank % 2`), each checked by an all-reduce of the world ranks and by its own rank order;
/// a key that reverses the order is honoured.
pub fn sub_groups(comm: &dyn Communicator) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let width = if size.is_multiple_of(2) { 2 } else { 1 };
    let blocks = comm.split(rank / width, rank)?;
    let strided = comm.split(rank % width, rank)?;
    let reversed = comm.split(0, size - 1 - rank)?;
    ensure!(blocks.size() == width && blocks.rank() == rank % width);
    ensure!(strided.size() == size / width && strided.rank() == rank / width);
    ensure!(reversed.size() == size && reversed.rank() == size - 1 - rank);
    let id = |c: &dyn Communicator| -> Result<Vec<f32>> {
        let g = c.all_gather(TensorData::new(vec![rank as f32], [1]), 0)?;
        Ok(values(&g))
    };
    let base = rank - rank % width;
    let want: Vec<f32> = (0..width).map(|k| (base + k) as f32).collect();
    ensure!(id(blocks.as_ref())? == want, "block group members");
    let want: Vec<f32> = (0..size / width)
        .map(|k| (k * width + rank % width) as f32)
        .collect();
    ensure!(id(strided.as_ref())? == want, "strided group members");
    let want: Vec<f32> = (0..size).rev().map(|r| r as f32).collect();
    ensure!(id(reversed.as_ref())? == want, "reversed group members");
    // Sub-groups run their collectives independently of each other and of the parent.
    collectives(blocks.as_ref(), DType::F32).context("block group")?;
    collectives(strided.as_ref(), DType::BF16).context("strided group")?;
    comm.barrier()?;
    Ok(())
}
