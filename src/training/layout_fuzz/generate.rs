//! The fuzzer's generator: from a seed, run configurations that combine every parallelism and
//! option the trainer has, drawn independently, so that combinations nobody listed get run.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::data::{DType, DataSources, IndexedDataset, IndexedDatasetBuilder};
use crate::model::vocab::padded_vocab_size;
use crate::model::{GptConfig, Normalization, PositionEmbedding, Recompute};
use crate::optim::grad_scaler::DynamicGradScalerConfig;
use crate::optim::{AdamWConfig, LrDecayStyle, LrSchedule, Precision};
use crate::parallel::context::ContextComm;
use crate::training::{ParallelConfig, PretrainConfig};

/// GPT-2's vocabulary, which the fuzzer's data is tokenized with: padded per layout as
/// Megatron pads it, to a multiple of `--make-vocab-size-divisible-by` × TP.
const TOKENIZER_VOCAB: usize = 50257;

/// GPT-2's end-of-document id.
const EOD: u32 = 50256;

/// Training iterations of every case: enough for a wrong gradient to show in the losses, the
/// gradient norms and the weights, few enough for hundreds of cases.
pub const FUZZ_ITERS: u64 = 4;

/// SplitMix64: a seeded stream of draws (each case's choices come from its own stream, so a
/// case is reproduced from the seed and its index alone).
struct Draws(u64);

impl Draws {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// One of `choices`, uniformly.
    fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
        choices[(self.next() % choices.len() as u64) as usize]
    }

    /// `true` with probability one half.
    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

/// One generated case: a layout of the world and the options of the run on it. The reference
/// it is held against is the same run in one process ([`FuzzCase::single_process`]).
#[derive(Clone, Debug)]
pub struct FuzzCase {
    /// Which case of the seed's stream this is.
    pub index: u64,
    /// The generator's seed.
    pub seed: u64,
    /// Data-parallel ranks (the world is TP × PP × CP × DP).
    pub data_parallel: usize,
    /// The run on the layout.
    pub config: PretrainConfig,
}

impl FuzzCase {
    /// Ranks the case runs on.
    pub fn world_size(&self) -> usize {
        self.config.parallel.replica_ranks() * self.data_parallel
    }

    /// The same run in one process: one rank, nothing recomputed, the replicated optimizer,
    /// but the same model (its padded vocabulary included), batches, precision and seeds.
    pub fn single_process(&self) -> PretrainConfig {
        self.config.in_one_process()
    }

    /// The case in one line: what a reader needs to see which combination failed.
    pub fn describe(&self) -> String {
        let c = &self.config;
        let m = &c.model;
        let mut parts = vec![format!(
            "TP={} PP={} DP={}",
            c.parallel.tensor_model_parallel_size,
            c.parallel.pipeline_model_parallel_size,
            self.data_parallel
        )];
        if c.parallel.context_parallel_size > 1 {
            parts.push(format!(
                "CP={} ({:?})",
                c.parallel.context_parallel_size, c.parallel.cp_comm_type
            ));
        }
        if let Some(n) = c.parallel.num_layers_per_virtual_pipeline_stage {
            parts.push(format!("{n} layer(s) per virtual stage"));
        }
        if let Some(n) = c.parallel.decoder_first_pipeline_num_layers {
            parts.push(format!("{n} layer(s) on the first stage"));
        }
        if let Some(n) = c.parallel.decoder_last_pipeline_num_layers {
            parts.push(format!("{n} layer(s) on the last stage"));
        }
        let flags = [
            (m.sequence_parallel, "sequence parallel"),
            (
                c.parallel.use_distributed_optimizer,
                "distributed optimizer",
            ),
            (c.parallel.overlap_grad_reduce, "overlapped grad reduce"),
        ];
        let packing = [
            (m.reset_position_ids, "per-document positions"),
            (m.reset_attention_mask, "per-document attention"),
            (c.eod_mask_loss, "EOD loss masked"),
        ];
        let flags = flags.iter().chain(&packing);
        parts.extend(flags.filter(|f| f.0).map(|f| f.1.to_owned()));
        if m.yarn.is_some() {
            parts.push("YaRN".to_owned());
        }
        if let Some(window) = m.window_size {
            let layers = match m.window_layers {
                Some(_) => "every other layer",
                None => "every layer",
            };
            parts.push(format!("sliding window of {window} on {layers}"));
        }
        if c.recompute != Recompute::None {
            parts.push(format!("recompute {:?}", c.recompute));
        }
        parts.push(c.precision.name().to_owned());
        parts.push(format!(
            "{} layers, {} heads / {} groups, {}, vocab {}",
            m.num_layers,
            m.num_attention_heads,
            m.query_groups(),
            m.architecture(),
            m.padded_vocab_size
        ));
        parts.push(format!(
            "micro-batch {} × {} per rank, seed {}",
            c.micro_batch_size,
            c.global_batch_size / (c.micro_batch_size * self.data_parallel),
            c.seed
        ));
        parts.join(", ")
    }
}

/// The parallel sizes of one case.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    tp: usize,
    pp: usize,
    dp: usize,
}

/// Draws the parallel sizes: of a world of `world` ranks when given (an MPI launch), else of
/// any world up to 8 thread ranks.
fn draw_sizes(d: &mut Draws, world: Option<usize>) -> Sizes {
    loop {
        let sizes = Sizes {
            tp: d.pick(&[1, 1, 2, 2, 4]),
            pp: d.pick(&[1, 1, 2, 2, 4]),
            dp: d.pick(&[1, 1, 2, 2, 4]),
        };
        let ranks = sizes.tp * sizes.pp * sizes.dp;
        let fits = match world {
            Some(w) => ranks == w,
            None => (2..=8).contains(&ranks),
        };
        if fits {
            return sizes;
        }
    }
}

/// Draws a small GPT in GPT-2's form, the Llama family's, or any mixture of their options:
/// each option is drawn on its own.
fn draw_model(d: &mut Draws, s: Sizes) -> GptConfig {
    // Layers: a multiple of the pipeline size, sometimes two per stage.
    let layers = s.pp * d.pick(&[1, 2]);
    let heads = 4;
    // Query groups must split over the tensor-parallel ranks too.
    let groups = d.pick(&[1, 2, 4]).max(s.tp);
    let divisible_by = d.pick(&[1, 3, 128]);
    let vocab = padded_vocab_size(TOKENIZER_VOCAB, divisible_by, s.tp);
    let rope = d.coin();
    let rms = d.coin();
    let mut m = GptConfig::new(layers, 32, heads, 16, vocab)
        .with_hidden_dropout(0.1)
        .with_attention_dropout(0.1)
        .with_position_embedding_type(if rope {
            PositionEmbedding::Rope
        } else {
            PositionEmbedding::LearnedAbsolute
        })
        .with_normalization(if rms {
            Normalization::RmsNorm
        } else {
            Normalization::LayerNorm
        })
        .with_swiglu(d.coin())
        .with_num_query_groups((groups < heads).then_some(groups))
        .with_qk_layernorm(d.coin())
        .with_add_bias_linear(d.coin())
        .with_untie_embeddings_and_output_weights(d.coin())
        .with_sequence_parallel(s.tp > 1 && d.coin());
    if m.swiglu {
        m = m.with_ffn_hidden_size(Some(48));
    }
    if !m.add_bias_linear {
        m = m.with_add_qkv_bias(d.coin());
    }
    m
}

/// Draws the pipeline's cut: even stages, virtual stages (the interleaved schedule), or
/// uneven first and last stages.
fn draw_pipeline_cut(d: &mut Draws, cfg: &mut PretrainConfig, micro_batches: &mut usize) {
    let (pp, layers) = (
        cfg.parallel.pipeline_model_parallel_size,
        cfg.model.num_layers,
    );
    if pp == 1 {
        return;
    }
    match d.pick(&[0, 1, 2]) {
        1 if layers >= 2 * pp => {
            cfg.parallel.num_layers_per_virtual_pipeline_stage = Some(layers / (2 * pp));
            // The interleaved schedule runs a multiple of PP micro-batches per rank.
            *micro_batches = pp * micro_batches.div_ceil(pp);
        }
        2 => {
            // One stage more or less on the first (or last): the rest must still split
            // evenly, which the trainer checks (a refusal is resampled).
            let n = d.pick(&[0, 1, 2, 3]);
            if d.coin() {
                cfg.parallel.decoder_first_pipeline_num_layers = Some(n);
            } else {
                cfg.parallel.decoder_last_pipeline_num_layers = Some(n);
            }
        }
        _ => {}
    }
}

/// Draws the recomputation: none, full (uniform or block), or selective.
fn draw_recompute(d: &mut Draws) -> Recompute {
    d.pick(&[
        Recompute::None,
        Recompute::None,
        Recompute::Uniform(1),
        Recompute::Block(1),
        Recompute::Selective,
    ])
}

/// Draws packed documents: in one case of three some of `--reset-position-ids`,
/// `--reset-attention-mask` and `--eod-mask-loss`, on [`short_documents`] (so that every
/// sample holds several documents).
fn draw_packing(d: &mut Draws, cfg: &mut PretrainConfig, cache: &Path) {
    if d.pick(&[0, 0, 1]) == 0 {
        return;
    }
    let (positions, attention) = match d.pick(&[0, 1, 2]) {
        0 => (true, false),
        1 => (false, true),
        _ => (true, true),
    };
    cfg.model.reset_position_ids = positions;
    cfg.model.reset_attention_mask = attention;
    cfg.eod_mask_loss = d.coin();
    cfg.data = DataSources::single(short_documents_prefix(cache));
}

/// Draws sliding-window attention (`--window-size`) in one case of four, shorter than the
/// 16-token samples, on every layer or (`--window-attn-skip-freq`) on every other one.
fn draw_window(d: &mut Draws, model: &mut GptConfig) {
    if d.pick(&[0, 0, 0, 1]) == 0 {
        return;
    }
    model.window_size = Some(d.pick(&[1, 3, 6]));
    if model.num_layers > 1 && d.coin() {
        model.window_layers = Some((0..model.num_layers).map(|i| i % 2 == 0).collect());
    }
}

/// Draws YaRN (`--position-embedding-type yarn`) for a rotary model in one case of four: the
/// 16-token samples as a context stretched 4 times from 4.
fn draw_yarn(d: &mut Draws, model: &mut GptConfig) {
    if model.position_embedding_type != PositionEmbedding::Rope || d.pick(&[0, 0, 0, 1]) == 0 {
        return;
    }
    model.yarn = Some(crate::model::YarnScaling {
        factor: 4.0,
        original_max_position_embeddings: 4.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 1.0,
        mscale_all_dim: 0.0,
        round_to_int: d.coin(),
    });
}

/// Draws context parallelism in one case of three whose data-parallel size allows it: CP = 2
/// or 4 of the drawn data-parallel ranks become context-parallel ones (the world keeps its
/// size, so an MPI launch's cases still fit), exchanging keys and values either way.
fn draw_context(d: &mut Draws, s: &mut Sizes, parallel: &mut ParallelConfig) {
    if s.dp == 1 || d.pick(&[0, 0, 1]) == 0 {
        return;
    }
    let cp = if s.dp == 4 { d.pick(&[2, 4]) } else { 2 };
    s.dp /= cp;
    parallel.context_parallel_size = cp;
    parallel.cp_comm_type = if d.coin() {
        ContextComm::P2p
    } else {
        ContextComm::AllGather
    };
}

/// Where [`short_documents`] writes its dataset under the index cache `cache`.
fn short_documents_prefix(cache: &Path) -> PathBuf {
    cache.join("short_documents_text_document")
}

/// The packed cases' corpus: the first 20,000 tokens of `data` (its own end-of-document
/// tokens left out) cut into documents of 1 to 11 tokens, each ended by the end-of-document
/// id, so that a 16-token sample holds several (real corpora's documents run to thousands of
/// tokens). Written into `cache` once; returns its prefix.
pub fn short_documents(data: &Path, cache: &Path) -> Result<PathBuf> {
    let prefix = short_documents_prefix(cache);
    if crate::data::index_file_path(&prefix).exists() {
        return Ok(prefix);
    }
    std::fs::create_dir_all(cache).with_context(|| format!("cannot create {}", cache.display()))?;
    let source = IndexedDataset::open(data)?;
    let mut tokens = Vec::new();
    for i in 0..source.sequence_count() {
        source.sequence(i).append_to(&mut tokens);
        if tokens.len() >= 20_000 {
            break;
        }
    }
    tokens.retain(|&t| t != EOD);
    let mut builder = IndexedDatasetBuilder::new(&prefix, DType::U16)?;
    let mut lengths = Draws(0x5eed);
    let mut rest = &tokens[..tokens.len().min(20_000)];
    while !rest.is_empty() {
        let n = (1 + lengths.next() as usize % 11).min(rest.len());
        let document: Vec<u32> = rest[..n].iter().copied().chain([EOD]).collect();
        builder.add_document(&document, &[document.len()])?;
        rest = &rest[n..];
    }
    builder.finish()?.persist()?;
    Ok(prefix)
}

/// Case `index` of `seed`'s stream, on `world` ranks when given, its data the dataset at
/// `data` (GPT-2 tokens) with its index cache in `cache`. The draw may be one the trainer
/// refuses ([`super::refusal`]; [`super::generate`] moves on to the next index then).
pub fn draw_case(
    seed: u64,
    index: u64,
    world: Option<usize>,
    data: &Path,
    cache: &Path,
) -> FuzzCase {
    let mut d = Draws(seed ^ index.wrapping_mul(0xA076_1D64_78BD_642F));
    let mut s = draw_sizes(&mut d, world);
    let model = draw_model(&mut d, s);
    let micro_batch_size = d.pick(&[1, 2]);
    let mut micro_batches: usize = d.pick(&[1, 2, 3, 4]);
    let mut cfg = PretrainConfig {
        seq_length: 16,
        micro_batch_size,
        train_iters: FUZZ_ITERS,
        schedule: LrSchedule {
            max_lr: 4e-3,
            min_lr: 4e-4,
            warmup_steps: 0.0,
            decay_steps: 0.0,
            style: LrDecayStyle::Cosine,
            ..Default::default()
        },
        split: "90,10,0".into(),
        data_cache_path: Some(cache.to_path_buf()),
        log_interval: FUZZ_ITERS,
        eval_interval: FUZZ_ITERS / 2,
        eval_iters: 1,
        seed: d.next() % 100_000,
        precision: d.pick(&[
            Precision::Fp32,
            Precision::Fp32,
            Precision::Bf16,
            Precision::Fp16,
        ]),
        // fp16's dynamic scale from 2^16: sometimes the first steps overflow and are skipped,
        // which every rank must agree on.
        dynamic_loss_scale: DynamicGradScalerConfig {
            initial_scale: 2f64.powi(16),
            growth_interval: 2,
            ..Default::default()
        },
        // Adam divides each gradient by its root mean square plus ε. At Megatron's ε of 1e-8
        // an element whose gradient is near rounding noise (zero in exact arithmetic; a bias's
        // sum over the tokens that cancels) moves by a noise-chosen fraction of a step, and a
        // gradient too large by any factor moves its elements as far as the right one: the
        // updates could only be compared loosely, and scaling bugs would not show. With ε
        // above most gradients the update is nearly proportional to the gradient, so the
        // updates hold every gradient to the sums' rounding.
        adam: AdamWConfig {
            eps: 1e-2,
            ..AdamWConfig::default()
        },
        recompute: draw_recompute(&mut d),
        parallel: ParallelConfig {
            // Small buckets: several all-reduces (and reduce-scatters) per step.
            ddp_bucket_size: d.pick(&[5_000, 40_000, 40_000_000]),
            tensor_model_parallel_size: s.tp,
            pipeline_model_parallel_size: s.pp,
            use_distributed_optimizer: d.coin(),
            overlap_grad_reduce: d.coin(),
            ..ParallelConfig::default()
        },
        ..PretrainConfig::new(model, DataSources::single(data.to_path_buf()))
    };
    draw_pipeline_cut(&mut d, &mut cfg, &mut micro_batches);
    // Drawn last, so the cases drawn before packing was a choice keep their other choices.
    draw_packing(&mut d, &mut cfg, cache);
    draw_window(&mut d, &mut cfg.model);
    draw_yarn(&mut d, &mut cfg.model);
    draw_context(&mut d, &mut s, &mut cfg.parallel);
    cfg.global_batch_size = micro_batch_size * micro_batches * s.dp;
    // No warm-up (its first step would have a learning rate of 0): a cosine decay from the
    // first iteration over the run.
    cfg.schedule.decay_steps = (cfg.global_batch_size as u64 * FUZZ_ITERS) as f64;
    FuzzCase {
        index,
        seed,
        data_parallel: s.dp,
        config: cfg,
    }
}
