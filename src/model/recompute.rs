//! Activation recomputation. Megatron's `--recompute-granularity full`: keep only the inputs
//! of chunks of layers during the forward pass, and run each chunk's forward again, with its
//! graph, just before its backward. `--recompute-granularity selective`: keep every layer's
//! activations but those of the attention core (scores, softmax, dropout, `· v`), the
//! largest per byte of compute, which is run again from the kept queries, keys and values.
//!
//! The step runs as a chain of vector–Jacobian products. Each chunk's forward starts from a
//! leaf copy of its input; its backward is `backward(Σ output ⊙ g)` with `g` the gradient of
//! the chunk after it, which yields the chunk's parameter gradients and `g` for the chunk
//! before. The dropout streams are saved at each chunk's start and replayed for its
//! recomputation (Megatron's `CheckpointFunction`), so the masks, and so the losses and
//! gradients, are the ones of the run without recomputation. Collectives inside a chunk
//! (tensor parallelism) run again in the recomputation, in the same order on every rank.

use std::ops::Range;

use burn::module::Module;
use burn::tensor::{Gradients, Int, Tensor};

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

/// A chunk between its forward and its backward.
struct Pending {
    layers: Range<usize>,
    /// The chunk's input: a leaf of the kept graph, or the saved activation to recompute from.
    input: Tensor<3>,
    /// The kept chunk's output (with its graph); `None` when the chunk is recomputed.
    output: Option<Tensor<3>>,
    /// The dropout streams at the chunk's start.
    rng: RngState,
}

/// `backward(Σ output ⊙ g)`: the vector–Jacobian product that continues the chain (a
/// recomputed chunk's, a pipeline stage's).
pub fn backward_through<const D: usize>(output: Tensor<D>, g: Tensor<D>) -> Gradients {
    (output * g.autodiff()).sum().backward()
}

/// The head's forward and backward from the last layer's output `x`: the loss (without a
/// graph) and the gradient of `x`; the head's parameter gradients go to `on_grads`.
fn head_backward(
    model: &Gpt,
    x: Tensor<3>,
    labels: Tensor<2, Int>,
    loss_mask: Tensor<2>,
    divisor: f64,
    on_grads: &mut impl FnMut(Gradients),
) -> (Tensor<1>, Tensor<3>) {
    let last = x.require_grad();
    let loss = model.head_loss(last.clone(), labels, loss_mask);
    let value = loss.clone().detach();
    let grads = loss.div_scalar(divisor).backward();
    let g = last
        .grad(&grads)
        .expect("the head's input takes part in the loss");
    on_grads(grads);
    (value, g)
}

/// One layer between its forward and its backward under selective recomputation: three
/// graphs, the part before the attention core (kept), the core (recomputed), the part after
/// (kept). Each starts from leaves of its own, so each backward frees only its own graph.
struct SelectiveLayer {
    /// Leaf: the layer's input, as the part before the core sees it.
    input: Tensor<3>,
    /// q, k, v with the graph of the part before the core.
    attention_inputs: [Tensor<4>; 3],
    /// q, k, v without a graph: what the core is recomputed from.
    saved: [Tensor<4>; 3],
    /// The dropout streams at the core's start.
    rng: RngState,
    /// Leaves of the part after the core: the layer's input (residual) and the context.
    residual: Tensor<3>,
    context: Tensor<4>,
    /// The layer's output, with the graph of the part after the core.
    output: Tensor<3>,
}

/// [`lm_loss_backward`] under selective recomputation.
fn selective_lm_loss_backward(
    model: &Gpt,
    tokens: Tensor<2, Int>,
    labels: Tensor<2, Int>,
    loss_mask: Tensor<2>,
    divisor: f64,
    mut on_grads: impl FnMut(Gradients),
) -> Tensor<1> {
    let embedded = model.embed(tokens);
    let mut x = embedded.clone().detach();
    let mut pending = Vec::with_capacity(model.layers.len());
    for layer in model.held_layers() {
        // Two leaves of the same value (detach gives each its own node): the two graphs that
        // use the layer's input must not share a node.
        let input = x.clone().detach().require_grad();
        let attention_inputs = layer.attention_inputs(input.clone());
        let saved = attention_inputs.clone().map(|t| t.detach());
        let rng = rng_state();
        // Without a graph: the core's inputs do not require gradients.
        let [q, k, v] = saved.clone();
        let context = layer.self_attention.core(q, k, v).require_grad();
        let residual = x.detach().require_grad();
        let output = layer.after_attention_core(residual.clone(), context.clone());
        x = output.clone().detach();
        pending.push(SelectiveLayer {
            input,
            attention_inputs,
            saved,
            rng,
            residual,
            context,
            output,
        });
    }
    let (value, mut g) = head_backward(model, x, labels, loss_mask, divisor, &mut on_grads);
    for (layer, p) in model
        .held_layers()
        .collect::<Vec<_>>()
        .into_iter()
        .zip(pending)
        .rev()
    {
        let grads = backward_through(p.output, g);
        let g_context = p.context.grad(&grads).expect("the context is used");
        let g_residual = p.residual.grad(&grads).expect("the residual is used");
        on_grads(grads);
        let [q, k, v] = p.saved.map(|t| t.require_grad());
        let context = replaying(p.rng, || {
            layer.self_attention.core(q.clone(), k.clone(), v.clone())
        });
        let grads = backward_through(context, g_context);
        let g_qkv = [&q, &k, &v].map(|t| t.grad(&grads).expect("q, k and v are used"));
        let [(q, gq), (k, gk), (v, gv)] = {
            let [a, b, c] = p.attention_inputs;
            let [ga, gb, gc] = g_qkv;
            [(a, ga), (b, gb), (c, gc)]
        };
        // The residual's gradient joins the input's inside this backward pass, so autodiff
        // sums the input's three gradients (residual, and LayerNorm's two uses) in the order
        // one whole backward pass does.
        let grads = ((q * gq.autodiff()).sum()
            + (k * gk.autodiff()).sum()
            + (v * gv.autodiff()).sum()
            + (p.input.clone() * g_residual.autodiff()).sum())
        .backward();
        g = p.input.grad(&grads).expect("the input is used");
        on_grads(grads);
    }
    on_grads(backward_through(embedded, g));
    value
}

/// One micro-batch's forward and backward with the layers recomputed as `recompute` says:
/// the gradients of `model.lm_loss(tokens, labels, mask) / divisor`, handed to `on_grads` a
/// chunk at a time (so each chunk's graph is freed before the next is built): the head's
/// first, the embeddings' last. With `layer_by_layer`, kept layers are chunks of one layer
/// each ([`Recompute::layer_by_layer`]). Returns the loss (before the division, without a
/// graph).
#[allow(clippy::too_many_arguments)]
pub fn lm_loss_backward(
    model: &Gpt,
    tokens: Tensor<2, Int>,
    labels: Tensor<2, Int>,
    loss_mask: Tensor<2>,
    divisor: f64,
    recompute: Recompute,
    layer_by_layer: bool,
    mut on_grads: impl FnMut(Gradients),
) -> Tensor<1> {
    if recompute == Recompute::Selective {
        return selective_lm_loss_backward(model, tokens, labels, loss_mask, divisor, on_grads);
    }
    let embedded = model.embed(tokens);
    let mut x = embedded.clone().detach();
    let mut pending = Vec::new();
    // The same weights, not requiring gradients: forward passes through them build no graph
    // (so keep no activations) yet run the training computation, dropout included, op for op.
    let without_graph = model.clone().no_grad();
    let chunks = if layer_by_layer {
        recompute.layer_by_layer(model.layers.len())
    } else {
        recompute.chunks(model.layers.len())
    };
    for (layers, recomputed) in chunks {
        let rng = rng_state();
        if recomputed {
            let output = without_graph.run_layers(layers.clone(), x.clone());
            pending.push(Pending {
                layers,
                input: x,
                output: None,
                rng,
            });
            x = output;
        } else {
            let input = x.require_grad();
            let output = model.run_layers(layers.clone(), input.clone());
            x = output.clone().detach();
            pending.push(Pending {
                layers,
                input,
                output: Some(output),
                rng,
            });
        }
    }
    let (value, mut g) = head_backward(model, x, labels, loss_mask, divisor, &mut on_grads);
    for chunk in pending.into_iter().rev() {
        let (input, output) = match chunk.output {
            Some(output) => (chunk.input, output),
            None => {
                let input = chunk.input.require_grad();
                let output = replaying(chunk.rng, || {
                    model.run_layers(chunk.layers.clone(), input.clone())
                });
                (input, output)
            }
        };
        let grads = backward_through(output, g);
        g = input
            .grad(&grads)
            .expect("a chunk's input takes part in its output");
        on_grads(grads);
    }
    on_grads(backward_through(embedded, g));
    value
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
