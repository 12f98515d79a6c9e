//! Picking the next token from logits: greedy, or sampled after temperature, top-k and top-p
//! (nucleus) filtering, applied in that order as HuggingFace's `generate` applies them.

use crate::util::numpy_random::NumpyRandomState;

/// How the next token is chosen.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingConfig {
    /// Always the most likely token (also what temperature 0 means).
    pub greedy: bool,
    /// Logits are divided by this before sampling.
    pub temperature: f64,
    /// Keep only the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the fewest most likely tokens whose probabilities reach this mass (0 or 1: all).
    pub top_p: f64,
    /// Seed of the sampling generator.
    pub seed: u32,
}

impl SamplingConfig {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            greedy: true,
            temperature: 1.0,
            top_k: 0,
            top_p: 0.0,
            seed: 0,
        }
    }

    /// Checks the ranges, naming the flag at fault.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "--temperature {} must be a number ≥ 0",
                self.temperature
            ));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(format!("--top-p {} must lie in [0, 1]", self.top_p));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.greedy || self.temperature == 0.0
    }
}

/// Draws next tokens with a seeded generator, so a run is repeatable.
pub struct Sampler {
    config: SamplingConfig,
    rng: NumpyRandomState,
}

impl Sampler {
    /// A sampler following `config`.
    pub fn new(config: SamplingConfig) -> Self {
        let rng = NumpyRandomState::new(config.seed);
        Self { config, rng }
    }

    /// The next token for `logits` (one per vocabulary entry).
    pub fn next_token(&mut self, logits: &[f32]) -> u32 {
        if self.config.is_greedy() {
            return argmax(logits);
        }
        let probs = filtered_probabilities(logits, &self.config);
        let u = self.rng.random_sample();
        let mut cumulative = 0.0;
        let mut last = 0;
        for (id, &p) in probs.iter().enumerate() {
            if p > 0.0 {
                cumulative += p;
                last = id;
                if u < cumulative {
                    return id as u32;
                }
            }
        }
        last as u32
    }
}

/// The first index of the largest logit (as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Softmax of `logits / temperature` over the tokens top-k and top-p keep (the others 0).
pub fn filtered_probabilities(logits: &[f32], config: &SamplingConfig) -> Vec<f64> {
    let scaled: Vec<f64> = logits
        .iter()
        .map(|&x| x as f64 / config.temperature)
        .collect();
    let mut order: Vec<usize> = (0..scaled.len()).collect();
    order.sort_by(|&a, &b| scaled[b].total_cmp(&scaled[a]).then(a.cmp(&b)));
    let mut keep = order.len();
    if config.top_k > 0 {
        keep = keep.min(config.top_k);
    }
    let max = scaled[order[0]];
    let weights: Vec<f64> = order[..keep]
        .iter()
        .map(|&i| (scaled[i] - max).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    if config.top_p > 0.0 && config.top_p < 1.0 {
        // The smallest prefix (by probability) whose mass reaches top_p; at least one token.
        let mut mass = 0.0;
        for (n, w) in weights.iter().enumerate() {
            mass += w / total;
            if mass >= config.top_p {
                keep = n + 1;
                break;
            }
        }
    }
    let kept_total: f64 = weights[..keep].iter().sum();
    let mut probs = vec![0.0; scaled.len()];
    for (&i, w) in order[..keep].iter().zip(&weights) {
        probs[i] = w / kept_total;
    }
    probs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(temperature: f64, top_k: usize, top_p: f64) -> SamplingConfig {
        SamplingConfig {
            greedy: false,
            temperature,
            top_k,
            top_p,
            seed: 1,
        }
    }

    #[test]
    fn filters_against_a_direct_softmax() {
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let e: Vec<f64> = logits.iter().map(|&x| (x as f64 / 2.0).exp()).collect();
        let z: f64 = e.iter().sum();
        let all = filtered_probabilities(&logits, &config(2.0, 0, 0.0));
        for (p, q) in all.iter().zip(&e) {
            assert!((p - q / z).abs() < 1e-15);
        }
        // top-k 2 keeps ids 1 and 2, renormalised.
        let two = filtered_probabilities(&logits, &config(2.0, 2, 0.0));
        assert_eq!((two[0], two[3]), (0.0, 0.0));
        assert!((two[1] - e[1] / (e[1] + e[2])).abs() < 1e-15);
        // top-p: the most likely id (1) alone holds p1 of the mass.
        let p1 = e[1] / z;
        let nucleus = filtered_probabilities(&logits, &config(2.0, 0, p1 * 0.99));
        assert_eq!(nucleus[1], 1.0);
        let nucleus = filtered_probabilities(&logits, &config(2.0, 0, p1 * 1.01));
        assert!(nucleus[1] > 0.0 && nucleus[2] > 0.0 && nucleus[0] == 0.0);
    }

    #[test]
    fn sampling_follows_the_probabilities_and_greedy_takes_the_first_max() {
        assert_eq!(argmax(&[0.0, 2.0, 2.0, 1.0]), 1);
        let mut sampler = Sampler::new(config(1.0, 0, 0.0));
        let logits = [0.0f32, (3.0f32).ln()];
        let ones = (0..20_000)
            .filter(|_| sampler.next_token(&logits) == 1)
            .count();
        // p(1) = 0.75; 20 000 draws: σ ≈ 61.
        assert!((ones as i64 - 15_000).abs() < 400, "{ones}");
        let mut greedy = Sampler::new(SamplingConfig::greedy());
        assert_eq!(greedy.next_token(&logits), 1);
    }
}
