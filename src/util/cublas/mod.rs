//! Matrix products of CUDA tensors through NVIDIA's cuBLAS (CUDA builds only).
//!
//! Why: on GPT-2 345M's shapes CubeCL's autotuned matmuls reach a fraction of cuBLAS's
//! throughput on the same GPU (benchmarks/results/2026-11-26-h200-gpu-profile.md), and
//! matmuls were the largest part of a training step's GPU time
//! (benchmarks/results/2026-11-26-h200-flat-adam.md). cuBLAS is opened at run time (as NCCL
//! is): a machine without it falls back to CubeCL's kernels with one warning.
//!
//! Here: which products go to cuBLAS and how each is laid out for it (a view cuBLAS can
//! read as it is, else a contiguous copy); [`gemm`]: the call itself; [`ordering`]: how
//! cuBLAS's stream is ordered against CubeCL's, and captured steps' products.

mod gemm;
mod ordering;

pub use ordering::{capturable, recording, settle, RecordedWindows};

use std::sync::OnceLock;

use burn::backend::TensorMetadata;
use burn::tensor::{DType, Shape};
use burn_cubecl::cubecl::device::Device as CubeDevice;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cudarc::cublas::sys;

use crate::util::product_plan::ProductKernels;
use gemm::{data_type, operand, GemmShape, Operand};
use ordering::window;

/// burn's CUDA runtime's server: its storage hands out raw device pointers.
type CudaServer =
    <burn_cubecl::cubecl::cuda::CudaRuntime as burn_cubecl::cubecl::__private::Runtime>::Server;

/// Whether cuBLAS takes this process's half-precision products: the plan asks for it
/// ([`crate::util::product_plan::product_plan`]) and the library is there.
fn cublas_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        if crate::util::product_plan::product_plan().kernels == ProductKernels::Cubecl {
            return false;
        }
        // SAFETY: only tries to open the shared library.
        let present = unsafe { sys::is_culib_present() };
        if !present {
            eprintln!(
                "warning: cuBLAS (libcublas) was not found on the library path; matrix \
                 products run on CubeCL's kernels"
            );
        }
        present
    })
}

/// The environment variable `name` read as one of `choices` (its spelling, what it asks for):
/// `default` where it is unset or empty, and, with a warning saying what that means
/// (`default_means`), where it is none of them.
fn env_choice<T: Copy>(name: &str, choices: &[(&str, T)], default: T, default_means: &str) -> T {
    let value = std::env::var(name).unwrap_or_default();
    if value.is_empty() {
        return default;
    }
    match choices.iter().find(|(spelling, _)| *spelling == value) {
        Some(&(_, chosen)) => chosen,
        None => {
            let spellings: Vec<_> = choices.iter().map(|(s, _)| format!("`{s}`")).collect();
            eprintln!(
                "warning: {name}={value} is none of {}; {default_means}",
                spellings.join(", ")
            );
            default
        }
    }
}

/// The environment variable `name` read as a whole number of at least 1: `default` where it
/// is unset or empty, and, with a warning saying what that means (`default_means`), where it
/// is anything else.
fn env_count(name: &str, default: usize, default_means: &str) -> usize {
    let value = std::env::var(name).unwrap_or_default();
    if value.is_empty() {
        return default;
    }
    match value.parse::<usize>() {
        Ok(count) if count >= 1 => count,
        _ => {
            eprintln!(
                "warning: {name}={value} is not a whole number of at least 1; {default_means}"
            );
            default
        }
    }
}

/// Whether products of CUDA tensors of `dtype` go to cuBLAS.
pub fn takes(dtype: DType) -> bool {
    cublas_on() && matches!(dtype, DType::BF16 | DType::F16)
}

/// The CUDA GPU index of `t`, if it is a tensor of burn's CUDA runtime.
fn cuda_index(t: &CubeTensor) -> Option<usize> {
    match &t.device {
        CubeDevice::Cuda(device) => Some(device.index),
        _ => None,
    }
}

/// `a · b` for `a` `[..., m, k]` and `b` `[..., k, n]` (the same batch dimensions) on
/// cuBLAS, accumulating in f32 (no TF32: fp32 runs keep fp32 products); `None` where it
/// does not apply (not a CUDA tensor, a dtype [`takes`] refuses, broadcast batches, an empty
/// product, cuBLAS unavailable), and the caller runs CubeCL's matmul instead.
pub fn matmul(a: &CubeTensor, b: &CubeTensor) -> Option<CubeTensor> {
    let [c] = window([plan(a, b)?])?;
    Some(c)
}

/// `[a₁ · b₁, …, a_N · b_N]` as [`matmul`] computes each, in one ordering window: CubeCL's
/// work is waited for once before all of them and cuBLAS's once after (where each product
/// alone costs two host waits, or two ordering kernels). For a backward pass's gradient
/// products, which read the same output gradient and none of each other's results. `None`
/// where any product does not apply.
pub fn matmul_independent<const N: usize>(
    products: [(&CubeTensor, &CubeTensor); N],
) -> Option<[CubeTensor; N]> {
    let planned: Vec<Planned> = products
        .iter()
        .map(|(a, b)| plan(a, b))
        .collect::<Option<_>>()?;
    let first = planned.first()?;
    let shared = planned
        .iter()
        .all(|p| p.a.dtype == first.a.dtype && cuda_index(&p.a) == cuda_index(&first.a));
    if shared {
        return window::<N>(planned.try_into().ok()?);
    }
    let mut outs = Vec::with_capacity(N);
    for product in planned {
        let [c] = window([product])?;
        outs.push(c);
    }
    outs.try_into().ok()
}

/// One product checked and laid out for cuBLAS: the operands as it reads them and the
/// result's buffer.
struct Planned {
    a: CubeTensor,
    oa: Operand,
    b: CubeTensor,
    ob: Operand,
    out: CubeTensor,
    shape: GemmShape,
}

/// `a · b` checked for cuBLAS (see [`matmul`]) and its result allocated; `None` where
/// cuBLAS does not apply.
fn plan(a: &CubeTensor, b: &CubeTensor) -> Option<Planned> {
    cuda_index(a)?;
    let dtype = a.dtype;
    if !takes(dtype) {
        return None;
    }
    let elem = data_type(dtype)?;
    let (ad, bd) = (TensorMetadata::shape(a), TensorMetadata::shape(b));
    let (ad, bd) = (ad.as_slice(), bd.as_slice());
    let d = ad.len();
    if b.dtype != dtype || bd.len() != d || d < 2 || ad[..d - 2] != bd[..d - 2] {
        return None;
    }
    let (m, k, n) = (ad[d - 2], ad[d - 1], bd[d - 1]);
    let batch: usize = ad[..d - 2].iter().product();
    // cuBLAS takes the sizes as 32-bit ints.
    let fits = [m, k, n, batch].iter().all(|&x| i32::try_from(x).is_ok());
    if bd[d - 2] != k || m == 0 || n == 0 || k == 0 || !fits {
        return None;
    }
    let (a, oa) = readable(a)?;
    let (b, ob) = readable(b)?;
    let mut out_dims = ad.to_vec();
    out_dims[d - 1] = n;
    let out = empty_device_contiguous_dtype(
        a.client.clone(),
        a.device.clone(),
        Shape::from(out_dims),
        dtype,
    );
    let shape = GemmShape {
        m,
        n,
        k,
        batch,
        elem,
    };
    Some(Planned {
        a,
        oa,
        b,
        ob,
        out,
        shape,
    })
}

/// `t` itself when cuBLAS can read its layout, else a contiguous copy, with that layout.
fn readable(t: &CubeTensor) -> Option<(CubeTensor, Operand)> {
    match operand(t) {
        Some(layout) => Some((t.clone(), layout)),
        None => {
            let copy = into_contiguous(t.clone());
            let layout = operand(&copy)?;
            Some((copy, layout))
        }
    }
}
