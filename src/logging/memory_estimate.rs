//! A memory estimate printed before training (as Megatron's `report_theoretical_memory`),
//! so that a configuration that cannot fit is known before it runs out of memory, with the
//! flags that would make it fit.
//!
//! Weights and optimizer state are counted exactly from the parameters a rank holds. The
//! activations are what burn's autodiff keeps for the backward pass of ferrotron's composed
//! layers (per layer: matmul and GELU inputs, LayerNorm inputs, dropout masks; the attention
//! scores; the logits' softmax), with coefficients checked against the peak RSS measured by
//! `benchmarks/training_memory.rs` (fp32, bf16 and fp16, with and without recomputation; on
//! the high side for half precision: docs/benchmarks.md, "Training memory"). The process's own
//! memory (binary, runtime) comes on top, uncounted.

use crate::model::{GptConfig, Recompute};
use crate::optim::Precision;

/// What one rank holds, in bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryEstimate {
    /// Model weights (fp32 main and half copy), fp32 gradient sums, Adam's moments.
    pub weights_and_optimizer: f64,
    /// Activations kept for one micro-batch's backward pass (with recomputation: the kept
    /// chunk inputs plus the chunk being recomputed).
    pub activations: f64,
}

impl MemoryEstimate {
    /// Both together.
    pub fn total(&self) -> f64 {
        self.weights_and_optimizer + self.activations
    }
}

/// The shape of a run, as far as memory goes.
#[derive(Clone, Debug)]
pub struct MemoryPlan<'a> {
    /// Model shape.
    pub model: &'a GptConfig,
    /// Parameters this rank holds.
    pub rank_parameters: usize,
    /// `--micro-batch-size`.
    pub micro_batch_size: usize,
    /// `--seq-length`.
    pub seq_length: usize,
    /// Tensor-parallel size.
    pub tensor_parallel: usize,
    /// Data-parallel size.
    pub data_parallel: usize,
    /// `--use-distributed-optimizer`.
    pub distributed_optimizer: bool,
    /// This rank's pipeline stage (the whole model without pipelining).
    pub stage: StageMemory,
}

/// What a pipeline stage keeps activations of: its layers, how many (micro-batch, model
/// chunk) forwards wait for their backward at once, and whether it holds the embedding and
/// the head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageMemory {
    /// Layers of one model chunk.
    pub layers_per_chunk: usize,
    /// Chunk forwards in flight at most (1 without pipelining; under 1F1B the first stage
    /// holds min(P, m) micro-batches).
    pub in_flight: usize,
    /// Holds the embeddings.
    pub embedding: bool,
    /// Holds the output layer and the loss.
    pub head: bool,
}

impl StageMemory {
    /// The whole model on one stage.
    pub fn whole(num_layers: usize) -> Self {
        Self {
            layers_per_chunk: num_layers,
            in_flight: 1,
            embedding: true,
            head: true,
        }
    }

    /// Pipeline rank `rank` of `pipeline` ranks with `chunks` model chunks of
    /// `layers_per_chunk` layers each and `microbatches` micro-batches per step: the
    /// warm-up forwards of Megatron's schedules (1F1B: P − rank; interleaved:
    /// 2(P − rank − 1) + (v − 1)P + 1) bound what is in flight.
    pub fn pipelined(
        layers_per_chunk: usize,
        pipeline: usize,
        chunks: usize,
        rank: usize,
        microbatches: usize,
    ) -> Self {
        let in_flight = if chunks == 1 {
            pipeline - rank
        } else {
            2 * (pipeline - rank - 1) + (chunks - 1) * pipeline + 1
        };
        Self {
            layers_per_chunk,
            in_flight: in_flight.min(microbatches * chunks).max(1),
            embedding: rank == 0,
            head: rank + 1 == pipeline,
        }
    }
}

/// Bytes one rank needs with `precision` and `recompute`.
pub fn estimate(plan: &MemoryPlan, precision: Precision, recompute: Recompute) -> MemoryEstimate {
    let p = plan.rank_parameters as f64;
    let e = precision.bytes() as f64;
    // Working weights; fp32 main weights when the working copy is half; the fp32 gradient
    // sums and one backward pass's gradients in the model's dtype; Adam's two fp32 moments
    // (sharded over data-parallel ranks by the distributed optimizer).
    let main = if precision == Precision::Fp32 {
        0.0
    } else {
        4.0
    };
    let adam = if plan.distributed_optimizer {
        8.0 / plan.data_parallel as f64
    } else {
        8.0
    };
    let weights_and_optimizer = p * (e + main + 4.0 + e + adam);

    let m = plan.model;
    let (b, s, h) = (
        plan.micro_batch_size as f64,
        plan.seq_length as f64,
        m.hidden_size as f64,
    );
    let t = plan.tensor_parallel as f64;
    let (f, heads, v) = (
        m.ffn_size() as f64,
        m.num_attention_heads as f64,
        m.padded_vocab_size as f64,
    );
    let layer_input = b * s * h * e;
    // Per layer, what autodiff keeps, in the model's dtype: the split [b, s, ffn/t] tensors
    // (fc1 output, GELU output), the split q, k, v ones, and the
    // replicated [b, s, h] ones (LayerNorm inputs, dropout masks), in units of `e` bytes.
    // Grouped-query attention shrinks k and v to one head per group; SwiGLU keeps its gate's
    // output, the SiLU of it and the product as well.
    let attention = m.qkv_size() as f64 / t;
    let mlp = if m.swiglu { 4.0 * f / t } else { 2.0 * f / t };
    // The replicated [b, s, h] tensors: two norm inputs, two dropout masks, two norm outputs
    // (kept by the column-parallel matmuls). Sequence parallelism splits the first four over
    // the tensor-parallel ranks; the matmuls keep their gathered input whole.
    let replicated = if m.sequence_parallel {
        1.5 * h * (1.0 / 3.0 + 2.0 / 3.0 / t)
    } else {
        1.5 * h
    };
    let rest = b * s * e * (mlp + attention + replicated);
    // [b, heads/t, s, s]: the softmax's fp32 exponentials, and the probabilities, dropout
    // mask and dropped probabilities in the model's dtype.
    let scores = b * (heads / t) * s * s * (4.0 + 3.0 * e);
    let per_layer = rest + scores;
    // The head over this rank's vocabulary shard: the cross-entropy's fp32 softmax (computed
    // in place from fp32 logits); half-precision logits add their half copy and the fp32
    // upcast beside it (and CPU half matmuls an fp32 output). Plus the embedding output.
    let logits = if precision == Precision::Fp32 {
        4.0
    } else {
        8.0 + e
    };
    let stage = plan.stage;
    let in_flight = stage.in_flight as f64;
    let mut ends = 0.0;
    if stage.embedding {
        ends += in_flight * layer_input;
    }
    if stage.head {
        // The head's backward follows its forward at once.
        ends += layer_input + b * s * (v / t) * logits;
    }
    let layers = stage.layers_per_chunk as f64;
    let kept = match recompute {
        // A stage of no layers (an uneven cut's first or last) keeps nothing of its own.
        _ if stage.layers_per_chunk == 0 => 0.0,
        Recompute::None => layers * per_layer,
        Recompute::Selective => layers * rest + scores,
        Recompute::Uniform(n) => {
            let n = (n.max(1) as f64).min(layers);
            (layers / n).ceil() * layer_input + n * per_layer
        }
        Recompute::Block(n) => {
            let n = (n as f64).min(layers);
            n * layer_input + (layers - n) * per_layer + per_layer.min(n * per_layer)
        }
    };
    MemoryEstimate {
        weights_and_optimizer,
        activations: in_flight * kept + ends,
    }
}

/// Memory the system can still give (`MemAvailable` of `/proc/meminfo`), in bytes.
pub fn available_bytes() -> Option<f64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// The report: one line for the estimate (for `ranks` ranks in this process), and, when it
/// exceeds `available` bytes, a warning naming the flags that would bring it down.
pub fn report(
    plan: &MemoryPlan,
    precision: Precision,
    recompute: Recompute,
    ranks: usize,
    available: Option<f64>,
) -> Vec<String> {
    let mb = |x: f64| x / (1024.0 * 1024.0);
    let n = ranks as f64;
    let est = estimate(plan, precision, recompute);
    let total = n * est.total();
    let mut lines = vec![format!(
        " > memory estimate{}: weights and optimizer={:.1} MB, activation={:.1} MB, total={:.1} MB",
        if ranks > 1 {
            format!(" (this process: {ranks} ranks)")
        } else {
            String::new()
        },
        mb(n * est.weights_and_optimizer),
        mb(n * est.activations),
        mb(total)
    )];
    let Some(available) = available else {
        return lines;
    };
    if total <= available {
        return lines;
    }
    let mut options = vec![];
    let layers = plan.model.num_layers;
    if recompute == Recompute::None {
        // The attention scores first: the most memory for the least compute.
        let t = n * estimate(plan, precision, Recompute::Selective).total();
        options.push(format!("--recompute-activations (≈{:.0} MB)", mb(t)));
    }
    if matches!(recompute, Recompute::None | Recompute::Selective)
        || matches!(recompute, Recompute::Block(k) if k < layers)
    {
        let r = Recompute::Uniform(1);
        let t = n * estimate(plan, precision, r).total();
        options.push(format!(
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 (≈{:.0} MB)",
            mb(t)
        ));
    }
    if precision == Precision::Fp32 {
        let t = n * estimate(plan, Precision::Bf16, recompute).total();
        options.push(format!("--bf16 (≈{:.0} MB)", mb(t)));
    }
    if plan.data_parallel > 1 && !plan.distributed_optimizer {
        let mut p = plan.clone();
        p.distributed_optimizer = true;
        let t = n * estimate(&p, precision, recompute).total();
        options.push(format!("--use-distributed-optimizer (≈{:.0} MB)", mb(t)));
    }
    if options.is_empty() {
        options.push("a smaller --micro-batch-size or more machines".to_owned());
    }
    lines.push(format!(
        "WARNING: this run may not fit: it needs about {:.0} MB and {:.0} MB are available; try {}",
        mb(total),
        mb(available),
        options.join(", or ")
    ));
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(model: &GptConfig) -> MemoryPlan<'_> {
        MemoryPlan {
            model,
            rank_parameters: model.num_parameters(),
            micro_batch_size: 4,
            seq_length: 1024,
            tensor_parallel: 1,
            data_parallel: 1,
            distributed_optimizer: false,
            stage: StageMemory::whole(model.num_layers),
        }
    }

    #[test]
    fn recompute_and_half_precision_lower_the_estimate_and_the_warning_says_so() {
        let model = GptConfig::new(24, 1024, 16, 1024, 50304);
        let plan = plan(&model);
        let full = estimate(&plan, Precision::Fp32, Recompute::None);
        let recomputed = estimate(&plan, Precision::Fp32, Recompute::Uniform(1));
        let bf16 = estimate(&plan, Precision::Bf16, Recompute::None);
        let selective = estimate(&plan, Precision::Fp32, Recompute::Selective);
        assert!(selective.activations < full.activations);
        assert!(selective.activations > recomputed.activations);
        assert!(recomputed.activations < full.activations / 4.0);
        assert!(bf16.activations < full.activations);
        // Mixed precision keeps fp32 main weights: the half copy and its half gradients
        // take what fp32 main weights add, so weight memory does not shrink.
        assert_eq!(bf16.weights_and_optimizer, full.weights_and_optimizer);
        // 345M parameters × (4 weights + 4 sums + 4 backward + 8 Adam) bytes.
        let p = model.num_parameters() as f64;
        assert_eq!(full.weights_and_optimizer, p * 20.0);
        let lines = report(&plan, Precision::Fp32, Recompute::None, 1, Some(1e9));
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[1].contains("--recompute-activations")
                && lines[1].contains("--recompute-method uniform")
                && lines[1].contains("--bf16"),
            "{lines:?}"
        );
        let selective = report(&plan, Precision::Fp32, Recompute::Selective, 1, Some(1e9));
        assert!(
            !selective[1].contains("--recompute-activations"),
            "{selective:?}"
        );
        let fits = report(&plan, Precision::Fp32, Recompute::None, 1, Some(1e12));
        assert_eq!(fits.len(), 1);
    }

    #[test]
    fn a_first_pipeline_stage_keeps_its_layers_for_the_micro_batches_in_flight() {
        let model = GptConfig::new(24, 1024, 16, 1024, 50304);
        let whole = estimate(&plan(&model), Precision::Fp32, Recompute::None);
        // 1F1B, 4 stages of 6 layers, 8 micro-batches: the first stage holds 4 micro-batches
        // of 6 layers (24 layer-passes, as the whole model's one) and no head.
        let first = MemoryPlan {
            stage: StageMemory::pipelined(6, 4, 1, 0, 8),
            ..plan(&model)
        };
        let last = MemoryPlan {
            stage: StageMemory::pipelined(6, 4, 1, 3, 8),
            ..plan(&model)
        };
        let first = estimate(&first, Precision::Fp32, Recompute::None);
        let last = estimate(&last, Precision::Fp32, Recompute::None);
        assert!(first.activations < whole.activations);
        assert!(first.activations > 0.8 * whole.activations);
        assert!(last.activations < 0.5 * whole.activations);
        // Interleaved warm-up: 2(P − 1) + (v − 1)P + 1 = 11 chunk forwards on rank 0.
        assert_eq!(StageMemory::pipelined(3, 4, 2, 0, 8).in_flight, 11);
        assert_eq!(StageMemory::pipelined(6, 4, 1, 0, 2).in_flight, 2);
    }
}
