//! Megatron's distributed optimizer (`--use-distributed-optimizer`, ZeRO stage 1): Adam's
//! state is cut over the data-parallel ranks instead of being replicated on each.
//!
//! As in llm.c, the parameters are laid end to end in one flat buffer (declaration order,
//! padded to a multiple of the data-parallel size), so a rank's share is a contiguous range
//! of it and sharding is offset arithmetic. One step: the flat gradient is reduce-scattered
//! (each rank receives the sum of its range), the global norm is all-reduced from the shards,
//! Adam updates the rank's range of the parameters with its range of the moments, and the
//! updated ranges are all-gathered back into every rank's full model.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Bool, Device, Tensor, TensorData};

use super::adamw::{AdamWConfig, NamedMoments};
use super::grad_buffer::GradientAccumulator;
use super::LearningRates;
use crate::comm::{tensor as comm_tensor, CommError, Group, ReduceOp};
use crate::util::fixed_order_sum::fixed_order_sum;

/// One parameter's place in the flat buffer.
#[derive(Clone, Debug)]
struct Entry {
    id: ParamId,
    name: String,
    shape: Vec<usize>,
    offset: usize,
    decay: bool,
}

impl Entry {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

struct Layout<'a> {
    names: &'a HashMap<ParamId, String>,
    entries: Vec<Entry>,
    total: usize,
}

impl ModuleVisitor for Layout<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let shape = param.val().dims().to_vec();
        let entry = Entry {
            id: param.id,
            name: self.names.get(&param.id).cloned().unwrap_or_default(),
            offset: self.total,
            decay: D >= 2,
            shape,
        };
        self.total += entry.len();
        self.entries.push(entry);
    }
}

/// Flattened values of every parameter, by id.
struct Flatten {
    values: HashMap<ParamId, Tensor<1>>,
}

impl ModuleVisitor for Flatten {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val().inner();
        let n = value.shape().num_elements();
        self.values.insert(param.id, value.reshape([n]));
    }
}

/// Replaces parameters by new flattened values, keeping autodiff tracking.
struct Replace {
    values: HashMap<ParamId, Tensor<1>>,
}

impl ModuleMapper for Replace {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(flat) = self.values.remove(&param.id) else {
            return param;
        };
        let (id, value, mapper) = param.consume();
        let shape: [usize; D] = value.dims();
        let p = flat.reshape(shape);
        let p = if value.is_autodiff() {
            p.autodiff().require_grad()
        } else {
            p
        };
        Param::from_mapped_value(id, p, mapper)
    }
}

/// Adam with decoupled weight decay whose state is sharded over the data-parallel group.
pub struct DistributedAdamW {
    config: AdamWConfig,
    steps: u64,
    /// Whether a step counts the zero elements of its summed gradient shard
    /// (`--log-num-zeros-in-grad`), and what the last one counted over the world.
    count_zeros: bool,
    num_zeros_in_grad: Option<u64>,
    entries: Vec<Entry>,
    padded: usize,
    shard: Range<usize>,
    m: Tensor<1>,
    v: Tensor<1>,
    /// Where weight decay applies, over the shard.
    decay: Tensor<1, Bool>,
    /// Where the decoupled learning rate applies (word embedding, output layer), over the
    /// shard.
    decoupled: Tensor<1, Bool>,
    /// 1 where the element counts in the global norm on this rank (a parameter replicated
    /// over tensor-parallel ranks counts on tensor-parallel rank 0 only), over the shard.
    counted: Tensor<1>,
    data: Group,
}

impl DistributedAdamW {
    /// The optimizer for `module`'s parameters (`names` by id, for checkpoints), sharded over
    /// `data`; `not_counted` are the parameters left out of the global norm on this rank
    /// because another rank counts them (see
    /// [`GradientAccumulator::clip_global_norm_parallel`]).
    pub fn new<M: Module>(
        config: AdamWConfig,
        module: &M,
        names: &HashMap<ParamId, String>,
        not_counted: &HashSet<ParamId>,
        decoupled_params: &HashSet<ParamId>,
        data: Group,
        device: &Device,
    ) -> Self {
        let mut layout = Layout {
            names,
            entries: Vec::new(),
            total: 0,
        };
        module.visit(&mut layout);
        let dp = data.size();
        let padded = layout.total.div_ceil(dp) * dp;
        let len = padded / dp;
        let shard = data.rank() * len..(data.rank() + 1) * len;
        let mut decay = vec![false; len];
        let mut decoupled = vec![false; len];
        let mut counted = vec![0f32; len];
        for e in &layout.entries {
            let start = e.offset.max(shard.start);
            let end = (e.offset + e.len()).min(shard.end);
            if start < end {
                let counts = !not_counted.contains(&e.id);
                let local = start - shard.start..end - shard.start;
                decay[local.clone()].fill(e.decay);
                decoupled[local.clone()].fill(decoupled_params.contains(&e.id));
                counted[local].fill(if counts { 1.0 } else { 0.0 });
            }
        }
        Self {
            config,
            steps: 0,
            count_zeros: false,
            num_zeros_in_grad: None,
            entries: layout.entries,
            padded,
            shard,
            m: Tensor::zeros([len], device),
            v: Tensor::zeros([len], device),
            decay: Tensor::from_data(TensorData::new(decay, [len]), device),
            decoupled: Tensor::from_data(TensorData::new(decoupled, [len]), device),
            counted: Tensor::from_data(TensorData::new(counted, [len]), device),
            data,
        }
    }

    /// Whether steps count the zero elements of the summed gradients
    /// (`--log-num-zeros-in-grad`).
    pub fn count_zeros(&mut self, count: bool) {
        self.count_zeros = count;
    }

    /// What the last step counted, over the world: the zero elements of the summed
    /// gradients, each parameter counted once (as the global norm counts it).
    pub fn num_zeros_in_grad(&self) -> Option<u64> {
        self.num_zeros_in_grad
    }

    /// Number of steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The decoupled weight decay of the next steps.
    pub fn weight_decay(&self) -> f64 {
        self.config.weight_decay
    }

    /// Sets the weight decay of the next steps (the weight-decay schedule's value).
    pub fn set_weight_decay(&mut self, weight_decay: f64) {
        self.config.weight_decay = weight_decay;
    }

    /// Elements of Adam state (both moments) this rank holds, and what one rank would hold
    /// without sharding.
    pub fn state_elements(&self) -> (usize, usize) {
        (
            2 * self.shard.len(),
            2 * self.entries.iter().map(Entry::len).sum::<usize>(),
        )
    }

    /// The flat buffer of `values` by id, in layout order, zero-padded.
    fn flat(&self, mut values: impl FnMut(&Entry) -> Tensor<1>, device: &Device) -> Tensor<1> {
        let mut parts: Vec<Tensor<1>> = self.entries.iter().map(&mut values).collect();
        let total: usize = self.entries.iter().map(Entry::len).sum();
        if self.padded > total {
            parts.push(Tensor::zeros([self.padded - total], device));
        }
        Tensor::cat(parts, 0)
    }

    /// One step: reduce-scatters `grads` over the data-parallel group, clips by the global
    /// norm (squares all-reduced over `norm_group`, the whole world), updates this rank's
    /// range and all-gathers the new parameters into `module`. Returns the module and the
    /// norm before clipping.
    pub fn step<M: Module>(
        &mut self,
        module: M,
        grads: &GradientAccumulator,
        lr: LearningRates,
        max_norm: f64,
        norm_group: &Group,
    ) -> Result<(M, f64), CommError> {
        let device = self.m.device();
        let flat_grads = self.flat(
            |e| {
                grads
                    .get(&e.id)
                    .unwrap_or_else(|| Tensor::zeros([e.len()], &device))
            },
            &device,
        );
        let mut g = comm_tensor::reduce_scatter(&self.data, flat_grads, 0, ReduceOp::Sum)?;
        let local =
            fixed_order_sum(g.clone().square() * self.counted.clone()).into_scalar::<f32>() as f64;
        let norm = norm_group.all_reduce_scalar(local, ReduceOp::Sum)?.sqrt();
        self.num_zeros_in_grad = if self.count_zeros {
            let zeros = (g.clone().equal_elem(0.0).float() * self.counted.clone())
                .sum()
                .into_scalar::<f32>() as f64;
            Some(norm_group.all_reduce_scalar(zeros, ReduceOp::Sum)?.round() as u64)
        } else {
            None
        };
        if max_norm > 0.0 {
            let coefficient = max_norm / (norm + 1e-6);
            if coefficient < 1.0 {
                g = g.mul_scalar(coefficient);
            }
        }

        self.steps += 1;
        let c = &self.config;
        let t = self.steps as i32;
        self.m = self.m.clone().mul_scalar(c.beta1) + g.clone().mul_scalar(1.0 - c.beta1);
        self.v = self.v.clone().mul_scalar(c.beta2) + g.square().mul_scalar(1.0 - c.beta2);
        let m_hat = self.m.clone().div_scalar(1.0 - c.beta1.powi(t));
        let v_hat = self.v.clone().div_scalar(1.0 - c.beta2.powi(t));
        let update = m_hat / v_hat.sqrt().add_scalar(c.eps);

        let mut flatten = Flatten {
            values: HashMap::new(),
        };
        module.visit(&mut flatten);
        let params = self.flat(
            |e| flatten.values.remove(&e.id).expect("a parameter"),
            &device,
        );
        let p = params.narrow(0, self.shard.start, self.shard.len());
        let len = self.shard.len();
        let (p, update) = if lr.decoupled == lr.base {
            let decayed = p.clone().mul_scalar(1.0 - lr.base * c.weight_decay);
            (
                p.mask_where(self.decay.clone(), decayed),
                update.mul_scalar(lr.base),
            )
        } else {
            // The learning rate per element: the decoupled one on its parameters.
            let rates = Tensor::<1>::full([len], lr.base, &device)
                .mask_fill(self.decoupled.clone(), lr.decoupled);
            let keep = rates.clone().mul_scalar(-c.weight_decay).add_scalar(1.0);
            let decayed = p.clone() * keep;
            (p.mask_where(self.decay.clone(), decayed), update * rates)
        };
        let p = p - update;
        debug_assert_eq!(p.dims()[0], len);

        let full = comm_tensor::all_gather(&self.data, p, 0)?;
        let values = self
            .entries
            .iter()
            .map(|e| (e.id, full.clone().narrow(0, e.offset, e.len())))
            .collect();
        Ok((module.map(&mut Replace { values }), norm))
    }

    /// Adam's moments of every parameter, gathered from all data-parallel ranks (a
    /// collective: every rank of the group calls it), for checkpoints.
    pub fn export(&self) -> Result<Vec<NamedMoments>, CommError> {
        let m = comm_tensor::all_gather(&self.data, self.m.clone(), 0)?;
        let v = comm_tensor::all_gather(&self.data, self.v.clone(), 0)?;
        let (m, v) = (
            m.try_into_vec_as::<f32>().expect("f32"),
            v.try_into_vec_as::<f32>().expect("f32"),
        );
        Ok(self
            .entries
            .iter()
            .map(|e| NamedMoments {
                name: e.name.clone(),
                m: m[e.offset..e.offset + e.len()].to_vec(),
                v: v[e.offset..e.offset + e.len()].to_vec(),
            })
            .collect())
    }

    /// Restores state saved by [`Self::export`] (or by the replicated optimizer) after
    /// `steps` steps: this rank keeps its range.
    pub fn import(&mut self, steps: u64, moments: &[NamedMoments]) {
        let device = self.m.device();
        let by_name: HashMap<&str, &NamedMoments> =
            moments.iter().map(|m| (m.name.as_str(), m)).collect();
        let (mut m, mut v) = (vec![0f32; self.padded], vec![0f32; self.padded]);
        for e in &self.entries {
            if let Some(saved) = by_name.get(e.name.as_str()) {
                if saved.m.len() == e.len() && saved.v.len() == e.len() {
                    m[e.offset..e.offset + e.len()].copy_from_slice(&saved.m);
                    v[e.offset..e.offset + e.len()].copy_from_slice(&saved.v);
                }
            }
        }
        let mine = |x: Vec<f32>| {
            let part = x[self.shard.clone()].to_vec();
            Tensor::from_data(TensorData::new(part, [self.shard.len()]), &device)
        };
        self.steps = steps;
        self.m = mine(m);
        self.v = mine(v);
    }
}
