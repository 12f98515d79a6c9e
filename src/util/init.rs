//! Megatron's initialization, drawn on the host from a per-parameter seed.
//!
//! Every parameter gets its own generator seeded from `--seed` and its name, and its values
//! are drawn in row-major order on the host. So the full model is the same whatever the
//! backend (Flex, wgpu, CUDA) and whatever the tensor-parallel size (a rank takes its shard of
//! the same master tensor), and adding a parameter does not change the others.

use burn::tensor::{Device, Tensor, TensorData};

use crate::util::numpy_random::NumpyRandomState;

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal(0, std).
    Normal(f64),
    /// All zeros (biases, LayerNorm β).
    Zeros,
    /// All ones (LayerNorm γ).
    Ones,
}

fn seed_for(seed: u64, name: &str) -> u32 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h ^ (h >> 32)) as u32
}

/// The full (unsharded) values of parameter `name`, on the host.
pub fn master_values(init: Init, shape: &[usize], seed: u64, name: &str) -> Vec<f32> {
    let n: usize = shape.iter().product();
    match init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Normal(std) => {
            let mut rng = NumpyRandomState::new(seed_for(seed, name));
            let mut uniform = move || {
                // 53-bit uniform in (0, 1], as numpy's random_sample, shifted off zero.
                let a = (rng.next_u32() >> 5) as f64;
                let b = (rng.next_u32() >> 6) as f64;
                (a * 67_108_864.0 + b + 1.0) / 9_007_199_254_740_992.0
            };
            let mut out = Vec::with_capacity(n + 1);
            while out.len() < n {
                // Box–Muller: two independent normals per pair of uniforms.
                let (u1, u2) = (uniform(), uniform());
                let r = (-2.0 * u1.ln()).sqrt();
                let t = std::f64::consts::TAU * u2;
                out.push((std * r * t.cos()) as f32);
                out.push((std * r * t.sin()) as f32);
            }
            out.truncate(n);
            out
        }
    }
}

/// A tensor of parameter `name` with Megatron's initialization.
pub fn init_tensor<const D: usize>(
    init: Init,
    shape: [usize; D],
    seed: u64,
    name: &str,
    device: &Device,
) -> Tensor<D> {
    Tensor::from_data(
        TensorData::new(master_values(init, &shape, seed, name), shape),
        device,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_values_have_the_requested_moments_and_depend_on_the_name() {
        let v = master_values(Init::Normal(0.02), &[1000, 100], 1234, "w");
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 2e-4, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 2e-4, "std {}", var.sqrt());
        assert_eq!(
            v,
            master_values(Init::Normal(0.02), &[1000, 100], 1234, "w")
        );
        assert_ne!(
            v[..10],
            master_values(Init::Normal(0.02), &[1000, 100], 1234, "v")[..10]
        );
        assert_ne!(
            v[..10],
            master_values(Init::Normal(0.02), &[1000, 100], 1235, "w")[..10]
        );
    }
}
