//! Megatron-Core's `BlendedDataset`: samples drawn from several datasets in fixed proportions.
//!
//! Sample k of the blend is sample `dataset_sample_index[k]` of dataset `dataset_index[k]`.
//! Both arrays come from Megatron's greedy rule (`build_blending_indices` in its C++ helpers):
//! each next sample goes to the dataset furthest behind its target share. The weights are
//! normalised with numpy's float64 arithmetic (pairwise summation included) so that ties break
//! as in Megatron and the same arguments give the same sample sequence. The arrays are cached
//! as `.npy` files named like Megatron-Core's (`…-BlendedDataset-<split>-dataset_index.npy`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::gpt_dataset::fnv1a;
use super::npy::{read_npy, write_npy};
use super::{DatasetError, SampleDataset, Split};

/// Megatron-Core's `mid_level_dataset_surplus` default: each dataset is built with this many
/// more samples than its share of the blend, as a margin.
pub const MID_LEVEL_DATASET_SURPLUS: f64 = 0.005;

/// numpy's float64 `add.reduce` (`numpy.sum`): the identity 0 plus numpy's pairwise sum,
/// which adds blocks of eight in eight accumulators. Plain left-to-right summation differs in
/// the last bit from nine values on.
pub fn numpy_sum(values: &[f64]) -> f64 {
    0.0 + pairwise_sum(values)
}

fn pairwise_sum(a: &[f64]) -> f64 {
    const BLOCK: usize = 128;
    let n = a.len();
    if n < 8 {
        a.iter().fold(0.0, |s, &x| s + x)
    } else if n <= BLOCK {
        let mut r = [0.0; 8];
        r.copy_from_slice(&a[..8]);
        let whole = n - n % 8;
        for chunk in a[8..whole].chunks_exact(8) {
            for (acc, &x) in r.iter_mut().zip(chunk) {
                *acc += x;
            }
        }
        let head = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        a[whole..].iter().fold(head, |s, &x| s + x)
    } else {
        let mut half = n / 2;
        half -= half % 8;
        pairwise_sum(&a[..half]) + pairwise_sum(&a[half..])
    }
}

/// Megatron-Core's `normalize`: each weight over their numpy sum.
pub fn normalize(weights: &[f64]) -> Vec<f64> {
    let total = numpy_sum(weights);
    weights.iter().map(|w| w / total).collect()
}

/// `_get_size_per_split_per_dataset`: samples to take from each dataset for each split,
/// `ceil(ceil(target · weight) · (1 + surplus))`. Indexed `[dataset][split]`.
pub fn sizes_per_dataset(weights: &[f64], targets: &[u64; 3], surplus: f64) -> Vec<[u64; 3]> {
    weights
        .iter()
        .map(|&w| targets.map(|t| ((t as f64 * w).ceil() * (1.0 + surplus)).ceil() as u64))
        .collect()
}

/// `build_blending_indices`: for each of `size` samples, the dataset whose share is furthest
/// behind `weights` (the first one on ties), and that dataset's running sample count.
pub fn build_blending_indices(weights: &[f64], size: usize) -> (Vec<i16>, Vec<i64>) {
    let mut dataset_index = Vec::with_capacity(size);
    let mut dataset_sample_index = Vec::with_capacity(size);
    let mut taken = vec![0i64; weights.len()];
    for sample in 0..size {
        let position = (sample as f64).max(1.0);
        let mut best = 0;
        let mut best_error = weights[0] * position - taken[0] as f64;
        for (d, &w) in weights.iter().enumerate().skip(1) {
            let error = w * position - taken[d] as f64;
            if error > best_error {
                best = d;
                best_error = error;
            }
        }
        dataset_index.push(best as i16);
        dataset_sample_index.push(taken[best]);
        taken[best] += 1;
    }
    (dataset_index, dataset_sample_index)
}

/// Several datasets served as one, in Megatron-Core's blended order.
pub struct BlendedDataset {
    datasets: Vec<Arc<dyn SampleDataset>>,
    dataset_index: Vec<i16>,
    dataset_sample_index: Vec<i64>,
    description: String,
}

impl std::fmt::Debug for BlendedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlendedDataset")
            .field("datasets", &self.datasets.len())
            .field("samples", &self.dataset_index.len())
            .finish()
    }
}

impl BlendedDataset {
    /// Blends `datasets` (all of the same split) by `weights` (normalised here, as Megatron's
    /// `BlendedDataset` does when given a size) into `size` samples. The indices are loaded from
    /// `cache_dir` when a matching entry is there, else built and saved there.
    pub fn new(
        datasets: Vec<Arc<dyn SampleDataset>>,
        weights: &[f64],
        size: usize,
        split: Split,
        cache_dir: &Path,
    ) -> Result<Self, DatasetError> {
        assert_eq!(datasets.len(), weights.len(), "one weight per dataset");
        if datasets.len() >= i16::MAX as usize {
            return Err(DatasetError::OutOfRange(format!(
                "a blend holds at most {} datasets, not {}",
                i16::MAX - 1,
                datasets.len()
            )));
        }
        let weights = normalize(weights);
        let mut description = format!(
            "class: BlendedDataset (ferrotron)\nsplit: {}\nweights: {weights:?}\nsize: {size}\nformat: 1\n",
            split.name()
        );
        for (i, d) in datasets.iter().enumerate() {
            description.push_str(&format!("dataset {i}:\n{}", d.description()));
        }
        let cache = BlendCache::new(cache_dir, split, &description);
        let (dataset_index, dataset_sample_index) = match cache.load(size) {
            Some(indices) => indices,
            None => {
                let indices = build_blending_indices(&weights, size);
                check_not_oversampled(&datasets, &indices.0, split)?;
                if let Err(e) = cache.save(&indices.0, &indices.1) {
                    eprintln!("warning: could not cache the blend indices: {e}");
                }
                indices
            }
        };
        Ok(Self {
            datasets,
            dataset_index,
            dataset_sample_index,
            description,
        })
    }

    /// The blended datasets, in `--data-path` order.
    pub fn datasets(&self) -> &[Arc<dyn SampleDataset>] {
        &self.datasets
    }
}

impl SampleDataset for BlendedDataset {
    fn len(&self) -> usize {
        self.dataset_index.len()
    }

    fn source(&self, i: usize) -> (usize, usize) {
        let i = i % self.dataset_index.len();
        (
            self.dataset_index[i] as usize,
            self.dataset_sample_index[i] as usize,
        )
    }

    fn sample_tokens(&self, i: usize) -> Vec<u32> {
        let (dataset, sample) = self.source(i);
        self.datasets[dataset].sample_tokens(sample)
    }

    fn description(&self) -> String {
        self.description.clone()
    }
}

/// Megatron raises when the blend asks a dataset for more samples than it was built with.
fn check_not_oversampled(
    datasets: &[Arc<dyn SampleDataset>],
    dataset_index: &[i16],
    split: Split,
) -> Result<(), DatasetError> {
    let mut counts = vec![0usize; datasets.len()];
    for &d in dataset_index {
        counts[d as usize] += 1;
    }
    for (i, (d, &count)) in datasets.iter().zip(&counts).enumerate() {
        if count > d.len() {
            return Err(DatasetError::OutOfRange(format!(
                "the {} blend asks dataset {i} for {count} samples but it holds {}",
                split.name(),
                d.len()
            )));
        }
    }
    Ok(())
}

/// Cache entry of a blend: `<hash>-BlendedDataset-<split>-{description.txt,dataset_index.npy,
/// dataset_sample_index.npy}`, Megatron-Core's names with a hash of ferrotron's description.
struct BlendCache {
    stem: PathBuf,
    description: String,
}

impl BlendCache {
    fn new(dir: &Path, split: Split, description: &str) -> Self {
        let stem = dir.join(format!(
            "{:016x}-BlendedDataset-{}",
            fnv1a(description),
            split.name()
        ));
        Self {
            stem,
            description: description.to_owned(),
        }
    }

    fn path(&self, what: &str) -> PathBuf {
        let mut s = self.stem.as_os_str().to_owned();
        s.push(format!("-{what}"));
        PathBuf::from(s)
    }

    fn load(&self, size: usize) -> Option<(Vec<i16>, Vec<i64>)> {
        let description = std::fs::read_to_string(self.path("description.txt")).ok()?;
        if description != self.description {
            return None;
        }
        let dataset_index = read_npy::<i16>(&self.path("dataset_index.npy"), &[size]).ok()?;
        let sample_index = read_npy::<i64>(&self.path("dataset_sample_index.npy"), &[size]).ok()?;
        Some((dataset_index, sample_index))
    }

    fn save(&self, dataset_index: &[i16], sample_index: &[i64]) -> Result<(), DatasetError> {
        let dir = self.stem.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| DatasetError::io(dir, e))?;
        write_npy(
            &self.path("dataset_index.npy"),
            dataset_index,
            &[dataset_index.len()],
        )?;
        write_npy(
            &self.path("dataset_sample_index.npy"),
            sample_index,
            &[sample_index.len()],
        )?;
        // Last: its presence marks a complete entry.
        let path = self.path("description.txt");
        std::fs::write(&path, &self.description).map_err(|e| DatasetError::io(&path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact sums in f64 arithmetic's own terms: the reference adds in numpy's order, checked
    /// here against the plain sum where the two must agree and against float64-exact
    /// integer sums.
    #[test]
    fn numpy_sum_orders_additions_like_numpy() {
        let small = [0.1, 0.2, 0.3];
        assert_eq!(numpy_sum(&small), (0.1 + 0.2) + 0.3);
        // Nine values: numpy adds the first eight pairwise, then the ninth.
        let v = [0.1, 0.7, 0.3, 0.9, 0.2, 0.6, 0.4, 0.8, 0.5];
        let pairwise = (((0.1 + 0.7) + (0.3 + 0.9)) + ((0.2 + 0.6) + (0.4 + 0.8))) + 0.5;
        assert_eq!(numpy_sum(&v), pairwise);
        let ints: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(numpy_sum(&ints), 500_500.0);
    }

    /// The greedy rule against a brute-force restatement: each prefix of the blend is as close
    /// to the weights as a single step allows, and counts follow the weights.
    #[test]
    fn blending_indices_follow_the_weights() {
        let weights = normalize(&[1.0, 2.0, 1.0]);
        let (index, sample) = build_blending_indices(&weights, 1000);
        let mut counts = [0i64; 3];
        for (&d, &s) in index.iter().zip(&sample) {
            assert_eq!(
                s, counts[d as usize],
                "samples of a dataset are taken in order"
            );
            counts[d as usize] += 1;
        }
        assert_eq!(counts, [250, 500, 250]);
        // Positions 0 and 1 both count as 1: dataset 1 (largest weight) first, then the
        // first of the two equally behind, then the other, then dataset 1 again.
        assert_eq!(&index[..4], &[1, 0, 2, 1]);
    }

    #[test]
    fn sizes_carry_megatrons_margin() {
        let w = normalize(&[0.3, 0.7]);
        assert_eq!(
            sizes_per_dataset(&w, &[1000, 10, 0], 0.0),
            vec![[300, 3, 0], [700, 7, 0]]
        );
        assert_eq!(
            sizes_per_dataset(&w, &[1000, 10, 0], MID_LEVEL_DATASET_SURPLUS),
            vec![[302, 4, 0], [704, 8, 0]]
        );
    }
}
