//! Collectives made of point-to-point messages around the ring of a group's ranks: the
//! pattern of context parallelism's `p2p` exchange (Megatron's default `--cp-comm-type`),
//! where each rank only ever talks to its two neighbours.

use burn::tensor::TensorData;

use super::buffer::{join, reduce, split};
use super::{CommError, Communicator, Expect, ReduceOp};

/// All-gather along `dim` in `size − 1` steps, each rank handing the block it last received
/// to the next rank. Equal to [`Communicator::all_gather`].
pub fn ring_all_gather(
    comm: &dyn Communicator,
    data: TensorData,
    dim: usize,
) -> Result<TensorData, CommError> {
    let (n, r) = (comm.size(), comm.rank());
    let mut blocks = vec![None; n];
    let mut current = data;
    for step in 1..n {
        let received = ring_exchange(comm, current.clone())?;
        blocks[r].get_or_insert(current);
        blocks[(r + n - step) % n] = Some(received.clone());
        current = received;
    }
    blocks[r].get_or_insert(current);
    let blocks: Vec<TensorData> = blocks.into_iter().flatten().collect();
    join(&blocks, dim)
}

/// Sum-reduce-scatter along `dim` in `size − 1` steps: each rank adds its part to the partial
/// sum it received and hands it on, ending with the sum of its own block (the transpose of
/// [`ring_all_gather`]). Equal to [`Communicator::reduce_scatter`] up to the order of the
/// additions.
pub fn ring_reduce_scatter(
    comm: &dyn Communicator,
    data: TensorData,
    dim: usize,
) -> Result<TensorData, CommError> {
    let (n, r) = (comm.size(), comm.rank());
    let parts = split(&data, dim, n)?;
    // At step s a rank hands on the partial sum of block r − s; it starts with its own r − 1.
    let mut partial = parts[(r + n - 1) % n].clone();
    for step in 1..n {
        let received = ring_exchange(comm, partial)?;
        let own = &parts[(r + 2 * n - step - 1) % n];
        partial = reduce(&[received, own.clone()], ReduceOp::Sum)?;
    }
    Ok(partial)
}

/// Sends `block` to the next rank of the ring and returns the previous rank's. Rank 0
/// receives first and every other rank sends first, so blocking sends cannot deadlock: the
/// last rank's send completes, then the one before it, down to rank 0's.
fn ring_exchange(comm: &dyn Communicator, block: TensorData) -> Result<TensorData, CommError> {
    let (n, r) = (comm.size(), comm.rank());
    let expect = Expect {
        shape: block.shape().to_vec(),
        dtype: block.dtype(),
    };
    let (next, previous) = ((r + 1) % n, (r + n - 1) % n);
    if r == 0 {
        let received = comm.recv(&expect, previous)?;
        comm.send(block, next)?;
        Ok(received)
    } else {
        comm.send(block, next)?;
        comm.recv(&expect, previous)
    }
}
