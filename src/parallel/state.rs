//! Megatron's parallel state (`core/parallel_state.py`): the world cut into tensor-, context-,
//! data- and pipeline-parallel groups, in Megatron's rank order (`tp-cp-ep-dp-pp`: the
//! tensor-parallel rank fastest, then context-parallel, then data-parallel, then pipeline),
//! built once and passed explicitly; there are no globals.

use std::sync::Arc;

use anyhow::{bail, Result};

use crate::comm::{Communicator, Group};

/// Where one rank sits in the grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coordinates {
    /// Tensor-parallel rank.
    pub tp: usize,
    /// Context-parallel rank: which two chunks of each sequence this rank holds.
    pub cp: usize,
    /// Data-parallel rank.
    pub dp: usize,
    /// Pipeline-parallel rank (stage).
    pub pp: usize,
}

/// Sizes of the grid: world = tp × cp × dp × pp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Context-parallel size (`--context-parallel-size`).
    pub cp: usize,
    /// Data-parallel size.
    pub dp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
}

impl Layout {
    /// The layout of `world` ranks with the given tensor-, pipeline- and context-parallel
    /// sizes; the data-parallel size is what is left, as in Megatron.
    pub fn for_world(world: usize, tp: usize, pp: usize, cp: usize) -> Result<Self> {
        if tp == 0 || pp == 0 || cp == 0 || !world.is_multiple_of(tp * pp * cp) {
            bail!(
                "world size {world} is not divisible by tensor-model-parallel size {tp} × \
                 pipeline-model-parallel size {pp} × context-parallel size {cp}"
            );
        }
        Ok(Self {
            tp,
            cp,
            dp: world / (tp * pp * cp),
            pp,
        })
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.tp * self.cp * self.dp * self.pp
    }

    /// Ranks that sum each parameter's gradient: the data-parallel ranks times the
    /// context-parallel ones (each of which saw part of every sequence).
    pub fn gradient_ranks(&self) -> usize {
        self.dp * self.cp
    }

    /// The coordinates of `rank` (Megatron's order: tp fastest, then cp, dp, pp).
    pub fn coordinates(&self, rank: usize) -> Coordinates {
        Coordinates {
            tp: rank % self.tp,
            cp: (rank / self.tp) % self.cp,
            dp: (rank / (self.tp * self.cp)) % self.dp,
            pp: rank / (self.tp * self.cp * self.dp),
        }
    }

    /// The rank at `c`.
    pub fn rank_of(&self, c: Coordinates) -> usize {
        c.tp + self.tp * (c.cp + self.cp * (c.dp + self.dp * c.pp))
    }

    /// Megatron's first log line about the layout.
    pub fn log_line(&self) -> String {
        format!(
            "using world size: {}, data-parallel size: {}, context-parallel size: {}, \
             hierarchical context-parallel sizes: None, tensor-model-parallel size: {}, \
             pipeline-model-parallel size: {}",
            self.world(),
            self.dp,
            self.cp,
            self.tp,
            self.pp
        )
    }
}

/// This rank's groups.
#[derive(Clone, Debug)]
pub struct ParallelState {
    /// The grid.
    pub layout: Layout,
    /// This rank's place in it.
    pub coordinates: Coordinates,
    /// Every rank.
    pub world: Group,
    /// Ranks holding the other shards of the same layers (same cp, dp, pp).
    pub tensor: Group,
    /// Ranks holding the other chunks of the same sequences (same tp, dp, pp).
    pub context: Group,
    /// Ranks holding the same shards, reading different data (same tp, cp, pp).
    pub data: Group,
    /// Ranks summing each gradient: data- × context-parallel (same tp, pp; Megatron's data
    /// group `with_context_parallel`), which the distributed optimizer shards over.
    pub data_with_context: Group,
    /// The stages of one model replica (same tp, cp, dp).
    pub pipeline: Group,
    /// Every rank of one model replica: tensor × pipeline (same cp, dp).
    pub model: Group,
    /// The first and last pipeline stage of one replica (same tp, cp, dp), which hold the
    /// tied word embedding; with one stage, that stage alone.
    pub embedding: Group,
}

impl ParallelState {
    /// Splits `world` into Megatron's groups; every rank calls it.
    pub fn new(world: Arc<dyn Communicator>, tp: usize, pp: usize, cp: usize) -> Result<Self> {
        let layout = Layout::for_world(world.size(), tp, pp, cp)?;
        let c = layout.coordinates(world.rank());
        let (t, k, d) = (layout.tp, layout.cp, layout.dp);
        let tensor = world.split(c.cp + k * (c.dp + d * c.pp), c.tp)?;
        let context = world.split(c.tp + t * (c.dp + d * c.pp), c.cp)?;
        let data = world.split(c.tp + t * (c.cp + k * c.pp), c.dp)?;
        let data_with_context = world.split(c.tp + t * c.pp, c.cp + k * c.dp)?;
        // Each replica (one cp and dp coordinate) is its own pipeline and model group.
        let replica = c.cp + k * c.dp;
        let pipeline = world.split(c.tp + t * replica, c.pp)?;
        let model = world.split(replica, c.tp + t * c.pp)?;
        let on_embedding_stage = c.pp == 0 || c.pp + 1 == layout.pp;
        // Ranks off the embedding stages get a group of their own, never used.
        let embedding_color = if on_embedding_stage {
            c.tp + t * replica
        } else {
            t * k * d + world.rank()
        };
        let embedding = world.split(embedding_color, c.pp)?;
        Ok(Self {
            layout,
            coordinates: c,
            world: Group::new(world),
            tensor: Group::new(tensor),
            context: Group::new(context),
            data: Group::new(data),
            data_with_context: Group::new(data_with_context),
            pipeline: Group::new(pipeline),
            model: Group::new(model),
            embedding: Group::new(embedding),
        })
    }

    /// Whether this is rank 0 of the world: the rank that logs and writes shared files.
    pub fn is_world_rank0(&self) -> bool {
        self.world.rank() == 0
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::run_ranks;
    use burn::tensor::TensorData;

    #[test]
    fn megatron_orders_tensor_parallel_ranks_fastest() {
        let layout = Layout::for_world(8, 2, 2, 1).unwrap();
        assert_eq!(layout.dp, 2);
        // Megatron's documented example: 8 GPUs, TP 2, PP 2 → TP groups [0,1] [2,3] [4,5]
        // [6,7], DP groups [0,2] [1,3] [4,6] [5,7], PP groups [0,4] [1,5] [2,6] [3,7].
        let c = layout.coordinates(5);
        assert_eq!(
            c,
            Coordinates {
                tp: 1,
                cp: 0,
                dp: 0,
                pp: 1
            }
        );
        for r in 0..8 {
            assert_eq!(layout.rank_of(layout.coordinates(r)), r);
        }
        assert!(Layout::for_world(6, 4, 1, 1).is_err());
        assert_eq!(
            Layout::for_world(4, 2, 1, 1).unwrap().log_line(),
            "using world size: 4, data-parallel size: 2, context-parallel size: 1, \
             hierarchical context-parallel sizes: None, tensor-model-parallel size: 2, \
             pipeline-model-parallel size: 1"
        );
    }

    #[test]
    fn groups_hold_the_ranks_megatron_puts_in_them() {
        let members = |g: &Group, rank: usize| -> Vec<usize> {
            let d = g
                .all_gather(TensorData::new(vec![rank as i64], [1]), 0)
                .unwrap();
            d.try_to_vec::<i64>()
                .unwrap()
                .into_iter()
                .map(|v| v as usize)
                .collect()
        };
        let results = run_ranks(8, |world| {
            let rank = world.rank();
            let s = ParallelState::new(world, 2, 2, 1)?;
            Ok((
                members(&s.tensor, rank),
                members(&s.data, rank),
                members(&s.pipeline, rank),
                members(&s.model, rank),
                members(&s.embedding, rank),
            ))
        })
        .unwrap();
        let (tp, dp, pp, mp, emb) = &results[5];
        assert_eq!(tp, &[4, 5]);
        assert_eq!(dp, &[5, 7]);
        assert_eq!(pp, &[1, 5]);
        assert_eq!(mp, &[0, 1, 4, 5]);
        assert_eq!(emb, &[1, 5]);
        assert_eq!(results[2].1, vec![0, 2]);
        assert_eq!(results[6].2, vec![2, 6]);
    }

    /// Megatron's `RankGenerator` order `tp-cp-ep-dp-pp` at 8 ranks, TP 2, CP 2, DP 2: the
    /// context groups are the tensor groups' neighbours, the data groups stride over both, and
    /// the gradient group is data × context.
    #[test]
    fn context_parallel_ranks_sit_between_tensor_and_data_parallel_ones() {
        let layout = Layout::for_world(8, 2, 1, 2).unwrap();
        assert_eq!((layout.dp, layout.gradient_ranks()), (2, 4));
        assert_eq!(
            layout.coordinates(6),
            Coordinates {
                tp: 0,
                cp: 1,
                dp: 1,
                pp: 0
            }
        );
        let members = |g: &Group, rank: usize| -> Vec<i64> {
            let d = g.all_gather(TensorData::new(vec![rank as i64], [1]), 0);
            d.unwrap().try_to_vec::<i64>().unwrap()
        };
        let results = run_ranks(8, |world| {
            let rank = world.rank();
            let s = ParallelState::new(world, 2, 1, 2)?;
            Ok([
                members(&s.tensor, rank),
                members(&s.context, rank),
                members(&s.data, rank),
                members(&s.data_with_context, rank),
                members(&s.model, rank),
            ])
        })
        .unwrap();
        let [tp, cp, dp, dp_cp, mp] = &results[5];
        assert_eq!(tp, &[4, 5]);
        assert_eq!(cp, &[5, 7]);
        assert_eq!(dp, &[1, 5]);
        assert_eq!(dp_cp, &[1, 3, 5, 7]);
        assert_eq!(mp, &[4, 5]);
    }
}
