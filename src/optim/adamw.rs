//! Megatron's optimizer: Adam with decoupled weight decay (apex `FusedAdam`, `adam_w_mode`),
//! weight decay on weight matrices only (not on biases or LayerNorm), on gradients accumulated
//! in [`GradientAccumulator`] and clipped by their global L2 norm.
//!
//! burn's `AdamW` clips per parameter and keeps its state by burn's parameter ids; this one
//! clips globally, as Megatron does, and exposes its state by parameter name for checkpoints.

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Tensor, TensorData};

use super::grad_buffer::GradientAccumulator;
use super::LearningRates;

/// `--adam-beta1`, `--adam-beta2`, `--adam-eps`, `--weight-decay`.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWConfig {
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay, applied to parameters with two or more dimensions.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// Megatron's defaults.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// First and second moments of one parameter, flattened.
#[derive(Clone)]
struct Moments {
    m: Tensor<1>,
    v: Tensor<1>,
}

/// Adam with decoupled weight decay and bias correction.
pub struct AdamW {
    config: AdamWConfig,
    steps: u64,
    moments: HashMap<ParamId, Moments>,
}

struct Update<'a> {
    optimizer: &'a mut AdamW,
    grads: &'a GradientAccumulator,
    lr: LearningRates,
    /// The parameters that take `lr.decoupled`.
    decoupled: &'a HashSet<ParamId>,
}

impl ModuleMapper for Update<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(g) = self.grads.get(&param.id) else {
            return param;
        };
        let (id, value, mapper) = param.consume();
        let lr = if self.decoupled.contains(&id) {
            self.lr.decoupled
        } else {
            self.lr.base
        };
        let autodiff = value.is_autodiff();
        let shape = value.dims();
        let n = g.dims()[0];
        let p = value.inner().reshape([n]);
        let c = &self.optimizer.config;
        let t = self.optimizer.steps as i32;
        let decay = if D >= 2 { c.weight_decay } else { 0.0 };
        let previous = self.optimizer.moments.remove(&id);
        // One kernel for the whole step on CubeCL devices (fused_adam's docs say why).
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        let fused = {
            let scalars = super::fused_adam::adam_scalars(c, self.optimizer.steps, lr, decay);
            let moments = previous.as_ref().map(|s| (&s.m, &s.v));
            super::fused_adam::adam_step(&p, &g, moments, scalars)
        };
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        let fused: Option<[Tensor<1>; 3]> = None;
        let (p, m, v) = match fused {
            Some([p, m, v]) => (p, m, v),
            None => {
                let (m, v) = match previous {
                    Some(s) => (
                        s.m.mul_scalar(c.beta1) + g.clone().mul_scalar(1.0 - c.beta1),
                        s.v.mul_scalar(c.beta2) + g.square().mul_scalar(1.0 - c.beta2),
                    ),
                    None => (
                        g.clone().mul_scalar(1.0 - c.beta1),
                        g.square().mul_scalar(1.0 - c.beta2),
                    ),
                };
                let m_hat = m.clone().div_scalar(1.0 - c.beta1.powi(t));
                let v_hat = v.clone().div_scalar(1.0 - c.beta2.powi(t));
                let update = m_hat / v_hat.sqrt().add_scalar(c.eps);
                let p = p.mul_scalar(1.0 - lr * decay) - update.mul_scalar(lr);
                (p, m, v)
            }
        };
        self.optimizer.moments.insert(id, Moments { m, v });
        let p = p.reshape(shape);
        let p = if autodiff {
            p.autodiff().require_grad()
        } else {
            p
        };
        Param::from_mapped_value(id, p, mapper)
    }
}

/// Optimizer state of one parameter, by name, for checkpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedMoments {
    /// Parameter name.
    pub name: String,
    /// First moment (flattened).
    pub m: Vec<f32>,
    /// Second moment (flattened).
    pub v: Vec<f32>,
}

impl AdamW {
    /// A fresh optimizer.
    pub fn new(config: AdamWConfig) -> Self {
        Self {
            config,
            steps: 0,
            moments: HashMap::new(),
        }
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
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

    /// One update of every parameter that has a gradient, with learning rate `lr`.
    pub fn step<M: Module>(&mut self, module: M, grads: &GradientAccumulator, lr: f64) -> M {
        self.step_decoupled(module, grads, LearningRates::uniform(lr), &HashSet::new())
    }

    /// One update with `lr.decoupled` for the parameters in `decoupled` and `lr.base` for
    /// the others.
    pub fn step_decoupled<M: Module>(
        &mut self,
        module: M,
        grads: &GradientAccumulator,
        lr: LearningRates,
        decoupled: &HashSet<ParamId>,
    ) -> M {
        self.steps += 1;
        module.map(&mut Update {
            optimizer: self,
            grads,
            lr,
            decoupled,
        })
    }

    /// The moments by parameter name (`names` maps ids to names, from
    /// [`crate::model::named_parameters::parameter_names`]).
    pub fn export(&self, names: &[(ParamId, String)]) -> Vec<NamedMoments> {
        names
            .iter()
            .filter_map(|(id, name)| {
                let s = self.moments.get(id)?;
                Some(NamedMoments {
                    name: name.clone(),
                    m: s.m.clone().try_into_vec_as::<f32>().ok()?,
                    v: s.v.clone().try_into_vec_as::<f32>().ok()?,
                })
            })
            .collect()
    }

    /// Restores state saved by [`export`](Self::export) after `steps` steps, on `device`.
    pub fn import(
        &mut self,
        steps: u64,
        state: Vec<NamedMoments>,
        names: &[(ParamId, String)],
        device: &burn::tensor::Device,
    ) {
        self.steps = steps;
        self.moments.clear();
        let by_name: HashMap<&str, ParamId> =
            names.iter().map(|(id, n)| (n.as_str(), *id)).collect();
        for s in state {
            if let Some(id) = by_name.get(s.name.as_str()) {
                let n = s.m.len();
                let m = Tensor::<1>::from_data(TensorData::new(s.m, [n]), device);
                let v = Tensor::<1>::from_data(TensorData::new(s.v, [n]), device);
                self.moments.insert(*id, Moments { m, v });
            }
        }
    }
}
