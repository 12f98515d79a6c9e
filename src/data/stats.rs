//! Summary statistics of a dataset, for `idx-dump`.

use serde::Serialize;

use super::{IndexedDataset, Tokens};

/// Facts about a dataset that take a pass over its index and tokens.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DatasetStats {
    /// Shortest sequence, in tokens (0 when there are none).
    pub min_length: usize,
    /// Mean sequence length.
    pub mean_length: f64,
    /// Median sequence length (the lower middle for an even count).
    pub median_length: usize,
    /// Longest sequence.
    pub max_length: usize,
    /// Documents with no sequence (empty text).
    pub empty_documents: usize,
    /// Largest token id present.
    pub max_token_id: Option<i64>,
    /// Tokens equal to `eod`, if one was given.
    pub eod_tokens: Option<u64>,
}

impl DatasetStats {
    /// Computes the statistics; `eod` is counted when given.
    pub fn compute(ds: &IndexedDataset, eod: Option<u32>) -> Self {
        let mut lengths: Vec<usize> = ds.sequence_lengths().collect();
        let (min_length, max_length, mean_length, median_length) = if lengths.is_empty() {
            (0, 0, 0.0, 0)
        } else {
            let total: u64 = lengths.iter().map(|&l| l as u64).sum();
            let mean = total as f64 / lengths.len() as f64;
            let mid = (lengths.len() - 1) / 2;
            let (_, median, _) = lengths.select_nth_unstable(mid);
            let median = *median;
            let min = *lengths.iter().min().unwrap_or(&0);
            let max = *lengths.iter().max().unwrap_or(&0);
            (min, max, mean, median)
        };
        let indices: Vec<usize> = ds.document_indices().collect();
        let empty_documents = indices.windows(2).filter(|w| w[0] == w[1]).count();
        let (max_token_id, eod_tokens) = match ds.all_tokens() {
            Tokens::U16(t) => (
                t.iter().max().map(|&m| m as i64),
                eod.map(|e| t.iter().filter(|&&x| x as u32 == e).count() as u64),
            ),
            Tokens::I32(t) => (
                t.iter().max().map(|&m| m as i64),
                eod.map(|e| t.iter().filter(|&&x| x as i64 == e as i64).count() as u64),
            ),
        };
        Self {
            min_length,
            mean_length,
            median_length,
            max_length,
            empty_documents,
            max_token_id,
            eod_tokens,
        }
    }
}
