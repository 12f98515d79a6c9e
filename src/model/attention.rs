//! Causal self-attention with a fused QKV projection (Megatron's `ParallelAttention` /
//! `SelfAttention`): multi-head, or grouped-query with fewer key/value heads; optionally with
//! query/key norms and rotary position embeddings.

use burn::module::Module;
use burn::tensor::{Device, Gradients, Int, Tensor};

use super::documents::{window_first_keys, Documents};
use super::dropout::Dropout;
use super::kv_cache::LayerKv;
use super::norm::Norm;
use super::ops::{
    offset_causal_masked_softmax, offset_document_masked_softmax, scaled_causal_masked_softmax,
    scaled_document_masked_softmax,
};
use super::rotary::RotaryEmbedding;
use super::GptConfig;
use crate::comm::Group;
use crate::parallel::context::ContextSplit;
use crate::parallel::layers::{ColumnParallelLinear, RowParallelLinear};
use crate::parallel::random::RngRegion;
use crate::util::matmul::matmul;

/// Causal self-attention, its query groups split across the tensor-parallel ranks.
///
/// The fused QKV output is laid out per query group as Megatron's is (`[groups, heads per
/// group + 2, head_dim]`: the group's queries, its key, its value; with one group per head
/// that is `[heads, 3, head_dim]`), so the column split gives each rank whole groups.
#[derive(Module, Debug)]
pub struct CausalSelfAttention {
    /// hidden → (heads + 2 · groups) × head_dim, column-parallel (this rank's groups).
    pub query_key_value: ColumnParallelLinear,
    /// heads × head_dim → hidden, row-parallel (std / √(2 · layers) at init).
    pub dense: RowParallelLinear,
    /// Per-head norm of the queries (`--qk-layernorm`).
    pub q_layernorm: Option<Norm>,
    /// Per-head norm of the keys (`--qk-layernorm`).
    pub k_layernorm: Option<Norm>,
    /// Dropout on the attention probabilities: a mask drawn over every head, of which this
    /// rank applies its heads' part (so every tensor-parallel size drops alike).
    pub attention_dropout: Dropout,
    /// Query heads on this rank.
    pub local_heads: usize,
    /// Key/value heads (query groups) on this rank.
    pub local_groups: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Rotary embedding of queries and keys (`--position-embedding-type rope`).
    #[module(skip)]
    pub rotary: Option<RotaryEmbedding>,
    /// Use the fused softmax kernel where the backend has it (off:
    /// `--no-masked-softmax-fusion`).
    pub masked_softmax_fusion: bool,
    /// Use the fused (FlashAttention-style) attention kernel where the backend has it
    /// (`--use-flash-attn`).
    pub flash_attention: bool,
    /// The core from the projection's rows keeps only q, k, v
    /// (`GptConfig::core_keeps_only_inputs`).
    pub core_keeps_only_inputs: bool,
    /// The micro-batches carry per-document positions (`--reset-position-ids`): the rotary
    /// embedding is applied at them, outside the core.
    pub reset_position_ids: bool,
    /// The micro-batches carry per-document attention starts (`--reset-attention-mask`): the
    /// core is the composed one, whose softmax takes them.
    pub reset_attention_mask: bool,
    /// The keys before each query this layer sees besides itself (sliding-window attention,
    /// `--window-size`); `None`: all of them.
    pub sliding_window: Option<usize>,
    /// The micro-batches hold a context-parallel rank's two chunks of each sequence
    /// (`--context-parallel-size`): the core gathers the whole sequence's keys and values.
    #[module(skip)]
    pub context: Option<ContextSplit>,
}

impl CausalSelfAttention {
    /// The attention named `name` (e.g. `layers.0.self_attention`).
    pub fn new(config: &GptConfig, seed: u64, name: &str, group: &Group, device: &Device) -> Self {
        let (h, d) = (config.hidden_size, config.head_dim());
        let std = config.init_method_std;
        let output_std = std / (2.0 * config.num_layers as f64).sqrt();
        let qk_norm = |which: &str| {
            config.qk_layernorm.then(|| {
                Norm::new(
                    config.normalization,
                    d,
                    config.layernorm_epsilon,
                    config.apply_layernorm_1p,
                    &format!("{name}.{which}"),
                    device,
                )
                .with_fusion(config.layer_norm_fusion)
                .with_input_split_over(group)
            })
        };
        let rope = config.position_embedding_type == super::architecture::PositionEmbedding::Rope;
        Self {
            query_key_value: ColumnParallelLinear::new(
                h,
                config.qkv_size(),
                std,
                seed,
                &format!("{name}.query_key_value"),
                false,
                group,
                device,
            )
            .with_bias(config.qkv_bias())
            .with_sequence_parallel(config.sequence_parallel),
            dense: RowParallelLinear::new(
                config.num_attention_heads * d,
                h,
                output_std,
                seed,
                &format!("{name}.dense"),
                true,
                group,
                device,
            )
            .with_bias(config.add_bias_linear)
            .with_sequence_parallel(config.sequence_parallel),
            q_layernorm: qk_norm("q_layernorm"),
            k_layernorm: qk_norm("k_layernorm"),
            attention_dropout: Dropout::new(config.attention_dropout, RngRegion::AttentionHeads)
                .with_chunk_of(group),
            local_heads: config.num_attention_heads / group.size(),
            local_groups: config.query_groups() / group.size(),
            head_dim: d,
            rotary: rope.then(|| RotaryEmbedding::new(config)),
            masked_softmax_fusion: config.masked_softmax_fusion,
            flash_attention: config.flash_attention,
            core_keeps_only_inputs: config.core_keeps_only_inputs,
            reset_position_ids: config.reset_position_ids,
            reset_attention_mask: config.reset_attention_mask,
            sliding_window: None,
            context: None,
        }
    }

    /// The same layer on a context-parallel rank's chunks of each sequence (`None`: whole
    /// sequences).
    pub fn with_context(mut self, split: Option<ContextSplit>) -> Self {
        self.context = split;
        self
    }

    /// The same layer seeing only `window` keys before each query (`None`: all of them).
    pub fn with_window(mut self, window: Option<usize>) -> Self {
        self.sliding_window = window;
        self
    }

    /// The first key each query of a `[batch, seq]` micro-batch sees, where it is not key 0:
    /// its document's first token (`first_keys`, packed documents), or `window` keys back,
    /// whichever is later. `None` where every query sees from key 0.
    pub fn visible_first_keys(
        &self,
        first_keys: Option<&Tensor<2, Int>>,
        [batch, seq]: [usize; 2],
        device: &Device,
    ) -> Option<Tensor<2, Int>> {
        let Some(window) = self.sliding_window else {
            return first_keys.cloned();
        };
        // Each query's window ends at its position in the whole sequence.
        let windowed = match &self.context {
            Some(split) => split
                .rows(seq, device)
                .sub_scalar(window as i64)
                .clamp_min(0),
            None => window_first_keys(window, 0, seq, device),
        };
        let windowed = windowed.unsqueeze::<2>().expand([batch, seq]);
        Some(match first_keys {
            Some(documents) => documents.clone().max_pair(windowed),
            None => windowed,
        })
    }

    /// Whether the attention core of inputs on `device` is computed from the projection's
    /// rows, in one op that splits and rotates them: on a CubeCL device, when nothing comes
    /// between the projection and the core but a fused rotary embedding (no query/key norms)
    /// and a fused core is on, and the micro-batches carry no per-document attention starts
    /// (nor per-document positions to rotate at).
    pub fn core_from_rows(&self, device: &Device) -> bool {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        let on_cube = crate::util::device::is_cube(device);
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        let on_cube = {
            let _ = device;
            false
        };
        let rotates_per_document = self.reset_position_ids && self.rotary.is_some();
        on_cube
            && self.context.is_none()
            && !self.reset_attention_mask
            && self.sliding_window.is_none()
            && !rotates_per_document
            && self.q_layernorm.is_none()
            && self.rotary.as_ref().is_none_or(RotaryEmbedding::is_fused)
            && (self.flash_attention || self.masked_softmax_fusion)
    }

    /// Which part of the attention dropout's draw (over every head) the probabilities `[batch,
    /// local heads, seq, seq]` of this rank's heads hold, for the fused kernels that drop
    /// inside.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn probabilities_slice(
        &self,
        batch: usize,
        seq: usize,
    ) -> ferrotron_kernels::launch::DrawSlice {
        self.attention_dropout
            .slice_of(&[batch, self.local_heads, seq, seq])
    }

    /// What the attention core of `x` is computed from: the projection's rows where
    /// [`Self::core_from_rows`], otherwise [`Self::query_key_value_heads`] at positions
    /// from 0, or at the documents' own positions where `documents` has them.
    pub fn core_inputs(&self, x: Tensor<3>, documents: &Documents) -> CoreInputs {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if self.core_from_rows(&x.device()) {
            // The bias is added by the core's split kernel, not by a launch of its own.
            let (rows, bias) = self.query_key_value.forward_skip_bias(x);
            return CoreInputs::Rows { rows, bias };
        }
        match (&documents.positions, &self.rotary) {
            (Some(positions), Some(rotary)) => {
                let [q, k, v] = self.split_heads(self.query_key_value.forward(x));
                let whole_seq =
                    positions.dims()[1] * self.context.as_ref().map_or(1, ContextSplit::size);
                let [q, k] = rotary.apply_at([q, k], positions, whole_seq);
                CoreInputs::Heads([q, k, v])
            }
            _ => CoreInputs::Heads(self.query_key_value_heads(x, 0)),
        }
    }

    /// Queries `[batch, local heads, seq, head_dim]`, keys and values `[batch, local groups,
    /// seq, head_dim]` of `x` at positions `start..start + seq`: the fused per-group
    /// projection split, the query/key norms and the rotary embedding applied.
    pub fn query_key_value_heads(&self, x: Tensor<3>, start: usize) -> [Tensor<4>; 3] {
        // [b, s, local groups · (heads per group + 2) · head_dim], the whole sequence (the
        // projection gathers it under sequence parallelism).
        self.heads_of(self.query_key_value.forward(x), start)
    }

    /// [`Self::query_key_value_heads`] of the projection's rows `qkv`.
    pub fn heads_of(&self, qkv: Tensor<3>, start: usize) -> [Tensor<4>; 3] {
        let [q, k, v] = self.split_heads(qkv);
        match &self.rotary {
            Some(rotary) => {
                let [q, k] = rotary.apply_to([q, k], start);
                [q, k, v]
            }
            None => [q, k, v],
        }
    }

    /// The projection's rows `qkv` split into queries, keys and values per head, the
    /// query/key norms applied (not the rotary embedding).
    fn split_heads(&self, qkv: Tensor<3>) -> [Tensor<4>; 3] {
        let (groups, d) = (self.local_groups, self.head_dim);
        let per_group = self.local_heads / groups;
        let [b, s, _] = qkv.dims();
        let qkv = qkv.reshape([b, s, groups, (per_group + 2) * d]);
        let part = |from: usize, heads: usize| {
            qkv.clone()
                .narrow(3, from * d, heads * d)
                .reshape([b, s, groups * heads, d])
                .swap_dims(1, 2)
        };
        let (mut q, mut k, v) = (
            part(0, per_group),
            part(per_group, 1),
            part(per_group + 1, 1),
        );
        if let (Some(q_norm), Some(k_norm)) = (&self.q_layernorm, &self.k_layernorm) {
            q = q_norm.forward_heads(q);
            k = k_norm.forward_heads(k);
        }
        [q, k, v]
    }

    /// Keys or values of the local groups `[batch, groups, seq, head_dim]` repeated for the
    /// query heads of each group `[batch, heads, seq, head_dim]` (HF's `repeat_kv`).
    fn per_head(&self, t: Tensor<4>) -> Tensor<4> {
        let per_group = self.local_heads / self.local_groups;
        if per_group == 1 {
            return t;
        }
        let [b, g, s, d] = t.dims();
        t.unsqueeze_dim::<5>(2)
            .expand([b, g, per_group, s, d])
            .reshape([b, g * per_group, s, d])
    }

    /// The output projection of the context `[batch, seq, local heads · head_dim]`.
    pub fn project_out(&self, context: Tensor<3>) -> Tensor<3> {
        self.dense.forward(context)
    }

    /// [`Self::project_out`] without its bias, and the bias (for a fused bias-dropout-add).
    pub fn project_out_skip_bias(&self, context: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        self.dense.forward_skip_bias(context)
    }

    /// The attention core (Megatron's `CoreAttention`) of `inputs`: the context `[batch,
    /// seq, local heads · head_dim]`, heads side by side as the output projection takes them.
    /// From the projection's rows it is one fused op (the rotary embedding inside, at
    /// positions from 0), which keeps for its backward what `keeps` says; from per-head
    /// inputs, [`Self::core_heads`] with the heads merged, which keeps what its ops keep;
    /// each query sees its own document only where `documents` has attention starts.
    pub fn core(&self, inputs: CoreInputs, keeps: CoreKeeps, documents: &Documents) -> Tensor<3> {
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        let _ = keeps;
        match inputs {
            CoreInputs::Heads([q, k, v]) => {
                let [batch, _, seq, _] = q.dims();
                let first_keys = documents.first_keys.as_ref();
                let first_keys = self.visible_first_keys(first_keys, [batch, seq], &q.device());
                if let Some(split) = &self.context {
                    return merge_heads(self.context_core_heads([q, k, v], first_keys, split));
                }
                merge_heads(self.core_heads(q, k, v, first_keys.as_ref()))
            }
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            CoreInputs::Rows { rows: qkv, bias } => {
                let scale = 1.0 / (self.head_dim as f64).sqrt();
                let per_group = self.local_heads / self.local_groups;
                let draw = self.attention_dropout.draw(qkv.is_autodiff());
                let [batch, seq, _] = qkv.dims();
                let rotation = self
                    .rotary
                    .as_ref()
                    .and_then(|rotary| rotary.for_rows(seq, &qkv.device()));
                let kernels = self.core_kernels(keeps);
                super::fused::attention_from_qkv(
                    qkv,
                    bias,
                    self.local_groups,
                    per_group,
                    scale,
                    draw,
                    self.probabilities_slice(batch, seq),
                    kernels,
                    rotation,
                )
            }
        }
    }

    /// The kernels the core from the projection's rows runs when the chunk asks it to keep
    /// `keeps`: the fused attention, or the composed kernels keeping their probabilities, or
    /// keeping only q, k, v (selective recomputation, or `core_keeps_only_inputs`).
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    pub fn core_kernels(&self, keeps: CoreKeeps) -> super::fused::CoreKernels {
        use super::fused::CoreKernels;
        let only_inputs = keeps == CoreKeeps::Inputs || self.core_keeps_only_inputs;
        match (self.flash_attention, only_inputs) {
            (true, _) => CoreKernels::Flash,
            (false, false) => CoreKernels::Composed,
            (false, true) => CoreKernels::Recomputed,
        }
    }

    /// The attention core of per-head inputs: `dropout(softmax(q kᵀ / √d)) v`, the per-head
    /// context `[batch, local heads, seq, head_dim]`. It has no parameters and keeps the
    /// largest activations (`[batch, heads, seq, seq]`), which is why selective recomputation
    /// recomputes exactly this.
    ///
    /// With `--use-flash-attn` on a CubeCL device it is one fused kernel that keeps only the
    /// output and a log-sum-exp per row (dropping the same probabilities as the composed
    /// path for the same seed). With `first_keys` (`[batch, seq]`, packed documents) each
    /// query sees the keys from its entry to itself: in the fused kernel, which skips the
    /// tiles of other documents, or else in the composed core with a mask built from them.
    pub fn core_heads(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        first_keys: Option<&Tensor<2, Int>>,
    ) -> Tensor<4> {
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let (k, v) = (self.per_head(k), self.per_head(v));
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if self.flash_attention && crate::util::device::is_cube(&q.device()) {
            let draw = self.attention_dropout.draw(q.is_autodiff());
            let [batch, _, seq, _] = q.dims();
            let slice = self.probabilities_slice(batch, seq);
            let first_keys = first_keys.cloned();
            return super::fused::causal_attention(q, k, v, scale, draw, slice, first_keys, None);
        }
        if let Some(first_keys) = first_keys {
            let scores = matmul(q, k.transpose());
            let probs = scaled_document_masked_softmax(scores, scale, first_keys.clone());
            return matmul(self.attention_dropout.forward(probs), v);
        }
        let scores = matmul(q, k.transpose());
        let probs = scaled_causal_masked_softmax(scores, scale, self.masked_softmax_fusion);
        matmul(self.attention_dropout.forward(probs), v)
    }

    /// [`Self::core_heads`] of a context-parallel rank's queries (its two chunks of the
    /// sequence, `[batch, local heads, 2c, head_dim]`) over the whole sequence's keys and
    /// values, gathered from every rank of `split`. Each chunk's queries at positions
    /// `start..start + c` see keys `0..start + c` only, causally from `start` (and from their
    /// `first_keys` on); the attention dropout is the whole sequence's draw at those scores.
    /// With `--use-flash-attn` on a CubeCL device the fused kernels take each chunk
    /// ([`Self::fused_context_chunks`]); otherwise the composed core computes each chunk's
    /// scores, `(2 · size + 1) · c²` of the sequence's `(2 · size · c)²` on a rank.
    fn context_core_heads(
        &self,
        [q, k, v]: [Tensor<4>; 3],
        first_keys: Option<Tensor<2, Int>>,
        split: &ContextSplit,
    ) -> Tensor<4> {
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        // Gathered per group, before the repeat for each head: fewer bytes travel.
        let k = self.per_head(split.gather_sequence(k));
        let v = self.per_head(split.gather_sequence(v));
        let [batch, heads, local, _] = q.dims();
        let whole_seq = k.dims()[2];
        let draw = self.attention_dropout.draw(q.is_autodiff());
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if self.flash_attention && crate::util::device::is_cube(&q.device()) {
            let inputs = ContextChunks {
                q,
                k,
                v,
                first_keys,
                chunks: split.chunks(local),
            };
            return self.fused_context_chunks(inputs, draw, scale);
        }
        let half = local / 2;
        let contexts = split
            .chunks(local)
            .into_iter()
            .enumerate()
            .map(|(i, rows)| {
                let q = q.clone().narrow(2, i * half, half);
                let seen = rows.end;
                let scores = matmul(q, k.clone().narrow(2, 0, seen).transpose());
                let probs = match &first_keys {
                    Some(first) => {
                        let first = first.clone().narrow(1, i * half, half);
                        offset_document_masked_softmax(scores, scale, rows.start, first)
                    }
                    None => offset_causal_masked_softmax(scores, scale, rows.start),
                };
                let probs = match draw {
                    Some((key, _)) => {
                        let heads_held = self.attention_dropout.rows_of(heads);
                        let whole_heads = heads
                            * self
                                .attention_dropout
                                .chunk_of
                                .as_ref()
                                .map_or(1, Group::size);
                        let whole = [batch, whole_heads, whole_seq, whole_seq];
                        let picks = [
                            (0..batch).collect(),
                            heads_held,
                            rows.collect(),
                            (0..seen).collect(),
                        ];
                        self.attention_dropout
                            .forward_drawn(probs, key, whole, picks)
                    }
                    None => probs,
                };
                matmul(probs, v.clone().narrow(2, 0, seen))
            });
        Tensor::cat(contexts.collect(), 2)
    }

    /// [`Self::context_core_heads`] in the fused kernels: each chunk's queries as the
    /// positions `start..start + c` of a head `start + c` long (the positions before them
    /// padding, which see nothing and which the kernels skip by the block), over the keys up
    /// to its end; one draw for both chunks, the whole sequence's. Memory stays linear in the
    /// sequence: the padding is `start` rows of a head.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn fused_context_chunks(
        &self,
        inputs: ContextChunks,
        draw: Option<(u64, f64)>,
        scale: f64,
    ) -> Tensor<4> {
        use super::fused::ChunkRows;
        let ContextChunks {
            q,
            k,
            v,
            first_keys,
            chunks,
        } = inputs;
        let [batch, heads, local, d] = q.dims();
        let (whole, half, device) = (k.dims()[2], local / 2, q.device());
        let slice = self.probabilities_slice(batch, whole);
        let contexts = chunks.into_iter().enumerate().map(|(i, rows)| {
            let (start, seen) = (rows.start, rows.end);
            let mine = q.clone().narrow(2, i * half, half);
            let first = match &first_keys {
                Some(first) => first.clone().narrow(1, i * half, half),
                None => Tensor::<2, Int>::zeros([batch, half], &device),
            };
            let (queries, first) = if start == 0 {
                (mine, first)
            } else {
                let padding = Tensor::<4>::zeros([batch, heads, start, d], (&device, mine.dtype()));
                let before = Tensor::<2, Int>::zeros([batch, start], &device);
                (
                    Tensor::cat(vec![padding, mine], 2),
                    Tensor::cat(vec![before, first], 1),
                )
            };
            let rows = ChunkRows {
                queries_from: start,
                draw_seq: whole,
            };
            let (k, v) = (k.clone().narrow(2, 0, seen), v.clone().narrow(2, 0, seen));
            super::fused::causal_attention(
                queries,
                k,
                v,
                scale,
                draw,
                slice,
                Some(first),
                Some(rows),
            )
            .narrow(2, start, half)
        });
        Tensor::cat(contexts.collect(), 2)
    }

    /// `[batch, seq, hidden]` → `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let documents = Documents::none();
        let inputs = self.core_inputs(x, &documents);
        self.project_out(self.core(inputs, CoreKeeps::Everything, &documents))
    }

    /// [`Self::forward`] for `x` = the positions after those in `past` (inference only, no
    /// dropout): their keys and values (one per group) are appended to `past`, and each query
    /// attends to every cached position and to the new ones up to itself.
    pub fn forward_cached(&self, x: Tensor<3>, past: &mut Option<LayerKv>) -> Tensor<3> {
        let cached = past.as_ref().map_or(0, |p| p.keys.dims()[2]);
        let [q, k, v] = self.query_key_value_heads(x, cached);
        let (k, v) = match past.take() {
            Some(p) => (
                Tensor::cat(vec![p.keys, k], 2),
                Tensor::cat(vec![p.values, v], 2),
            ),
            None => (k, v),
        };
        *past = Some(LayerKv {
            keys: k.clone(),
            values: v.clone(),
        });
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let scores = q.matmul(self.per_head(k).transpose());
        let probs = match (self.sliding_window, cached) {
            (Some(window), _) => {
                let sq = scores.dims()[2];
                let first_keys = window_first_keys(window, cached, sq, &scores.device());
                offset_document_masked_softmax(scores, scale, cached, first_keys.unsqueeze())
            }
            (None, 0) => scaled_causal_masked_softmax(scores, scale, self.masked_softmax_fusion),
            (None, _) => offset_causal_masked_softmax(scores, scale, cached),
        };
        self.project_out(merge_heads(probs.matmul(self.per_head(v))))
    }
}

/// What the attention core keeps for its backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CoreKeeps {
    /// What its ops keep: the composed core's probabilities `[batch, heads, seq, seq]` (the
    /// core from the projection's rows keeps them before dropout only; the per-head core's
    /// autodiff graph, after dropout too).
    #[default]
    Everything,
    /// Only its inputs, the backward forming the probabilities again (selective
    /// recomputation inside the op). Only the core from the projection's rows
    /// ([`CausalSelfAttention::core_from_rows`]) can; from per-head inputs it is
    /// [`Self::Everything`].
    Inputs,
}

/// What the attention core is computed from.
// One value per layer and micro-batch, moved a few times: not worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum CoreInputs {
    /// Queries, keys and values per head, after the query/key norms and rotary embedding.
    Heads([Tensor<4>; 3]),
    /// The fused QKV projection's rows `[batch, seq, width]` without its bias, and the bias
    /// `[width]` the core adds (GPU builds).
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    Rows {
        /// The projection's product.
        rows: Tensor<3>,
        /// Its bias, if it has one.
        bias: Option<Tensor<1>>,
    },
}

impl CoreInputs {
    /// The same values without a graph.
    pub fn detach(self) -> Self {
        match self {
            Self::Heads(heads) => Self::Heads(heads.map(|t| t.detach())),
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            Self::Rows { rows, bias } => Self::Rows {
                rows: rows.detach(),
                bias: bias.map(|b| b.detach()),
            },
        }
    }

    /// The same values as leaves that require gradients.
    pub fn require_grad(self) -> Self {
        match self {
            Self::Heads(heads) => Self::Heads(heads.map(|t| t.require_grad())),
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            Self::Rows { rows, bias } => Self::Rows {
                rows: rows.require_grad(),
                bias: bias.map(|b| b.require_grad()),
            },
        }
    }

    /// `Σ x · g` over the tensors `x` of `self`, `g` the gradient in `grads` of the matching
    /// tensor of `leaves` (the same kind): backpropagating it gives each `x` its gradient `g`.
    pub fn weighted_by_grads(self, leaves: &Self, grads: &Gradients) -> Tensor<1> {
        let grad = |t: &Tensor<4>| t.grad(grads).expect("q, k and v are used").autodiff();
        match (self, leaves) {
            (Self::Heads([q, k, v]), Self::Heads([lq, lk, lv])) => {
                (q * grad(lq)).sum() + (k * grad(lk)).sum() + (v * grad(lv)).sum()
            }
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            (
                Self::Rows { rows, bias },
                Self::Rows {
                    rows: leaf,
                    bias: leaf_bias,
                },
            ) => {
                let g = leaf.grad(grads).expect("the rows are used").autodiff();
                let weighted = (rows * g).sum();
                let Some((bias, leaf)) = bias.zip(leaf_bias.as_ref()) else {
                    return weighted;
                };
                let g = leaf.grad(grads).expect("the bias is used").autodiff();
                weighted + (bias * g).sum()
            }
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            _ => panic!("core inputs of two kinds"),
        }
    }
}

/// `[batch, heads, seq, head_dim]` → `[batch, seq, heads · head_dim]`.
fn merge_heads(context: Tensor<4>) -> Tensor<3> {
    let [b, heads, s, head_dim] = context.dims();
    context.swap_dims(1, 2).reshape([b, s, heads * head_dim])
}

/// A context-parallel rank's attention inputs: its queries (two chunks), the whole sequence's
/// keys and values (per head), the queries' first visible keys, and where its chunks lie.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
struct ContextChunks {
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    first_keys: Option<Tensor<2, Int>>,
    chunks: [std::ops::Range<usize>; 2],
}
