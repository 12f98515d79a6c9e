//! `--mock-data`: Megatron-Core's `MockGPTLowLevelDataset`, synthetic documents a GPT dataset
//! is built over exactly as over real ones (same indices, same samples as Megatron's for the
//! same seed), for benchmarks and recipes that need no corpus.
//!
//! Megatron draws 100,000 document lengths in `[1, 4096)` from numpy's `default_rng(0)`;
//! document `d` of length `L` holds the ids `1, 2, …, L - 1` (modulo the vocabulary) and then
//! the end-of-document id. The run's `--split` is replaced by `1,1,1`.

use std::ops::Range;

use crate::util::numpy_pcg64::NumpyPcg64;

/// The synthetic documents of a vocabulary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MockDocuments {
    lengths: Vec<u32>,
    vocab_size: u32,
    eod: u32,
}

impl MockDocuments {
    /// Documents in Megatron's mock dataset.
    pub const DOCUMENTS: usize = 100_000;
    /// numpy seed of the lengths (hard-coded in Megatron).
    pub const SEED: u32 = 0;
    /// Exclusive bound of a document's length.
    pub const MAX_LENGTH: i32 = 4096;
    /// The split Megatron forces on mock data.
    pub const SPLIT: &'static str = "1,1,1";

    /// Megatron's documents for a tokenizer of `vocab_size` ids whose end-of-document id is
    /// `eod`.
    pub fn new(vocab_size: u32, eod: u32) -> Self {
        let mut rng = NumpyPcg64::new(Self::SEED);
        let lengths = (0..Self::DOCUMENTS)
            .map(|_| rng.integer_i32(1, Self::MAX_LENGTH) as u32)
            .collect();
        Self {
            lengths,
            vocab_size: vocab_size.max(1),
            eod,
        }
    }

    /// Token count of every document.
    pub fn lengths(&self) -> &[u32] {
        &self.lengths
    }

    /// The tokens `range` of document `doc`, appended to `out`.
    pub fn append_tokens(&self, doc: usize, range: Range<usize>, out: &mut Vec<u32>) {
        let last = self.lengths[doc] as usize - 1;
        out.extend(range.map(|i| {
            if i == last {
                self.eod
            } else {
                ((i as u64 + 1) % self.vocab_size as u64) as u32
            }
        }));
    }

    /// What the dataset indices depend on, for the cache description.
    pub fn describe(&self) -> String {
        format!(
            "MockGPTLowLevelDataset: {} documents, numpy default_rng({}) lengths in [1, {}), vocab_size {}, eod {}",
            Self::DOCUMENTS,
            Self::SEED,
            Self::MAX_LENGTH,
            self.vocab_size,
            self.eod
        )
    }
}
