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

/// The document ranges of the three splits over `num_documents` documents (Megatron's
/// `_get_split_indices`: cumulative rounded sizes, the rounding error taken off every bound).
pub fn split_ranges(weights: &[f64; 3], num_documents: usize) -> [Range<usize>; 3] {
    let mut bounds = [0i64; 4];
    for i in 0..3 {
        bounds[i + 1] = bounds[i] + round_half_even(weights[i] * num_documents as f64) as i64;
    }
    let diff = bounds[3] - num_documents as i64;
    for b in bounds.iter_mut().skip(1) {
        *b -= diff;
    }
    let b = bounds.map(|x| x.max(0) as usize);
    [b[0]..b[1], b[1]..b[2], b[2]..b[3]]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_like_megatron() {
        let w = parse_split("969,30,1").unwrap();
        assert_eq!(split_ranges(&w, 1000), [0..969, 969..999, 999..1000]);
        // 489 documents: round(473.841)=474, round(14.67)=15, round(0.489)=0.
        assert_eq!(split_ranges(&w, 489), [0..474, 474..489, 489..489]);
        assert_eq!(
            split_ranges(&parse_split("1").unwrap(), 10),
            [0..10, 10..10, 10..10]
        );
        // Ties go to even, as in Python: round(2.5) = 2.
        assert_eq!(
            split_ranges(&parse_split("1,1").unwrap(), 5),
            [0..3, 3..5, 5..5]
        );
        assert!(parse_split("1,2,3,4").is_err());
        assert!(parse_split("a,b").is_err());
        assert!(parse_split("0,0").is_err());
    }
}
