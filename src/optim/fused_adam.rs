//! Adam's step as one CubeCL kernel per parameter (`ferrotron_kernels::adam`), on CUDA and
//! wgpu devices. Composed of burn ops the step launches about fifteen element-wise kernels per
//! parameter, most of a small model's launches (the count for a 24-layer GPT:
//! benchmarks/results/2026-12-03-figures-from-comments.md). The arithmetic is the composed step's, in f32.

use burn::tensor::{DType, Shape, Tensor};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::launch::{self as kernels, AdamScalars};

/// The f32 scalars of step `step` (1-based) with learning rate `lr` and decoupled weight decay
/// `decay`, rounded once from the optimizer's f64 values.
pub fn adam_scalars(c: &super::AdamWConfig, step: u64, lr: f64, decay: f64) -> AdamScalars {
    let t = step as i32;
    AdamScalars {
        beta1: c.beta1 as f32,
        one_minus_beta1: (1.0 - c.beta1) as f32,
        beta2: c.beta2 as f32,
        one_minus_beta2: (1.0 - c.beta2) as f32,
        correction1: (1.0 - c.beta1.powi(t)) as f32,
        correction2: (1.0 - c.beta2.powi(t)) as f32,
        eps: c.eps as f32,
        keep: (1.0 - lr * decay) as f32,
        lr: lr as f32,
    }
}

/// `t` as a contiguous f32 CubeCL tensor, if it is one.
pub(super) fn cube_f32(t: &Tensor<1>) -> Option<CubeTensor> {
    if t.dtype() != DType::F32 {
        return None;
    }
    let cube = t.clone().try_into_primitive::<CubeBackend>().ok()?;
    Some(into_contiguous(cube))
}

/// The new parameter, first and second moment of one Adam step of the flattened `param`
/// with gradient `grad` and `moments` (`None` on the first step), or `None` when they are not
/// f32 tensors on a CubeCL device (the caller then composes the step from tensor ops).
pub fn adam_step(
    param: &Tensor<1>,
    grad: &Tensor<1>,
    moments: Option<(&Tensor<1>, &Tensor<1>)>,
    scalars: AdamScalars,
) -> Option<[Tensor<1>; 3]> {
    let (p, g) = (cube_f32(param)?, cube_f32(grad)?);
    let mv = match moments {
        Some((m, v)) => Some((cube_f32(m)?, cube_f32(v)?)),
        None => None,
    };
    let n = param.dims()[0];
    let shape = Shape::new([3 * n]);
    let handle = p.client.empty(shape.num_elements() * DType::F32.size());
    let out = CubeTensor::new_contiguous(
        p.client.clone(),
        p.device.clone(),
        shape,
        handle,
        DType::F32,
    );
    kernels::adam_step::<f32>(
        &p.client,
        &p.handle,
        &g.handle,
        mv.as_ref().map(|(m, v)| (&m.handle, &v.handle)),
        &out.handle,
        n,
        scalars,
    );
    // Views of the one output buffer, no copies.
    let out = Tensor::<1>::from_primitive::<CubeBackend>(out);
    Some([0, 1, 2].map(|k| out.clone().narrow(0, k * n, n)))
}
