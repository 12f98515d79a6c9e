//! Context parallelism's split of each sequence over the context-parallel group (Megatron's
//! `get_batch_on_this_cp_rank`): the sequence cut into `2 · size` equal chunks, rank `r`
//! holding chunks `r` and `2 · size − 1 − r`. Under causal attention a query's work grows
//! with its position, so pairing an early chunk with a late one gives every rank the same
//! work (the load balance Megatron's split is for).
//!
//! Everything but attention is per token, so a rank runs its tokens alone; attention needs
//! the keys and values of the whole sequence, which [`ContextSplit::gather_sequence`] brings
//! together (its backward sums each rank's gradient of them back to the rank that holds
//! them).

use std::ops::Range;

use burn::tensor::{Int, Tensor, TensorData};

use super::mappings::{apply, RegionKind};
use crate::comm::Group;

/// The two chunks (ranges of positions in the whole sequence) that context-parallel rank
/// `rank` of `size` holds of a `seq`-long sequence: chunks `rank` and `2·size − 1 − rank`.
pub fn context_chunks(size: usize, rank: usize, seq: usize) -> [Range<usize>; 2] {
    let chunk = seq / (2 * size);
    let late = 2 * size - 1 - rank;
    [
        rank * chunk..(rank + 1) * chunk,
        late * chunk..(late + 1) * chunk,
    ]
}

/// The positions in the whole sequence of the tokens rank `rank` holds, in its order.
pub fn context_rows(size: usize, rank: usize, seq: usize) -> Vec<usize> {
    context_chunks(size, rank, seq)
        .into_iter()
        .flatten()
        .collect()
}

/// Rank `rank`'s part `[batch, seq / size]` of a `[batch, seq]` row-major array.
pub fn context_slice<T: Copy>(
    values: &[T],
    [batch, seq]: [usize; 2],
    size: usize,
    rank: usize,
) -> Vec<T> {
    let rows = context_rows(size, rank, seq);
    (0..batch)
        .flat_map(|b| rows.iter().map(move |&p| values[b * seq + p]))
        .collect()
}

/// How the keys and values of the whole sequence are brought to every rank
/// (`--cp-comm-type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContextComm {
    /// Passed around the ring, each rank sending what it last received to the next
    /// (Megatron's default; its backward passes the gradients' partial sums the other way).
    #[default]
    P2p,
    /// One all-gather (its backward a reduce-scatter).
    AllGather,
}

impl ContextComm {
    /// The `--cp-comm-type` value, or why it is not one ferrotron implements.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value {
            "p2p" => Ok(Self::P2p),
            "allgather" => Ok(Self::AllGather),
            "a2a" | "a2a+p2p" => Err(format!(
                "--cp-comm-type {value} is not implemented (p2p and allgather are)"
            )),
            other => Err(format!(
                "--cp-comm-type must be p2p, a2a, allgather or a2a+p2p, got {other:?}"
            )),
        }
    }
}

/// This rank's place in the context-parallel group, for the layers that need the whole
/// sequence (attention) or where their tokens sit in it (dropout masks).
#[derive(Clone, Debug)]
pub struct ContextSplit {
    /// The context-parallel group (more than one rank).
    pub group: Group,
    /// How keys and values travel.
    pub comm: ContextComm,
}

impl ContextSplit {
    /// The split over `group`; `None` for a group of one (nothing is split).
    pub fn over(group: &Group, comm: ContextComm) -> Option<Self> {
        (group.size() > 1).then(|| Self {
            group: group.clone(),
            comm,
        })
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's chunks of a sequence of which it holds `local` tokens.
    pub fn chunks(&self, local: usize) -> [Range<usize>; 2] {
        context_chunks(self.size(), self.group.rank(), local * self.size())
    }

    /// The positions in the whole sequence of this rank's `local` tokens, `[local]`.
    pub fn rows(&self, local: usize, device: &burn::tensor::Device) -> Tensor<1, Int> {
        let rows = context_rows(self.size(), self.group.rank(), local * self.size());
        let rows: Vec<i64> = rows.into_iter().map(|p| p as i64).collect();
        Tensor::from_data(TensorData::new(rows, [local]), device)
    }

    /// Keys or values `[batch, groups, local, head_dim]` of this rank's tokens → those of the
    /// whole sequence `[batch, groups, local · size, head_dim]`, in sequence order. The
    /// backward sums every rank's gradient of each rank's tokens back onto that rank.
    pub fn gather_sequence(&self, x: Tensor<4>) -> Tensor<4> {
        let [_, _, local, _] = x.dims();
        let kind = match self.comm {
            ContextComm::AllGather => RegionKind::SequenceGather,
            ContextComm::P2p => RegionKind::RingGather,
        };
        // [b, local, g, d]: the region operators gather dimension 1.
        let gathered = apply(x.swap_dims(1, 2), kind, &self.group);
        // Gathered row `q · local + i` is rank q's token i; put them in sequence order.
        let whole = local * self.size();
        let mut order = vec![0i64; whole];
        for q in 0..self.size() {
            for (i, p) in context_rows(self.size(), q, whole).into_iter().enumerate() {
                order[p] = (q * local + i) as i64;
            }
        }
        let order =
            Tensor::<1, Int>::from_data(TensorData::new(order, [whole]), &gathered.device());
        gathered.select(1, order).swap_dims(1, 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Megatron's split of 16 tokens over 2 ranks: chunks of 4, rank 0 holds 0–3 and 12–15,
    /// rank 1 holds 4–11; over 4 ranks (chunks of 2) rank 1 holds 2, 3, 12, 13.
    #[test]
    fn each_rank_holds_an_early_and_a_late_chunk() {
        assert_eq!(context_chunks(2, 0, 16), [0..4, 12..16]);
        assert_eq!(context_chunks(2, 1, 16), [4..8, 8..12]);
        assert_eq!(context_rows(4, 1, 16), vec![2, 3, 12, 13]);
        let batch: Vec<u32> = (0..32).collect();
        assert_eq!(
            context_slice(&batch, [2, 16], 4, 1),
            vec![2, 3, 12, 13, 18, 19, 28, 29]
        );
        // Every position is held exactly once.
        let mut all: Vec<usize> = (0..4).flat_map(|r| context_rows(4, r, 16)).collect();
        all.sort();
        assert_eq!(all, (0..16).collect::<Vec<_>>());
    }
}
