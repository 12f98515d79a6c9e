//! What to train on: Megatron's `--data-path`, `--train-data-path` / `--valid-data-path` /
//! `--test-data-path` and `--data-args-path`, as dataset prefixes with optional weights.

use std::path::{Path, PathBuf};

use super::normalize_prefix;

/// One blend: dataset prefixes and, optionally, their weights (Megatron-Core's
/// `get_blend_from_list`: `W1 P1 W2 P2 ...` or just `P1 P2 ...`). Weights need not sum to 1.
#[derive(Clone, Debug, PartialEq)]
pub struct Blend {
    /// Dataset prefixes (`.bin`/`.idx` without the extension).
    pub prefixes: Vec<PathBuf>,
    /// One positive weight per prefix, or `None` to weigh datasets by their size.
    pub weights: Option<Vec<f64>>,
}

impl Blend {
    /// A single dataset, unweighted.
    pub fn single(prefix: impl Into<PathBuf>) -> Self {
        Self {
            prefixes: vec![prefix.into()],
            weights: None,
        }
    }

    /// Parses a flag's values as Megatron-Core does: an even count whose every other word is a
    /// number is `weight prefix` pairs, anything else is a list of prefixes. `flag` names the
    /// option in errors.
    pub fn from_args(flag: &str, words: &[String]) -> Result<Self, String> {
        if words.is_empty() {
            return Err(format!("{flag} needs at least one dataset prefix"));
        }
        let numbers: Vec<Option<f64>> = words.iter().step_by(2).map(|w| w.parse().ok()).collect();
        let pairs = words.len().is_multiple_of(2);
        let weighted = pairs && numbers.iter().all(Option::is_some);
        if pairs && !weighted && numbers.iter().any(Option::is_some) {
            let example = words.iter().step_by(2).find(|w| w.parse::<f64>().is_err());
            return Err(format!(
                "{flag}: expected `weight prefix` pairs or only prefixes, but {:?} stands where \
                 a weight should be",
                example.map(String::as_str).unwrap_or_default()
            ));
        }
        if !weighted {
            return Ok(Self {
                prefixes: words.iter().map(|w| prefix(w)).collect(),
                weights: None,
            });
        }
        let weights: Vec<f64> = numbers.into_iter().map(|w| w.expect("checked")).collect();
        let prefixes: Vec<PathBuf> = words.iter().skip(1).step_by(2).map(|w| prefix(w)).collect();
        for (w, p) in weights.iter().zip(&prefixes) {
            if !w.is_finite() || *w <= 0.0 {
                return Err(format!(
                    "{flag}: the weight of {} is {w}; blend weights must be positive numbers",
                    p.display()
                ));
            }
        }
        Ok(Self {
            prefixes,
            weights: Some(weights),
        })
    }

    /// Reads `--data-args-path`: a text file holding what `--data-path` would (words separated
    /// by any whitespace, newlines included).
    pub fn from_args_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--data-args-path {}: {e}", path.display()))?;
        let words: Vec<String> = text.split_whitespace().map(str::to_owned).collect();
        Self::from_args(&format!("--data-args-path {}", path.display()), &words)
    }
}

fn prefix(word: &str) -> PathBuf {
    normalize_prefix(Path::new(word.trim()))
}

/// Where each split's samples come from.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSources {
    /// `--data-path` (or `--data-args-path`): one blend, every dataset cut by `--split`.
    Blend(Blend),
    /// `--train-data-path` / `--valid-data-path` / `--test-data-path`: a blend per split,
    /// each dataset used whole; `None` gives no such split.
    PerSplit([Option<Blend>; 3]),
    /// `--mock-data`: Megatron-Core's synthetic documents, cut `1,1,1`.
    Mock(std::sync::Arc<super::MockDocuments>),
}

impl DataSources {
    /// One dataset, cut by `--split`.
    pub fn single(prefix: impl Into<PathBuf>) -> Self {
        Self::Blend(Blend::single(prefix))
    }

    /// The first dataset prefix named (where caches go by default, and for messages).
    pub fn first_prefix(&self) -> Option<&Path> {
        match self {
            Self::Blend(b) => b.prefixes.first(),
            Self::PerSplit(splits) => splits.iter().flatten().flat_map(|b| &b.prefixes).next(),
            Self::Mock(_) => None,
        }
        .map(PathBuf::as_path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn parses_megatron_blend_lists() {
        let b = Blend::from_args("--data-path", &words("0.3 a 0.7 b.bin")).unwrap();
        assert_eq!(b.prefixes, [PathBuf::from("a"), PathBuf::from("b")]);
        assert_eq!(b.weights, Some(vec![0.3, 0.7]));
        let b = Blend::from_args("--data-path", &words("a b c")).unwrap();
        assert_eq!(b.prefixes.len(), 3);
        assert_eq!(b.weights, None);
        // An even count of prefixes is still prefixes when none of them is a number.
        let b = Blend::from_args("--data-path", &words("a b")).unwrap();
        assert_eq!(b.weights, None);
        assert_eq!(b.prefixes.len(), 2);
    }

    #[test]
    fn rejects_mixed_and_non_positive_weights() {
        let e = Blend::from_args("--data-path", &words("0.3 a b c")).unwrap_err();
        assert!(e.contains("\"b\""), "{e}");
        let e = Blend::from_args("--data-path", &words("0 a 1 b")).unwrap_err();
        assert!(e.contains("weight of a is 0"), "{e}");
        assert!(Blend::from_args("--data-path", &[]).is_err());
    }
}
