//! One optimizer interface (Megatron-Core's `MegatronOptimizer`): what the training step
//! calls, whether Adam's state is replicated on every data-parallel rank or sharded over them.
//!
//! Both clip by the global norm inside their step, each in the place where the gradients are
//! whole for it: the replicated optimizer after the data-parallel all-reduce, over the ranks
//! of one model replica; the distributed optimizer on its reduce-scattered shard, over the
//! whole world.

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ParamId};
use burn::tensor::{Device, FloatDType};

use super::{
    AdamW, AdamWConfig, DistributedAdamW, GradNorm, GradientAccumulator, LearningRates,
    NamedMoments,
};
use crate::comm::{CommError, Group};

/// An optimizer of a module of type `M`.
pub trait Optimizer<M: Module> {
    /// Whether [`Self::step`] sums the gradients over the data-parallel ranks itself (the
    /// distributed optimizer's reduce-scatter); otherwise they must be summed before it.
    fn reduces_data_parallel_grads(&self) -> bool;

    /// How [`Self::step`] updates the parameters on a CubeCL device, in words, for the log's
    /// kernel line (each implementation says what it launches).
    fn update_in_words(&self) -> &'static str;

    /// One update of `module` from `grads` (unscaled) with learning rates `lr`, clipped by
    /// the global norm; returns the module and the norm before clipping.
    fn step(
        &mut self,
        module: M,
        grads: &mut GradientAccumulator,
        lr: LearningRates,
    ) -> Result<(M, GradNorm), CommError>;

    /// Takes the loss scale off `grads` (multiplies them by `inv_scale`) and says whether any
    /// of them is not finite, where this optimizer does both in a pass of its own (the
    /// flat-buffer Adam: in the copy into its buffer, and from the global norm it needs
    /// anyway); `None` leaves both to the caller and `grads` untouched. After `Some`, the next
    /// [`Self::step`] starts from what this prepared, or [`Self::skip_step`] drops it.
    fn unscale_and_check(
        &mut self,
        _main: &M,
        _grads: &mut GradientAccumulator,
        _inv_scale: f64,
    ) -> Option<bool> {
        None
    }

    /// The step is skipped (a rank's gradients overflowed): drop what
    /// [`Self::unscale_and_check`] prepared for it.
    fn skip_step(&mut self) {}

    /// The half-precision model the next micro-batches run, if this optimizer makes it
    /// better than a per-parameter cast of `main` (one cast of a flat buffer); `None` leaves
    /// it to [`super::Precision::working_copy`]. `previous` is what this returned the step
    /// before, if anything: an optimizer casting into storage that `previous` already views
    /// casts in place and hands it back, rather than building each parameter's view again.
    fn working_copy(&self, _main: &M, _dtype: FloatDType, _previous: Option<M>) -> Option<M> {
        None
    }

    /// Whether a step of this optimizer can be captured as a graph and replayed: it reads
    /// nothing from the device, writes its per-step values only where
    /// [`Self::write_next_step_values`] wrote them already, and updates its buffers in place
    /// (the flat-buffer Adam on a CubeCL device).
    fn replayable(&self) -> bool {
        false
    }

    /// Writes the next step's per-step values (learning rates, bias corrections) where the
    /// step reads them on the device, before a captured step is recorded or replayed.
    fn write_next_step_values(&self, _lr: LearningRates) {}

    /// Counts a step a replay took (a replay runs none of the step's host code).
    fn count_replayed_step(&mut self) {}

    /// Steps taken.
    fn steps(&self) -> u64;

    /// The decoupled weight decay of the next steps.
    fn weight_decay(&self) -> f64;

    /// Sets the weight decay of the next steps (Megatron's scheduler writes it into the
    /// parameter groups).
    fn set_weight_decay(&mut self, weight_decay: f64);

    /// Adam's moments of every parameter by name, for checkpoints (a collective over the
    /// data-parallel group when they are sharded: every rank calls it).
    fn moments(&self) -> Result<Vec<NamedMoments>, CommError>;

    /// With [`OptimizerSetup::count_zeros`], the zero gradient elements the last step counted,
    /// where only the step sees the summed gradients (the distributed optimizer, after its
    /// reduce-scatter); `None` elsewhere: they are counted before the step.
    fn num_zeros_in_grad(&self) -> Option<u64> {
        None
    }
}

/// What both optimizers need besides Adam's hyper-parameters.
#[derive(Clone)]
pub struct OptimizerSetup {
    /// Adam's hyper-parameters.
    pub adam: AdamWConfig,
    /// `--clip-grad` (0 disables).
    pub clip_grad: f64,
    /// Parameter names by id (checkpoints store moments by name).
    pub names: Vec<(ParamId, String)>,
    /// Parameters left out of the global norm on this rank because another rank counts them.
    pub not_counted: HashSet<ParamId>,
    /// Parameters that take the decoupled learning rate (the word embedding and the output
    /// layer, with `--decoupled-lr`).
    pub decoupled_lr: HashSet<ParamId>,
    /// `--log-num-zeros-in-grad`: the distributed optimizer counts the zero elements of the
    /// summed gradients in its step (Megatron counts them on each rank's shard of the main
    /// gradients).
    pub count_zeros: bool,
}

impl OptimizerSetup {
    /// Adam over all of `module`'s parameters on one rank, clipping the global norm at
    /// `clip_grad`: no decoupled learning rate, no zero counting.
    pub fn for_module<M: Module>(module: &M, adam: AdamWConfig, clip_grad: f64) -> Self {
        let names = crate::model::named_parameters::parameter_names(module)
            .into_iter()
            .map(|p| (p.id, p.name))
            .collect();
        Self {
            adam,
            clip_grad,
            names,
            not_counted: HashSet::new(),
            decoupled_lr: HashSet::new(),
            count_zeros: false,
        }
    }
}

/// Adam replicated on every data-parallel rank: the gradients arrive summed; the global norm
/// is summed over the ranks of one model replica (`model_group`: tensor × pipeline).
pub struct ReplicatedAdamW {
    adam: AdamW,
    setup: OptimizerSetup,
    model_group: Group,
}

impl ReplicatedAdamW {
    /// A fresh optimizer, or one resuming `saved` (`(steps, moments)`) on `device`.
    pub fn new(
        setup: OptimizerSetup,
        model_group: Group,
        saved: Option<(u64, Vec<NamedMoments>)>,
        device: &Device,
    ) -> Self {
        let mut adam = AdamW::new(setup.adam.clone());
        if let Some((steps, moments)) = saved {
            adam.import(steps, moments, &setup.names, device);
        }
        Self {
            adam,
            setup,
            model_group,
        }
    }
}

impl<M: Module> Optimizer<M> for ReplicatedAdamW {
    fn reduces_data_parallel_grads(&self) -> bool {
        false
    }

    fn update_in_words(&self) -> &'static str {
        "Adam fused, one kernel per parameter"
    }

    fn step(
        &mut self,
        module: M,
        grads: &mut GradientAccumulator,
        lr: LearningRates,
    ) -> Result<(M, GradNorm), CommError> {
        let norm = grads.clip_global_norm_deferred(
            self.setup.clip_grad,
            &self.setup.not_counted,
            &self.model_group,
        )?;
        let module = self
            .adam
            .step_decoupled(module, grads, lr, &self.setup.decoupled_lr);
        Ok((module, norm))
    }

    fn steps(&self) -> u64 {
        self.adam.steps()
    }

    fn weight_decay(&self) -> f64 {
        self.adam.weight_decay()
    }

    fn set_weight_decay(&mut self, weight_decay: f64) {
        self.adam.set_weight_decay(weight_decay);
    }

    fn moments(&self) -> Result<Vec<NamedMoments>, CommError> {
        Ok(self.adam.export(&self.setup.names))
    }
}

/// Adam sharded over the data-parallel ranks (ZeRO-1, `--use-distributed-optimizer`), the
/// global norm summed over `world`.
pub struct ShardedAdamW {
    adam: DistributedAdamW,
    clip_grad: f64,
    world: Group,
}

impl ShardedAdamW {
    /// The optimizer for `module`'s parameters, sharded over `data`, resuming `saved` if given.
    pub fn new<M: Module>(
        setup: &OptimizerSetup,
        module: &M,
        data: Group,
        world: Group,
        saved: Option<(u64, Vec<NamedMoments>)>,
        device: &Device,
    ) -> Self {
        let by_id: HashMap<ParamId, String> = setup.names.iter().cloned().collect();
        let mut adam = DistributedAdamW::new(
            setup.adam.clone(),
            module,
            &by_id,
            &setup.not_counted,
            &setup.decoupled_lr,
            data,
            device,
        );
        if let Some((steps, moments)) = saved {
            adam.import(steps, &moments);
        }
        adam.count_zeros(setup.count_zeros);
        Self {
            adam,
            clip_grad: setup.clip_grad,
            world,
        }
    }

    /// Elements of Adam state this rank holds, and what one rank would hold unsharded.
    pub fn state_elements(&self) -> (usize, usize) {
        self.adam.state_elements()
    }
}

impl<M: Module> Optimizer<M> for ShardedAdamW {
    fn reduces_data_parallel_grads(&self) -> bool {
        true
    }

    fn update_in_words(&self) -> &'static str {
        "distributed Adam composed over this rank's flat shard"
    }

    fn step(
        &mut self,
        module: M,
        grads: &mut GradientAccumulator,
        lr: LearningRates,
    ) -> Result<(M, GradNorm), CommError> {
        let (module, norm) = self
            .adam
            .step(module, grads, lr, self.clip_grad, &self.world)?;
        Ok((module, GradNorm::Read(norm)))
    }

    fn steps(&self) -> u64 {
        self.adam.steps()
    }

    fn weight_decay(&self) -> f64 {
        self.adam.weight_decay()
    }

    fn set_weight_decay(&mut self, weight_decay: f64) {
        self.adam.set_weight_decay(weight_decay);
    }

    fn moments(&self) -> Result<Vec<NamedMoments>, CommError> {
        self.adam.export()
    }

    fn num_zeros_in_grad(&self) -> Option<u64> {
        self.adam.num_zeros_in_grad()
    }
}
