//! The rotary position embedding of queries or keys, fused: one element-wise kernel, whose
//! backward is the same kernel turning the gradient by the negative angle. The angles come
//! from f32 tables (computed in float64 on the host), whatever the tensor's dtype.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::{DType, FloatDType, Tensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::RotaryTables;

use super::attention_shape;
use crate::util::cube_tensor::{by_dtype, empty_like, packed};

/// The rotary-embedding kernel a backend runs.
pub trait RotaryKernels: Backend {
    /// `[b, heads, s, head_dim]` rotated by the angles of rows `offset..offset + s` of the
    /// f32 tables `cos`, `sin` (`[positions, rotary_dim / 2]`), the channels past
    /// `rotary_dim` copied; with `inverse`, rotated back (the backward).
    fn rotary_apply(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
        interleaved: bool,
        inverse: bool,
    ) -> FloatTensor<Self>;
}

/// The differentiable fused rotary embedding (a burn backend extension).
#[backend_extension(Autodiff, Cube)]
pub trait RotaryOps: Backend {
    /// Rotary embedding of `[b, heads, s, head_dim]` at table rows `offset..offset + s` of
    /// the f32 tables `cos`, `sin` (`[positions, rotary_dim / 2]`; not differentiated).
    fn fused_rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: u32,
        interleaved: bool,
    ) -> FloatTensor<Self>;
}

impl RotaryKernels for CubeBackend {
    fn rotary_apply(
        x: CubeTensor,
        cos: CubeTensor,
        sin: CubeTensor,
        offset: usize,
        interleaved: bool,
        inverse: bool,
    ) -> CubeTensor {
        let (x, cos, sin) = (packed(x), packed(cos), packed(sin));
        assert!(
            cos.dtype == DType::F32 && sin.dtype == DType::F32,
            "rotary tables are f32"
        );
        let [positions, pairs] = cos.shape().dims::<2>();
        assert_eq!(cos.shape(), sin.shape(), "rotary tables");
        let shape = x.shape();
        let y = empty_like(&x, shape.clone(), x.dtype);
        let tables = RotaryTables {
            cos: &cos.handle,
            sin: &sin.handle,
            positions,
            rotary_dim: 2 * pairs,
            interleaved,
        };
        by_dtype!(
            x.dtype,
            rotary_embedding,
            &x.client,
            &x.handle,
            &y.handle,
            attention_shape(&shape),
            tables,
            offset,
            inverse
        );
        y
    }
}

impl RotaryOps for CubeBackend {
    fn fused_rotary(
        x: CubeTensor,
        cos: CubeTensor,
        sin: CubeTensor,
        offset: u32,
        interleaved: bool,
    ) -> CubeTensor {
        Self::rotary_apply(x, cos, sin, offset as usize, interleaved, false)
    }
}

#[derive(Debug)]
struct RotaryBackward;

impl<B: RotaryKernels> Backward<B, 1> for RotaryBackward {
    /// The tables, the offset and the layout: the backward turns the gradient back.
    type State = (FloatTensor<B>, FloatTensor<B>, usize, bool);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            let (cos, sin, offset, interleaved) = ops.state;
            let dx = B::rotary_apply(grad, cos, sin, offset, interleaved, true);
            grads.register::<B>(parent.id, dx);
        }
    }
}

impl<B: RotaryKernels + RotaryOps, C: CheckpointStrategy> RotaryOps for Autodiff<B, C> {
    fn fused_rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: u32,
        interleaved: bool,
    ) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        // The tables are constants of the op: no gradient flows to them.
        let (cos, sin) = (cos.into_primitive(), sin.into_primitive());
        let offset = offset as usize;
        match RotaryBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::rotary_apply(x, cos.clone(), sin.clone(), offset, interleaved, false);
                prep.finish((cos, sin, offset, interleaved), y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::rotary_apply(x, cos, sin, offset, interleaved, false))
            }
        }
    }
}

/// The fused rotary embedding of `x` `[b, heads, s, head_dim]`: sequence position `i` turned
/// by the angles of row `offset + i` of `cos` and `sin` (`[positions, rotary_dim / 2]`, one
/// column per rotated pair, computed in f32 whatever `x`'s dtype), pairs `(2i, 2i + 1)` if
/// `interleaved`, else `(i, i + rotary_dim / 2)`; channels past `rotary_dim` pass through.
pub fn rotary(
    x: Tensor<4>,
    cos: Tensor<2>,
    sin: Tensor<2>,
    offset: usize,
    interleaved: bool,
) -> Tensor<4> {
    let [_, _, s, d] = x.dims();
    let [positions, pairs] = cos.dims();
    assert!(
        2 * pairs <= d && offset + s <= positions,
        "rotary tables [{positions}, {pairs}] for {s} positions from {offset} of heads {d} wide"
    );
    let (cos, sin) = (cos.cast(FloatDType::F32), sin.cast(FloatDType::F32));
    Tensor::from_dispatch(<Dispatch as RotaryOps>::fused_rotary(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        offset as u32,
        interleaved,
    ))
}
