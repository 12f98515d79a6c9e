//! One training step (and one evaluation) of a GPT cut into pipeline stages: the GPT's
//! forward-step and backward-step ([`GptStage`], a [`StageWork`]) run by the pipeline
//! executor under the 1F1B or interleaved schedule.
//!
//! Every stage of a replica reads the same micro-batches (the first stage needs the tokens,
//! the last the labels and the loss mask; reading them is cheaper than sending them), and
//! seeds the dropout streams of each micro-batch before its forward, so every layer draws the
//! masks it draws in the one-stage run.

use std::collections::HashMap;

use anyhow::{Context, Result};
use burn::module::Module;
use burn::tensor::{DType, Device, Tensor, TensorData};

use super::loader::MicroBatch;
use crate::model::recompute::backward_through;
use crate::model::{Gpt, StageLayers};
use crate::optim::GradientAccumulator;
use crate::parallel::random::{replaying, rng_state, seed_micro_batch, RngState};
use crate::pipeline::{
    interleaved_one_forward_one_backward, one_forward_one_backward, run_schedule, PipelineP2p,
    ScheduleTiming, StageWork, Step,
};

/// The schedule of one training step on this pipeline rank: Megatron's 1F1B, or the
/// interleaved 1F1B with more than one model chunk per rank.
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

/// What a chunk's forward leaves for its backward.
enum Kept {
    /// The graph: the chunk's input leaf (`None` on the first virtual stage, whose graph
    /// starts at the embedding) and its output or loss.
    Graph {
        input: Option<Tensor<3>>,
        output: Box<ChunkOutput>,
    },
    /// Only the input, without a graph, and the dropout streams: the chunk is run again
    /// before its backward (activation recomputation, a whole model chunk at a time).
    Recompute {
        input: Option<Tensor<3>>,
        rng: RngState,
    },
}

enum ChunkOutput {
    Activation(Tensor<3>),
    Loss(Tensor<1>),
}

/// The GPT side of one pipeline step on one rank.
pub struct GptStage<'a> {
    /// This rank's stage of the working model (the dtype the micro-batches run in).
    pub model: &'a Gpt,
    /// Which layers the model's chunks hold.
    pub stage: &'a StageLayers,
    /// The links to the neighbouring stages.
    pub p2p: &'a PipelineP2p,
    /// This rank's micro-batches of the step, by index.
    pub batches: Vec<MicroBatch>,
    /// Maps a micro-batch index to its index in the global batch (keys its dropout masks).
    pub global_index: &'a dyn Fn(usize) -> u64,
    /// `--seed`, the iteration and the tensor-parallel rank (the dropout streams).
    pub seed: u64,
    /// The iteration.
    pub iteration: u64,
    /// Tensor-parallel rank.
    pub tp_rank: usize,
    /// Each micro-batch's loss is divided by this before its backward.
    pub divisor: f64,
    /// Recompute each model chunk before its backward instead of keeping its activations.
    pub recompute: bool,
    /// Evaluation: no dropout, no graph, no backward.
    pub forward_only: bool,
    /// The device.
    pub device: &'a Device,
    /// Summed parameter gradients.
    pub grads: GradientAccumulator,
    /// The last stage's loss of each micro-batch (without a graph).
    pub losses: Vec<Tensor<1>>,
    kept: HashMap<(usize, usize), Kept>,
}

impl<'a> GptStage<'a> {
    /// A step's work; see the fields.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: &'a Gpt,
        stage: &'a StageLayers,
        p2p: &'a PipelineP2p,
        batches: Vec<MicroBatch>,
        global_index: &'a dyn Fn(usize) -> u64,
        seed: u64,
        iteration: u64,
        tp_rank: usize,
        divisor: f64,
        recompute: bool,
        forward_only: bool,
        device: &'a Device,
    ) -> Self {
        Self {
            model,
            stage,
            p2p,
            batches,
            global_index,
            seed,
            iteration,
            tp_rank,
            divisor,
            recompute,
            forward_only,
            device,
            grads: GradientAccumulator::default(),
            losses: Vec::new(),
            kept: HashMap::new(),
        }
    }

    /// The chunk's forward on `model` from `input` (the embedding on the first virtual
    /// stage), ending in the loss on the last.
    fn run_chunk(
        &self,
        model: &Gpt,
        microbatch: usize,
        chunk: usize,
        input: Option<Tensor<3>>,
    ) -> ChunkOutput {
        // Only the ends read the batch: the first stage its tokens, the last its targets.
        let batch = &self.batches[microbatch];
        let x = match input {
            Some(x) => x,
            None => model.embed(batch.tokens_to_tensor(self.device)),
        };
        let y = model.run_layers(self.stage.chunks[chunk].clone(), x);
        if self.p2p.is_last(chunk) {
            let (labels, mask) = batch.targets_to_tensors(self.device);
            ChunkOutput::Loss(model.head_loss(y, labels, mask))
        } else {
            ChunkOutput::Activation(y)
        }
    }

    fn upload(&self, data: TensorData) -> Tensor<3> {
        let dtype = data.dtype();
        Tensor::from_data(data, (self.device, dtype))
    }

    /// Hands the chunk's output on: the loss is kept, an activation sent.
    fn hand_on(&mut self, output: &ChunkOutput) -> Option<TensorData> {
        match output {
            ChunkOutput::Loss(loss) => {
                self.losses.push(loss.clone().detach());
                None
            }
            ChunkOutput::Activation(y) => Some(y.clone().detach().into_data()),
        }
    }
}

impl StageWork for GptStage<'_> {
    fn forward(
        &mut self,
        microbatch: usize,
        chunk: usize,
        input: Option<TensorData>,
    ) -> Result<Option<TensorData>> {
        seed_micro_batch(
            self.seed,
            self.iteration,
            (self.global_index)(microbatch),
            self.tp_rank,
        );
        let input = input.map(|d| self.upload(d));
        if self.forward_only {
            let output = self.run_chunk(self.model, microbatch, chunk, input);
            return Ok(self.hand_on(&output));
        }
        if self.recompute {
            let rng = rng_state();
            let without_graph = self.model.clone().no_grad();
            let output = self.run_chunk(&without_graph, microbatch, chunk, input.clone());
            self.kept
                .insert((microbatch, chunk), Kept::Recompute { input, rng });
            return Ok(self.hand_on(&output));
        }
        let input = input.map(Tensor::require_grad);
        let output = self.run_chunk(self.model, microbatch, chunk, input.clone());
        let sent = self.hand_on(&output);
        self.kept.insert(
            (microbatch, chunk),
            Kept::Graph {
                input,
                output: Box::new(output),
            },
        );
        Ok(sent)
    }

    fn backward(
        &mut self,
        microbatch: usize,
        chunk: usize,
        output_grad: Option<TensorData>,
    ) -> Result<Option<TensorData>> {
        let kept = self.kept.remove(&(microbatch, chunk)).with_context(|| {
            format!("backward of micro-batch {microbatch} chunk {chunk} before its forward")
        })?;
        let (input, output) = match kept {
            Kept::Graph { input, output } => (input, *output),
            Kept::Recompute { input, rng } => {
                let input = input.map(Tensor::require_grad);
                let output = replaying(rng, || {
                    self.run_chunk(self.model, microbatch, chunk, input.clone())
                });
                (input, output)
            }
        };
        let grads = match (output, output_grad) {
            (ChunkOutput::Loss(loss), _) => loss.div_scalar(self.divisor).backward(),
            (ChunkOutput::Activation(y), Some(g)) => backward_through(y, self.upload(g)),
            (ChunkOutput::Activation(_), None) => {
                anyhow::bail!("chunk {chunk} is not the last stage but got no output gradient")
            }
        };
        let input_grad = input.map(|x| {
            x.grad(&grads)
                .expect("a chunk's input takes part in its output")
        });
        self.grads.add(self.model, grads);
        Ok(input_grad.map(Tensor::into_data))
    }
}

/// Runs `steps` with `work` and returns how long this rank waited on its neighbours.
pub fn run_stage(steps: &[Step], work: &mut GptStage<'_>) -> Result<ScheduleTiming> {
    let p2p = work.p2p;
    run_schedule(steps, p2p, work)
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
