//! What `--log-params-norm` and `--log-num-zeros-in-grad` print (Megatron's
//! `calc_params_l2_norm` and `count_zeros_fp32`): each parameter element counted once over
//! the model-parallel ranks, as the gradient norm counts them.

use std::collections::HashSet;

use anyhow::Result;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;

use crate::comm::{Group, ReduceOp};
use crate::model::Gpt;
use crate::optim::GradientAccumulator;
use crate::util::fixed_order_sum::fixed_order_sum;

/// The L2 norm of `model`'s parameters over the ranks of `model_group` (tensor × pipeline),
/// leaving out those another rank counts.
pub fn params_l2_norm(
    model: &Gpt,
    not_counted: &HashSet<ParamId>,
    model_group: &Group,
) -> Result<f64> {
    let mut squares = SquareSum {
        not_counted,
        total: None,
    };
    model.visit(&mut squares);
    let local = squares.total.map_or(0.0, |t| t.into_scalar::<f32>() as f64);
    Ok(model_group.all_reduce_scalar(local, ReduceOp::Sum)?.sqrt())
}

/// Zero elements of the (data-parallel summed) gradients over the ranks of `model_group`.
pub fn count_zero_grads(
    grads: &GradientAccumulator,
    not_counted: &HashSet<ParamId>,
    model_group: &Group,
) -> Result<u64> {
    let local = grads
        .count_zeros_on_device(|id| !not_counted.contains(id))
        .map_or(0.0, |t| t.into_scalar::<f32>() as f64);
    Ok(model_group.all_reduce_scalar(local, ReduceOp::Sum)?.round() as u64)
}

struct SquareSum<'a> {
    not_counted: &'a HashSet<ParamId>,
    total: Option<Tensor<1>>,
}

impl ModuleVisitor for SquareSum<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.not_counted.contains(&param.id) {
            return;
        }
        let s = fixed_order_sum(param.val().inner().square());
        self.total = Some(match self.total.take() {
            Some(t) => t + s,
            None => s,
        });
    }
}
