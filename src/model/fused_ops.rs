//! The fused CubeCL kernels of `ferrotron-kernels` inside burn (GPU builds only).
//!
//! [`FusedKernels`] is what a backend must run (forward kernels that save what the backward
//! needs, and the backward kernels); [`FusedOps`] is the burn backend extension the model
//! calls, with a hand-written `Backward` for `Autodiff<B>` that calls the backward kernels.
//! Implemented for burn's CubeCL backend, so the same code serves CUDA, wgpu (Vulkan, Metal,
//! lavapipe) and the other CubeCL runtimes; other backends use the composed reference ops in
//! [`super::ops`].

use crate::util::cube_tensor::{by_dtype, empty_like, packed, rows_cols};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::{DType, FloatDType, Shape, Tensor};
use burn_cubecl::cubecl::server::Handle;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::{
    AttentionInputs, AttentionLaunch, AttentionShape, DrawSlice, DropoutDraw, QkvLayout,
    RotaryTables, RowLaunch, ScoresShape, SoftmaxMask,
};

use super::fused_attention::{self, CoreKernels, MixedAttentionBackward, Rotation};
use super::fused_bias_dropout_add;
use crate::util::matmul::extension::Gemm;

/// The kernels a backend runs for the fused ops.
pub trait FusedKernels: Backend {
    /// `[y, dropout(y)]` for `y = softmax(scale · x)` over the last dimension of `[b, heads,
    /// sq, sk]`, keys after the query masked, from one kernel: the dropout by `draw` over the
    /// whole tensor (what [`Self::dropout_apply`] makes of `y`); without a draw both are `y`.
    fn causal_softmax_forward(
        x: FloatTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> [FloatTensor<Self>; 2];
    /// `scale · y ⊙ (dy − Σ dy ⊙ y)` per row of the last dimension; with a draw, `dy` is the
    /// gradient of [`Self::causal_softmax_forward`]'s dropped output, taken back through the
    /// dropout in the same kernel.
    fn softmax_backward(
        y: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self>;
    /// LayerNorm over the last dimension: output, and the per-row mean and 1/σ.
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// LayerNorm backward: dx, dγ, dβ.
    fn layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// RMSNorm over the last dimension: output, and the per-row 1/rms (f32).
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// RMSNorm backward: dx, dγ.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// GELU, element-wise (the tanh approximation with `tanh`).
    fn fused_gelu_forward(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        tanh: bool,
    ) -> FloatTensor<Self>;
    /// GELU backward: dx from the forward's input and dy (the exact derivative of the form
    /// computed; burn's default `gelu_backward` is the tanh form's for both).
    fn fused_gelu_backward(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        tanh: bool,
    ) -> FloatTensor<Self>;
    /// `silu(gate) ⊙ up`, element-wise.
    fn swiglu_forward(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
    /// SwiGLU backward: d_gate, d_up.
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
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
    /// `x ⊙ mask` of the dropout draw `draw`, `x` holding `slice` of it (forward; backward
    /// on the gradient).
    fn dropout_apply(
        x: FloatTensor<Self>,
        draw: DropoutDraw,
        slice: DrawSlice,
    ) -> FloatTensor<Self>;
    /// Causal attention of `[b, heads, s, head_dim]` queries, keys and values, dropout
    /// inside: the output, and the per-row log-sum-exp of the scores (f32, `[b · heads · s]`).
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
        dropout: Option<DropoutDraw>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// The attention's backward: dq, dk, dv from the forward's inputs, output and
    /// log-sum-exp, the output's gradient and the same dropout draw.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        output: FloatTensor<Self>,
        logsumexp: FloatTensor<Self>,
        grad_output: FloatTensor<Self>,
        scale: f32,
        dropout: Option<DropoutDraw>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// Queries, keys and values `[b, heads, s, head_dim]` (keys and values repeated for each
    /// query head of their group) from the fused QKV projection's rows `[b, s, width]`.
    fn qkv_split(mixed: FloatTensor<Self>, layout: QkvLayout) -> [FloatTensor<Self>; 3];
    /// The rows' gradient from the gradients of [`Self::qkv_split`]'s three outputs.
    fn qkv_merge(grads: [FloatTensor<Self>; 3], layout: QkvLayout) -> FloatTensor<Self>;
    /// `x` stored contiguously, row-major (a copy only if it is not).
    fn contiguous(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `residual + dropout(y + bias)` (Megatron's bias-dropout-add), the bias broadcast over
    /// the rows of the last dimension; `y` holds `slice` of the draw.
    fn bias_dropout_add_apply(
        residual: FloatTensor<Self>,
        y: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        draw: Option<DropoutDraw>,
        slice: DrawSlice,
    ) -> FloatTensor<Self>;
}

/// The differentiable fused ops (a burn backend extension).
#[backend_extension(Autodiff, Cube)]
pub trait FusedOps: Backend {
    /// Megatron's scaled upper-triangular masked softmax.
    fn fused_causal_softmax(x: FloatTensor<Self>, scale: f32) -> FloatTensor<Self>;
    /// LayerNorm over the last dimension.
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self>;
    /// RMSNorm over the last dimension.
    fn fused_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self>;
    /// GELU: exact, or the tanh approximation with `tanh` (`--openai-gelu`).
    fn fused_gelu(x: FloatTensor<Self>, tanh: bool) -> FloatTensor<Self>;
    /// GELU of `x + bias`, the bias over the last dimension (Megatron's bias-GELU fusion).
    fn fused_bias_gelu(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        tanh: bool,
    ) -> FloatTensor<Self>;
    /// SwiGLU's `silu(gate) ⊙ up`.
    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Rotary embedding of `[b, heads, s, head_dim]` at table rows `offset..offset + s` of
    /// the f32 tables `cos`, `sin` (`[positions, rotary_dim / 2]`; not differentiated).
    fn fused_rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: u32,
        interleaved: bool,
    ) -> FloatTensor<Self>;
    /// Dropout with the mask of the draw keyed `(key_lo, key_hi)`: elements whose bits are
    /// below `threshold` dropped, the others multiplied by `scale`; `x` holds the slice
    /// `(own, row, first)` of the draw ([`DrawSlice`]).
    #[allow(clippy::too_many_arguments)]
    fn fused_dropout(
        x: FloatTensor<Self>,
        key_lo: u32,
        key_hi: u32,
        threshold: u32,
        scale: f32,
        own: u32,
        row: u32,
        first: u32,
    ) -> FloatTensor<Self>;
    /// Causal attention `dropout(softmax(scale · q kᵀ)) v` without the `[s, s]` scores
    /// (FlashAttention), the probabilities dropped by `draw` (none: nothing dropped).
    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self>;
    /// `residual + dropout(y + bias)`, the bias over the last dimension, `y` holding `slice`
    /// of the draw (none: nothing dropped).
    fn fused_bias_dropout_add(
        residual: FloatTensor<Self>,
        y: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        draw: Option<DropoutDraw>,
        slice: DrawSlice,
    ) -> FloatTensor<Self>;
    /// `residual + dropout(y)` (a layer without biases).
    fn fused_dropout_add(
        residual: FloatTensor<Self>,
        y: FloatTensor<Self>,
        draw: Option<DropoutDraw>,
        slice: DrawSlice,
    ) -> FloatTensor<Self>;
    /// The attention core from the fused QKV projection's rows `[b, s, groups · (per_group
    /// + 2) · head_dim]` to the context `[b, s, groups · per_group · head_dim]`: split,
    /// causal attention by `kernels`, heads merged; dropout as
    /// [`Self::fused_causal_attention`]'s.
    fn fused_attention_from_qkv(
        mixed: FloatTensor<Self>,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> FloatTensor<Self>;
    /// [`Self::fused_attention_from_qkv`] with the queries and keys rotated after the split
    /// by the angle tables `cos`, `sin` (f32, `[seq, rotary_dim / 2]`, positions from 0), as
    /// [`Self::fused_rotary`] with `interleaved`.
    #[allow(clippy::too_many_arguments)]
    fn fused_rotary_attention_from_qkv(
        mixed: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        interleaved: bool,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> FloatTensor<Self>;
}

/// The kernels' draw of a dropout `(key, probability)`: elements whose bits are below
/// `p · 2³²` dropped, the others scaled by `1 / (1 − p)` (none: nothing dropped).
pub(super) fn dropout_draw(dropout: Option<(u64, f64)>) -> Option<DropoutDraw> {
    dropout.map(|(key, p)| DropoutDraw {
        key_lo: key as u32,
        key_hi: (key >> 32) as u32,
        threshold: crate::parallel::random::dropout_threshold(p),
        scale: (1.0 / (1.0 - p)) as f32,
    })
}

/// The scores shape of a `[b, heads, sq, sk]` tensor.
fn scores_shape(shape: &Shape) -> ScoresShape {
    let [batch, heads, sq, sk] = shape.dims::<4>();
    ScoresShape {
        batch,
        heads,
        sq,
        sk,
    }
}

/// Panics unless `other` is stored as `x` is (the kernels read both as one type).
fn same_dtype(what: &str, x: &CubeTensor, other: &CubeTensor) {
    assert_eq!(other.dtype, x.dtype, "{what} is not stored as the input is");
}

impl FusedKernels for CubeBackend {
    fn causal_softmax_forward(
        x: CubeTensor,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> [CubeTensor; 2] {
        let x = packed(x);
        let shape = x.shape();
        let scores = scores_shape(&shape);
        let y = empty_like(&x, shape.clone(), x.dtype);
        let dropped = draw.map(|draw| (draw, empty_like(&x, shape, x.dtype)));
        by_dtype!(
            x.dtype,
            softmax_forward,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            SoftmaxMask::Causal,
            &y.handle,
            dropped.as_ref().map(|(draw, d)| (*draw, &d.handle)),
            scores,
            scale
        );
        let dropped = dropped.map_or_else(|| y.clone(), |(_, d)| d);
        [y, dropped]
    }

    fn softmax_backward(
        y: CubeTensor,
        dy: CubeTensor,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> CubeTensor {
        let (y, dy) = (packed(y), packed(dy));
        same_dtype("the softmax output's gradient", &y, &dy);
        let shape = y.shape();
        let (rows, cols) = rows_cols(&shape);
        let dx = empty_like(&y, shape, y.dtype);
        by_dtype!(
            y.dtype,
            softmax_backward,
            &y.client,
            RowLaunch::for_client(&y.client),
            &y.handle,
            &dy.handle,
            &dx.handle,
            rows,
            cols,
            scale,
            draw
        );
        dx
    }

    fn layer_norm_forward(
        x: CubeTensor,
        gamma: CubeTensor,
        beta: CubeTensor,
        epsilon: f32,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let (x, gamma, beta) = (packed(x), packed(gamma), packed(beta));
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let y = empty_like(&x, shape, x.dtype);
        let mean = empty_like(&x, Shape::new([rows]), DType::F32);
        let rstd = empty_like(&x, Shape::new([rows]), DType::F32);
        by_dtype!(
            x.dtype,
            layer_norm_forward,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            &gamma.handle,
            &beta.handle,
            &y.handle,
            &mean.handle,
            &rstd.handle,
            rows,
            cols,
            epsilon
        );
        (y, mean, rstd)
    }

    fn layer_norm_backward(
        x: CubeTensor,
        gamma: CubeTensor,
        dy: CubeTensor,
        mean: CubeTensor,
        rstd: CubeTensor,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let (x, gamma, dy) = (packed(x), packed(gamma), packed(dy));
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let dx = empty_like(&x, shape, x.dtype);
        let dgamma = empty_like(&x, Shape::new([cols]), x.dtype);
        let dbeta = empty_like(&x, Shape::new([cols]), x.dtype);
        by_dtype!(
            x.dtype,
            layer_norm_backward,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            &gamma.handle,
            &dy.handle,
            &mean.handle,
            &rstd.handle,
            &dx.handle,
            &dgamma.handle,
            &dbeta.handle,
            rows,
            cols
        );
        (dx, dgamma, dbeta)
    }

    fn rms_norm_forward(
        x: CubeTensor,
        gamma: CubeTensor,
        epsilon: f32,
    ) -> (CubeTensor, CubeTensor) {
        let (x, gamma) = (packed(x), packed(gamma));
        same_dtype("RMSNorm's γ", &x, &gamma);
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let y = empty_like(&x, shape, x.dtype);
        let rstd = empty_like(&x, Shape::new([rows]), DType::F32);
        by_dtype!(
            x.dtype,
            rms_norm_forward,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            &gamma.handle,
            &y.handle,
            &rstd.handle,
            rows,
            cols,
            epsilon
        );
        (y, rstd)
    }

    fn rms_norm_backward(
        x: CubeTensor,
        gamma: CubeTensor,
        dy: CubeTensor,
        rstd: CubeTensor,
    ) -> (CubeTensor, CubeTensor) {
        let (x, gamma, dy) = (packed(x), packed(gamma), packed(dy));
        same_dtype("RMSNorm's output gradient", &x, &dy);
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let dx = empty_like(&x, shape, x.dtype);
        let dgamma = empty_like(&x, Shape::new([cols]), x.dtype);
        by_dtype!(
            x.dtype,
            rms_norm_backward,
            &x.client,
            RowLaunch::for_client(&x.client),
            &x.handle,
            &gamma.handle,
            &dy.handle,
            &rstd.handle,
            &dx.handle,
            &dgamma.handle,
            rows,
            cols
        );
        (dx, dgamma)
    }

    fn fused_gelu_forward(x: CubeTensor, bias: Option<CubeTensor>, tanh: bool) -> CubeTensor {
        let (x, bias) = (packed(x), bias.map(packed));
        let shape = x.shape();
        let len = shape.num_elements();
        let row_bias = row_bias(&x, bias.as_ref());
        let y = empty_like(&x, shape, x.dtype);
        by_dtype!(
            x.dtype,
            gelu_forward,
            &x.client,
            &x.handle,
            row_bias,
            &y.handle,
            len,
            tanh
        );
        y
    }

    fn fused_gelu_backward(
        x: CubeTensor,
        bias: Option<CubeTensor>,
        dy: CubeTensor,
        tanh: bool,
    ) -> CubeTensor {
        let (x, dy, bias) = (packed(x), packed(dy), bias.map(packed));
        same_dtype("GELU's output gradient", &x, &dy);
        let shape = x.shape();
        assert_eq!(shape, dy.shape(), "GELU's input and output gradient");
        let len = shape.num_elements();
        let row_bias = row_bias(&x, bias.as_ref());
        let dx = empty_like(&x, shape, x.dtype);
        by_dtype!(
            x.dtype,
            gelu_backward,
            &x.client,
            &x.handle,
            row_bias,
            &dy.handle,
            &dx.handle,
            len,
            tanh
        );
        dx
    }

    fn swiglu_forward(gate: CubeTensor, up: CubeTensor) -> CubeTensor {
        let (gate, up) = (packed(gate), packed(up));
        same_dtype("SwiGLU's up", &gate, &up);
        let shape = gate.shape();
        assert_eq!(shape, up.shape(), "SwiGLU's gate and up");
        let len = shape.num_elements();
        let y = empty_like(&gate, shape, gate.dtype);
        by_dtype!(
            gate.dtype,
            swiglu_forward,
            &gate.client,
            &gate.handle,
            &up.handle,
            &y.handle,
            len
        );
        y
    }

    fn swiglu_backward(
        gate: CubeTensor,
        up: CubeTensor,
        dy: CubeTensor,
    ) -> (CubeTensor, CubeTensor) {
        let (gate, up, dy) = (packed(gate), packed(up), packed(dy));
        same_dtype("SwiGLU's output gradient", &gate, &dy);
        let shape = gate.shape();
        let len = shape.num_elements();
        let [dgate, dup] = [0; 2].map(|_| empty_like(&gate, shape.clone(), gate.dtype));
        by_dtype!(
            gate.dtype,
            swiglu_backward,
            &gate.client,
            &gate.handle,
            &up.handle,
            &dy.handle,
            [&dgate.handle, &dup.handle],
            len
        );
        (dgate, dup)
    }

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

    fn dropout_apply(x: CubeTensor, draw: DropoutDraw, slice: DrawSlice) -> CubeTensor {
        let x = packed(x);
        let shape = x.shape();
        let len = shape.num_elements();
        let y = empty_like(&x, shape, x.dtype);
        by_dtype!(
            x.dtype,
            dropout_slice,
            &x.client,
            &x.handle,
            &y.handle,
            len,
            draw,
            slice
        );
        y
    }

    fn flash_attention_forward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        scale: f32,
        dropout: Option<DropoutDraw>,
    ) -> (CubeTensor, CubeTensor) {
        let (q, k, v) = (packed(q), packed(k), packed(v));
        let shape = q.shape();
        let attention = attention_shape(&shape);
        let output = empty_like(&q, shape, q.dtype);
        let logsumexp = empty_like(&q, Shape::new([attention.rows()]), DType::F32);
        let inputs = AttentionInputs {
            query: &q.handle,
            key: &k.handle,
            value: &v.handle,
        };
        by_dtype!(
            q.dtype,
            flash_attention_forward,
            &q.client,
            AttentionLaunch::for_client(&q.client, attention.head_dim),
            inputs,
            &output.handle,
            &logsumexp.handle,
            attention,
            scale,
            dropout
        );
        (output, logsumexp)
    }

    fn flash_attention_backward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        output: CubeTensor,
        logsumexp: CubeTensor,
        grad_output: CubeTensor,
        scale: f32,
        dropout: Option<DropoutDraw>,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let (q, k, v) = (packed(q), packed(k), packed(v));
        let (output, grad_output) = (packed(output), packed(grad_output));
        let shape = q.shape();
        let attention = attention_shape(&shape);
        let [dq, dk, dv] = [0; 3].map(|_| empty_like(&q, shape.clone(), q.dtype));
        let delta = empty_like(&q, Shape::new([attention.rows()]), DType::F32);
        let inputs = AttentionInputs {
            query: &q.handle,
            key: &k.handle,
            value: &v.handle,
        };
        by_dtype!(
            q.dtype,
            flash_attention_backward,
            &q.client,
            AttentionLaunch::for_client(&q.client, attention.head_dim),
            inputs,
            &output.handle,
            &grad_output.handle,
            &logsumexp.handle,
            [&dq.handle, &dk.handle, &dv.handle],
            &delta.handle,
            attention,
            scale,
            dropout
        );
        (dq, dk, dv)
    }

    fn qkv_split(mixed: CubeTensor, layout: QkvLayout) -> [CubeTensor; 3] {
        let mixed = packed(mixed);
        let shape = Shape::new([layout.batch, layout.heads(), layout.seq, layout.head_dim]);
        let parts = [0; 3].map(|_| empty_like(&mixed, shape.clone(), mixed.dtype));
        by_dtype!(
            mixed.dtype,
            qkv_split,
            &mixed.client,
            &mixed.handle,
            [&parts[0].handle, &parts[1].handle, &parts[2].handle],
            layout
        );
        parts
    }

    fn qkv_merge(grads: [CubeTensor; 3], layout: QkvLayout) -> CubeTensor {
        let [dq, dk, dv] = grads.map(packed);
        same_dtype("the key gradient", &dq, &dk);
        same_dtype("the value gradient", &dq, &dv);
        let width = layout.groups * (layout.per_group + 2) * layout.head_dim;
        let shape = Shape::new([layout.batch, layout.seq, width]);
        let merged = empty_like(&dq, shape, dq.dtype);
        by_dtype!(
            dq.dtype,
            qkv_merge,
            &dq.client,
            [&dq.handle, &dk.handle, &dv.handle],
            &merged.handle,
            layout
        );
        merged
    }

    fn contiguous(x: CubeTensor) -> CubeTensor {
        packed(x)
    }

    fn bias_dropout_add_apply(
        residual: CubeTensor,
        y: CubeTensor,
        bias: Option<CubeTensor>,
        draw: Option<DropoutDraw>,
        slice: DrawSlice,
    ) -> CubeTensor {
        let (residual, y, bias) = (packed(residual), packed(y), bias.map(packed));
        same_dtype("the residual", &y, &residual);
        if let Some(bias) = &bias {
            same_dtype("the bias", &y, bias);
        }
        let shape = y.shape();
        let (len, hidden) = (shape.num_elements(), shape[shape.num_dims() - 1]);
        let output = empty_like(&y, shape, y.dtype);
        by_dtype!(
            y.dtype,
            bias_dropout_add,
            &y.client,
            [&residual.handle, &y.handle],
            bias.as_ref().map(|b| &b.handle),
            &output.handle,
            len,
            hidden,
            draw,
            slice
        );
        output
    }
}

/// The gradient of a bias added over the rows of a tensor of `shape` (its last dimension),
/// from the sum's gradient `grad`: `grad` summed over the rows, as the composed add's.
pub(super) fn bias_grad<B: Backend>(grad: FloatTensor<B>, shape: &Shape) -> FloatTensor<B> {
    let hidden = shape[shape.num_dims() - 1];
    let rows = Shape::new([shape.num_elements() / hidden, hidden]);
    let sum = B::float_sum_dim(B::float_reshape(grad, rows), 0);
    B::float_reshape(sum, Shape::new([hidden]))
}

/// A kernel's bias over the rows of `x` (its last dimension), when there is one.
fn row_bias<'a>(x: &CubeTensor, bias: Option<&'a CubeTensor>) -> Option<(&'a Handle, usize)> {
    bias.map(|b| {
        same_dtype("the bias", x, b);
        let shape = x.shape();
        (&b.handle, shape[shape.num_dims() - 1])
    })
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

impl FusedOps for CubeBackend {
    fn fused_bias_dropout_add(
        residual: CubeTensor,
        y: CubeTensor,
        bias: CubeTensor,
        draw: Option<DropoutDraw>,
        slice: DrawSlice,
    ) -> CubeTensor {
        Self::bias_dropout_add_apply(residual, y, Some(bias), draw, slice)
    }

    fn fused_dropout_add(
        residual: CubeTensor,
        y: CubeTensor,
        draw: Option<DropoutDraw>,
        slice: DrawSlice,
    ) -> CubeTensor {
        Self::bias_dropout_add_apply(residual, y, None, draw, slice)
    }

    fn fused_dropout(
        x: CubeTensor,
        key_lo: u32,
        key_hi: u32,
        threshold: u32,
        scale: f32,
        own: u32,
        row: u32,
        first: u32,
    ) -> CubeTensor {
        let draw = DropoutDraw {
            key_lo,
            key_hi,
            threshold,
            scale,
        };
        Self::dropout_apply(x, draw, DrawSlice { own, row, first })
    }

    fn fused_causal_softmax(x: CubeTensor, scale: f32) -> CubeTensor {
        let [y, _] = Self::causal_softmax_forward(x, scale, None);
        y
    }

    fn fused_causal_attention(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> CubeTensor {
        Self::flash_attention_forward(q, k, v, scale, draw).0
    }

    fn fused_attention_from_qkv(
        mixed: CubeTensor,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> CubeTensor {
        let layout = fused_attention::layout(&mixed.shape(), groups, per_group);
        fused_attention::forward::<Self>(mixed, layout, scale, draw, kernels, None).0
    }

    fn fused_rotary_attention_from_qkv(
        mixed: CubeTensor,
        cos: CubeTensor,
        sin: CubeTensor,
        interleaved: bool,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> CubeTensor {
        let layout = fused_attention::layout(&mixed.shape(), groups, per_group);
        let rotation = Rotation {
            cos,
            sin,
            interleaved,
        };
        fused_attention::forward::<Self>(mixed, layout, scale, draw, kernels, Some(&rotation)).0
    }

    fn fused_layer_norm(
        x: CubeTensor,
        gamma: CubeTensor,
        beta: CubeTensor,
        epsilon: f32,
    ) -> CubeTensor {
        Self::layer_norm_forward(x, gamma, beta, epsilon).0
    }

    fn fused_rms_norm(x: CubeTensor, gamma: CubeTensor, epsilon: f32) -> CubeTensor {
        Self::rms_norm_forward(x, gamma, epsilon).0
    }

    fn fused_gelu(x: CubeTensor, tanh: bool) -> CubeTensor {
        Self::fused_gelu_forward(x, None, tanh)
    }

    fn fused_bias_gelu(x: CubeTensor, bias: CubeTensor, tanh: bool) -> CubeTensor {
        Self::fused_gelu_forward(x, Some(bias), tanh)
    }

    fn fused_swiglu(gate: CubeTensor, up: CubeTensor) -> CubeTensor {
        Self::swiglu_forward(gate, up)
    }

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
struct SoftmaxBackward;

impl<B: FusedKernels> Backward<B, 1> for SoftmaxBackward {
    /// The softmax output and the scale.
    type State = (FloatTensor<B>, f32);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            let (y, scale) = ops.state;
            grads.register::<B>(parent.id, B::softmax_backward(y, grad, scale, None));
        }
    }
}

#[derive(Debug)]
struct LayerNormBackward;

impl<B: FusedKernels> Backward<B, 3> for LayerNormBackward {
    /// x, γ, mean, 1/σ.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pgamma, pbeta] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, gamma, mean, rstd) = ops.state;
        let (dx, dgamma, dbeta) = B::layer_norm_backward(x, gamma, grad, mean, rstd);
        if let Some(p) = px {
            grads.register::<B>(p.id, dx);
        }
        if let Some(p) = pgamma {
            grads.register::<B>(p.id, dgamma);
        }
        if let Some(p) = pbeta {
            grads.register::<B>(p.id, dbeta);
        }
    }
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: FusedKernels> Backward<B, 2> for RmsNormBackward {
    /// x, γ, 1/rms.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pgamma] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, gamma, rstd) = ops.state;
        let (dx, dgamma) = B::rms_norm_backward(x, gamma, grad, rstd);
        if let Some(p) = px {
            grads.register::<B>(p.id, dx);
        }
        if let Some(p) = pgamma {
            grads.register::<B>(p.id, dgamma);
        }
    }
}

#[derive(Debug)]
struct GeluBackward;

impl<B: FusedKernels> Backward<B, 1> for GeluBackward {
    /// The input, and whether the tanh approximation ran.
    type State = (FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, tanh) = ops.state;
        if let Some(p) = px {
            grads.register::<B>(p.id, B::fused_gelu_backward(x, None, grad, tanh));
        }
    }
}

#[derive(Debug)]
struct BiasGeluBackward;

impl<B: FusedKernels> Backward<B, 2> for BiasGeluBackward {
    /// The input, the bias, and whether the tanh approximation ran.
    type State = (FloatTensor<B>, FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pb] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, bias, tanh) = ops.state;
        let shape = x.shape();
        let dx = B::fused_gelu_backward(x, Some(bias), grad, tanh);
        if let Some(p) = pb {
            grads.register::<B>(p.id, bias_grad::<B>(dx.clone(), &shape));
        }
        if let Some(p) = px {
            grads.register::<B>(p.id, dx);
        }
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl<B: FusedKernels> Backward<B, 2> for SwigluBackward {
    /// gate, up.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [pgate, pup] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (dgate, dup) = B::swiglu_backward(gate, up, grad);
        if let Some(p) = pgate {
            grads.register::<B>(p.id, dgate);
        }
        if let Some(p) = pup {
            grads.register::<B>(p.id, dup);
        }
    }
}

#[derive(Debug)]
struct RotaryBackward;

impl<B: FusedKernels> Backward<B, 1> for RotaryBackward {
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

#[derive(Debug)]
struct DropoutBackward;

impl<B: FusedKernels> Backward<B, 1> for DropoutBackward {
    /// The draw and the tensor's slice of it: the backward derives the same mask.
    type State = (DropoutDraw, DrawSlice);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            let (draw, slice) = ops.state;
            grads.register::<B>(parent.id, B::dropout_apply(grad, draw, slice));
        }
    }
}

#[derive(Debug)]
struct AttentionBackward;

impl<B: FusedKernels> Backward<B, 3> for AttentionBackward {
    /// q, k, v, the output and its log-sum-exp per row, the scale and the dropout draw:
    /// `O(s · head_dim)` per head, no `[s, s]` tensor.
    type State = ([FloatTensor<B>; 5], f32, Option<DropoutDraw>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [pq, pk, pv] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let ([q, k, v, output, logsumexp], scale, draw) = ops.state;
        let (dq, dk, dv) =
            B::flash_attention_backward(q, k, v, output, logsumexp, grad, scale, draw);
        for (parent, g) in [(pq, dq), (pk, dk), (pv, dv)] {
            if let Some(p) = parent {
                grads.register::<B>(p.id, g);
            }
        }
    }
}

impl<B: FusedKernels + FusedOps + Gemm, C: CheckpointStrategy> FusedOps for Autodiff<B, C> {
    fn fused_bias_dropout_add(
        residual: FloatTensor<Self>,
        y: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        draw: Option<DropoutDraw>,
        slice: DrawSlice,
    ) -> FloatTensor<Self> {
        fused_bias_dropout_add::tracked::<B, C, 3>([residual, y, bias], draw, slice)
    }

    fn fused_dropout_add(
        residual: FloatTensor<Self>,
        y: FloatTensor<Self>,
        draw: Option<DropoutDraw>,
        slice: DrawSlice,
    ) -> FloatTensor<Self> {
        fused_bias_dropout_add::tracked::<B, C, 2>([residual, y], draw, slice)
    }

    fn fused_attention_from_qkv(
        mixed: FloatTensor<Self>,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> FloatTensor<Self> {
        let layout = fused_attention::layout(&mixed.shape(), groups, per_group);
        let op = MixedAttention::<B> {
            layout,
            scale,
            draw,
            kernels,
            rotation: None,
        };
        op.tracked::<C>(mixed)
    }

    fn fused_rotary_attention_from_qkv(
        mixed: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        interleaved: bool,
        groups: u32,
        per_group: u32,
        scale: f32,
        draw: Option<DropoutDraw>,
        kernels: CoreKernels,
    ) -> FloatTensor<Self> {
        let layout = fused_attention::layout(&mixed.shape(), groups, per_group);
        // The tables are constants of the op: no gradient flows to them.
        let rotation = Rotation {
            cos: cos.into_primitive(),
            sin: sin.into_primitive(),
            interleaved,
        };
        let op = MixedAttention::<B> {
            layout,
            scale,
            draw,
            kernels,
            rotation: Some(rotation),
        };
        op.tracked::<C>(mixed)
    }

    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
        draw: Option<DropoutDraw>,
    ) -> FloatTensor<Self> {
        let (q, nq) = q.into_parts();
        let (k, nk) = k.into_parts();
        let (v, nv) = v.into_parts();
        match AttentionBackward
            .prepare::<C>([nq, nk, nv])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (output, logsumexp) =
                    B::flash_attention_forward(q.clone(), k.clone(), v.clone(), scale, draw);
                prep.finish(([q, k, v, output.clone(), logsumexp], scale, draw), output)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::flash_attention_forward(q, k, v, scale, draw).0)
            }
        }
    }

    fn fused_dropout(
        x: FloatTensor<Self>,
        key_lo: u32,
        key_hi: u32,
        threshold: u32,
        scale: f32,
        own: u32,
        row: u32,
        first: u32,
    ) -> FloatTensor<Self> {
        let draw = DropoutDraw {
            key_lo,
            key_hi,
            threshold,
            scale,
        };
        let slice = DrawSlice { own, row, first };
        let (x, node) = x.into_parts();
        match DropoutBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((draw, slice), B::dropout_apply(x, draw, slice)),
            OpsKind::UnTracked(prep) => prep.finish(B::dropout_apply(x, draw, slice)),
        }
    }

    fn fused_causal_softmax(x: FloatTensor<Self>, scale: f32) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        match SoftmaxBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let [y, _] = B::causal_softmax_forward(x, scale, None);
                prep.finish((y.clone(), scale), y)
            }
            OpsKind::UnTracked(prep) => {
                let [y, _] = B::causal_softmax_forward(x, scale, None);
                prep.finish(y)
            }
        }
    }

    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self> {
        let (x, nx) = x.into_parts();
        let (gamma, ngamma) = gamma.into_parts();
        let (beta, nbeta) = beta.into_parts();
        match LayerNormBackward
            .prepare::<C>([nx, ngamma, nbeta])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, mean, rstd) =
                    B::layer_norm_forward(x.clone(), gamma.clone(), beta, epsilon);
                prep.finish((x, gamma, mean, rstd), y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::layer_norm_forward(x, gamma, beta, epsilon).0)
            }
        }
    }

    fn fused_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f32,
    ) -> FloatTensor<Self> {
        let (x, nx) = x.into_parts();
        let (gamma, ngamma) = gamma.into_parts();
        match RmsNormBackward
            .prepare::<C>([nx, ngamma])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, rstd) = B::rms_norm_forward(x.clone(), gamma.clone(), epsilon);
                prep.finish((x, gamma, rstd), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rms_norm_forward(x, gamma, epsilon).0),
        }
    }

    fn fused_gelu(x: FloatTensor<Self>, tanh: bool) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        match GeluBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = B::fused_gelu_forward(x.clone(), None, tanh);
                prep.finish((x, tanh), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_gelu_forward(x, None, tanh)),
        }
    }

    fn fused_bias_gelu(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        tanh: bool,
    ) -> FloatTensor<Self> {
        let (x, nx) = x.into_parts();
        let (bias, nb) = bias.into_parts();
        match BiasGeluBackward
            .prepare::<C>([nx, nb])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::fused_gelu_forward(x.clone(), Some(bias.clone()), tanh);
                prep.finish((x, bias, tanh), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_gelu_forward(x, Some(bias), tanh)),
        }
    }

    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let (gate, ngate) = gate.into_parts();
        let (up, nup) = up.into_parts();
        match SwigluBackward
            .prepare::<C>([ngate, nup])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::swiglu_forward(gate.clone(), up.clone());
                prep.finish((gate, up), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu_forward(gate, up)),
        }
    }

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

/// The attention core from the QKV rows as an autodiff op: its arguments but the rows.
struct MixedAttention<B: FusedKernels> {
    layout: QkvLayout,
    scale: f32,
    draw: Option<DropoutDraw>,
    kernels: CoreKernels,
    rotation: Option<Rotation<B>>,
}

impl<B: FusedKernels + Gemm> MixedAttention<B> {
    /// The context of the rows `mixed`, its backward recorded when they are tracked.
    fn tracked<C: CheckpointStrategy>(
        self,
        mixed: FloatTensor<Autodiff<B, C>>,
    ) -> FloatTensor<Autodiff<B, C>> {
        let (mixed, node) = mixed.into_parts();
        let Self {
            layout,
            scale,
            draw,
            kernels,
            rotation,
        } = self;
        let run = |mixed| {
            fused_attention::forward::<B>(mixed, layout, scale, draw, kernels, rotation.as_ref())
        };
        match MixedAttentionBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (context, saved) = run(mixed);
                prep.finish((saved, layout, scale, draw, rotation), context)
            }
            OpsKind::UnTracked(prep) => prep.finish(run(mixed).0),
        }
    }
}

/// The fused causal softmax of `[b, heads, s, s]` scores (square, as Megatron's kernel: query
/// i sees keys 0..=i, the same mask as the composed reference).
pub fn causal_softmax(x: Tensor<4>, scale: f64) -> Tensor<4> {
    let [_, _, sq, sk] = x.dims();
    assert_eq!(sq, sk, "the fused causal softmax takes square scores");
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_causal_softmax(
        x.into_dispatch(),
        scale as f32,
    ))
}

/// The fused LayerNorm of `x` over its last dimension.
pub fn layer_norm(x: Tensor<3>, gamma: Tensor<1>, beta: Tensor<1>, epsilon: f64) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon as f32,
    ))
}

/// The fused RMSNorm of `x` over its last dimension (γ stored as `x` is).
pub fn rms_norm(x: Tensor<3>, gamma: Tensor<1>, epsilon: f64) -> Tensor<3> {
    let gamma = gamma.cast(x.dtype());
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_rms_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        epsilon as f32,
    ))
}

/// The fused GELU of `x + bias` (the bias over the last dimension, cast to `x`'s dtype):
/// exact, or the tanh approximation with `tanh`.
pub fn bias_gelu<const D: usize>(x: Tensor<D>, bias: Tensor<1>, tanh: bool) -> Tensor<D> {
    let bias = bias.cast(x.dtype());
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_bias_gelu(
        x.into_dispatch(),
        bias.into_dispatch(),
        tanh,
    ))
}

/// The fused GELU of `x`: exact, or the tanh approximation with `tanh`.
pub fn gelu<const D: usize>(x: Tensor<D>, tanh: bool) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_gelu(x.into_dispatch(), tanh))
}

/// The fused SwiGLU activation `silu(gate) ⊙ up` (both of one shape and dtype).
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    assert_eq!(gate.dims(), up.dims(), "SwiGLU's gate and up");
    let up = up.cast(gate.dtype());
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
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
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_rotary(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        offset as u32,
        interleaved,
    ))
}

/// Dropout of `x` with probability `p`, the mask derived on the device from the draw's `key`
/// (the same mask as [`crate::parallel::random::dropout_mask_of`] on the host).
pub fn dropout<const D: usize>(x: Tensor<D>, key: u64, p: f64) -> Tensor<D> {
    let len = x.shape().num_elements();
    dropout_slice(x, key, p, DrawSlice::whole(len))
}

/// [`dropout`] of `x` holding `slice` of the draw (a sequence-parallel rank's chunk: the mask
/// of the whole sequence's draw, cut as [`DrawSlice::chunk`] says).
pub fn dropout_slice<const D: usize>(
    x: Tensor<D>,
    key: u64,
    p: f64,
    slice: DrawSlice,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_dropout(
        x.into_dispatch(),
        key as u32,
        (key >> 32) as u32,
        crate::parallel::random::dropout_threshold(p),
        (1.0 / (1.0 - p)) as f32,
        slice.own,
        slice.row,
        slice.first,
    ))
}

/// Causal attention of `[b, heads, s, head_dim]` queries, keys and values fused
/// (FlashAttention-style): `dropout(softmax(scale · q kᵀ)) v` with the `[s, s]` scores never
/// stored. `dropout` is the draw's key and probability; it drops the same probabilities as
/// [`dropout`] of that key on the materialised `[b, heads, s, s]` probabilities.
pub fn causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    dropout: Option<(u64, f64)>,
) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        scale as f32,
        dropout_draw(dropout),
    ))
}

/// The attention core from the fused QKV projection's rows `qkv` `[b, s, groups ·
/// (per_group + 2) · head_dim]` (Megatron's per-group layout) to the context `[b, s, heads ·
/// head_dim]`, as one differentiable op: its backward is one kernel into the rows' gradient,
/// where the composed split's is eight launches. `kernels` says which attention runs inside
/// ([`CoreKernels::Flash`]: [`causal_attention`]'s kernel) and so what it keeps; `dropout` as
/// [`causal_attention`]'s. With `rotary` the queries and keys are
/// rotated after the split inside the op.
pub fn attention_from_qkv(
    qkv: Tensor<3>,
    groups: usize,
    per_group: usize,
    scale: f64,
    dropout: Option<(u64, f64)>,
    kernels: CoreKernels,
    rotary: Option<RowRotation>,
) -> Tensor<3> {
    let (groups, per_group, scale) = (groups as u32, per_group as u32, scale as f32);
    let (qkv, draw) = (qkv.into_dispatch(), dropout_draw(dropout));
    Tensor::from_dispatch(match rotary {
        None => <Dispatch as FusedOps>::fused_attention_from_qkv(
            qkv, groups, per_group, scale, draw, kernels,
        ),
        Some(RowRotation {
            cos,
            sin,
            interleaved,
        }) => <Dispatch as FusedOps>::fused_rotary_attention_from_qkv(
            qkv,
            cos.cast(FloatDType::F32).into_dispatch(),
            sin.cast(FloatDType::F32).into_dispatch(),
            interleaved,
            groups,
            per_group,
            scale,
            draw,
            kernels,
        ),
    })
}

/// The rotary embedding [`attention_from_qkv`] applies to its queries and keys: the angle
/// tables `[seq, rotary_dim / 2]` of positions `0..seq` and the pairing.
pub struct RowRotation {
    /// `cos` of each position's pair angles.
    pub cos: Tensor<2>,
    /// `sin` of each position's pair angles.
    pub sin: Tensor<2>,
    /// Pairs `(2i, 2i + 1)` instead of `(i, i + rotary_dim / 2)`.
    pub interleaved: bool,
}
