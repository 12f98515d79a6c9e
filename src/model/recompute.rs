//! Activation recomputation, and a model chunk's forward and backward as two calls (what a
//! pipeline schedule runs; the one-stage run is its one-stage case).
//!
//! Megatron's `--recompute-granularity full`: keep only the inputs of pieces of layers during
//! the forward pass, and run each piece's forward again, with its graph, just before its
//! backward (`--recompute-method uniform`: pieces of N layers; `block`: the first N layers of
//! the chunk one by one, the rest kept). `--recompute-granularity selective`: keep every
//! layer's activations but those of the attention core (scores, softmax, dropout, `· v`), the
//! largest per byte of compute, which is run again from the kept queries, keys and values.
//! Where every core is the one fused op from the projection's rows (CubeCL devices), that op
//! does it itself ([`CoreKeeps::Inputs`]): it keeps its inputs only and forms the
//! probabilities again in its backward, and the chunk stays one graph.
//! Megatron applies both per model chunk (each chunk is its own `TransformerBlock`), and so
//! does [`ChunkForward`].
//!
//! Without recomputation a chunk keeps one graph from its input to its output or loss. With
//! it the backward runs as a chain of vector–Jacobian products: each piece's forward starts
//! from a leaf copy of its input; its backward is `backward(Σ output ⊙ g)` with `g` the
//! gradient of the piece after it, which yields the piece's parameter gradients and `g` for
//! the piece before. The dropout streams are saved at each piece's start and replayed for its
//! recomputation (Megatron's `CheckpointFunction`), so the masks, and so the losses and
//! gradients, are the ones of the run without recomputation. Collectives inside a piece
//! (tensor parallelism) run again in the recomputation, in the same order on every rank.

use std::ops::Range;

use burn::module::Module;
use burn::tensor::{Device, Gradients, Int, Tensor};

use super::attention::{CoreInputs, CoreKeeps};
use super::documents::Documents;
use super::Gpt;
use crate::parallel::random::{replaying, rng_state, RngState};

/// Which transformer layers are recomputed (Megatron's `--recompute-method` with
/// `--recompute-num-layers`; the legacy `--activations-checkpoint-method` means the same).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Every activation is kept.
    #[default]
    None,
    /// `uniform`: the layers in chunks of N, each chunk's input kept and the chunk recomputed.
    Uniform(usize),
    /// `block`: the first N layers recomputed one by one, the others kept.
    Block(usize),
    /// `selective`: only the attention core of every layer recomputed.
    Selective,
}

impl Recompute {
    /// Megatron's flags: `--recompute-granularity full`, `--recompute-method uniform|block`,
    /// `--recompute-num-layers N`.
    pub fn from_flags(method: &str, num_layers: usize) -> Result<Self, String> {
        if num_layers == 0 {
            return Err("--recompute-num-layers must be at least 1".into());
        }
        match method {
            "uniform" => Ok(Self::Uniform(num_layers)),
            "block" => Ok(Self::Block(num_layers)),
            other => Err(format!(
                "--recompute-method {other:?}: expected uniform or block"
            )),
        }
    }

    /// [`Self::chunks`] with every kept chunk cut into single layers: the backward pass in
    /// pieces of one layer (or one recomputed chunk), after each of which that piece's
    /// parameter gradients are final (what `--overlap-grad-reduce` needs).
    pub fn layer_by_layer(self, layers: usize) -> Vec<(Range<usize>, bool)> {
        self.chunks(layers)
            .into_iter()
            .flat_map(|(range, recomputed)| {
                if recomputed {
                    vec![(range, true)]
                } else {
                    range.map(|i| (i..i + 1, false)).collect()
                }
            })
            .collect()
    }

    /// The layers in chunks, each with whether it is recomputed.
    pub fn chunks(self, layers: usize) -> Vec<(Range<usize>, bool)> {
        match self {
            Self::None | Self::Selective => vec![(0..layers, false)],
            Self::Uniform(n) => (0..layers)
                .step_by(n.max(1))
                .map(|start| (start..(start + n.max(1)).min(layers), true))
                .collect(),
            Self::Block(n) => {
                let n = n.min(layers);
                let mut chunks: Vec<(Range<usize>, bool)> =
                    (0..n).map(|i| (i..i + 1, true)).collect();
                if n < layers {
                    chunks.push((n..layers, false));
                }
                chunks
            }
        }
    }
}

/// Where a model chunk's forward starts: the first chunk embeds tokens, the others continue
/// from the previous chunk's output.
pub enum ChunkInput {
    /// Token ids `[batch, seq]` (the chunk holds the embeddings).
    Tokens(Tensor<2, Int>),
    /// The previous chunk's output `[batch, seq, hidden]`, without a graph.
    Activation(Tensor<3>),
}

impl ChunkInput {
    /// The device the chunk runs on.
    fn device(&self) -> Device {
        match self {
            Self::Tokens(tokens) => tokens.device(),
            Self::Activation(x) => x.device(),
        }
    }
}

/// The labels and loss mask of the last chunk, which ends in the loss.
pub struct Targets {
    /// `[batch, seq]` next-token ids.
    pub labels: Tensor<2, Int>,
    /// `[batch, seq]` 1 where the token counts in the loss.
    pub loss_mask: Tensor<2>,
    /// Divides the masked loss sum instead of `Σ loss_mask` where the batch holds part of
    /// each sequence (context parallelism: the whole micro-batch's `Σ loss_mask`).
    pub loss_normalizer: Option<f64>,
}

/// Which layers a chunk runs and how it keeps what its backward needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkPlan {
    /// The chunk's layers (global indices).
    pub layers: Range<usize>,
    /// The recomputation of those layers.
    pub recompute: Recompute,
    /// Cut the backward into pieces of one layer (or one recomputed piece), after each of
    /// which that piece's parameter gradients are final: what `--overlap-grad-reduce` needs
    /// of a chunk's last backward.
    pub layer_by_layer: bool,
}

/// What a chunk's forward produced, without a graph: the activation handed to the next
/// chunk, or the loss.
#[derive(Clone)]
pub enum ChunkValue {
    /// `[batch, seq, hidden]`.
    Activation(Tensor<3>),
    /// The micro-batch's LM loss (one element).
    Loss(Tensor<1>),
}

/// A chunk between its forward and its backward.
pub struct ChunkForward {
    kept: Kept,
    value: ChunkValue,
}

enum Kept {
    /// One graph from the chunk's input leaf (`None` after an embedding) to its end.
    Whole(Box<KeptWhole>),
    /// The backward as a chain of pieces.
    Pieces(Box<KeptPieces>),
}

/// A chunk kept as one graph.
struct KeptWhole {
    input: Option<Tensor<3>>,
    end: ChunkValue,
}

/// A chunk kept as a chain of pieces.
struct KeptPieces {
    /// The embedding's output, with its graph (the first chunk).
    embedded: Option<Tensor<3>>,
    pieces: Vec<Piece>,
    /// The micro-batch's documents, which the recomputed pieces see again.
    documents: Documents,
    /// The head's input leaf and the loss with its graph (the last chunk); without it the
    /// chunk's output gradient comes from the next chunk.
    head: Option<(Tensor<3>, Tensor<1>)>,
}

/// Whose parameters a piece's gradients are: the parameters to look them up among. Why: a
/// gradient is found by visiting parameters, and a model has hundreds where a layer's piece
/// touches a dozen; looked up in the whole model, every piece of a deep model's backward would
/// visit all of them (benchmarks/results/2026-12-03-figures-from-comments.md counts a 24-layer
/// step's), host time the step waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GradsOf {
    /// These layers' parameters only.
    Layers(Range<usize>),
    /// Any of the model's: the embeddings' and the head's (the tied word embedding is both),
    /// and a chunk kept as one graph.
    Model,
}

/// Where a chunk's backward hands each piece's parameter gradients, with whose they are.
pub type OnGrads<'a> = dyn FnMut(Gradients, GradsOf) + 'a;

/// Part of a chunk's layers between its forward and its backward.
enum Piece {
    /// Kept with its graph from a leaf input.
    Kept {
        layers: Range<usize>,
        input: Tensor<3>,
        output: Box<Tensor<3>>,
    },
    /// Only the input (no graph) and the dropout streams: run again before the backward.
    Recomputed {
        layers: Range<usize>,
        input: Tensor<3>,
        rng: RngState,
    },
    /// One layer with its attention core recomputed.
    Selective(Box<SelectiveLayer>),
}

/// `backward(Σ output ⊙ g)`: the vector–Jacobian product that continues the chain (a
/// recomputed piece's, a pipeline stage's).
pub fn backward_through<const D: usize>(output: Tensor<D>, g: Tensor<D>) -> Gradients {
    (output * g.autodiff()).sum().backward()
}

/// One layer between its forward and its backward under selective recomputation: three
/// graphs, the part before the attention core (kept), the core (recomputed), the part after
/// (kept). Each starts from leaves of its own, so each backward frees only its own graph.
struct SelectiveLayer {
    layer: usize,
    /// Leaf: the layer's input, as the part before the core sees it.
    input: Tensor<3>,
    /// The core's inputs with the graph of the part before the core.
    attention_inputs: CoreInputs,
    /// The core's inputs without a graph: what the core is recomputed from.
    saved: CoreInputs,
    /// The dropout streams at the core's start.
    rng: RngState,
    /// Leaves of the part after the core: the layer's input (residual) and the context.
    residual: Tensor<3>,
    context: Tensor<3>,
    /// The layer's output, with the graph of the part after the core.
    output: Tensor<3>,
}

impl SelectiveLayer {
    /// The layer's forward from `x` (no graph); returns the kept layer and its output.
    fn forward(
        model: &Gpt,
        layer: usize,
        x: Tensor<3>,
        documents: &Documents,
    ) -> (Self, Tensor<3>) {
        let block = model.layer(layer).expect("the chunk holds its layers");
        // Two leaves of the same value (detach gives each its own node): the two graphs that
        // use the layer's input must not share a node.
        let input = x.clone().detach().require_grad();
        let attention_inputs = block.attention_inputs(input.clone(), documents);
        let saved = attention_inputs.clone().detach();
        let rng = rng_state();
        // Without a graph: the core's inputs do not require gradients.
        let context = block
            .self_attention
            .core(saved.clone(), CoreKeeps::Everything, documents)
            .require_grad();
        let residual = x.detach().require_grad();
        let output = block.after_attention_core(residual.clone(), context.clone());
        let next = output.clone().detach();
        let kept = Self {
            layer,
            input,
            attention_inputs,
            saved,
            rng,
            residual,
            context,
            output,
        };
        (kept, next)
    }

    /// The layer's backward from its output gradient `g`; returns its input gradient.
    fn backward(self, rerun: Rerun<'_>, g: Tensor<3>, on_grads: &mut OnGrads) -> Tensor<3> {
        let Rerun { model, documents } = rerun;
        let block = model.layer(self.layer).expect("the chunk holds its layers");
        let of = GradsOf::Layers(self.layer..self.layer + 1);
        let grads = backward_through(self.output, g);
        let g_context = self.context.grad(&grads).expect("the context is used");
        let g_residual = self.residual.grad(&grads).expect("the residual is used");
        on_grads(grads, of.clone());
        let leaves = self.saved.require_grad();
        let context = replaying(self.rng, || {
            block
                .self_attention
                .core(leaves.clone(), CoreKeeps::Everything, documents)
        });
        let grads = backward_through(context, g_context);
        // The residual's gradient joins the input's inside this backward pass, so autodiff
        // sums the input's three gradients (residual, and LayerNorm's two uses) in the order
        // one whole backward pass does.
        let grads = (self.attention_inputs.weighted_by_grads(&leaves, &grads)
            + (self.input.clone() * g_residual.autodiff()).sum())
        .backward();
        let g = self.input.grad(&grads).expect("the input is used");
        on_grads(grads, of);
        g
    }
}

/// What a piece's backward runs its layers again on: the model, and the micro-batch's
/// documents, which the recomputed attention must see as the forward did.
#[derive(Clone, Copy)]
struct Rerun<'a> {
    model: &'a Gpt,
    documents: &'a Documents,
}

impl Piece {
    /// The piece's backward from its output gradient `g`; returns its input gradient.
    fn backward(self, rerun: Rerun<'_>, g: Tensor<3>, on_grads: &mut OnGrads) -> Tensor<3> {
        let Rerun { model, documents } = rerun;
        let (layers, input, output) = match self {
            Self::Selective(layer) => return layer.backward(rerun, g, on_grads),
            Self::Kept {
                layers,
                input,
                output,
            } => (layers, input, *output),
            Self::Recomputed { layers, input, rng } => {
                let input = input.require_grad();
                let output = replaying(rng, || {
                    let input = input.clone();
                    model.run_layers(layers.clone(), input, CoreKeeps::Everything, documents)
                });
                (layers, input, output)
            }
        };
        let grads = backward_through(output, g);
        let g = input
            .grad(&grads)
            .expect("a piece's input takes part in its output");
        on_grads(grads, GradsOf::Layers(layers));
        g
    }
}

/// The pieces of `plan`'s layers from `x` (no graph), a micro-batch of `documents`, their
/// attention cores keeping what `keeps` says ([`ChunkPlan::core_keeps`]); returns them and
/// the output.
fn forward_pieces(
    model: &Gpt,
    plan: &ChunkPlan,
    mut x: Tensor<3>,
    keeps: CoreKeeps,
    documents: &Documents,
) -> (Vec<Piece>, Tensor<3>) {
    let mut pieces = Vec::new();
    if plan.recompute == Recompute::Selective && keeps == CoreKeeps::Everything {
        for layer in plan.layers.clone() {
            let (kept, next) = SelectiveLayer::forward(model, layer, x, documents);
            pieces.push(Piece::Selective(Box::new(kept)));
            x = next;
        }
        return (pieces, x);
    }
    // The same weights, not requiring gradients: forward passes through them build no graph
    // (so keep no activations) yet run the training computation, dropout included, op for op.
    let without_graph = model.clone().no_grad();
    let len = plan.layers.len();
    let cut = if plan.layer_by_layer {
        plan.recompute.layer_by_layer(len)
    } else {
        plan.recompute.chunks(len)
    };
    let start = plan.layers.start;
    for (range, recomputed) in cut {
        let layers = start + range.start..start + range.end;
        let rng = rng_state();
        if recomputed {
            let output = without_graph.run_layers(layers.clone(), x.clone(), keeps, documents);
            pieces.push(Piece::Recomputed {
                layers,
                input: x,
                rng,
            });
            x = output;
        } else {
            let input = x.require_grad();
            let output = model.run_layers(layers.clone(), input.clone(), keeps, documents);
            x = output.clone().detach();
            pieces.push(Piece::Kept {
                layers,
                input,
                output: Box::new(output),
            });
        }
    }
    (pieces, x)
}

impl ChunkPlan {
    /// What the attention cores of the plan's layers keep: only their inputs under
    /// selective recomputation when every core is the one op from the projection's rows,
    /// which then forms its probabilities again in its own backward (no graph of its own,
    /// nothing else run twice); otherwise everything, a selectively recomputed core being run
    /// again by [`SelectiveLayer`].
    fn core_keeps(&self, model: &Gpt, device: &Device) -> CoreKeeps {
        if self.recompute == Recompute::Selective
            && model.cores_from_rows(self.layers.clone(), device)
        {
            CoreKeeps::Inputs
        } else {
            CoreKeeps::Everything
        }
    }
}

impl ChunkForward {
    /// The chunk's forward on `model` (which builds graphs): from `input` (a micro-batch of
    /// `documents`) through `plan.layers`, ending in the loss when `targets` are given.
    pub fn run(
        model: &Gpt,
        input: ChunkInput,
        documents: &Documents,
        plan: &ChunkPlan,
        targets: Option<Targets>,
    ) -> Self {
        let keeps = plan.core_keeps(model, &input.device());
        let in_one_graph = plan.recompute == Recompute::None || keeps == CoreKeeps::Inputs;
        if in_one_graph && !plan.layer_by_layer {
            return Self::whole(model, input, documents, plan, targets, keeps);
        }
        let (embedded, x) = match input {
            ChunkInput::Tokens(tokens) => {
                let embedded = model.embed(tokens, documents);
                let x = embedded.clone().detach();
                (Some(embedded), x)
            }
            ChunkInput::Activation(x) => (None, x),
        };
        let (pieces, x) = forward_pieces(model, plan, x, keeps, documents);
        let (head, value) = match targets {
            Some(t) => {
                let last = x.require_grad();
                let loss = model.head_loss(last.clone(), t);
                let value = ChunkValue::Loss(loss.clone().detach());
                (Some((last, loss)), value)
            }
            None => (None, ChunkValue::Activation(x)),
        };
        Self {
            kept: Kept::Pieces(Box::new(KeptPieces {
                embedded,
                pieces,
                documents: documents.clone(),
                head,
            })),
            value,
        }
    }

    /// One graph through the whole chunk.
    fn whole(
        model: &Gpt,
        input: ChunkInput,
        documents: &Documents,
        plan: &ChunkPlan,
        targets: Option<Targets>,
        keeps: CoreKeeps,
    ) -> Self {
        let (leaf, x) = match input {
            ChunkInput::Tokens(tokens) => (None, model.embed(tokens, documents)),
            ChunkInput::Activation(x) => {
                let leaf = x.require_grad();
                (Some(leaf.clone()), leaf)
            }
        };
        let y = model.run_layers(plan.layers.clone(), x, keeps, documents);
        let end = match targets {
            Some(t) => ChunkValue::Loss(model.head_loss(y, t)),
            None => ChunkValue::Activation(y),
        };
        let value = match &end {
            ChunkValue::Loss(loss) => ChunkValue::Loss(loss.clone().detach()),
            ChunkValue::Activation(y) => ChunkValue::Activation(y.clone().detach()),
        };
        Self {
            kept: Kept::Whole(Box::new(KeptWhole { input: leaf, end })),
            value,
        }
    }

    /// Whether the backward runs as a chain of pieces (each piece's gradients handed on as
    /// it finishes) rather than one graph.
    pub fn in_pieces(&self) -> bool {
        matches!(self.kept, Kept::Pieces(_))
    }

    /// The chunk's output or loss, without a graph.
    pub fn value(&self) -> &ChunkValue {
        &self.value
    }

    /// The chunk's backward: from the loss divided by `divisor` (the last chunk) or from the
    /// gradient of its output `output_grad`. The parameter gradients go to `on_grads`, a
    /// piece at a time (the head's first, the embeddings' last), so each piece's graph is
    /// freed before the next is built. Returns the gradient of the chunk's input (`None`
    /// when it started from tokens).
    pub fn backward(
        self,
        model: &Gpt,
        output_grad: Option<Tensor<3>>,
        divisor: f64,
        on_grads: &mut OnGrads,
    ) -> Result<Option<Tensor<3>>, MissingOutputGradient> {
        match self.kept {
            Kept::Whole(kept) => {
                let KeptWhole { input, end } = *kept;
                let grads = match (end, output_grad) {
                    (ChunkValue::Loss(loss), _) => loss.div_scalar(divisor).backward(),
                    (ChunkValue::Activation(y), Some(g)) => backward_through(y, g),
                    (ChunkValue::Activation(_), None) => return Err(MissingOutputGradient),
                };
                let input_grad = input.map(|x| {
                    x.grad(&grads)
                        .expect("a chunk's input takes part in its output")
                });
                on_grads(grads, GradsOf::Model);
                Ok(input_grad)
            }
            Kept::Pieces(kept) => {
                let KeptPieces {
                    embedded,
                    pieces,
                    documents,
                    head,
                } = *kept;
                let mut g = match (head, output_grad) {
                    (Some((last, loss)), _) => {
                        let grads = loss.div_scalar(divisor).backward();
                        let g = last
                            .grad(&grads)
                            .expect("the head's input takes part in the loss");
                        on_grads(grads, GradsOf::Model);
                        g
                    }
                    (None, Some(g)) => g,
                    (None, None) => return Err(MissingOutputGradient),
                };
                for piece in pieces.into_iter().rev() {
                    let rerun = Rerun {
                        model,
                        documents: &documents,
                    };
                    g = piece.backward(rerun, g, on_grads);
                }
                match embedded {
                    Some(embedded) => {
                        on_grads(backward_through(embedded, g), GradsOf::Model);
                        Ok(None)
                    }
                    None => Ok(Some(g)),
                }
            }
        }
    }
}

/// A chunk that does not end in the loss was asked for its backward without the gradient
/// of its output (a schedule error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingOutputGradient;

impl std::fmt::Display for MissingOutputGradient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a chunk that is not the last got no output gradient for its backward")
    }
}

impl std::error::Error for MissingOutputGradient {}

/// The forward of `plan.layers` from `input` (a micro-batch of `documents`) without a graph
/// (evaluation: `model` is the model's `valid()` copy, so no dropout), ending in the loss
/// when `targets` are given.
pub fn forward_only(
    model: &Gpt,
    input: ChunkInput,
    documents: &Documents,
    layers: Range<usize>,
    targets: Option<Targets>,
) -> ChunkValue {
    let x = match input {
        ChunkInput::Tokens(tokens) => model.embed(tokens, documents),
        ChunkInput::Activation(x) => x,
    };
    let y = model.run_layers(layers, x, CoreKeeps::Everything, documents);
    match targets {
        Some(t) => ChunkValue::Loss(model.head_loss(y, t)),
        None => ChunkValue::Activation(y),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_follow_megatrons_methods() {
        assert_eq!(Recompute::None.chunks(4), vec![(0..4, false)]);
        assert_eq!(
            Recompute::Uniform(1).chunks(3),
            vec![(0..1, true), (1..2, true), (2..3, true)]
        );
        assert_eq!(
            Recompute::Uniform(2).chunks(5),
            vec![(0..2, true), (2..4, true), (4..5, true)]
        );
        assert_eq!(
            Recompute::Block(2).chunks(5),
            vec![(0..1, true), (1..2, true), (2..5, false)]
        );
        assert_eq!(Recompute::Block(9).chunks(2).len(), 2);
        assert_eq!(
            Recompute::None.layer_by_layer(3),
            vec![(0..1, false), (1..2, false), (2..3, false)]
        );
        assert_eq!(
            Recompute::Block(1).layer_by_layer(3),
            vec![(0..1, true), (1..2, false), (2..3, false)]
        );
        assert_eq!(
            Recompute::Uniform(2).layer_by_layer(3),
            Recompute::Uniform(2).chunks(3)
        );
        assert!(Recompute::from_flags("uniform", 0).is_err());
        assert!(Recompute::from_flags("blocks", 1).is_err());
    }
}
