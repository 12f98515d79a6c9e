//! Helpers for kernels that load rows in vectors ([`crate::rows::RowLaunch::vectorized`]):
//! a unit's vector of partial values is folded into one before the row-wide reduction, and
//! element positions inside a vector are needed for masks and per-element draws.

use cubecl::prelude::*;

/// The sum of `v`'s lanes.
#[cube]
pub fn total<A: Float, N: Size>(v: Vector<A, N>) -> A {
    let mut sum = A::new(0.0);
    #[unroll]
    for k in 0..N::value() {
        sum += v.extract(k);
    }
    sum
}

/// The largest of `v`'s lanes.
#[cube]
pub fn largest<A: Float, N: Size>(v: Vector<A, N>) -> A {
    let mut max = v.extract(0usize);
    #[unroll]
    for k in 1..N::value() {
        max = A::max(max, v.extract(k));
    }
    max
}

/// The element positions of the vector at index `vector`: `vector · N + k` in lane `k`.
#[cube]
pub fn positions<N: Size>(vector: usize) -> Vector<u32, N> {
    let mut at = Vector::<u32, N>::new(0u32);
    let first = (vector * N::value()) as u32;
    #[unroll]
    for k in 0..N::value() {
        at.insert(k, first + k as u32);
    }
    at
}

/// `value` in every lane, in `F` (a constant, or a runtime scalar).
#[cube]
pub fn spread<F: Float, N: Size>(value: f32) -> Vector<F, N> {
    Vector::<F, N>::new(F::cast_from(value))
}
