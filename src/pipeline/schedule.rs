//! The order in which a pipeline stage runs forward and backward passes of micro-batches, as
//! Megatron-Core's `pipeline_parallel/schedules.py` orders them.
//!
//! A schedule is a plain list of [`Step`]s per pipeline rank; the executor runs it, receiving
//! inputs from the previous stage and gradients from the next. Keeping the order apart from the
//! execution lets tests check it against the 1F1B rule and simulate its bubble without a model.

/// One pass of one micro-batch through one model chunk of this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// Forward of `microbatch` through this rank's model chunk `chunk`.
    Forward {
        /// Micro-batch index within the global batch (this data-parallel rank's share).
        microbatch: usize,
        /// Virtual stage (model chunk) on this rank; always 0 without interleaving.
        chunk: usize,
    },
    /// Backward of `microbatch` through model chunk `chunk`.
    Backward {
        /// Micro-batch index.
        microbatch: usize,
        /// Model chunk.
        chunk: usize,
    },
}

impl Step {
    /// Whether this is a forward pass.
    pub fn is_forward(self) -> bool {
        matches!(self, Self::Forward { .. })
    }

    /// `(microbatch, chunk)`.
    pub fn key(self) -> (usize, usize) {
        match self {
            Self::Forward { microbatch, chunk } | Self::Backward { microbatch, chunk } => {
                (microbatch, chunk)
            }
        }
    }
}

/// Why a schedule cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// Megatron's constraint on interleaving.
    #[error(
        "the interleaved schedule needs at least --pipeline-model-parallel-size {pipeline} \
         micro-batches per step and a multiple of it, got {microbatches}"
    )]
    Interleaving {
        /// Pipeline size.
        pipeline: usize,
        /// Micro-batches per step.
        microbatches: usize,
    },
}

/// All forwards, then all backwards in the same order (GPipe-style; Megatron's
/// no-pipelining schedule, and every schedule when forward-only gives just the forwards).
/// Every micro-batch's activations are alive at once.
pub fn all_forward_then_backward(microbatches: usize, forward_only: bool) -> Vec<Step> {
    let mut steps: Vec<Step> = (0..microbatches)
        .map(|microbatch| Step::Forward {
            microbatch,
            chunk: 0,
        })
        .collect();
    if !forward_only {
        steps.extend((0..microbatches).map(|microbatch| Step::Backward {
            microbatch,
            chunk: 0,
        }));
    }
    steps
}

/// Megatron's 1F1B (`forward_backward_pipelining_without_interleaving`): `PP − rank − 1`
/// warm-up forwards, then one forward and one backward in turn, then the remaining backwards.
/// At most `PP − rank` micro-batches are in flight on a rank.
pub fn one_forward_one_backward(
    pipeline_rank: usize,
    pipeline_size: usize,
    microbatches: usize,
) -> Vec<Step> {
    let warmup = (pipeline_size - pipeline_rank - 1).min(microbatches);
    let forward = |microbatch| Step::Forward {
        microbatch,
        chunk: 0,
    };
    let backward = |microbatch| Step::Backward {
        microbatch,
        chunk: 0,
    };
    let mut steps: Vec<Step> = (0..warmup).map(forward).collect();
    for i in 0..microbatches - warmup {
        steps.push(forward(warmup + i));
        steps.push(backward(i));
    }
    steps.extend((microbatches - warmup..microbatches).map(backward));
    steps
}

/// Megatron-Core's schedule table: micro-batches in groups of `group` (the pipeline size),
/// each group through every model chunk in turn. Entry k is virtual micro-batch k's
/// `(microbatch, chunk)`.
pub fn schedule_table(microbatches: usize, chunks: usize, group: usize) -> Vec<(usize, usize)> {
    let mut table = Vec::with_capacity(microbatches * chunks);
    let mut start = 0;
    while start < microbatches {
        let end = if start + group >= microbatches {
            microbatches
        } else {
            start + group
        };
        for chunk in 0..chunks {
            table.extend((start..end).map(|m| (m, chunk)));
        }
        start += group;
    }
    table
}

/// Megatron's interleaved 1F1B (`forward_backward_pipelining_with_interleaving`) with
/// `chunks` model chunks per rank (virtual stages `chunk · PP + rank`): the same 1F1B shape
/// over `microbatches · chunks` virtual micro-batches, with `2 (PP − rank − 1) + (chunks − 1)
/// PP` warm-up forwards; backwards visit the chunks in reverse.
pub fn interleaved_one_forward_one_backward(
    pipeline_rank: usize,
    pipeline_size: usize,
    microbatches: usize,
    chunks: usize,
) -> Result<Vec<Step>, ScheduleError> {
    if microbatches < pipeline_size || !microbatches.is_multiple_of(pipeline_size) {
        return Err(ScheduleError::Interleaving {
            pipeline: pipeline_size,
            microbatches,
        });
    }
    let table = schedule_table(microbatches, chunks, pipeline_size);
    let total = table.len();
    let warmup =
        ((pipeline_size - pipeline_rank - 1) * 2 + (chunks - 1) * pipeline_size).min(total);
    let forward = |k: usize| {
        let (microbatch, chunk) = table[k];
        Step::Forward { microbatch, chunk }
    };
    let backward = |k: usize| {
        let (microbatch, chunk) = table[k];
        Step::Backward {
            microbatch,
            chunk: chunks - chunk - 1,
        }
    };
    let mut steps: Vec<Step> = (0..warmup).map(forward).collect();
    for k in 0..total - warmup {
        steps.push(forward(warmup + k));
        steps.push(backward(k));
    }
    steps.extend((total - warmup..total).map(backward));
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_table_matches_megatrons_example() {
        // schedules.py's comment: PP2, 5 micro-batches, 2 chunks, groups of 3 (N3M5).
        let table = schedule_table(5, 2, 3);
        let microbatch: Vec<usize> = table.iter().map(|e| e.0).collect();
        let chunk: Vec<usize> = table.iter().map(|e| e.1).collect();
        assert_eq!(microbatch, [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]);
        assert_eq!(chunk, [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]);
    }
}
