//! A Megatron checkpoint's model and Adam's state as ferrotron parameters, whichever of
//! Megatron's formats it was read from, and the part of it one rank of a run loads.

use std::path::Path;

use anyhow::{bail, Context, Result};
use burn::tensor::Device;

use super::megatron_args::MegatronArgs;
use super::megatron_optimizer::{JoinedMoments, MegatronAdam};
use super::megatron_tensors::ParameterValues;
use super::{LoadedCheckpoint, OptimizerState, TrainState};
use crate::comm::Group;
use crate::model::named_parameters::load_named_parameters;
use crate::model::{Gpt, GptConfig, StageLayers};
use crate::optim::NamedMoments;
use crate::parallel::{
    holdings::{parameter_holdings, ParameterHolding},
    sharding::shard_of,
};
use crate::util::host_tensor::HostTensor;

/// A Megatron checkpoint's model, as ferrotron parameters.
pub struct MegatronCheckpoint {
    /// The iteration it was saved at (0 for `release`).
    pub iteration: u64,
    /// The tensor-parallel size it was saved with.
    pub tensor_parallel: usize,
    /// The pipeline-parallel size it was saved with.
    pub pipeline_parallel: usize,
    /// Parameter values by ferrotron name, joined over the tensor-parallel shards and the
    /// pipeline stages.
    pub values: ParameterValues,
    /// Adam's state, joined as the weights are.
    pub adam: MegatronAdam,
    /// The arguments Megatron saved with it (tensor-parallel rank 0's).
    pub args: MegatronArgs,
}

impl MegatronCheckpoint {
    /// The training state to continue from: the iteration, and the consumed samples and
    /// scheduler steps Megatron saved (iterations × `global_batch_size` where a file lacks
    /// them).
    pub fn train_state(&self, global_batch_size: u64) -> Result<TrainState> {
        let samples = match self.args.consumed_train_samples()? {
            Some(n) => n,
            None => self.iteration * global_batch_size,
        };
        Ok(TrainState {
            iteration: self.iteration,
            skipped_iterations: 0,
            scheduler_steps: self.args.scheduler_steps.unwrap_or(samples),
            consumed_train_samples: samples,
            consumed_valid_samples: self.args.consumed_valid_samples()?.unwrap_or(0),
        })
    }
}

/// What loading a Megatron checkpoint restores of Adam.
pub enum AdamResume {
    /// This rank's moments and the steps taken.
    Loaded(OptimizerState),
    /// Nothing: training continues with fresh moments, for this reason.
    Fresh(String),
}

impl MegatronCheckpoint {
    /// This rank's `stage` of the checkpoint's model `config` (read from `root`), split for
    /// the tensor-parallel `group` (whatever layout the checkpoint was saved with), on
    /// `device`; what was saved with it, and Adam's state for this rank's parameters.
    /// `global_batch_size` counts the consumed samples of a file that lacks them.
    pub fn load_rank(
        &self,
        config: GptConfig,
        root: &Path,
        device: &Device,
        group: &Group,
        stage: Option<&StageLayers>,
        global_batch_size: u64,
    ) -> Result<(Gpt, LoadedCheckpoint, AdamResume)> {
        let checkpoint = self;
        // Training continues from a mixed-precision optimizer's fp32 main weights, of which the
        // model's bf16/fp16 weights are rounded copies.
        let weights = match &checkpoint.adam {
            MegatronAdam::Moments(JoinedMoments {
                main_weights: Some(main),
                ..
            }) => main,
            _ => &checkpoint.values,
        };
        let whole = StageLayers::whole(config.num_layers);
        let stage = stage.unwrap_or(&whole);
        let model = config
            .init_stage(0, group, stage, device)
            .map_err(anyhow::Error::msg)?;
        let holdings = parameter_holdings(&model);
        let rank_part = |values: &ParameterValues, p: &ParameterHolding| {
            rank_part(values, p, group).with_context(|| format!("{}", root.display()))
        };
        let mut values = ParameterValues::new();
        for p in &holdings {
            let part = rank_part(weights, p)?;
            values.insert(p.name.clone(), (part.shape, part.values));
        }
        if let Some(extra) = checkpoint
            .values
            .keys()
            .filter(|name| on_stage(name, stage) && !values.contains_key(*name))
            .min()
        {
            bail!(
                "{}: the checkpoint holds {extra}, which the model these flags describe has not \
                 (check the architecture flags against the ones Megatron trained with)",
                root.display()
            );
        }
        let (model, missing) = load_named_parameters(model, &values);
        if let Some(first) = missing.first() {
            bail!(
                "{}: {first} has another shape in the checkpoint than these flags give it",
                root.display()
            );
        }
        let adam = match &checkpoint.adam {
            MegatronAdam::NotSaved => {
                AdamResume::Fresh("the checkpoint holds no optimizer state".into())
            }
            MegatronAdam::NotRead(why) => AdamResume::Fresh(why.clone()),
            MegatronAdam::Moments(joined) => AdamResume::Loaded(OptimizerState {
                steps: joined.steps,
                moments: holdings
                    .iter()
                    .map(|p| {
                        Ok(NamedMoments {
                            name: p.name.clone(),
                            m: rank_part(&joined.exp_avg, p)?.values,
                            v: rank_part(&joined.exp_avg_sq, p)?.values,
                        })
                    })
                    .collect::<Result<_>>()?,
                grad_scaler: None,
            }),
        };
        let info = LoadedCheckpoint {
            state: checkpoint.train_state(global_batch_size)?,
            optimizer_steps: match &adam {
                AdamResume::Loaded(state) => state.steps,
                AdamResume::Fresh(_) => 0,
            },
            grad_scaler: None,
            tensor_model_parallel_size: checkpoint.tensor_parallel,
            pipeline_model_parallel_size: checkpoint.pipeline_parallel,
            config,
        };
        Ok((model, info, adam))
    }
}

/// `group`'s rank's part of parameter `p` in whole `values` (its tensor-parallel shard).
fn rank_part(values: &ParameterValues, p: &ParameterHolding, group: &Group) -> Result<HostTensor> {
    let (shape, whole) = values.get(&p.name).with_context(|| {
        format!(
            "no tensor for {} (the checkpoint's model differs from this run's flags)",
            p.name
        )
    })?;
    let whole = HostTensor::new(shape.clone(), whole.clone());
    shard_of(
        &whole,
        p.holding.partition_dim(),
        group.rank(),
        group.size(),
    )
    .map_err(|e| anyhow::anyhow!("{}: {e}", p.name))
}

/// Whether the parameter `name` belongs to `stage` of the model.
fn on_stage(name: &str, stage: &StageLayers) -> bool {
    match name
        .strip_prefix("layers.")
        .and_then(|rest| rest.split_once('.'))
    {
        Some((layer, _)) => layer.parse().is_ok_and(|l| stage.holds_layer(l)),
        None if name.starts_with("word_embeddings") || name.starts_with("position_embeddings") => {
            stage.embedding
        }
        None => stage.head,
    }
}
