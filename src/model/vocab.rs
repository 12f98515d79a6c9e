//! Megatron's padded vocabulary.

/// Pads `vocab_size` up to a multiple of `divisible_by × tensor_parallel_size`, so that every
/// tensor-parallel rank holds an equal, GPU-friendly slice of the embedding.
pub fn padded_vocab_size(
    vocab_size: usize,
    divisible_by: usize,
    tensor_parallel_size: usize,
) -> usize {
    let multiple = divisible_by.max(1) * tensor_parallel_size.max(1);
    vocab_size.div_ceil(multiple) * multiple
}

/// Megatron's log line for the padding, e.g.
/// ` > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)`.
pub fn padded_vocab_log_line(vocab_size: usize, padded: usize) -> String {
    format!(
        " > padded vocab (size: {vocab_size}) with {} dummy tokens (new size: {padded})",
        padded - vocab_size
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_like_megatron() {
        assert_eq!(padded_vocab_size(50257, 128, 1), 50304);
        assert_eq!(padded_vocab_size(50257, 128, 2), 50432);
        assert_eq!(padded_vocab_size(50257, 128, 4), 50688);
        assert_eq!(padded_vocab_size(50257, 128, 8), 51200);
        assert_eq!(padded_vocab_size(50304, 128, 1), 50304);
        assert_eq!(
            padded_vocab_log_line(50257, 50688),
            " > padded vocab (size: 50257) with 431 dummy tokens (new size: 50688)"
        );
    }
}
