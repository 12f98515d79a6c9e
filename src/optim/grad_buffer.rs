//! Gradients accumulated over the micro-batches of one step, in fp32 whatever precision the
//! model computes in (Megatron's `main_grad` buffers, `--accumulate-allreduce-grads-in-fp32`),
//! with what is done to them before the optimizer step: the data-parallel all-reduce in
//! buckets, unscaling and the overflow check of mixed precision, and clipping by the global
//! norm.

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Tensor};

use crate::comm::CommError;
use crate::comm::{Group, ReduceOp};
use crate::util::device::at_least_f32;
use crate::util::fixed_order_sum::fixed_order_sum;

/// The global gradient norm of a step: already a host value, or a one-element device tensor
/// still to be read (see [`GradientAccumulator::clip_global_norm_deferred`]).
#[derive(Clone)]
pub enum GradNorm {
    /// Read already (it went through a host collective).
    Read(f64),
    /// On the device, not read yet.
    OnDevice(Box<Tensor<1>>),
}

/// Gradients summed over the micro-batches of one step, flattened, by parameter.
///
/// Parameters are kept in the module's declaration order, so reductions over them (the
/// global norm) add in the same order in every run: bitwise reproducible.
///
/// A parameter with one contribution so far keeps it as the backward pass gave it (in half
/// precision for a half-precision model) and is read in fp32: cast when it is read, or by a
/// consumer that casts as it copies ([`Self::drain_as_stored`]: the flat-buffer optimizer),
/// which saves a cast kernel and a pass per parameter and step. The values are the same
/// either way: a cast is exact, and a sum of two contributions is taken in fp32.
#[derive(Default)]
pub struct GradientAccumulator {
    grads: HashMap<ParamId, Tensor<1>>,
    order: Vec<ParamId>,
    /// Sum in the gradients' own dtype instead of fp32 (see [`Self::in_model_dtype`]).
    model_dtype: bool,
}

struct Accumulate<'a> {
    incoming: &'a mut GradientsParams,
    into: &'a mut HashMap<ParamId, Tensor<1>>,
    order: &'a mut Vec<ParamId>,
    model_dtype: bool,
    added: Vec<ParamId>,
}

impl ModuleVisitor for Accumulate<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.incoming.remove::<D>(param.id) {
            let n = g.shape().num_elements();
            sum_into(
                self.into,
                self.order,
                self.model_dtype,
                param.id,
                g.reshape([n]),
            );
            self.added.push(param.id);
        }
    }
}

/// `into[id] += g` (or `= g`, recording `id` in `order`), in fp32 unless `model_dtype`: half
/// precision models give half-precision gradients, summed in fp32. A first contribution is
/// kept as it is (see [`GradientAccumulator`]).
fn sum_into(
    into: &mut HashMap<ParamId, Tensor<1>>,
    order: &mut Vec<ParamId>,
    model_dtype: bool,
    id: ParamId,
    g: Tensor<1>,
) {
    let sum = match into.remove(&id) {
        Some(acc) => read_as(model_dtype, acc) + read_as(model_dtype, g),
        None => {
            if !order.contains(&id) {
                order.push(id);
            }
            g
        }
    };
    into.insert(id, sum);
}

/// A stored gradient as it is read: fp32, or as stored in an accumulator in the model's dtype.
fn read_as(model_dtype: bool, g: Tensor<1>) -> Tensor<1> {
    if model_dtype {
        g
    } else {
        at_least_f32(g)
    }
}

impl GradientAccumulator {
    /// `g` (one of this accumulator's) as it is read.
    fn read(&self, g: &Tensor<1>) -> Tensor<1> {
        read_as(self.model_dtype, g.clone())
    }

    /// Every stored gradient in the dtype it is read in, before they are changed in place.
    fn settle(&mut self) {
        let model_dtype = self.model_dtype;
        for g in self.grads.values_mut() {
            *g = read_as(model_dtype, g.clone());
        }
    }

    /// An accumulator for the pieces of *one* backward pass that runs as several (activation
    /// recomputation): it sums in the model's dtype, as autodiff sums the contributions of a
    /// parameter used twice (the tied embedding) within one pass, so that merging it
    /// ([`Self::merge`]) gives the fp32 sums of one whole pass bit for bit.
    pub fn in_model_dtype() -> Self {
        Self {
            model_dtype: true,
            ..Self::default()
        }
    }

    /// Adds the gradients of one backward pass (`loss.backward()`) of `module`.
    pub fn add<M: Module>(&mut self, module: &M, mut grads: Gradients) {
        self.add_listing(module, &mut grads);
    }

    /// Adds the gradients in `grads` of `module`'s parameters (taking them out of `grads`: a
    /// part of the model, the rest left for another), returning those parameters in
    /// declaration order: what one piece of a backward pass run in pieces touched.
    pub fn add_listing<M: Module>(&mut self, module: &M, grads: &mut Gradients) -> Vec<ParamId> {
        let mut incoming = GradientsParams::from_module(grads, module);
        let mut visitor = Accumulate {
            incoming: &mut incoming,
            into: &mut self.grads,
            order: &mut self.order,
            model_dtype: self.model_dtype,
            added: Vec::new(),
        };
        module.visit(&mut visitor);
        visitor.added
    }

    /// Removes and returns the gradient of `id` (its place in the order stays: put a
    /// gradient back with [`Self::insert`] before reading norms).
    pub fn take(&mut self, id: &ParamId) -> Option<Tensor<1>> {
        let g = self.grads.remove(id)?;
        Some(self.read(&g))
    }

    /// The gradient so far of `id` plus `g` (summed as [`Self::merge`] sums), taken out of
    /// the accumulator: the final gradient of a parameter whose last contribution is `g`.
    pub fn take_sum(&mut self, id: ParamId, g: Tensor<1>) -> Tensor<1> {
        sum_into(&mut self.grads, &mut self.order, self.model_dtype, id, g);
        let sum = self.grads.remove(&id).expect("just summed");
        self.read(&sum)
    }

    /// Sets the gradient of `id`.
    pub fn insert(&mut self, id: ParamId, g: Tensor<1>) {
        if !self.order.contains(&id) {
            self.order.push(id);
        }
        self.grads.insert(id, g);
    }

    /// Puts the parameters back in `module`'s declaration order (after gradients were
    /// inserted in another order), so reductions over them add in the usual order.
    pub fn restore_declaration_order<M: Module>(&mut self, module: &M) {
        struct Declared(Vec<ParamId>);
        impl ModuleVisitor for Declared {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0.push(param.id);
            }
        }
        let mut declared = Declared(Vec::new());
        module.visit(&mut declared);
        let position: HashMap<ParamId, usize> = declared
            .0
            .into_iter()
            .enumerate()
            .map(|(i, id)| (id, i))
            .collect();
        self.order
            .sort_by_key(|id| position.get(id).copied().unwrap_or(usize::MAX));
    }

    /// The gradients left, in declaration order, taken out.
    pub fn drain(&mut self) -> Vec<(ParamId, Tensor<1>)> {
        self.settle();
        self.drain_as_stored()
    }

    /// [`Self::drain`] without the cast of a gradient with one contribution: each as the
    /// backward pass gave it (in the model's dtype) or summed (fp32), for a consumer that
    /// casts to fp32 as it copies.
    pub fn drain_as_stored(&mut self) -> Vec<(ParamId, Tensor<1>)> {
        let order = std::mem::take(&mut self.order);
        order
            .into_iter()
            .filter_map(|id| self.grads.remove(&id).map(|g| (id, g)))
            .collect()
    }

    /// Adds `other` (one micro-batch's gradients gathered from several backward passes, as
    /// with recomputation) parameter by parameter in `module`'s declaration order, so the sums
    /// and their order are those of one whole backward pass.
    pub fn merge<M: Module>(&mut self, module: &M, mut other: GradientAccumulator) {
        struct Merge<'a> {
            from: &'a mut HashMap<ParamId, Tensor<1>>,
            into: &'a mut GradientAccumulator,
        }
        impl ModuleVisitor for Merge<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(g) = self.from.remove(&param.id) {
                    let into = &mut *self.into;
                    sum_into(
                        &mut into.grads,
                        &mut into.order,
                        into.model_dtype,
                        param.id,
                        g,
                    );
                }
            }
        }
        module.visit(&mut Merge {
            from: &mut other.grads,
            into: self,
        });
    }

    /// `Σ g²` over the parameters `counted` selects (one host read).
    pub fn sum_of_squares(&self, counted: impl Fn(&ParamId) -> bool) -> f64 {
        self.sum_of_squares_on_device(counted)
            .map_or(0.0, |t| t.into_scalar::<f32>() as f64)
    }

    /// `Σ g²` as a one-element tensor on the gradients' device (no host read); `None` when
    /// no gradient is counted.
    pub fn sum_of_squares_on_device(
        &self,
        counted: impl Fn(&ParamId) -> bool,
    ) -> Option<Tensor<1>> {
        let mut total: Option<Tensor<1>> = None;
        for id in &self.order {
            if !counted(id) {
                continue;
            }
            let s = fixed_order_sum(self.read(&self.grads[id]).square());
            total = Some(match total {
                Some(t) => t + s,
                None => s,
            });
        }
        total
    }

    /// How many gradient elements of the `counted` parameters are exactly zero, on the
    /// device (`--log-num-zeros-in-grad`).
    pub fn count_zeros_on_device(&self, counted: impl Fn(&ParamId) -> bool) -> Option<Tensor<1>> {
        let mut total: Option<Tensor<1>> = None;
        for id in self.order.iter().filter(|id| counted(id)) {
            let zeros = self.read(&self.grads[id]).equal_elem(0.0).float().sum();
            total = Some(match total {
                Some(t) => t + zeros,
                None => zeros,
            });
        }
        total
    }

    /// Whether every gradient is finite (one host read): `g · 0` is 0 for a finite `g` and NaN
    /// for ±inf or NaN, so the sum of all of them is 0 exactly when nothing overflowed.
    pub fn all_finite(&self) -> bool {
        let mut total: Option<Tensor<1>> = None;
        for id in &self.order {
            let s = self.read(&self.grads[id]).mul_scalar(0.0).sum();
            total = Some(match total {
                Some(t) => t + s,
                None => s,
            });
        }
        total.is_none_or(|t| t.into_scalar::<f32>() == 0.0)
    }

    /// Global L2 norm of all gradients (one host read).
    pub fn global_norm(&self) -> f64 {
        self.sum_of_squares(|_| true).sqrt()
    }

    /// Multiplies every gradient by `factor`.
    pub fn scale(&mut self, factor: f64) {
        self.settle();
        for g in self.grads.values_mut() {
            *g = g.clone().mul_scalar(factor);
        }
    }

    /// Scales the gradients down so that their norm `norm` becomes `max_norm` (no-op when
    /// already below, or when `max_norm` is 0); returns `norm`.
    pub fn clip_to(&mut self, norm: f64, max_norm: f64) -> f64 {
        if max_norm > 0.0 {
            let coefficient = max_norm / (norm + 1e-6);
            if coefficient < 1.0 {
                self.scale(coefficient);
            }
        }
        norm
    }

    /// Clips to `max_norm` by the global norm (Megatron's `clip_grad_norm_fp32`) and returns
    /// the norm before clipping.
    pub fn clip_global_norm(&mut self, max_norm: f64) -> f64 {
        self.settle();
        let norm = self.global_norm();
        self.clip_to(norm, max_norm)
    }

    /// [`Self::clip_global_norm`] over the ranks of one model replica (tensor × pipeline):
    /// each rank's squares are all-reduced over `group`, leaving out `not_counted`, the
    /// parameters another rank counts already (a parameter replicated over tensor-parallel
    /// ranks counts on tensor-parallel rank 0 only; the last stage's copy of the tied word
    /// embedding not at all), so every rank clips by the norm of the whole model.
    pub fn clip_global_norm_parallel(
        &mut self,
        max_norm: f64,
        not_counted: &HashSet<ParamId>,
        group: &Group,
    ) -> Result<f64, CommError> {
        self.settle();
        let local = self.sum_of_squares(|id| !not_counted.contains(id));
        let total = group.timed(|| group.all_reduce_scalar(local, ReduceOp::Sum))?;
        Ok(self.clip_to(total.sqrt(), max_norm))
    }

    /// [`Self::clip_global_norm_parallel`] without reading the device when `group` has one
    /// rank (a single GPU): the norm, the clipping coefficient `min(1, max_norm / (norm +
    /// 1e-6))` and the scaling stay on the device, and the norm comes back as a tensor, to be
    /// read with the losses once per step. With more ranks the squares are summed over the
    /// group through the host, as [`Self::clip_global_norm_parallel`] does.
    pub fn clip_global_norm_deferred(
        &mut self,
        max_norm: f64,
        not_counted: &HashSet<ParamId>,
        group: &Group,
    ) -> Result<GradNorm, CommError> {
        self.settle();
        if group.size() > 1 {
            return Ok(GradNorm::Read(self.clip_global_norm_parallel(
                max_norm,
                not_counted,
                group,
            )?));
        }
        let Some(squares) = self.sum_of_squares_on_device(|id| !not_counted.contains(id)) else {
            return Ok(GradNorm::Read(0.0));
        };
        let norm = squares.sqrt();
        if max_norm > 0.0 {
            // Below the limit the coefficient is exactly 1, and multiplying by it changes
            // nothing.
            let coefficient = norm
                .clone()
                .add_scalar(1e-6)
                .recip()
                .mul_scalar(max_norm)
                .clamp_max(1.0);
            for g in self.grads.values_mut() {
                *g = g.clone() * coefficient.clone();
            }
        }
        Ok(GradNorm::OnDevice(Box::new(norm)))
    }

    /// Sums the gradients over the data-parallel `group` (Megatron's DDP: every rank's
    /// gradients were computed with the loss already divided by the global number of
    /// micro-batches, so the sum is the gradient of the global batch). Parameters are
    /// concatenated in declaration order into buckets of at least `bucket_elements` elements,
    /// one all-reduce each, so small parameters do not each pay a collective's latency.
    pub fn all_reduce_in_buckets(
        &mut self,
        group: &Group,
        bucket_elements: usize,
    ) -> Result<(), CommError> {
        if group.size() == 1 {
            return Ok(());
        }
        self.settle();
        let mut bucket: Vec<ParamId> = Vec::new();
        let mut filled = 0;
        for (k, id) in self.order.iter().enumerate() {
            bucket.push(*id);
            filled += self.grads[id].dims()[0];
            if filled >= bucket_elements || k + 1 == self.order.len() {
                let parts: Vec<Tensor<1>> =
                    bucket.iter().map(|id| self.grads[id].clone()).collect();
                let sizes: Vec<usize> = parts.iter().map(|p| p.dims()[0]).collect();
                let flat = Tensor::cat(parts, 0);
                let summed = crate::comm::tensor::all_reduce(group, flat, ReduceOp::Sum)?;
                let mut offset = 0;
                for (id, n) in bucket.drain(..).zip(sizes) {
                    self.grads.insert(id, summed.clone().narrow(0, offset, n));
                    offset += n;
                }
                filled = 0;
            }
        }
        Ok(())
    }

    /// Sums the gradients of the parameters `ids` over `group` (Megatron's embedding group:
    /// the first and the last pipeline stage each hold the tied word embedding and each
    /// computed the gradient of one of its two uses; both then take the sum, so both copies
    /// stay equal).
    pub fn all_reduce_parameters(
        &mut self,
        ids: &[ParamId],
        group: &Group,
    ) -> Result<(), CommError> {
        if group.size() == 1 {
            return Ok(());
        }
        self.settle();
        for id in ids {
            let g = self.grads.get(id).cloned().ok_or_else(|| {
                CommError::Invalid("a shared parameter has no gradient on this rank".into())
            })?;
            let summed = crate::comm::tensor::all_reduce(group, g, ReduceOp::Sum)?;
            self.grads.insert(*id, summed);
        }
        Ok(())
    }

    /// The parameters with gradients, in declaration order.
    pub fn order(&self) -> &[ParamId] {
        &self.order
    }

    /// The gradient of a parameter, flattened.
    pub fn get(&self, id: &ParamId) -> Option<Tensor<1>> {
        self.grads.get(id).map(|g| self.read(g))
    }
}
