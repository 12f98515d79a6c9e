//! One cuBLAS product as it is queued: the operands' layouts, the shape, and the call
//! (`cublasGemmStridedBatchedEx`, f32 accumulation, row-major through the transposes).

use std::ffi::c_void;

use burn::backend::TensorMetadata;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cudarc::cublas::{result, sys};

/// One product as cuBLAS runs it: its shape, the operands' layouts and every device address.
#[derive(Clone, Copy)]
pub(super) struct Product {
    pub(super) shape: GemmShape,
    pub(super) a: (Operand, u64),
    pub(super) b: (Operand, u64),
    pub(super) c: u64,
}

/// How cuBLAS reads one operand: the batch stride, the leading dimension, and whether it is
/// stored transposed (column-major) for the row-major product.
#[derive(Clone, Copy)]
pub(super) struct Operand {
    pub(super) batch_stride: i64,
    pub(super) leading: i32,
    pub(super) transposed: bool,
}

/// `t`'s layout as a batch of `[rows, cols]` matrices, if cuBLAS can read it as it is
/// (each matrix row- or column-major, the batch dimensions one uniform stride).
pub(super) fn operand(t: &CubeTensor) -> Option<Operand> {
    let dims = t.meta.shape().as_slice().to_vec();
    let strides: Vec<usize> = t.meta.strides().to_vec();
    // A storage-tiled tensor's physical dims are not its logical ones.
    if dims.as_slice() != TensorMetadata::shape(t).as_slice() {
        return None;
    }
    let d = dims.len();
    let (rows, cols) = (dims[d - 2], dims[d - 1]);
    let (sr, sc) = (strides[d - 2], strides[d - 1]);
    let (leading, transposed) = if (sc == 1 || cols == 1) && sr >= cols.max(1) {
        (sr, false)
    } else if (sr == 1 || rows == 1) && sc >= rows.max(1) {
        (sc, true)
    } else {
        return None;
    };
    // The batch dimensions must flatten to one stride (size-1 dimensions have any stride).
    let batched: Vec<usize> = (0..d - 2).filter(|&i| dims[i] > 1).collect();
    if batched
        .windows(2)
        .any(|w| strides[w[0]] != strides[w[1]] * dims[w[1]])
    {
        return None;
    }
    let batch_stride = batched.last().map_or(0, |&i| strides[i]);
    Some(Operand {
        batch_stride: batch_stride as i64,
        leading: i32::try_from(leading.max(1)).ok()?,
        transposed,
    })
}

pub(super) fn data_type(dtype: DType) -> Option<sys::cudaDataType> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        DType::F16 => Some(sys::cudaDataType::CUDA_R_16F),
        _ => None,
    }
}

/// A batch of row-major products `[m, k] · [k, n]` of one cuBLAS element type.
#[derive(Clone, Copy)]
pub(super) struct GemmShape {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) batch: usize,
    pub(super) elem: sys::cudaDataType,
}

/// Queues `c = a · b` (row-major, `c` contiguous) on `handle`'s stream.
///
/// # Safety
/// The addresses must hold the operands as `a` and `b` describe them and room for `c`, on the
/// handle's device, until the stream has run the product.
pub(super) unsafe fn gemm(
    handle: sys::cublasHandle_t,
    s: GemmShape,
    (a, a_address): (Operand, u64),
    (b, b_address): (Operand, u64),
    c_address: u64,
) -> Result<(), result::CublasError> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    let op = |transposed: bool| {
        if transposed {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: cuBLAS's first operand is b.
    result::gemm_strided_batched_ex(
        handle,
        op(b.transposed),
        op(a.transposed),
        s.n as i32,
        s.m as i32,
        s.k as i32,
        &alpha as *const f32 as *const c_void,
        b_address as *const c_void,
        s.elem,
        b.leading,
        b.batch_stride,
        a_address as *const c_void,
        s.elem,
        a.leading,
        a.batch_stride,
        &beta as *const f32 as *const c_void,
        c_address as *mut c_void,
        s.elem,
        s.n as i32,
        (s.m * s.n) as i64,
        s.batch as i32,
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
    )
}
