//! HuggingFace's `no_repeat_ngram_size` rule (fairseq's before it): a token that would complete
//! an n-gram already present in the sequence — the prompt included — is banned (its score set
//! to −∞, the others left as they are, not renormalised).

/// The tokens that may not follow `sequence` under `n`-gram blocking (`n == 0`: none).
pub fn banned_tokens(sequence: &[u32], n: usize) -> Vec<u32> {
    if n == 0 || sequence.len() < n {
        return Vec::new();
    }
    let prefix = &sequence[sequence.len() + 1 - n..];
    sequence
        .windows(n)
        .filter(|w| w[..n - 1] == *prefix)
        .map(|w| w[n - 1])
        .collect()
}

/// Sets the banned tokens' scores to −∞.
pub fn ban(scores: &mut [f32], sequence: &[u32], n: usize) {
    for token in banned_tokens(sequence, n) {
        if let Some(score) = scores.get_mut(token as usize) {
            *score = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bans_what_would_repeat_an_ngram() {
        // Bigrams (1,2), (2,3), (3,1), (1,2): after ...1 the token 2 would repeat (1,2).
        assert_eq!(banned_tokens(&[1, 2, 3, 1], 2), vec![2]);
        assert_eq!(banned_tokens(&[1, 2, 3, 1, 2], 3), vec![3]);
        assert_eq!(banned_tokens(&[5, 6, 5], 1), vec![5, 6, 5]);
        assert!(banned_tokens(&[1, 2], 3).is_empty());
        assert!(banned_tokens(&[1, 1, 1], 0).is_empty());
        // The window that ends at the prefix itself is one token short: [7, 7] bans 7 under
        // bigrams because (7, 7) occurred, but [7] alone bans nothing.
        assert_eq!(banned_tokens(&[7, 7], 2), vec![7]);
        assert!(banned_tokens(&[7], 2).is_empty());
    }
}
