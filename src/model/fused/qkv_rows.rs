//! The fused QKV projection's rows `[b, s, groups · (per_group + 2) · head_dim]` (Megatron's
//! per-group layout) split into per-head queries, keys and values, and their gradients merged
//! back, one kernel each way (for grouped-query attention the split repeats a group's key and
//! value for each of its query heads, and the merge sums the repeats' gradients in a fixed
//! order); and the core's output moved between the per-head layout and the rows', one
//! kernel each way.

use burn::backend::tensor::FloatTensor;
use burn::backend::Backend;
use burn::tensor::Shape;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::{ColumnLaunch, QkvLayout};

use super::same_dtype;
use crate::util::cube_tensor::{by_dtype, empty_like, packed};

/// The split and merge kernels a backend runs.
pub trait QkvKernels: Backend {
    /// Queries, keys and values `[b, heads, s, head_dim]` (keys and values repeated for each
    /// query head of their group) from the fused QKV projection's rows `[b, s, width]`, the
    /// projection's `bias` `[width]` (if any) added on the way.
    fn qkv_split(
        mixed: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        layout: QkvLayout,
    ) -> [FloatTensor<Self>; 3];
    /// The rows' gradient from the gradients of [`Self::qkv_split`]'s three outputs.
    fn qkv_merge(grads: [FloatTensor<Self>; 3], layout: QkvLayout) -> FloatTensor<Self>;
    /// [`Self::qkv_merge`]'s rows' gradient and the projection bias's (the rows' gradient
    /// summed over the rows, `[width]`), in one launch where they were two.
    fn qkv_merge_bias_gradient(
        grads: [FloatTensor<Self>; 3],
        layout: QkvLayout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// The core's output `[b, heads, s, head_dim]` as rows `[b, s, heads · head_dim]`.
    fn merge_heads(heads: FloatTensor<Self>, layout: QkvLayout) -> FloatTensor<Self>;
    /// Rows `[b, s, heads · head_dim]` (the output projection's input gradient) as
    /// `[b, heads, s, head_dim]`.
    fn split_heads(rows: FloatTensor<Self>, layout: QkvLayout) -> FloatTensor<Self>;
}

impl QkvKernels for CubeBackend {
    fn qkv_split(
        mixed: CubeTensor,
        bias: Option<CubeTensor>,
        layout: QkvLayout,
    ) -> [CubeTensor; 3] {
        let (mixed, bias) = (packed(mixed), bias.map(packed));
        if let Some(bias) = &bias {
            same_dtype("the QKV bias", &mixed, bias);
        }
        let shape = Shape::new([layout.batch, layout.heads(), layout.seq, layout.head_dim]);
        let parts = [0; 3].map(|_| empty_like(&mixed, shape.clone(), mixed.dtype));
        by_dtype!(
            mixed.dtype,
            qkv_split,
            &mixed.client,
            &mixed.handle,
            bias.as_ref().map(|b| &b.handle),
            [&parts[0].handle, &parts[1].handle, &parts[2].handle],
            layout
        );
        parts
    }

    fn qkv_merge(grads: [CubeTensor; 3], layout: QkvLayout) -> CubeTensor {
        let [dq, dk, dv] = grads.map(packed);
        same_dtype("the key gradient", &dq, &dk);
        same_dtype("the value gradient", &dq, &dv);
        let width = layout.row_width();
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

    fn qkv_merge_bias_gradient(
        grads: [CubeTensor; 3],
        layout: QkvLayout,
    ) -> (CubeTensor, CubeTensor) {
        let [dq, dk, dv] = grads.map(packed);
        same_dtype("the key gradient", &dq, &dk);
        same_dtype("the value gradient", &dq, &dv);
        let width = layout.row_width();
        let merged = empty_like(&dq, Shape::new([layout.batch, layout.seq, width]), dq.dtype);
        let sums = empty_like(&dq, Shape::new([width]), dq.dtype);
        if layout.batch * layout.seq == 0 {
            let zeros = <Self as burn::backend::ops::FloatTensorOps<Self>>::float_zeros(
                Shape::new([width]),
                &dq.device,
                dq.dtype.into(),
            );
            return (merged, zeros);
        }
        by_dtype!(
            dq.dtype,
            qkv_merge_bias_gradient,
            &dq.client,
            ColumnLaunch::for_client(&dq.client),
            [&dq.handle, &dk.handle, &dv.handle],
            &merged.handle,
            &sums.handle,
            layout
        );
        (merged, sums)
    }

    fn merge_heads(heads: CubeTensor, layout: QkvLayout) -> CubeTensor {
        let heads = packed(heads);
        let shape = Shape::new([layout.batch, layout.seq, layout.heads() * layout.head_dim]);
        let rows = empty_like(&heads, shape, heads.dtype);
        by_dtype!(
            heads.dtype,
            heads_to_rows,
            &heads.client,
            &heads.handle,
            &rows.handle,
            layout
        );
        rows
    }

    fn split_heads(rows: CubeTensor, layout: QkvLayout) -> CubeTensor {
        let rows = packed(rows);
        let shape = Shape::new([layout.batch, layout.heads(), layout.seq, layout.head_dim]);
        let heads = empty_like(&rows, shape, rows.dtype);
        by_dtype!(
            rows.dtype,
            rows_to_heads,
            &rows.client,
            &rows.handle,
            &heads.handle,
            layout
        );
        heads
    }
}

/// The layout of rows of shape `[b, s, groups · (per_group + 2) · head_dim]`.
pub fn layout(shape: &Shape, groups: u32, per_group: u32) -> QkvLayout {
    let [batch, seq, width] = shape.dims::<3>();
    let (groups, per_group) = (groups as usize, per_group as usize);
    assert!(
        groups * per_group > 0 && width.is_multiple_of(groups * (per_group + 2)),
        "QKV rows {width} wide for {groups} groups of {per_group} query heads"
    );
    QkvLayout {
        batch,
        seq,
        groups,
        per_group,
        head_dim: width / (groups * (per_group + 2)),
    }
}
