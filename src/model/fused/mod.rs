//! The fused CubeCL kernels of `ferrotron-kernels` inside burn (GPU builds only).
//!
//! Each file is one fused op whole: the kernels a backend runs for it (a `…Kernels` trait:
//! forward kernels that save what the backward needs, and the backward kernels), the
//! differentiable op (a burn backend extension, `…Ops`, with a hand-written `Backward` for
//! `Autodiff<B>` that calls the backward kernels), and the function the model calls.
//! Implemented for burn's CubeCL backend, so the same code serves CUDA, wgpu (Vulkan, Metal,
//! lavapipe) and the other CubeCL runtimes; other backends use the composed reference ops in
//! [`super::ops`].

mod activations;
mod attention_core;
mod attention_from_rows;
mod bias_gradient;
mod dropout;
mod flash_attention;
mod norms;
mod qkv_rows;
mod residual_join;
mod rotary;
mod softmax;

pub use activations::{bias_gelu, gelu, swiglu};
pub use attention_core::CoreKernels;
pub use attention_from_rows::{attention_from_qkv, RowRotation};
pub use bias_gradient::BiasGradKernels;
pub use dropout::{bias_dropout_add, dropout_slice};
pub use flash_attention::{attention_kernels_in_words, causal_attention, ChunkRows};
pub use norms::{layer_norm, rms_norm};
pub use rotary::rotary;
pub use softmax::causal_softmax;

use burn::tensor::Shape;
use burn_cubecl::tensor::CubeTensor;
use ferrotron_kernels::launch::{AttentionShape, DrawSlice, DropoutDraw};

/// The kernels' draw of a dropout `(key, probability)` taken now: elements whose bits are
/// below `p · 2³²` dropped, the others scaled by `1 / (1 − p)` (none: nothing dropped). The
/// key is split into the micro-batch's salt ([`crate::parallel::random::dropout_salt`]), which
/// reaches the kernels through device memory, and the rest, which the launch carries: the
/// same for every micro-batch at this point of the step, so a captured step replays with the
/// masks of the salt written before the replay.
///
/// The tensor it is applied to holds `slice` of the draw (all of it, a sequence-parallel
/// rank's chunk, a tensor-parallel rank's heads), so every layout drops what one process drops.
fn dropout_draw(dropout: Option<(u64, f64)>, slice: DrawSlice) -> Option<DropoutDraw> {
    dropout.map(|(key, p)| {
        let salt = crate::parallel::random::dropout_salt();
        let constant = key ^ salt.value;
        DropoutDraw {
            key_lo: constant as u32,
            key_hi: (constant >> 32) as u32,
            salt: salt.value,
            salt_slot: salt.slot,
            threshold: crate::parallel::random::dropout_threshold(p),
            scale: (1.0 / (1.0 - p)) as f32,
            slice,
        }
    })
}

/// Panics unless `other` is stored as `x` is (the kernels read both as one type).
fn same_dtype(what: &str, x: &CubeTensor, other: &CubeTensor) {
    assert_eq!(other.dtype, x.dtype, "{what} is not stored as the input is");
}

/// The kernels' view of `[b, heads, s, head_dim]`.
fn attention_shape(shape: &Shape) -> AttentionShape {
    let [b, heads, seq, head_dim] = shape.dims::<4>();
    AttentionShape {
        heads: b * heads,
        seq,
        head_dim,
    }
}
