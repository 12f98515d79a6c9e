//! Host-side arithmetic on messages: joining and cutting [`TensorData`] along a dimension by
//! bytes (any dtype), and reducing the ranks' contributions in rank order.
//!
//! Half-precision reductions accumulate in f32 and round once at the end, as NCCL does for
//! bf16 sums on recent GPUs, so the result does not depend on how many ranks there are beyond
//! one rounding.

use burn::tensor::{DType, TensorData};

use super::{CommError, ReduceOp};

/// `(outer, inner)`: blocks before `dim`, and elements per unit of `dim`.
fn blocks(shape: &[usize], dim: usize) -> (usize, usize) {
    (
        shape[..dim].iter().product(),
        shape[dim + 1..].iter().product(),
    )
}

/// `parts` joined along `dim`; they must share dtype, rank and every other dimension.
pub fn join(parts: &[TensorData], dim: usize) -> Result<TensorData, CommError> {
    let first = parts
        .first()
        .ok_or_else(|| CommError::Invalid("nothing to join".into()))?;
    let (shape0, dtype) = (first.shape().to_vec(), first.dtype());
    if dim >= shape0.len() {
        return Err(CommError::Invalid(format!(
            "dimension {dim} out of range for shape {shape0:?}"
        )));
    }
    for p in parts {
        let s = p.shape();
        let same = p.dtype() == dtype
            && s.len() == shape0.len()
            && (0..s.len()).all(|d| d == dim || s[d] == shape0[d]);
        if !same {
            return Err(CommError::Invalid(format!(
                "cannot join {:?} {:?} and {:?} {:?} along dimension {dim}",
                shape0,
                dtype,
                s.to_vec(),
                p.dtype()
            )));
        }
    }
    let (outer, inner) = blocks(&shape0, dim);
    let size = dtype.size();
    let mut shape = shape0;
    shape[dim] = parts.iter().map(|p| p.shape()[dim]).sum();
    let mut bytes = Vec::with_capacity(shape.iter().product::<usize>() * size);
    for o in 0..outer {
        for p in parts {
            let block = p.shape()[dim] * inner * size;
            bytes.extend_from_slice(&p.as_bytes()[o * block..(o + 1) * block]);
        }
    }
    Ok(TensorData::from_bytes_vec(bytes, shape, dtype))
}

/// `data` cut into `parts` equal pieces along `dim`.
pub fn split(data: &TensorData, dim: usize, parts: usize) -> Result<Vec<TensorData>, CommError> {
    let shape = data.shape().to_vec();
    if dim >= shape.len() || parts == 0 || !shape[dim].is_multiple_of(parts) {
        return Err(CommError::Invalid(format!(
            "shape {shape:?} does not split into {parts} equal parts along dimension {dim}"
        )));
    }
    let (outer, inner) = blocks(&shape, dim);
    let size = data.dtype().size();
    let len = shape[dim] / parts;
    let block = shape[dim] * inner * size;
    let piece = len * inner * size;
    let mut piece_shape = shape.clone();
    piece_shape[dim] = len;
    Ok((0..parts)
        .map(|k| {
            let mut bytes = Vec::with_capacity(outer * piece);
            for o in 0..outer {
                let start = o * block + k * piece;
                bytes.extend_from_slice(&data.as_bytes()[start..start + piece]);
            }
            TensorData::from_bytes_vec(bytes, piece_shape.clone(), data.dtype())
        })
        .collect())
}

/// The dtype a reduction accumulates in.
fn accumulator(dtype: DType) -> Result<DType, CommError> {
    match dtype {
        DType::F64 => Ok(DType::F64),
        DType::F32 | DType::BF16 | DType::F16 => Ok(DType::F32),
        DType::I64 | DType::I32 => Ok(DType::I64),
        other => Err(CommError::Invalid(format!(
            "reductions of {other:?} tensors are not supported"
        ))),
    }
}

fn fold<T: Copy + PartialOrd + std::ops::Add<Output = T>>(acc: &mut [T], x: &[T], op: ReduceOp) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a = match op {
            ReduceOp::Sum => *a + b,
            ReduceOp::Max if b > *a => b,
            ReduceOp::Max => *a,
        };
    }
}

/// The element-wise `op` of `parts` (same shape and dtype), combined in the order given.
pub fn reduce(parts: &[TensorData], op: ReduceOp) -> Result<TensorData, CommError> {
    let first = parts
        .first()
        .ok_or_else(|| CommError::Invalid("nothing to reduce".into()))?;
    let (shape, dtype) = (first.shape().to_vec(), first.dtype());
    if let Some(p) = parts
        .iter()
        .find(|p| p.dtype() != dtype || p.shape().as_slice() != shape.as_slice())
    {
        return Err(CommError::Invalid(format!(
            "cannot reduce {shape:?} {dtype:?} with {:?} {:?}",
            p.shape().to_vec(),
            p.dtype()
        )));
    }
    let acc_dtype = accumulator(dtype)?;
    let wide = |p: &TensorData| p.clone().convert_dtype(acc_dtype);
    let out = match acc_dtype {
        DType::F64 => {
            let mut acc = wide(first).try_into_vec::<f64>().expect("f64");
            for p in &parts[1..] {
                fold(&mut acc, wide(p).as_slice::<f64>().expect("f64"), op);
            }
            TensorData::new(acc, shape)
        }
        DType::F32 => {
            let mut acc = wide(first).try_into_vec::<f32>().expect("f32");
            for p in &parts[1..] {
                fold(&mut acc, wide(p).as_slice::<f32>().expect("f32"), op);
            }
            TensorData::new(acc, shape)
        }
        _ => {
            let mut acc = wide(first).try_into_vec::<i64>().expect("i64");
            for p in &parts[1..] {
                fold(&mut acc, wide(p).as_slice::<i64>().expect("i64"), op);
            }
            TensorData::new(acc, shape)
        }
    };
    Ok(if out.dtype() == dtype {
        out
    } else {
        out.convert_dtype(dtype)
    })
}

/// Part `rank` (of `parts.len()` along `dim`) of the element-wise `op` of every rank's
/// `parts`: the local half of a reduce-scatter computed from gathered contributions.
pub fn reduce_own_part(
    parts: &[TensorData],
    dim: usize,
    rank: usize,
    op: ReduceOp,
) -> Result<TensorData, CommError> {
    let mine: Vec<TensorData> = parts
        .iter()
        .map(|p| split(p, dim, parts.len()).map(|mut v| v.swap_remove(rank)))
        .collect::<Result<_, _>>()?;
    reduce(&mine, op)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(shape: &[usize]) -> TensorData {
        let n = shape.iter().product::<usize>();
        TensorData::new((0..n).map(|v| v as f32).collect::<Vec<_>>(), shape.to_vec())
    }

    #[test]
    fn split_then_join_is_the_identity_along_every_dimension() {
        let t = iota(&[4, 6, 2]);
        for dim in 0..3 {
            for parts in [1, 2] {
                let pieces = split(&t, dim, parts).unwrap();
                assert_eq!(join(&pieces, dim).unwrap(), t);
            }
        }
        // Element (i, j, k) of the second chunk along dim 1 is element (i, j + 3, k).
        let c = &split(&t, 1, 2).unwrap()[1];
        assert_eq!(c.shape().to_vec(), vec![4, 3, 2]);
        let v = c.as_slice::<f32>().unwrap();
        assert_eq!(v[(2 * 3 + 1) * 2 + 1], ((2 * 6 + 4) * 2 + 1) as f32);
        assert!(split(&t, 1, 4).is_err());
        assert!(join(&[iota(&[2, 3]), iota(&[3, 3])], 1).is_err());
    }

    #[test]
    fn half_precision_sums_round_once() {
        // 256 + 1 + 1 in bf16, rounding after each step, stays 256 (8 bits of mantissa);
        // accumulated in f32 and rounded once it is 258.
        let part = |v: f32| TensorData::new(vec![v], [1]).convert_dtype(DType::BF16);
        let sum = reduce(&[part(256.0), part(1.0), part(1.0)], ReduceOp::Sum).unwrap();
        assert_eq!(sum.dtype(), DType::BF16);
        assert_eq!(
            sum.convert::<f32>().try_to_vec::<f32>().unwrap(),
            vec![258.0]
        );
        let max = reduce(&[part(-3.0), part(2.0), part(1.0)], ReduceOp::Max).unwrap();
        assert_eq!(max.convert::<f32>().try_to_vec::<f32>().unwrap(), vec![2.0]);
    }
}
