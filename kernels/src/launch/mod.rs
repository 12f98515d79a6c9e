//! Host-side launchers: cube shapes and argument plumbing for each kernel, on contiguous
//! buffers of a CubeCL [`Client`] (any runtime), one file per family of kernels. Accumulation
//! is always f32.

use cubecl::prelude::*;
use cubecl::server::Handle;

mod activations;
mod attention;
mod attention_mma;
mod columns;
mod dropout;
mod embedding;
mod heads;
mod loss;
mod norms;
mod optimizer;
mod rotary;
mod salt;
mod softmax;
mod stream_order;

pub use crate::rows::RowLaunch;
pub use activations::*;
pub use attention::*;
pub use attention_mma::*;
pub use columns::*;
pub use dropout::*;
pub use embedding::*;
pub use heads::*;
pub use loss::*;
pub use norms::*;
pub use optimizer::*;
pub use rotary::*;
pub use salt::{dropout_salt_buffer, set_dropout_salt};
pub use softmax::*;
pub use stream_order::*;

fn arg(handle: &Handle, len: usize) -> BufferArg {
    // SAFETY: every launcher sizes its buffers from the same shape it passes to the kernel,
    // and the kernels index within `len`.
    unsafe { BufferArg::from_raw_parts(handle.clone(), len) }
}

/// Element-wise launches index with 32 bits.
fn check_elements(len: usize, what: &str) {
    assert!(len <= u32::MAX as usize, "{what} of more than 2³² elements");
}

/// The vector size of an element-wise kernel over rows of `hidden` elements of `F` (a bias's
/// rows, or the whole tensor): the widest vector `client` loads in one instruction that
/// divides `hidden`, or 1 where a benchmark turned vectors off ([`crate::rows::vectors_on`]).
fn element_vector_size<F: CubeElement>(client: &Client, hidden: usize) -> usize {
    if crate::rows::vectors_on() {
        crate::rows::widest_vector::<F>(client, hidden)
    } else {
        1
    }
}

/// The greatest common divisor of `a` and `b` (`gcd(0, b) = b`).
fn gcd(a: usize, b: usize) -> usize {
    if a == 0 {
        b
    } else {
        gcd(b % a, a)
    }
}

/// A bias broadcast over rows: the buffer and the row length (`hidden` elements).
pub type RowBias<'a> = Option<(&'a Handle, usize)>;

/// The bias argument of an element-wise kernel over `len` elements: the bias, or (never read)
/// the input in its place; and the row length (the whole tensor without a bias).
fn bias_arg(input: &Handle, bias: RowBias<'_>, len: usize) -> (BufferArg, u32) {
    match bias {
        Some((b, hidden)) => {
            assert!(
                hidden > 0 && len.is_multiple_of(hidden),
                "{len} elements in rows of {hidden}"
            );
            (arg(b, hidden), hidden as u32)
        }
        None => (arg(input, 1), len as u32),
    }
}

/// Half-precision storage must keep compiling: every launcher instantiated for f16 and bf16
/// (whether a device runs them depends on its shader features).
#[allow(dead_code)]
fn half_precision_instantiates(client: &Client, h: &Handle) {
    fn all<F: Float + CubeElement>(client: &Client, h: &Handle) {
        let shape = ScoresShape {
            batch: 1,
            heads: 1,
            sq: 1,
            sk: 1,
        };
        let rows = RowLaunch::for_client(client);
        softmax_forward::<F>(client, rows, h, SoftmaxMask::Causal, h, None, shape, 1.0);
        causal_softmax_dropped::<F>(client, rows, h, h, NO_DRAW, shape, 1.0);
        softmax_backward::<F>(client, rows, h, h, h, shape, true, 1.0, None, None);
        softmax_backward_from_scores::<F>(client, rows, h, h, h, h, shape, 1.0, None);
        layer_norm_forward::<F>(client, rows, h, h, h, h, h, h, 1, 1, 1e-5);
        layer_norm_backward::<F>(client, rows, h, h, h, h, h, Some(h), h, h, h, 1, 1);
        rms_norm_forward::<F>(client, rows, h, h, h, h, 1, 1, 1e-5);
        rms_norm_backward::<F>(client, rows, h, h, h, h, Some(h), h, h, 1, 1);
        swiglu_forward::<F>(client, h, h, h, 1);
        swiglu_backward::<F>(client, h, h, h, [h, h], 1);
        for tanh in [false, true] {
            gelu_forward::<F>(client, h, None, h, 1, tanh);
            gelu_backward::<F>(client, h, None, h, h, 1, tanh);
        }
        let heads = AttentionShape {
            heads: 1,
            seq: 1,
            head_dim: 1,
        };
        let (q, o) = (AttentionInputs::causal(h, h, h), h);
        let tiles = AttentionLaunch::for_client(client, 1);
        flash_attention_forward::<F>(client, tiles, q, o, h, heads, 1.0, None);
        flash_attention_backward::<F>(client, tiles, q, o, h, h, [h, h, h], h, heads, 1.0, None);
        let tables = RotaryTables {
            cos: h,
            sin: h,
            positions: 1,
            rotary_dim: 2,
            interleaved: false,
        };
        let rotary_shape = AttentionShape {
            head_dim: 2,
            ..heads
        };
        rotary_embedding::<F>(client, h, h, rotary_shape, tables, 0, false);
    }
    all::<half::f16>(client, h);
    all::<half::bf16>(client, h);
}
