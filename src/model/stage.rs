//! Which part of the GPT a pipeline rank holds (Megatron's stage split): the first stage the
//! embeddings, the last the final LayerNorm and the output layer (the tied word embedding),
//! and each rank one or more contiguous ranges of layers ("model chunks"; more than one with
//! the interleaved schedule's virtual stages).

use std::ops::Range;

/// The part of the model one pipeline rank builds and runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageLayers {
    /// Holds the word and position embeddings and runs them first.
    pub embedding: bool,
    /// Holds the final LayerNorm and the output layer and computes the loss.
    pub head: bool,
    /// The rank's model chunks, in the order the micro-batches pass them; layer numbers are
    /// those of the whole model.
    pub chunks: Vec<Range<usize>>,
}

impl StageLayers {
    /// The whole model on one rank.
    pub fn whole(num_layers: usize) -> Self {
        Self {
            embedding: true,
            head: true,
            chunks: std::iter::once(0..num_layers).collect(),
        }
    }

    /// Pipeline rank `rank` of `pipeline` ranks with `virtual_stages` model chunks each:
    /// Megatron's split, where chunk `c` of rank `r` is virtual stage `c · pipeline + r` and
    /// holds the layers of that place in the stack (`num_layers` must divide evenly).
    pub fn of(
        num_layers: usize,
        pipeline: usize,
        virtual_stages: usize,
        rank: usize,
    ) -> Result<Self, String> {
        let stages = pipeline * virtual_stages;
        if stages == 0 || !num_layers.is_multiple_of(stages) {
            return Err(format!(
                "--num-layers {num_layers} is not divisible by pipeline-model-parallel size \
                 {pipeline} × {virtual_stages} virtual stages"
            ));
        }
        let per_stage = num_layers / stages;
        Ok(Self {
            embedding: rank == 0,
            head: rank + 1 == pipeline,
            chunks: (0..virtual_stages)
                .map(|c| {
                    let start = (c * pipeline + rank) * per_stage;
                    start..start + per_stage
                })
                .collect(),
        })
    }

    /// Whether layer `layer` is on this rank.
    pub fn holds_layer(&self, layer: usize) -> bool {
        self.chunks.iter().any(|c| c.contains(&layer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatrons_interleaved_split() {
        // Megatron's docstring: 8 layers, 2 stages, 2 virtual stages → rank 0 holds layers
        // [0, 1] and [4, 5], rank 1 [2, 3] and [6, 7].
        let r0 = StageLayers::of(8, 2, 2, 0).unwrap();
        let r1 = StageLayers::of(8, 2, 2, 1).unwrap();
        assert_eq!(r0.chunks, vec![0..2, 4..6]);
        assert_eq!(r1.chunks, vec![2..4, 6..8]);
        assert!(r0.embedding && !r0.head && r1.head && !r1.embedding);
        assert_eq!(StageLayers::of(6, 3, 1, 1).unwrap().chunks, vec![2..4]);
        assert_eq!(StageLayers::of(4, 1, 1, 0).unwrap(), StageLayers::whole(4));
        assert!(StageLayers::of(6, 4, 1, 0).is_err());
    }
}
