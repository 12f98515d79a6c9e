//! The optimizer the training step talks to (Megatron-Core's `MixedPrecisionOptimizer` /
//! `FP32Optimizer`): it owns the fp32 main weights, the model the micro-batches run (the same
//! module in fp32, a half-precision copy otherwise), and the loss scaler. Its step unscales
//! the gradients, checks every rank for overflow, skips the update when one is found, and
//! otherwise runs the inner optimizer on the main weights and copies them back into the model.

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};

use super::optimizer::Optimizer;
use super::{
    GradNorm, GradScaler, GradScalerState, GradientAccumulator, LearningRates, NamedMoments,
    Precision,
};
use crate::comm::{CommError, Group, ReduceOp};

/// What one [`MixedPrecisionOptimizer::step`] did.
pub enum StepResult {
    /// Some rank's gradients overflowed: no update, the loss scale backed off.
    Skipped,
    /// The weights were updated; the gradient norm before clipping.
    Updated(GradNorm),
}

/// The main weights, the working model and the loss scaler around an inner optimizer.
pub struct MixedPrecisionOptimizer<M: Module> {
    inner: Box<dyn Optimizer<M>>,
    precision: Precision,
    scaler: Option<GradScaler>,
    /// `None` only inside [`Self::step`].
    main: Option<M>,
    working: Option<M>,
    /// Whether `working` is what the inner optimizer's [`Optimizer::working_copy`] returned.
    working_from_inner: bool,
    /// The ranks whose overflow skips the step (the whole world: every rank skips together).
    overflow_group: Group,
}

impl<M: Module> MixedPrecisionOptimizer<M> {
    /// Wraps `inner` around the main weights `main`, computing in `precision` with `scaler`.
    pub fn new(
        inner: Box<dyn Optimizer<M>>,
        main: M,
        precision: Precision,
        scaler: Option<GradScaler>,
        overflow_group: Group,
    ) -> Self {
        let working = precision.working_copy(&main);
        Self {
            inner,
            precision,
            scaler,
            main: Some(main),
            working: Some(working),
            working_from_inner: false,
            overflow_group,
        }
    }

    /// The model the micro-batches run.
    pub fn model(&self) -> &M {
        self.working.as_ref().expect("outside a step")
    }

    /// The fp32 main weights (what checkpoints keep).
    pub fn main_weights(&self) -> &M {
        self.main.as_ref().expect("outside a step")
    }

    /// The loss scale the next micro-batches' losses are multiplied by (1 without a scaler).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, GradScaler::scale)
    }

    /// The scaler's state, for checkpoints.
    pub fn scaler_state(&self) -> Option<GradScalerState> {
        self.scaler.as_ref().map(GradScaler::state)
    }

    /// How the inner optimizer updates the parameters, in words (the log's kernel line).
    pub fn update_in_words(&self) -> &'static str {
        self.inner.update_in_words()
    }

    /// Whether the inner optimizer sums the gradients over data-parallel ranks itself.
    pub fn reduces_data_parallel_grads(&self) -> bool {
        self.inner.reduces_data_parallel_grads()
    }

    /// The inner optimizer's weight decay.
    pub fn weight_decay(&self) -> f64 {
        self.inner.weight_decay()
    }

    /// Sets the inner optimizer's weight decay for the next steps.
    pub fn set_weight_decay(&mut self, weight_decay: f64) {
        self.inner.set_weight_decay(weight_decay);
    }

    /// Whether a step can be captured as a graph and replayed: no loss scaler (it reads the
    /// gradients' norm on the host to skip a step) and a replayable inner optimizer.
    pub fn replayable(&self) -> bool {
        self.scaler.is_none() && self.inner.replayable()
    }

    /// Writes the next step's per-step values where the step reads them on the device.
    pub fn write_next_step_values(&self, lr: LearningRates) {
        self.inner.write_next_step_values(lr);
    }

    /// Counts a step a replay took.
    pub fn count_replayed_step(&mut self) {
        self.inner.count_replayed_step();
    }

    /// Steps the inner optimizer took.
    pub fn steps(&self) -> u64 {
        self.inner.steps()
    }

    /// The zero gradient elements the last step counted, where the step counts them (the
    /// distributed optimizer; see [`Optimizer::num_zeros_in_grad`]).
    pub fn num_zeros_in_grad(&self) -> Option<u64> {
        self.inner.num_zeros_in_grad()
    }

    /// Adam's moments by name (a collective with the distributed optimizer).
    pub fn moments(&self) -> Result<Vec<NamedMoments>, CommError> {
        self.inner.moments()
    }

    /// One step from `grads`, the gradients of the scaled loss: unscale, skip on overflow
    /// anywhere, otherwise update the main weights (clipping inside the inner optimizer) and
    /// refresh the working model.
    pub fn step(
        &mut self,
        grads: &mut GradientAccumulator,
        lr: LearningRates,
    ) -> Result<StepResult, CommError> {
        if let Some(scaler) = self.scaler.as_mut() {
            let inv_scale = 1.0 / scaler.scale();
            let main = self.main.as_ref().expect("outside a step");
            let found_here = self
                .inner
                .unscale_and_check(main, grads, inv_scale)
                .unwrap_or_else(|| {
                    grads.scale(inv_scale);
                    !grads.all_finite()
                });
            let local = if found_here { 1.0 } else { 0.0 };
            let found_inf = self
                .overflow_group
                .all_reduce_scalar(local, ReduceOp::Max)?
                > 0.0;
            scaler.update(found_inf);
            if found_inf {
                self.inner.skip_step();
                return Ok(StepResult::Skipped);
            }
        }
        // The working copy goes first (in fp32 it shares the main weights' storage, and the
        // step replaces them parameter by parameter), unless the inner optimizer made it and
        // casts into its storage in place.
        let previous = self.working.take().filter(|_| self.working_from_inner);
        let main = self.main.take().expect("outside a step");
        let (main, norm) = self.inner.step(main, grads, lr)?;
        let from_inner = match self.precision {
            Precision::Fp32 => None,
            half => self.inner.working_copy(&main, half.dtype(), previous),
        };
        self.working_from_inner = from_inner.is_some();
        self.working = Some(from_inner.unwrap_or_else(|| self.precision.working_copy(&main)));
        self.main = Some(main);
        Ok(StepResult::Updated(norm))
    }
}

/// The sum of `values` (one-element tensors) and, if it is still on the device, the gradient
/// norm, read from the device together: one read per step. A device that failed to run the
/// step fails here, its first read: an error, not a panic.
pub fn read_step_values(
    values: Vec<Tensor<1>>,
    norm: Option<GradNorm>,
) -> anyhow::Result<(f64, Option<f64>)> {
    use burn::tensor::FloatDType;
    let m = values.len();
    let mut pending: Vec<Tensor<1>> = values
        .into_iter()
        .map(|l| l.cast(FloatDType::F32))
        .collect();
    let read_norm = match norm {
        Some(GradNorm::OnDevice(norm)) => {
            pending.push((*norm).cast(FloatDType::F32));
            None
        }
        Some(GradNorm::Read(norm)) => Some(Some(norm)),
        None => Some(None),
    };
    let read: Vec<f64> = if pending.is_empty() {
        Vec::new()
    } else {
        let data: TensorData = Tensor::cat(pending, 0)
            .try_into_data()
            .map_err(|e| anyhow::anyhow!("the device failed to run the training step: {e:?}"))?
            .convert::<f32>();
        data.as_slice::<f32>()
            .expect("converted to f32")
            .iter()
            .map(|&x| f64::from(x))
            .collect()
    };
    let sum = read[..m].iter().sum();
    let norm = read_norm.unwrap_or_else(|| read.get(m).copied());
    Ok((sum, norm))
}
