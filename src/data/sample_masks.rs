//! What a sample's end-of-document tokens change (Megatron-Core's
//! `_get_ltor_masks_and_position_ids`): the loss mask (`--eod-mask-loss`), and for packed
//! documents the positions (`--reset-position-ids`) and which keys each query may attend to
//! (`--reset-attention-mask`).
//!
//! The attention mask is not an `s × s` tensor here. Under Megatron's rule a token after an
//! end-of-document sees nothing up to it, so the keys a query sees are always one run, from
//! its document's first token to itself: one number per token ([`SampleMasks::first_keys`])
//! says it all, and it is what kernels that skip whole tiles need. The positions are the same
//! number seen the other way: a token's position is its distance from that first token.

/// Megatron's switches for a sample's masks and positions, with the end-of-document id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleMasks {
    /// The end-of-document token id.
    pub eod: u32,
    /// `--eod-mask-loss`: no loss where the input token is the end-of-document.
    pub eod_mask_loss: bool,
    /// `--reset-position-ids`: positions restart at 0 after each end-of-document.
    pub reset_position_ids: bool,
    /// `--reset-attention-mask`: a token after an end-of-document attends to nothing up to it.
    pub reset_attention_mask: bool,
}

impl SampleMasks {
    /// No switch on: every position counts, positions run from 0, attention is causal.
    pub fn plain(eod: u32) -> Self {
        Self {
            eod,
            eod_mask_loss: false,
            reset_position_ids: false,
            reset_attention_mask: false,
        }
    }

    /// Whether samples carry positions or attention masks of their own documents.
    pub fn packs_documents(&self) -> bool {
        self.reset_position_ids || self.reset_attention_mask
    }

    /// The loss mask of input `tokens`: 0 at an end-of-document under `--eod-mask-loss`.
    pub fn loss_mask(&self, tokens: &[u32]) -> Vec<f32> {
        tokens
            .iter()
            .map(|&t| {
                if self.eod_mask_loss && t == self.eod {
                    0.0
                } else {
                    1.0
                }
            })
            .collect()
    }

    /// Each input token's position under `--reset-position-ids` (`None` without it: positions
    /// `0..s`).
    pub fn positions(&self, tokens: &[u32]) -> Option<Vec<u32>> {
        self.reset_position_ids.then(|| {
            document_starts(tokens, self.eod)
                .iter()
                .enumerate()
                .map(|(i, &start)| i as u32 - start)
                .collect()
        })
    }

    /// Each input token's first visible key under `--reset-attention-mask` (`None` without
    /// it: every query sees the keys from 0 to itself).
    pub fn first_keys(&self, tokens: &[u32]) -> Option<Vec<u32>> {
        self.reset_attention_mask
            .then(|| document_starts(tokens, self.eod))
    }
}

/// For each of `tokens`, where its document starts: the position after the last
/// end-of-document before it (an end-of-document ends its own document).
pub fn document_starts(tokens: &[u32], eod: u32) -> Vec<u32> {
    let mut start = 0u32;
    let mut out = Vec::with_capacity(tokens.len());
    for (i, &t) in tokens.iter().enumerate() {
        out.push(start);
        if t == eod {
            start = i as u32 + 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_end_of_document_closes_its_own_document() {
        const E: u32 = 9;
        assert_eq!(
            document_starts(&[1, E, 2, 3, E, E, 4], E),
            [0, 0, 2, 2, 2, 5, 6]
        );
        assert_eq!(document_starts(&[E, 1, 2], E), [0, 1, 1]);
        assert_eq!(document_starts(&[1, 2, 3], E), [0, 0, 0]);
        let masks = SampleMasks {
            reset_position_ids: true,
            ..SampleMasks::plain(E)
        };
        assert_eq!(masks.positions(&[1, E, 2, 3]), Some(vec![0, 1, 0, 1]));
        assert_eq!(masks.first_keys(&[1, E, 2, 3]), None);
    }
}
