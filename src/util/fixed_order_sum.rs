//! Sums of every element whose rounding does not change from run to run.
//!
//! Why: burn's `Tensor::sum` on a CubeCL device (CUDA, wgpu) adds each cube's partial sum into
//! the output with a float atomic where the device has one, so the order of those additions,
//! and the last bits of the result, depend on which cube finishes first. The training loss and
//! the gradient norm (which scales every update through clipping) must come out the same in
//! runs that are compared bit for bit: with and without recomputation, resumed or not. A
//! reduction along a dimension (`sum_dim`) has no atomics; here it runs in two stages, rows of
//! [`ROW`] elements and then the row sums, so a large tensor is still spread over many cubes.
//! The CPU backend's own `sum` is already in a fixed order, and is kept there (its numbers stay
//! those of the runs and fixtures made before).

use burn::tensor::Tensor;

/// Elements per row of the first stage.
const ROW: usize = 1 << 14;

/// The sum of all of `t`'s elements, a one-element tensor, added in an order fixed by its
/// size alone.
pub fn fixed_order_sum<const D: usize>(t: Tensor<D>) -> Tensor<1> {
    if super::device::is_flex(&t.device()) {
        return t.sum();
    }
    two_stage_sum(t)
}

/// The sum of rows of [`ROW`] elements, then of the row sums (and of the tail).
fn two_stage_sum<const D: usize>(t: Tensor<D>) -> Tensor<1> {
    let n = t.shape().num_elements();
    let flat = t.reshape([n]);
    if n <= ROW {
        return flat.sum_dim(0);
    }
    let rows = n / ROW;
    let whole = rows * ROW;
    let head = flat
        .clone()
        .narrow(0, 0, whole)
        .reshape([rows, ROW])
        .sum_dim(1)
        .reshape([rows])
        .sum_dim(0);
    if whole == n {
        head
    } else {
        head + flat.narrow(0, whole, n - whole).sum_dim(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    /// The two stages against float64 at sizes below, at and past one row, with and without a
    /// tail (to float rounding of the sum of magnitudes: the values cancel).
    #[test]
    fn sums_match_float64() {
        let device = Device::flex();
        for n in [1, 7, ROW, ROW + 1, 3 * ROW, 3 * ROW + 5] {
            let values: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let want: f64 = values.iter().map(|&v| v as f64).sum();
            let magnitude: f64 = values.iter().map(|&v| v.abs() as f64).sum();
            let t = Tensor::<1>::from_data(TensorData::new(values, [n]), &device);
            let got = two_stage_sum(t.reshape([1, n])).into_scalar::<f32>() as f64;
            assert!(
                (got - want).abs() <= 1e-6 * magnitude,
                "{n}: {got} vs {want}"
            );
        }
    }
}
