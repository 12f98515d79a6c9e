//! Megatron's `--attention-backend` (`flash`, `fused`, `unfused`, `local`, `auto`), as
//! ferrotron's attention cores.
//!
//! In Megatron-Core the flag chooses Transformer Engine's kernel: FlashAttention (`flash`),
//! cuDNN's fused attention (`fused`), TE's composed attention (`unfused`) or Megatron's own
//! `DotProductAttention` (`local`); `auto`, the default, lets TE choose, which on a recent GPU
//! is flash or fused. What a user gets from those two, besides speed, is that the `[batch,
//! heads, seq, seq]` probabilities are never kept for the backward pass; that is most of the
//! difference in peak memory between a composed core and a fused one (GPT-2 345M at micro-batch
//! 4: 24 layers of `[4, 16, 1024, 1024]` bf16 probabilities).
//!
//! ferrotron's cores, and which flag value gets which:
//! - `flash`: the fused FlashAttention-2 kernels (what `--use-flash-attn` turns on), on CubeCL
//!   devices; the CPU backend keeps the composed core (the same math).
//! - `fused`: the composed core (its products on cuBLAS on CUDA) keeping only its inputs and
//!   forming its probabilities again in its backward pass: Megatron's selective recomputation,
//!   which is what it is ([`Recompute::Selective`]), bit for bit the losses of `unfused`.
//! - `unfused`, `local`: the composed core keeping its probabilities.
//! - `auto`: on CUDA in half precision, the core keeping only its inputs wherever it is the one
//!   op from the projection's rows (where that costs one product and one softmax kernel per
//!   layer more, inside the op), and `unfused` where it is not (query/key norms, an unfused
//!   rotary embedding: there selective recomputation would run the core again from outside, in
//!   three graphs per layer). Why on CUDA: on a GPU the recomputation costs almost no time and
//!   saves the probabilities' memory, bringing the peak to PyTorch's with SDPA (docs/gpu.md,
//!   "The attention backend"; benchmarks/results/2026-11-27-h200-device-order.md). Elsewhere `unfused`: memory is
//!   plentiful and the recomputation is not free (the CPU backend, lavapipe).

use std::str::FromStr;

use super::Recompute;

/// A value of `--attention-backend`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionBackend {
    /// Megatron's default: the best core for the device (see the module's doc).
    #[default]
    Auto,
    /// The fused FlashAttention-2 kernels.
    Flash,
    /// The composed core keeping only its inputs.
    Fused,
    /// The composed core keeping its probabilities.
    Unfused,
    /// Megatron's own core: here the same as `unfused`.
    Local,
}

impl FromStr for AttentionBackend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let all = [
            Self::Flash,
            Self::Fused,
            Self::Unfused,
            Self::Local,
            Self::Auto,
        ];
        all.into_iter().find(|b| b.name() == s).ok_or_else(|| {
            format!("--attention-backend {s}: expected flash, fused, unfused, local or auto")
        })
    }
}

/// What the attention of a run is, once the backend is resolved for its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionChoice {
    /// The fused FlashAttention-2 kernels (`GptConfig::flash_attention`).
    pub flash: bool,
    /// The core from the projection's rows keeps only q, k, v
    /// (`GptConfig::core_keeps_only_inputs`).
    pub core_keeps_only_inputs: bool,
    /// The run's recomputation: selective under `fused` where the flags asked for none (so
    /// that a core that is not the op from the rows keeps no probabilities either).
    pub recompute: Recompute,
}

impl AttentionBackend {
    /// The attention of a run with this backend, `--use-flash-attn` (Megatron's older spelling
    /// of `flash`), the recomputation the flags asked for, and whether the run is on CUDA in
    /// bf16 or fp16 (where `auto` keeps only the inputs of the cores from the rows). A full
    /// recomputation stays as it is: its layers keep no probabilities anyway.
    pub fn resolve(
        self,
        use_flash_attn: bool,
        recompute: Recompute,
        cuda_in_half_precision: bool,
    ) -> Result<AttentionChoice, String> {
        let backend = match (self, use_flash_attn) {
            (Self::Auto | Self::Flash, true) => Self::Flash,
            (other, true) => {
                return Err(format!(
                    "--use-flash-attn asks for the flash backend and --attention-backend for \
                     {}: give one of them",
                    other.name()
                ))
            }
            (other, false) => other,
        };
        let recompute = match (backend, recompute) {
            (Self::Fused, Recompute::None) => Recompute::Selective,
            (_, recompute) => recompute,
        };
        Ok(AttentionChoice {
            flash: backend == Self::Flash,
            core_keeps_only_inputs: backend == Self::Fused
                || (backend == Self::Auto && cuda_in_half_precision),
            recompute,
        })
    }

    /// The flag's value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Flash => "flash",
            Self::Fused => "fused",
            Self::Unfused => "unfused",
            Self::Local => "local",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (flash, the core keeping only its inputs, recomputation).
    fn resolved(
        flag: &str,
        flash_attn: bool,
        recompute: Recompute,
        cuda_half: bool,
    ) -> Result<(bool, bool, Recompute), String> {
        let choice = flag
            .parse::<AttentionBackend>()?
            .resolve(flash_attn, recompute, cuda_half)?;
        Ok((
            choice.flash,
            choice.core_keeps_only_inputs,
            choice.recompute,
        ))
    }

    #[test]
    fn each_backend_is_a_core_and_auto_keeps_no_probabilities_on_cuda_in_half_precision() {
        use Recompute::{Block, None as Kept, Selective, Uniform};
        for cuda_half in [false, true] {
            let r = |flag, flash_attn, recompute| resolved(flag, flash_attn, recompute, cuda_half);
            assert_eq!(r("flash", false, Kept), Ok((true, false, Kept)));
            assert_eq!(r("fused", false, Kept), Ok((false, true, Selective)));
            assert_eq!(r("unfused", false, Kept), Ok((false, false, Kept)));
            assert_eq!(r("local", false, Kept), Ok((false, false, Kept)));
            // --use-flash-attn is the flash backend, under auto or flash.
            assert_eq!(r("auto", true, Kept), Ok((true, false, Kept)));
            assert_eq!(r("flash", true, Kept), Ok((true, false, Kept)));
            // A full recomputation is left as the flags give it.
            assert_eq!(r("fused", false, Uniform(2)), Ok((false, true, Uniform(2))));
            assert_eq!(
                r("unfused", false, Selective),
                Ok((false, false, Selective))
            );
            // auto never has a core recomputed from outside.
            assert_eq!(r("auto", false, Block(1)), Ok((false, cuda_half, Block(1))));
            assert_eq!(r("auto", false, Kept), Ok((false, cuda_half, Kept)));
        }
        assert_eq!(AttentionBackend::default(), AttentionBackend::Auto);
    }

    #[test]
    fn unknown_values_and_contradicting_flags_are_refused() {
        let err = resolved("sdpa", false, Recompute::None, true).unwrap_err();
        assert!(
            err.contains("--attention-backend sdpa: expected flash, fused"),
            "{err}"
        );
        for other in ["fused", "unfused", "local"] {
            let err = resolved(other, true, Recompute::None, false).unwrap_err();
            assert!(
                err.contains("--use-flash-attn") && err.contains(other),
                "{err}"
            );
        }
    }
}
