//! Mixed precision as Megatron's `Float16OptimizerWithFloat16Params`: the model computes in
//! bf16 or fp16, while the optimizer keeps fp32 *main* weights (and fp32 Adam moments and
//! gradient sums). Each step updates the main weights and copies them, rounded, into the
//! half-precision model. The model itself knows nothing of this: its parameters merely have
//! a dtype, and the few operations that need fp32 (LayerNorm statistics, softmax, the
//! cross-entropy) upcast their inputs themselves.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{FloatDType, Tensor};

/// `--fp16`, `--bf16`, or neither.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Everything in fp32.
    #[default]
    Fp32,
    /// bf16 model, fp32 main weights; no loss scaling (bf16 has fp32's range).
    Bf16,
    /// fp16 model, fp32 main weights, dynamic loss scaling.
    Fp16,
}

impl Precision {
    /// From Megatron's flags (at most one of them).
    pub fn from_flags(fp16: bool, bf16: bool) -> Result<Self, String> {
        match (fp16, bf16) {
            (true, true) => Err("--fp16 and --bf16 exclude each other: give one".into()),
            (true, false) => Ok(Precision::Fp16),
            (false, true) => Ok(Precision::Bf16),
            (false, false) => Ok(Precision::Fp32),
        }
    }

    /// The dtype the model's parameters and activations have.
    pub fn dtype(self) -> FloatDType {
        match self {
            Precision::Fp32 => FloatDType::F32,
            Precision::Bf16 => FloatDType::BF16,
            Precision::Fp16 => FloatDType::F16,
        }
    }

    /// Megatron's flag for it (`fp32` for neither).
    pub fn flag(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// Bytes per model parameter or activation element.
    pub fn bytes(self) -> usize {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 | Precision::Fp16 => 2,
        }
    }

    /// Megatron's `params_dtype` log name.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "torch.float32",
            Precision::Bf16 => "torch.bfloat16",
            Precision::Fp16 => "torch.float16",
        }
    }

    /// The model a step computes with, from the main weights: the same module (sharing its
    /// storage) in fp32, a rounded copy in half precision. Parameter ids are kept, so the
    /// gradients of the copy are the gradients of the main weights.
    pub fn working_copy<M: Module>(self, main: &M) -> M {
        match self {
            Precision::Fp32 => main.clone(),
            _ => cast_parameters(main.clone(), self.dtype()),
        }
    }
}

/// Every float parameter of `module` cast to `dtype`, keeping its id and, on an autodiff
/// device, its being a leaf that requires a gradient.
pub fn cast_parameters<M: Module>(module: M, dtype: FloatDType) -> M {
    struct Cast(FloatDType);
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, value, mapper) = param.consume();
            let value = if value.is_autodiff() {
                value.inner().cast(self.0).autodiff().require_grad()
            } else {
                value.cast(self.0)
            };
            Param::from_mapped_value(id, value, mapper)
        }
    }
    module.map(&mut Cast(dtype))
}
