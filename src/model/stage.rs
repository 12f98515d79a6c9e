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

    /// Pipeline rank `rank` of `pipeline` ranks (one model chunk each) with `first` layers
    /// on the first stage and `last` on the last where given, the others split evenly over
    /// the remaining stages: Megatron's `--decoder-first-pipeline-num-layers` /
    /// `--decoder-last-pipeline-num-layers`, for when the embedding or the output layer makes
    /// one end of the pipeline slower than the rest.
    pub fn uneven(
        num_layers: usize,
        pipeline: usize,
        first: Option<usize>,
        last: Option<usize>,
        rank: usize,
    ) -> Result<Self, String> {
        if first.is_none() && last.is_none() {
            return Self::of(num_layers, pipeline, 1, rank);
        }
        if pipeline < 2 {
            return Err(
                "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1"
                    .into(),
            );
        }
        let fixed = first.unwrap_or(0) + last.unwrap_or(0);
        let others = pipeline - usize::from(first.is_some()) - usize::from(last.is_some());
        let rest = num_layers.checked_sub(fixed).unwrap_or(usize::MAX);
        let even = match others {
            0 if rest == 0 => 0,
            0 => usize::MAX,
            n if rest != usize::MAX && rest.is_multiple_of(n) => rest / n,
            _ => usize::MAX,
        };
        if even == usize::MAX {
            return Err(format!(
                "--num-layers {num_layers} cannot be cut into {pipeline} stages with {} on the \
                 first and {} on the last and the rest split evenly",
                first.map_or("an even share".to_owned(), |n| n.to_string()),
                last.map_or("an even share".to_owned(), |n| n.to_string()),
            ));
        }
        let count = |stage: usize| match (stage, first, last) {
            (0, Some(n), _) => n,
            (s, _, Some(n)) if s + 1 == pipeline => n,
            _ => even,
        };
        let start: usize = (0..rank).map(count).sum();
        Ok(Self {
            embedding: rank == 0,
            head: rank + 1 == pipeline,
            chunks: std::iter::once(start..start + count(rank)).collect(),
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

    #[test]
    fn uneven_first_and_last_stages() {
        let ranges = |first, last, pp| {
            (0..pp)
                .map(|r| StageLayers::uneven(8, pp, first, last, r).unwrap().chunks[0].clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(ranges(Some(5), None, 2), vec![0..5, 5..8]);
        assert_eq!(ranges(None, Some(2), 4), vec![0..2, 2..4, 4..6, 6..8]);
        assert_eq!(ranges(Some(1), Some(1), 4), vec![0..1, 1..4, 4..7, 7..8]);
        assert_eq!(ranges(None, None, 2), vec![0..4, 4..8]);
        assert!(StageLayers::uneven(8, 3, Some(3), None, 0).is_err());
        assert!(StageLayers::uneven(8, 2, Some(9), None, 0).is_err());
        assert!(StageLayers::uneven(8, 2, Some(5), Some(2), 0).is_err());
    }
}
