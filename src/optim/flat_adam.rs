//! Adam over flat buffers on CubeCL devices (llm.c's layout; Megatron's `param_and_grad_buffer`
//! does the same for its distributed optimizer): the fp32 main weights and both moments each
//! live in one buffer, every parameter of the model is a view into the first, and a step
//! gathers the gradients into one more.
//!
//! Why: on a GPU a small model's step is bound by the host's cost per launch (measured with
//! 24 layers at hidden 64, with and without this:
//! `benchmarks/results/2026-11-26-h200-flat-adam.md`), and per parameter the previous step
//! launched about seven kernels (norm square and sum, clip multiply, Adam, the half-precision
//! cast), a large share of a GPT's launches (benchmarks/results/
//! 2026-12-03-figures-from-comments.md). Here a step is one copy per four parameters
//! (their gradients into the flat buffer), two launches for the global norm and the clipping
//! coefficient (read on the device, so nothing waits for the host), one in-place Adam launch per
//! parameter group (learning rate × weight decay: at most four; the values that change from
//! step to step read from device memory) and one cast for the half-precision working copy,
//! into one kept buffer in place. Nothing is read from the host and every kept buffer is
//! updated in place, so a step can be captured as a graph and replayed
//! (`crate::training::step_graph`). The gradient buffer lives only through the step (kept, it
//! would add its size to the backward pass's activation peak), the norm's scratch is one
//! number per 16,384 gradients, and the per-parameter gradients are freed once copied.
//!
//! The arithmetic is the per-parameter step's; only the norm's summation order differs (one
//! sum over the buffer instead of a sum of per-parameter sums). Unlike the per-parameter step,
//! a parameter without a gradient in a step is stepped with a zero gradient, as Megatron's
//! buffers do (its moments decay, its weight decays).

use std::cell::{OnceCell, RefCell};
use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Device, FloatDType, Shape, Tensor, TensorData};
use burn_cubecl::cubecl::bytes::Bytes;
use burn_cubecl::cubecl::prelude::CubeElement;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use ferrotron_kernels::half::{bf16, f16};
use ferrotron_kernels::launch::{self as kernels, AdamScalars, CopyPiece, RowLaunch};

use super::optimizer::{Optimizer, OptimizerSetup};
use super::{AdamWConfig, GradNorm, GradientAccumulator, LearningRates, NamedMoments};
use crate::comm::CommError;
use crate::util::cube_tensor::{empty_like, packed};

/// Where one parameter lives in the flat buffers.
struct Segment {
    id: ParamId,
    offset: usize,
    len: usize,
}

/// A run of parameters that share learning rate and weight decay: one Adam launch.
struct Group {
    start: usize,
    len: usize,
    decay: bool,
    decoupled: bool,
}

/// The flat buffers and where each parameter is in them.
struct FlatBuffers {
    segments: Vec<Segment>,
    by_id: HashMap<ParamId, usize>,
    groups: Vec<Group>,
    total: usize,
    params: CubeTensor,
    m: CubeTensor,
    v: CubeTensor,
    /// The Adam launches' per-step values, four f32 per group ([`AdamScalars::per_step`]),
    /// and what was last written there: rewritten only when they change, so a step whose
    /// values were written before it (a captured step's replay) writes nothing itself.
    per_step: CubeTensor,
    per_step_written: RefCell<Vec<f32>>,
    /// The half-precision working copy of `params`, cast into in place each step (a captured
    /// step's forward reads the buffer the previous replay's cast wrote).
    half: OnceCell<CubeTensor>,
}

/// Adam with decoupled weight decay over flat buffers (see the module's docs), replicated on
/// every data-parallel rank, for a model replica on one device.
pub struct FlatAdamW {
    config: AdamWConfig,
    clip_grad: f64,
    names: Vec<(ParamId, String)>,
    decoupled: HashSet<ParamId>,
    steps: u64,
    /// Moments to resume from, uploaded when the buffers are built (at the first step).
    saved: Vec<NamedMoments>,
    buffers: Option<FlatBuffers>,
    /// The gradients gathered, unscaled and measured by [`Optimizer::unscale_and_check`]
    /// for the next step.
    prepared: Option<Prepared>,
    /// Whether the module a step is given views the main-weight buffer already: after the
    /// first step, whose module it returned does (each step is given the module the step
    /// before returned, as [`super::MixedPrecisionOptimizer`] does). Why: building a view of
    /// the buffer for each of a 24-layer GPT's 292 parameters cost host time every step, for
    /// the same views (measured: benchmarks/results/2026-11-29-lavapipe-host-thread-work.md).
    module_views_params: bool,
}

/// A step's gradient buffer with its global norm (read already) and clipping coefficient.
struct Prepared {
    grads: CubeTensor,
    norm: f64,
    clip: CubeTensor,
}

/// `t` as a contiguous f32 CubeCL tensor; flat Adam runs only where that holds.
fn cube_f32(t: Tensor<1>, what: &str) -> CubeTensor {
    super::fused_adam::cube_f32(&t)
        .unwrap_or_else(|| panic!("flat Adam: {what} is not an fp32 tensor on a CubeCL device"))
}

/// `t` (f32, f16 or bf16) as a contiguous tensor on a CubeCL device.
fn cube_tensor(t: Tensor<1>) -> CubeTensor {
    let dtype = t.dtype();
    assert!(
        matches!(dtype, DType::F32 | DType::F16 | DType::BF16),
        "flat Adam: a {dtype:?} parameter or gradient"
    );
    let cube = t
        .try_into_primitive::<CubeBackend>()
        .unwrap_or_else(|_| panic!("flat Adam: a gradient not on a CubeCL device"));
    packed(cube)
}

fn tensor(cube: &CubeTensor) -> Tensor<1> {
    Tensor::<1>::from_primitive::<CubeBackend>(cube.clone())
}

/// The parameters of a module in declaration order: id, whether weight decay applies (two or
/// more dimensions, as Megatron: not biases or norms) and the flattened fp32 value.
fn collect_parameters<M: Module>(module: &M) -> Vec<(ParamId, bool, Tensor<1>)> {
    struct Collect(Vec<(ParamId, bool, Tensor<1>)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            let value = if value.is_autodiff() {
                value.inner()
            } else {
                value
            };
            let n = value.shape().num_elements();
            self.0.push((param.id, D >= 2, value.reshape([n])));
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}

impl FlatBuffers {
    /// The buffers for `module`'s parameters, grouped by (decoupled learning rate, weight
    /// decay), each parameter starting at an offset views of it can take without a copy (burn
    /// slices a buffer in place only at the device's memory alignment, for every dtype the
    /// working copy may have).
    fn build<M: Module>(
        module: &M,
        decoupled: &HashSet<ParamId>,
        saved: &[NamedMoments],
        names: &[(ParamId, String)],
    ) -> Option<Self> {
        let mut params = collect_parameters(module);
        let first = params.first()?.2.clone();
        let device = first.device();
        let alignment = cube_f32(first, "a parameter")
            .client
            .properties()
            .memory
            .alignment;
        // Half precision is the narrowest dtype a view is taken in.
        let pad = (alignment as usize / 2).max(1);
        params.sort_by_key(|(id, decay, _)| (!decoupled.contains(id), !decay));
        let mut segments = Vec::with_capacity(params.len());
        let mut groups: Vec<Group> = Vec::new();
        let mut total = 0;
        for (id, decay, value) in &params {
            let (len, is_decoupled) = (value.dims()[0], decoupled.contains(id));
            match groups.last_mut() {
                Some(g) if g.decay == *decay && g.decoupled == is_decoupled => {
                    g.len = total + len - g.start;
                }
                _ => groups.push(Group {
                    start: total,
                    len,
                    decay: *decay,
                    decoupled: is_decoupled,
                }),
            }
            segments.push(Segment {
                id: *id,
                offset: total,
                len,
            });
            total += len.div_ceil(pad) * pad;
        }
        let zeros = |n| cube_f32(Tensor::<1>::zeros([n], &device), "a flat buffer");
        let [m, v] = Self::upload_moments(&segments, total, saved, names, &device);
        let per_step = zeros(4 * groups.len());
        let buffers = Self {
            by_id: segments
                .iter()
                .enumerate()
                .map(|(k, s)| (s.id, k))
                .collect(),
            params: zeros(total),
            m,
            v,
            per_step,
            per_step_written: RefCell::new(Vec::new()),
            half: OnceCell::new(),
            segments,
            groups,
            total,
        };
        let values = params.into_iter().map(|(_, _, value)| value);
        buffers.copy_in(values.zip(&buffers.segments), &buffers.params, 1.0);
        Some(buffers)
    }

    /// Both moment buffers: zeros, or the saved moments by parameter name.
    fn upload_moments(
        segments: &[Segment],
        total: usize,
        saved: &[NamedMoments],
        names: &[(ParamId, String)],
        device: &Device,
    ) -> [CubeTensor; 2] {
        let mut host = [vec![0.0f32; total], vec![0.0f32; total]];
        let by_name: HashMap<&str, &NamedMoments> =
            saved.iter().map(|s| (s.name.as_str(), s)).collect();
        let name_of: HashMap<ParamId, &str> =
            names.iter().map(|(id, n)| (*id, n.as_str())).collect();
        for s in segments {
            let Some(found) = name_of.get(&s.id).and_then(|n| by_name.get(n)) else {
                continue;
            };
            for (host, values) in host.iter_mut().zip([&found.m, &found.v]) {
                if values.len() == s.len {
                    host[s.offset..s.offset + s.len].copy_from_slice(values);
                }
            }
        }
        host.map(|h| {
            cube_f32(
                Tensor::<1>::from_data(TensorData::new(h, [total]), device),
                "a moment buffer",
            )
        })
    }

    /// Copies each value (one parameter's elements, f32 or half precision) to its segment of
    /// `into` (f32), cast and multiplied by `scale` on the way, up to 32 per launch (one run
    /// of launches per dtype).
    fn copy_in<'a>(
        &self,
        values: impl Iterator<Item = (Tensor<1>, &'a Segment)>,
        into: &CubeTensor,
        scale: f32,
    ) {
        let sources: Vec<(CubeTensor, &Segment)> = values
            .map(|(value, segment)| (cube_tensor(value), segment))
            .collect();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let pieces: Vec<CopyPiece> = sources
                .iter()
                .filter(|(value, _)| value.dtype == dtype)
                .map(|(value, segment)| CopyPiece {
                    source: &value.handle,
                    offset: segment.offset,
                    len: segment.len,
                })
                .collect();
            let (client, handle, total) = (&into.client, &into.handle, self.total);
            match dtype {
                DType::F16 => {
                    kernels::copy_at_offsets::<f16, f32>(client, &pieces, handle, total, scale)
                }
                DType::BF16 => {
                    kernels::copy_at_offsets::<bf16, f32>(client, &pieces, handle, total, scale)
                }
                _ => kernels::copy_at_offsets::<f32, f32>(client, &pieces, handle, total, scale),
            }
        }
    }

    /// The step's gradients in one fp32 buffer, multiplied by `scale` (zeros for a parameter
    /// without one, and in the padding), taken out of `grads`: a gradient with one
    /// contribution is cast from the model's dtype by the copy itself. Allocated per step, not
    /// kept: a persistent buffer would add its size to the activations' peak in the backward
    /// pass.
    fn gather(&self, grads: &mut GradientAccumulator, scale: f32) -> CubeTensor {
        let device = tensor(&self.params).device();
        let flat = cube_f32(
            Tensor::<1>::zeros([self.total], &device),
            "the gradient buffer",
        );
        // A parameter without a gradient keeps the buffer's zeros. The per-parameter
        // gradients are freed once copied (before the norm's scratch is allocated).
        let mut stored: HashMap<ParamId, Tensor<1>> = grads.drain_as_stored().into_iter().collect();
        let present = self
            .segments
            .iter()
            .filter_map(|segment| Some((stored.remove(&segment.id)?, segment)));
        self.copy_in(present, &flat, scale);
        flat
    }

    /// The global L2 norm of the gradient buffer and the clipping coefficient `min(1,
    /// max_norm / (norm + 1e-6))` (Megatron's `clip_grad_norm_fp32`; exactly 1 below the
    /// limit, and without clipping, `max_norm` 0): one-element tensors on the device, two
    /// launches in an order fixed by the buffer's length.
    fn norm_and_clip(&self, grads: &CubeTensor, max_norm: f64) -> (CubeTensor, CubeTensor) {
        let f32_tensor = |len| empty_like(grads, Shape::new([len]), DType::F32);
        let partials = f32_tensor(kernels::grad_norm_blocks(self.total));
        let (norm, clip) = (f32_tensor(1), f32_tensor(1));
        kernels::grad_norm_and_clip(
            &grads.client,
            RowLaunch::for_client(&grads.client),
            &grads.handle,
            &partials.handle,
            [&norm.handle, &clip.handle],
            self.total,
            max_norm as f32,
        );
        (norm, clip)
    }

    /// Writes the Adam launches' per-step values (one [`AdamScalars`] per group) into their
    /// device buffer, if they are not what it holds.
    fn write_per_step(&self, scalars: &[AdamScalars]) {
        let values: Vec<f32> = scalars.iter().flat_map(AdamScalars::per_step).collect();
        let mut written = self.per_step_written.borrow_mut();
        if *written != values {
            let bytes = f32::as_bytes(&values).to_vec();
            let client = &self.per_step.client;
            client.write(&self.per_step.handle, Bytes::from_bytes_vec(bytes));
            *written = values;
        }
    }

    /// The main weights cast to `dtype` (f16 or bf16) into the kept half-precision buffer, in
    /// place (one launch); `None` for another dtype.
    fn cast_into_half(&self, dtype: FloatDType) -> Option<&CubeTensor> {
        let dtype = match dtype {
            FloatDType::F16 => DType::F16,
            FloatDType::BF16 => DType::BF16,
            _ => return None,
        };
        let half = self
            .half
            .get_or_init(|| empty_like(&self.params, Shape::new([self.total]), dtype));
        assert_eq!(half.dtype, dtype, "the working copy's dtype changed");
        let piece = [CopyPiece {
            source: &self.params.handle,
            offset: 0,
            len: self.total,
        }];
        let (client, into, total) = (&self.params.client, &half.handle, self.total);
        match dtype {
            DType::F16 => kernels::copy_at_offsets::<f32, f16>(client, &piece, into, total, 1.0),
            _ => kernels::copy_at_offsets::<f32, bf16>(client, &piece, into, total, 1.0),
        }
        Some(half)
    }

    /// `module` with every parameter a view of `source` (the main weights, or their cast),
    /// keeping ids and, on an autodiff device, being a leaf that requires a gradient.
    fn views<M: Module>(&self, module: M, source: &Tensor<1>) -> M {
        struct Views<'a> {
            buffers: &'a FlatBuffers,
            source: &'a Tensor<1>,
        }
        impl ModuleMapper for Views<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let (id, value, mapper) = param.consume();
                let Some(&k) = self.buffers.by_id.get(&id) else {
                    return Param::from_mapped_value(id, value, mapper);
                };
                let s = &self.buffers.segments[k];
                let view = self
                    .source
                    .clone()
                    .narrow(0, s.offset, s.len)
                    .reshape(value.dims());
                let view = if value.is_autodiff() {
                    view.autodiff().require_grad()
                } else {
                    view
                };
                Param::from_mapped_value(id, view, mapper)
            }
        }
        module.map(&mut Views {
            buffers: self,
            source,
        })
    }
}

impl FlatAdamW {
    /// A fresh optimizer, or one resuming `saved` (`(steps, moments)`); the buffers are built
    /// from the module at the first step.
    pub fn new(setup: OptimizerSetup, saved: Option<(u64, Vec<NamedMoments>)>) -> Self {
        let (steps, saved) = saved.unwrap_or_default();
        Self {
            config: setup.adam,
            clip_grad: setup.clip_grad,
            names: setup.names,
            decoupled: setup.decoupled_lr,
            steps,
            saved,
            buffers: None,
            prepared: None,
            module_views_params: false,
        }
    }

    /// Writes the next step's per-step values (its learning rates and bias corrections) into
    /// the Adam launches' device buffer, where [`Optimizer::step`] would write them: before
    /// a captured step is recorded or replayed, so that the step itself writes nothing. A
    /// replay does not advance [`Optimizer::steps`] ([`Optimizer::count_replayed_step`]
    /// does).
    pub fn write_next_step_values(&self, lr: LearningRates) {
        let Some(b) = self.buffers.as_ref() else {
            return;
        };
        let next = self.steps + 1;
        let scalars: Vec<AdamScalars> =
            b.groups.iter().map(|g| self.scalars(g, lr, next)).collect();
        b.write_per_step(&scalars);
    }

    /// Builds the buffers from `module` at the first call (none for a module without
    /// parameters).
    fn build_buffers<M: Module>(&mut self, module: &M) {
        if self.buffers.is_none() {
            self.buffers = FlatBuffers::build(module, &self.decoupled, &self.saved, &self.names);
            self.saved = Vec::new();
        }
    }

    /// The scalars of step `step`'s Adam launch for one group.
    fn scalars(&self, group: &Group, lr: LearningRates, step: u64) -> AdamScalars {
        let lr = if group.decoupled {
            lr.decoupled
        } else {
            lr.base
        };
        let decay = if group.decay {
            self.config.weight_decay
        } else {
            0.0
        };
        super::fused_adam::adam_scalars(&self.config, step, lr, decay)
    }
}

impl<M: Module> Optimizer<M> for FlatAdamW {
    fn reduces_data_parallel_grads(&self) -> bool {
        false
    }

    fn update_in_words(&self) -> &'static str {
        "Adam over flat buffers, one fused update per parameter group"
    }

    fn step(
        &mut self,
        module: M,
        grads: &mut GradientAccumulator,
        lr: LearningRates,
    ) -> Result<(M, GradNorm), CommError> {
        let prepared = self.prepared.take();
        self.steps += 1;
        self.build_buffers(&module);
        let Some(b) = self.buffers.as_ref() else {
            return Ok((module, GradNorm::Read(0.0)));
        };
        let (flat_grads, norm, clip) = match prepared {
            Some(p) => (p.grads, GradNorm::Read(p.norm), p.clip),
            None => {
                let flat_grads = b.gather(grads, 1.0);
                let (norm, clip) = b.norm_and_clip(&flat_grads, self.clip_grad);
                let norm = GradNorm::OnDevice(Box::new(tensor(&norm)));
                (flat_grads, norm, clip)
            }
        };
        let step = self.steps;
        let scalars: Vec<AdamScalars> =
            b.groups.iter().map(|g| self.scalars(g, lr, step)).collect();
        b.write_per_step(&scalars);
        for (slot, (group, scalars)) in b.groups.iter().zip(scalars).enumerate() {
            kernels::adam_step_in_place::<f32>(
                &b.params.client,
                &b.params.handle,
                &flat_grads.handle,
                (&b.m.handle, &b.v.handle),
                &clip.handle,
                (&b.per_step.handle, slot),
                b.total,
                (group.start, group.len),
                scalars,
            );
        }
        // Stepped in place: a module that views the buffer already (the one the last step
        // returned) sees the new weights as it is.
        let module = if self.module_views_params {
            module
        } else {
            self.module_views_params = true;
            b.views(module, &tensor(&b.params))
        };
        Ok((module, norm))
    }

    /// Gathers the gradients with the loss scale taken off in the copy, and takes their norm:
    /// a gradient that is ±inf or NaN makes the norm so, as Megatron's check finds it. (Finite
    /// squares could overflow the sum too, but not these: an fp16 gradient is below 65,504
    /// per micro-batch and rank, so with a loss scale ≥ 1, Megatron's minimum, `n` of them
    /// summed over `k` micro-batches and ranks overflow only for `n k² > 7.9e28`.) One read of
    /// the device, as the per-parameter check made.
    fn unscale_and_check(
        &mut self,
        main: &M,
        grads: &mut GradientAccumulator,
        inv_scale: f64,
    ) -> Option<bool> {
        self.build_buffers(main);
        let b = self.buffers.as_ref()?;
        let flat_grads = b.gather(grads, inv_scale as f32);
        let (norm, clip) = b.norm_and_clip(&flat_grads, self.clip_grad);
        let norm = f64::from(tensor(&norm).into_scalar::<f32>());
        self.prepared = Some(Prepared {
            grads: flat_grads,
            norm,
            clip,
        });
        Some(!norm.is_finite())
    }

    fn skip_step(&mut self) {
        self.prepared = None;
    }

    fn working_copy(&self, main: &M, dtype: FloatDType, previous: Option<M>) -> Option<M> {
        let b = self.buffers.as_ref()?;
        let half = b.cast_into_half(dtype)?;
        Some(previous.unwrap_or_else(|| b.views(main.clone(), &tensor(half))))
    }

    fn replayable(&self) -> bool {
        true
    }

    fn write_next_step_values(&self, lr: LearningRates) {
        FlatAdamW::write_next_step_values(self, lr);
    }

    fn count_replayed_step(&mut self) {
        self.steps += 1;
    }

    fn steps(&self) -> u64 {
        self.steps
    }

    fn weight_decay(&self) -> f64 {
        self.config.weight_decay
    }

    fn set_weight_decay(&mut self, weight_decay: f64) {
        self.config.weight_decay = weight_decay;
    }

    fn moments(&self) -> Result<Vec<NamedMoments>, CommError> {
        let Some(b) = self.buffers.as_ref() else {
            return Ok(self.saved.clone());
        };
        let (m, v) = (tensor(&b.m), tensor(&b.v));
        let read = |t: &Tensor<1>, s: &Segment| {
            t.clone()
                .narrow(0, s.offset, s.len)
                .try_into_vec_as::<f32>()
                .expect("an fp32 buffer")
        };
        Ok(self
            .names
            .iter()
            .filter_map(|(id, name)| {
                let s = &b.segments[*b.by_id.get(id)?];
                Some(NamedMoments {
                    name: name.clone(),
                    m: read(&m, s),
                    v: read(&v, s),
                })
            })
            .collect())
    }
}
