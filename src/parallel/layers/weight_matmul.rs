//! `x · W` for activations `[..., in]` and a weight matrix `[in, out]`, as one 2-D matmul.

use burn::tensor::Tensor;

/// `x · w` over the last dimension of `x`, computed as a single `[rows, in] · [in, out]`
/// matmul on the flattened leading dimensions.
///
/// Why not `x.matmul(w.unsqueeze())`: that is a batched matmul against a broadcast weight,
/// and autodiff then computes the weight gradient as one `[in, out]` product *per batch
/// entry* and sums them afterwards — for the `[hidden, vocab]` output layer that is a
/// `batch × hidden × vocab` temporary and several small gemms where one large one does.
pub fn weight_matmul<const D: usize>(x: Tensor<D>, w: Tensor<2>) -> Tensor<D> {
    let dims = x.dims();
    let d_in = dims[D - 1];
    let rows = dims[..D - 1].iter().product::<usize>();
    let mut out_dims = dims;
    out_dims[D - 1] = w.dims()[1];
    crate::util::matmul::matmul(x.reshape([rows, d_in]), w).reshape(out_dims)
}
