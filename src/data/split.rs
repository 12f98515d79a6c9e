//! Megatron's `--split` ("969,30,1"): train / validation / test ranges of documents.

use std::ops::Range;

/// Parses `--split` ("969,30,1", "98/2/0", "1") into three weights summing to 1, as
/// Megatron's `parse_and_normalize_split` does (missing parts are 0).
pub fn parse_split(split: &str) -> Result<[f64; 3], String> {
    let parts: Vec<&str> = split.split([',', '/']).map(str::trim).collect();
    if parts.len() > 3 || parts.iter().any(|p| p.is_empty()) {
        return Err(format!(
            "--split {split:?}: expected up to three numbers like 969,30,1"
        ));
    }
    let mut weights = [0.0; 3];
    for (w, p) in weights.iter_mut().zip(&parts) {
        *w = p
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("--split {split:?}: {p:?} is not a non-negative number"))?;
    }
    let total: f64 = weights.iter().sum();
    if total <= 0.0 {
        return Err(format!("--split {split:?}: the parts sum to zero"));
    }
    Ok(weights.map(|w| w / total))
}

/// Python's `round()`: to the nearest integer, ties to even.
fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 {
        2.0 * (x / 2.0).round()
    } else {
        r
    }
}

/// The document ranges of the three splits over `num_documents` documents, as
/// Megatron-Core cuts them (`convert_split_vector_to_split_matrix` and the dataset builder):
/// each split's book-ends are the running sums of the weights, and each book-end is rounded on
/// its own (`round(fraction · documents)`, ties to even). A split of weight zero is `None`
/// (no dataset at all); a split with weight may still get an empty range on few documents.
pub fn split_ranges(weights: &[f64; 3], num_documents: usize) -> [Option<Range<usize>>; 3] {
    let n = num_documents as f64;
    let mut start = 0.0;
    weights.map(|w| {
        let end = start + w;
        let bookends = (start, end);
        start = end;
        (bookends.1 > bookends.0).then(|| {
            let cut = |f: f64| round_half_even(f * n) as usize;
            cut(bookends.0)..cut(bookends.1)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_like_megatron_core() {
        let w = parse_split("969,30,1").unwrap();
        assert_eq!(
            split_ranges(&w, 1000),
            [Some(0..969), Some(969..999), Some(999..1000)]
        );
        // Book-ends rounded one by one: 1/3 and 2/3 of 62 documents are 20.67 → 21 and
        // 41.33 → 41, so the training split gets 21 documents.
        assert_eq!(
            split_ranges(&parse_split("1,1,1").unwrap(), 62),
            [Some(0..21), Some(21..41), Some(41..62)]
        );
        // A zero weight is no split at all; a small weight may round to an empty range.
        assert_eq!(
            split_ranges(&parse_split("98,2,0").unwrap(), 20),
            [Some(0..20), Some(20..20), None]
        );
        assert_eq!(
            split_ranges(&parse_split("1").unwrap(), 10),
            [Some(0..10), None, None]
        );
        // Ties go to even, as in Python: round(2.5) = 2.
        assert_eq!(
            split_ranges(&parse_split("1,1").unwrap(), 5),
            [Some(0..2), Some(2..5), None]
        );
        assert!(parse_split("1,2,3,4").is_err());
        assert!(parse_split("a,b").is_err());
        assert!(parse_split("0,0").is_err());
    }
}
