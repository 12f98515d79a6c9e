//! What training reads: numbered samples of `seq_length + 1` tokens, from one GPT dataset or
//! a blend of several.

use super::sample_masks::SampleMasks;
use super::GptSample;

/// A dataset of fixed-length token samples in training order (Megatron's `MegatronDataset`
/// and `BlendedDataset` seen from the loader): the loader and evaluation take any of them.
pub trait SampleDataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `seq_length + 1` tokens of sample `i` (wrapping around the end).
    fn sample_tokens(&self, i: usize) -> Vec<u32>;

    /// Where sample `i` comes from: (dataset of the blend, sample of that dataset); a single
    /// dataset is its own dataset 0.
    fn source(&self, i: usize) -> (usize, usize) {
        (0, i % self.len())
    }

    /// What built the dataset's indices, as text: cache keys of the blends holding it.
    fn description(&self) -> String;

    /// Sample `i` as inputs, labels, loss mask and, for packed documents, positions and
    /// attention starts, as `masks` says (Megatron's `_get_ltor_masks_and_position_ids`).
    fn sample(&self, i: usize, masks: &SampleMasks) -> GptSample {
        let mut tokens = self.sample_tokens(i);
        let labels = tokens[1..].to_vec();
        tokens.pop();
        GptSample {
            loss_mask: masks.loss_mask(&tokens),
            positions: masks.positions(&tokens),
            first_keys: masks.first_keys(&tokens),
            tokens,
            labels,
        }
    }
}
