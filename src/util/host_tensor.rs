//! A row-major f32 tensor on the host: what checkpoints store and what the in-process
//! collectives exchange.

/// Shape and row-major values.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub values: Vec<f32>,
}

impl HostTensor {
    /// A tensor of `shape` holding `values` (their count must match).
    pub fn new(shape: Vec<usize>, values: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), values.len());
        Self { shape, values }
    }

    /// `(outer, inner)`: the number of blocks before `dim`, and the elements per unit of `dim`.
    fn blocks(shape: &[usize], dim: usize) -> (usize, usize) {
        (
            shape[..dim].iter().product(),
            shape[dim + 1..].iter().product(),
        )
    }

    /// `parts` joined along `dim`; they must agree on every other dimension.
    pub fn concat(parts: &[HostTensor], dim: usize) -> Result<HostTensor, String> {
        let first = parts.first().ok_or("nothing to concatenate")?;
        let rank = first.shape.len();
        if dim >= rank {
            return Err(format!(
                "dimension {dim} out of range for {:?}",
                first.shape
            ));
        }
        for p in parts {
            let same = p.shape.len() == rank
                && (0..rank).all(|d| d == dim || p.shape[d] == first.shape[d]);
            if !same {
                return Err(format!(
                    "cannot concatenate {:?} and {:?} along dimension {dim}",
                    first.shape, p.shape
                ));
            }
        }
        let (outer, inner) = Self::blocks(&first.shape, dim);
        let mut shape = first.shape.clone();
        shape[dim] = parts.iter().map(|p| p.shape[dim]).sum();
        let mut values = Vec::with_capacity(shape.iter().product());
        for o in 0..outer {
            for p in parts {
                let block = p.shape[dim] * inner;
                values.extend_from_slice(&p.values[o * block..(o + 1) * block]);
            }
        }
        Ok(HostTensor { shape, values })
    }

    /// The `[start, start + len)` range of `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> HostTensor {
        assert!(start + len <= self.shape[dim], "narrow out of range");
        let (outer, inner) = Self::blocks(&self.shape, dim);
        let block = self.shape[dim] * inner;
        let mut values = Vec::with_capacity(outer * len * inner);
        for o in 0..outer {
            let base = o * block + start * inner;
            values.extend_from_slice(&self.values[base..base + len * inner]);
        }
        let mut shape = self.shape.clone();
        shape[dim] = len;
        HostTensor { shape, values }
    }

    /// Part `index` of `parts` equal parts along `dim` (which must divide evenly).
    pub fn chunk(&self, dim: usize, parts: usize, index: usize) -> Result<HostTensor, String> {
        if parts == 0 || !self.shape[dim].is_multiple_of(parts) {
            return Err(format!(
                "dimension {dim} of {:?} does not split into {parts} equal parts",
                self.shape
            ));
        }
        let len = self.shape[dim] / parts;
        Ok(self.narrow(dim, index * len, len))
    }

    /// A matrix's transpose (PyTorch's `Linear` stores `[out, in]`, ferrotron `[in, out]`).
    pub fn transposed(&self) -> Result<HostTensor, String> {
        let [rows, cols] = self.shape[..] else {
            return Err(format!(
                "cannot transpose a tensor of shape {:?}",
                self.shape
            ));
        };
        let mut values = Vec::with_capacity(self.values.len());
        for c in 0..cols {
            values.extend((0..rows).map(|r| self.values[r * cols + c]));
        }
        Ok(HostTensor {
            shape: vec![cols, rows],
            values,
        })
    }

    /// The tensor with `dim` cut or zero-padded to `len`.
    pub fn resized(&self, dim: usize, len: usize) -> HostTensor {
        if len <= self.shape[dim] {
            return self.narrow(dim, 0, len);
        }
        let mut pad_shape = self.shape.clone();
        pad_shape[dim] = len - self.shape[dim];
        let pad = HostTensor {
            values: vec![0.0; pad_shape.iter().product()],
            shape: pad_shape,
        };
        HostTensor::concat(&[self.clone(), pad], dim).expect("shapes agree by construction")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(shape: &[usize]) -> HostTensor {
        let n = shape.iter().product::<usize>();
        HostTensor::new(shape.to_vec(), (0..n).map(|v| v as f32).collect())
    }

    #[test]
    fn chunks_concatenate_back_to_the_whole_along_every_dimension() {
        let t = iota(&[4, 6, 2]);
        for dim in 0..3 {
            for parts in [1, 2] {
                let pieces: Vec<_> = (0..parts)
                    .map(|i| t.chunk(dim, parts, i).unwrap())
                    .collect();
                assert_eq!(HostTensor::concat(&pieces, dim).unwrap(), t);
            }
        }
        // Element (i, j, k) of the second column chunk is element (i, j + 3, k) of the whole.
        let c = t.chunk(1, 2, 1).unwrap();
        assert_eq!(c.shape, vec![4, 3, 2]);
        assert_eq!(c.values[(2 * 3 + 1) * 2 + 1], t.values[(2 * 6 + 4) * 2 + 1]);
        assert!(t.chunk(1, 4, 0).is_err());
        assert!(HostTensor::concat(&[iota(&[2, 3]), iota(&[3, 3])], 1).is_err());
    }

    #[test]
    fn resizing_cuts_or_pads_with_zeros() {
        let t = iota(&[3, 2]);
        assert_eq!(t.resized(0, 2).values, vec![0.0, 1.0, 2.0, 3.0]);
        let padded = t.resized(0, 4);
        assert_eq!(padded.shape, vec![4, 2]);
        assert_eq!(&padded.values[..6], &t.values[..]);
        assert_eq!(&padded.values[6..], &[0.0, 0.0]);
    }
}
