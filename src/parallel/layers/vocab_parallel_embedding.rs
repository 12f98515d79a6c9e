//! The token embedding with its vocabulary rows split across ranks.

use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor};

use crate::comm::Group;
use crate::parallel::embedding_lookup::embedding_lookup;
use crate::parallel::mappings::reduce_from_region;
use crate::parallel::sharding::{init_shard, vocab_shard_index, DeclaresHoldings, Holding};
use crate::util::init::Init;

/// Megatron's `VocabParallelEmbedding`: rank r holds rows `[r·V/N, (r+1)·V/N)`. Each rank
/// looks up the tokens in its range, zeroes the others, and an all-reduce assembles the
/// embeddings. The same shard is the (tied) output layer.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding {
    /// `[padded vocab / N, hidden]`.
    pub weight: Param<Tensor<2>>,
    /// The tensor-parallel group.
    #[module(skip)]
    pub group: Group,
}

/// The vocabulary rows are split.
impl DeclaresHoldings for VocabParallelEmbedding {
    const HOLDINGS: &'static [(&'static str, Holding)] = &[("weight", Holding::Split(0))];
}

impl VocabParallelEmbedding {
    /// This rank's rows of a `[vocab, hidden]` Normal(0, `std`) embedding named `name`.
    pub fn new(
        vocab: usize,
        hidden: usize,
        std: f64,
        seed: u64,
        name: &str,
        group: &Group,
        device: &Device,
    ) -> Self {
        Self {
            weight: Param::from_tensor(init_shard(
                Init::Normal(std),
                [vocab, hidden],
                seed,
                &format!("{name}.weight"),
                Self::holding("weight").partition_dim(),
                group,
                device,
            )),
            group: group.clone(),
        }
    }

    /// The first vocabulary id this rank holds.
    pub fn vocab_start(&self) -> usize {
        self.group.rank() * self.weight.dims()[0]
    }

    /// Embeddings `[batch, seq, hidden]` of token ids `[batch, seq]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [b, s] = tokens.dims();
        let [rows, h] = self.weight.dims();
        let flat = tokens.reshape([b * s]);
        if self.group.size() == 1 {
            return embedding_lookup(self.weight.val(), flat).reshape([b, s, h]);
        }
        let (index, outside) = vocab_shard_index(flat, self.vocab_start(), rows);
        let rows_out = embedding_lookup(self.weight.val(), index)
            .mask_fill(outside.unsqueeze_dim::<2>(1), 0.0);
        reduce_from_region(rows_out, &self.group).reshape([b, s, h])
    }
}
