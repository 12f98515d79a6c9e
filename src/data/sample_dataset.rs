//! What training reads: numbered samples of `seq_length + 1` tokens, from one GPT dataset or
//! a blend of several.

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

    /// Sample `i` as inputs, labels and loss mask (0 where the input token is the EOD with
    /// `--eod-mask-loss`, as Megatron does).
    fn sample(&self, i: usize, eod: u32, eod_mask_loss: bool) -> GptSample {
        let mut tokens = self.sample_tokens(i);
        let labels = tokens[1..].to_vec();
        tokens.pop();
        let loss_mask = tokens
            .iter()
            .map(|&t| if eod_mask_loss && t == eod { 0.0 } else { 1.0 })
            .collect();
        GptSample {
            tokens,
            labels,
            loss_mask,
        }
    }
}
