//! A run with a tensor larger than the device can allocate is refused before it starts, with
//! the flags that would make it fit.
//!
//! Why: a CubeCL device allocates no buffer over a size of its own (CubeCL's `max_page_size`:
//! 128 MiB on lavapipe, a quarter of the memory on CUDA). Past it the allocation failed inside
//! the step and the run panicked at the step's first read ("An error happened during
//! execution"), with nothing to say which tensor or what to change. The tensors checked are
//! the largest a step certainly allocates whole, each counted at its exact size, so a run that
//! fits is never refused: the logits of a micro-batch, the word-embedding table (fp32 main
//! weights), and the flat fp32 buffers of a single model replica's parameters on a CubeCL
//! device ([`crate::optim::FlatAdamW`]).

use anyhow::{bail, Result};
use burn::tensor::FloatDType;

use super::config::PretrainConfig;

/// One tensor a step allocates whole.
#[derive(Clone, Debug, PartialEq)]
pub struct WholeTensor {
    /// What it is, for the error.
    pub what: &'static str,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Bytes per element.
    pub element_bytes: usize,
    /// The flags that would make it smaller.
    pub remedy: &'static str,
}

impl WholeTensor {
    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.element_bytes as u64
    }
}

/// The largest tensors a rank of `cfg` allocates whole: the logits of a micro-batch (in the
/// working precision), the word-embedding table (fp32), and with `flat_buffers` the flat
/// fp32 buffer of the model's parameters (one model replica per rank on a CubeCL device
/// without the distributed optimizer).
pub fn largest_tensors(cfg: &PretrainConfig, flat_buffers: bool) -> Vec<WholeTensor> {
    let model = &cfg.model;
    let vocab = model.padded_vocab_size / cfg.parallel.tensor_model_parallel_size.max(1);
    let working_bytes = match cfg.precision.dtype() {
        FloatDType::F64 => 8,
        FloatDType::F32 | FloatDType::Flex32 => 4,
        _ => 2,
    };
    let mut tensors = vec![
        WholeTensor {
            what: "the logits of a micro-batch",
            shape: vec![cfg.micro_batch_size, cfg.seq_length, vocab],
            element_bytes: working_bytes,
            remedy:
                "lower --micro-batch-size or --seq-length, or raise --tensor-model-parallel-size",
        },
        WholeTensor {
            what: "the word-embedding table (fp32 main weights)",
            shape: vec![vocab, model.hidden_size],
            element_bytes: 4,
            remedy: "raise --tensor-model-parallel-size",
        },
    ];
    if flat_buffers {
        tensors.push(WholeTensor {
            what: "the flat fp32 buffer of the parameters (one for the weights, one for each of Adam's moments)",
            shape: vec![model.num_parameters()],
            element_bytes: 4,
            remedy: "use --use-distributed-optimizer or tensor/pipeline-parallel ranks",
        });
    }
    tensors
}

/// An error naming the first of `tensors` over `limit` bytes (the largest buffer the device
/// allocates), its size, and what would make it fit.
pub fn check_against(tensors: &[WholeTensor], limit: u64) -> Result<()> {
    if let Some(t) = tensors.iter().find(|t| t.bytes() > limit) {
        bail!(
            "{} ({:?}, {:.1} MB) is larger than the largest buffer this device allocates \
             ({:.1} MB): {}",
            t.what,
            t.shape,
            t.bytes() as f64 / 1e6,
            limit as f64 / 1e6,
            t.remedy
        );
    }
    Ok(())
}

/// The largest buffer `device` allocates, where it has such a limit (CubeCL devices).
pub fn device_limit(device: &burn::tensor::Device) -> Option<u64> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        crate::util::device::cube_client(device).map(|c| c.properties().memory.max_page_size)
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = device;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(shape: Vec<usize>, element_bytes: usize) -> WholeTensor {
        WholeTensor {
            what: "a tensor",
            shape,
            element_bytes,
            remedy: "a remedy",
        }
    }

    #[test]
    fn a_tensor_over_the_limit_is_named_with_its_size_and_remedy() {
        // The logits of 4 × 256 tokens over GPT-2's padded vocabulary in fp32: 206 MB, over
        // lavapipe's 128 MiB.
        let logits = tensor(vec![4, 256, 50304], 4);
        assert_eq!(logits.bytes(), 206_045_184);
        let lavapipe = 128 << 20;
        let err = check_against(&[tensor(vec![8], 4), logits.clone()], lavapipe)
            .expect_err("over the limit")
            .to_string();
        assert!(
            err.starts_with("a tensor ([4, 256, 50304], 206.0 MB)"),
            "{err}"
        );
        assert!(err.contains("(134.2 MB): a remedy"), "{err}");
        // Exactly at the limit fits.
        check_against(&[tensor(vec![lavapipe as usize / 2], 2)], lavapipe).expect("fits");
        check_against(&[logits], 206_045_184).expect("fits");
    }
}
