//! One path for the forward and backward passes of a step, whatever the pipeline layout
//! (Megatron-Core's `get_forward_backward_func`): the GPT's forward-step and backward-step
//! ([`GptStage`], a [`StageWork`]) run by the pipeline executor under a schedule. Without
//! pipelining the schedule is the one-stage 1F1B (forward and backward of each micro-batch in
//! turn); with it, 1F1B or the interleaved 1F1B. Evaluation runs the forward-only schedule.
//!
//! Every stage of a replica reads the same micro-batches (the first stage needs the tokens,
//! the last the labels and the loss mask; reading them is cheaper than sending them), and
//! seeds the dropout streams of each micro-batch before its forward, so every layer draws the
//! masks it draws in the one-stage run. Recomputation applies per model chunk, as Megatron's.
//!
//! With `--overlap-grad-reduce`, each chunk's last backward of the step runs a layer at a
//! time, and the gradients each piece makes final are pushed to a [`BackgroundAllReduce`]
//! while the next pieces run (see [`crate::optim::background_reduce`]).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use anyhow::{Context, Result};
use burn::module::ParamId;
use burn::tensor::{DType, Device, Gradients, Tensor, TensorData};

use crate::comm::Group;
use crate::data::loader::{BatchReads, DeviceBatch};
use crate::model::recompute::{
    forward_only, ChunkForward, ChunkInput, ChunkPlan, ChunkValue, GradsOf, Targets,
};
use crate::model::{Gpt, Recompute, StageLayers};
use crate::optim::{BackgroundAllReduce, GradientAccumulator};
use crate::parallel::random::seed_micro_batch;
use crate::pipeline::{
    interleaved_one_forward_one_backward, one_forward_one_backward, run_schedule, PipelineP2p,
    ScheduleTiming, StageWork, Step,
};

/// The micro-batch inputs this pipeline rank reads.
pub fn batch_reads(p2p: &PipelineP2p) -> BatchReads {
    BatchReads {
        tokens: p2p.holds_first(),
        targets: p2p.holds_last(),
    }
}

/// The schedule of one training step on this pipeline rank: Megatron's 1F1B (with one stage:
/// each micro-batch's forward then its backward), or the interleaved 1F1B with more than one
/// model chunk per rank.
pub fn training_schedule(
    pipeline_rank: usize,
    pipeline_size: usize,
    microbatches: usize,
    chunks: usize,
) -> Result<Vec<Step>> {
    Ok(if chunks == 1 {
        one_forward_one_backward(pipeline_rank, pipeline_size, microbatches)
    } else {
        interleaved_one_forward_one_backward(pipeline_rank, pipeline_size, microbatches, chunks)?
    })
}

/// The forward-only schedule (evaluation): the micro-batches through the chunks in the
/// interleaved schedule's order (all of chunk 0 first without interleaving).
pub fn forward_only_schedule(microbatches: usize, chunks: usize, pipeline: usize) -> Vec<Step> {
    crate::pipeline::schedule::schedule_table(microbatches, chunks, pipeline)
        .into_iter()
        .map(|(microbatch, chunk)| Step::Forward { microbatch, chunk })
        .collect()
}

/// The shape and dtype of the activations between stages.
pub fn activation_expect(
    micro_batch_size: usize,
    seq_length: usize,
    hidden_size: usize,
    dtype: DType,
) -> crate::comm::Expect {
    crate::comm::Expect {
        shape: vec![micro_batch_size, seq_length, hidden_size],
        dtype,
    }
}

/// What a step's passes need besides the micro-batches.
pub struct StepInputs<'a> {
    /// This rank's stage of the working model (the dtype the micro-batches run in).
    pub model: &'a Gpt,
    /// Which layers the model's chunks hold.
    pub stage: &'a StageLayers,
    /// The links to the neighbouring stages (none are used with one stage).
    pub p2p: &'a PipelineP2p,
    /// Maps a micro-batch index to its index in the global batch (keys its dropout masks).
    pub global_index: &'a dyn Fn(usize) -> u64,
    /// `--seed`, the iteration and the tensor-parallel rank (the dropout streams).
    pub seed: u64,
    /// The iteration (0 in evaluation).
    pub iteration: u64,
    /// The device.
    pub device: &'a Device,
}

/// `--overlap-grad-reduce`: the data-parallel group and the bucket size.
pub struct OverlapGradReduce<'a> {
    /// The data-parallel group the gradients are summed over.
    pub group: &'a Group,
    /// Elements per all-reduce (`--ddp-bucket-size`).
    pub bucket_elements: usize,
}

/// What a step's forward and backward passes leave.
pub struct StepGradients {
    /// Parameter gradients summed over this rank's micro-batches (and over the data-parallel
    /// ranks when they were reduced in the background).
    pub grads: GradientAccumulator,
    /// The last stage's loss of each micro-batch (empty on other stages), on the device.
    pub losses: Vec<Tensor<1>>,
    /// Where this rank's time went.
    pub timing: ScheduleTiming,
    /// With `--overlap-grad-reduce`: the reduction time the backward pass did not hide.
    pub background_reduce_exposed: Option<Duration>,
}

/// Runs `steps` (a training schedule) over `batches`: forwards and backwards with
/// `recompute`, each micro-batch's loss divided by `divisor` before its backward.
pub fn forward_backward(
    inputs: &StepInputs<'_>,
    batches: &[DeviceBatch],
    steps: &[Step],
    recompute: Recompute,
    divisor: f64,
    overlap: Option<OverlapGradReduce<'_>>,
) -> Result<StepGradients> {
    let mut work = GptStage::new(inputs, batches, Mode::Train { recompute, divisor });
    if let Some(overlap) = overlap {
        work.overlap = Some(Overlap::start(&overlap, steps));
    }
    let timing = run_schedule(steps, inputs.p2p, &mut work)?;
    let background_reduce_exposed = match work.overlap.take() {
        Some(overlap) => {
            let reduced = overlap.reducer.finish()?;
            for (id, g) in reduced.grads {
                work.grads.insert(id, g);
            }
            work.grads.restore_declaration_order(inputs.model);
            Some(reduced.exposed)
        }
        None => None,
    };
    Ok(StepGradients {
        grads: work.grads,
        losses: work.losses,
        timing,
        background_reduce_exposed,
    })
}

/// Runs the forward-only schedule over `batches` (`inputs.model` is the model's `valid()`
/// copy: no dropout); returns the last stage's losses (empty on other stages).
pub fn forward_only_losses(
    inputs: &StepInputs<'_>,
    batches: &[DeviceBatch],
    pipeline_size: usize,
) -> Result<Vec<Tensor<1>>> {
    let steps = forward_only_schedule(batches.len(), inputs.stage.chunks.len(), pipeline_size);
    let mut work = GptStage::new(inputs, batches, Mode::ForwardOnly);
    run_schedule(&steps, inputs.p2p, &mut work)?;
    Ok(work.losses)
}

/// Training (with its recomputation and loss divisor) or evaluation.
#[derive(Clone, Copy)]
enum Mode {
    Train { recompute: Recompute, divisor: f64 },
    ForwardOnly,
}

/// The background reduction of `--overlap-grad-reduce` and when each chunk's gradients
/// become final.
struct Overlap {
    reducer: BackgroundAllReduce,
    /// The micro-batch of each chunk's last backward in the schedule.
    last_backward: HashMap<usize, usize>,
}

impl Overlap {
    fn start(overlap: &OverlapGradReduce<'_>, steps: &[Step]) -> Self {
        let mut last_backward = HashMap::new();
        for step in steps {
            if let Step::Backward { microbatch, chunk } = *step {
                last_backward.insert(chunk, microbatch);
            }
        }
        Self {
            reducer: BackgroundAllReduce::start(overlap.group, overlap.bucket_elements.max(1)),
            last_backward,
        }
    }
}

/// A chunk's forward kept for its backward, and whether that backward is the chunk's last of
/// the step under `--overlap-grad-reduce`.
struct Kept {
    forward: ChunkForward,
    last: bool,
}

/// The GPT side of one schedule on one rank.
struct GptStage<'a> {
    inputs: &'a StepInputs<'a>,
    batches: &'a [DeviceBatch],
    mode: Mode,
    grads: GradientAccumulator,
    losses: Vec<Tensor<1>>,
    kept: HashMap<(usize, usize), Kept>,
    overlap: Option<Overlap>,
}

impl<'a> GptStage<'a> {
    fn new(inputs: &'a StepInputs<'a>, batches: &'a [DeviceBatch], mode: Mode) -> Self {
        Self {
            inputs,
            batches,
            mode,
            grads: GradientAccumulator::default(),
            losses: Vec::new(),
            kept: HashMap::new(),
            overlap: None,
        }
    }

    /// The chunk's input: the tokens on the first virtual stage (only the ends read the
    /// batch), the received activation elsewhere.
    fn chunk_input(&self, microbatch: usize, input: Option<TensorData>) -> ChunkInput {
        match input {
            Some(data) => ChunkInput::Activation(self.upload(data)),
            None => ChunkInput::Tokens(
                (self.batches[microbatch].tokens.clone())
                    .expect("the rank holding the first stage uploads the tokens"),
            ),
        }
    }

    /// The labels and mask on the last virtual stage.
    fn targets(&self, microbatch: usize, chunk: usize) -> Option<Targets> {
        self.inputs.p2p.is_last(chunk).then(|| {
            let targets = (self.batches[microbatch].targets.clone())
                .expect("the rank holding the last stage uploads the targets");
            Targets {
                labels: targets.labels,
                loss_mask: targets.loss_mask,
                loss_normalizer: targets.loss_normalizer,
            }
        })
    }

    fn upload(&self, data: TensorData) -> Tensor<3> {
        let dtype = data.dtype();
        Tensor::from_data(data, (self.inputs.device, dtype))
    }

    /// Hands the chunk's value on: the loss is kept, an activation sent.
    fn hand_on(&mut self, value: &ChunkValue) -> Option<TensorData> {
        match value {
            ChunkValue::Loss(loss) => {
                self.losses.push(loss.clone());
                None
            }
            ChunkValue::Activation(y) => Some(y.clone().into_data()),
        }
    }

    /// Whether this backward is the chunk's last of the step under `--overlap-grad-reduce`.
    fn is_last_backward(&self, microbatch: usize, chunk: usize) -> bool {
        self.overlap
            .as_ref()
            .is_some_and(|o| o.last_backward.get(&chunk) == Some(&microbatch))
    }

    /// Parameters that get a gradient from two pieces of one chunk's backward (the tied word
    /// embedding of a chunk that both embeds and computes the loss): final only at its end.
    fn used_twice(inputs: &StepInputs<'_>, chunk: usize) -> HashSet<ParamId> {
        let p2p = inputs.p2p;
        if p2p.is_first(chunk) && p2p.is_last(chunk) {
            inputs.model.tied_embedding().into_iter().collect()
        } else {
            HashSet::new()
        }
    }

    /// Runs a kept chunk's backward, summing its gradients (pushing the final ones to the
    /// background reduction on the chunk's last backward).
    fn run_backward(
        &mut self,
        kept: Kept,
        chunk: usize,
        output_grad: Option<Tensor<3>>,
        divisor: f64,
    ) -> Result<Option<Tensor<3>>> {
        let model = self.inputs.model;
        if !kept.forward.in_pieces() {
            // One graph: its gradients are one whole pass's, summed straight into fp32.
            let grads = &mut self.grads;
            let mut add = |g, of| {
                add_piece(grads, model, g, of);
            };
            return Ok(kept
                .forward
                .backward(model, output_grad, divisor, &mut add)?);
        }
        // A backward in pieces sums them in the model's dtype first, as one pass would.
        let mut micro = GradientAccumulator::in_model_dtype();
        let input_grad = match (kept.last, self.overlap.as_mut()) {
            // The chunk's last backward under overlap pushes gradients as they become final.
            (true, Some(overlap)) => {
                let held = Self::used_twice(self.inputs, chunk);
                let (grads, reducer) = (&mut self.grads, &mut overlap.reducer);
                let mut push_final = |g: Gradients, of: GradsOf| {
                    for id in add_piece(&mut micro, model, g, of) {
                        if !held.contains(&id) {
                            let g = micro.take(&id).expect("just added");
                            reducer.push(id, grads.take_sum(id, g));
                        }
                    }
                };
                let input_grad =
                    kept.forward
                        .backward(model, output_grad, divisor, &mut push_final)?;
                for (id, g) in micro.drain() {
                    reducer.push(id, grads.take_sum(id, g));
                }
                input_grad
            }
            _ => {
                let mut add = |g, of| {
                    add_piece(&mut micro, model, g, of);
                };
                let input_grad = kept
                    .forward
                    .backward(model, output_grad, divisor, &mut add)?;
                self.grads.merge(model, micro);
                input_grad
            }
        };
        Ok(input_grad)
    }
}

/// Adds the gradients of one piece of a backward pass to `into`, looking them up among the
/// parameters `of` names only; returns the parameters that had one, in declaration order.
fn add_piece(
    into: &mut GradientAccumulator,
    model: &Gpt,
    mut grads: Gradients,
    of: GradsOf,
) -> Vec<ParamId> {
    match of {
        GradsOf::Model => into.add_listing(model, &mut grads),
        GradsOf::Layers(layers) => layers
            .flat_map(|i| {
                let layer = model.layer(i).expect("a piece's layers are on its stage");
                into.add_listing(layer, &mut grads)
            })
            .collect(),
    }
}

impl StageWork for GptStage<'_> {
    fn forward(
        &mut self,
        microbatch: usize,
        chunk: usize,
        input: Option<TensorData>,
    ) -> Result<Option<TensorData>> {
        let inputs = self.inputs;
        seed_micro_batch(
            inputs.seed,
            inputs.iteration,
            (inputs.global_index)(microbatch),
        );
        let layers = inputs.stage.chunks[chunk].clone();
        let chunk_input = self.chunk_input(microbatch, input);
        let targets = self.targets(microbatch, chunk);
        let Mode::Train { recompute, .. } = self.mode else {
            let documents = &self.batches[microbatch].documents;
            let value = forward_only(inputs.model, chunk_input, documents, layers, targets);
            return Ok(self.hand_on(&value));
        };
        let last = self.is_last_backward(microbatch, chunk);
        let plan = ChunkPlan {
            layers,
            recompute,
            layer_by_layer: last,
        };
        let documents = &self.batches[microbatch].documents;
        let forward = ChunkForward::run(inputs.model, chunk_input, documents, &plan, targets);
        let sent = self.hand_on(forward.value());
        self.kept
            .insert((microbatch, chunk), Kept { forward, last });
        Ok(sent)
    }

    fn backward(
        &mut self,
        microbatch: usize,
        chunk: usize,
        output_grad: Option<TensorData>,
    ) -> Result<Option<TensorData>> {
        let Mode::Train { divisor, .. } = self.mode else {
            anyhow::bail!("a backward step in a forward-only schedule");
        };
        let kept = self.kept.remove(&(microbatch, chunk)).with_context(|| {
            format!("backward of micro-batch {microbatch} chunk {chunk} before its forward")
        })?;
        let output_grad = output_grad.map(|g| self.upload(g));
        let input_grad = self.run_backward(kept, chunk, output_grad, divisor)?;
        Ok(input_grad.map(Tensor::into_data))
    }
}
