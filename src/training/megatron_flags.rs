//! Every flag of Megatron-LM's `arguments.py` that ferrotron does not implement, with what
//! `pretrain` does when a script passes it (see docs/megatron-flags.md for the full table).
//!
//! Read from Megatron-LM's `megatron/training/arguments.py` at commit d98e8a64ddf3 (the flags it
//! adds itself, those generated from its config dataclasses, the Kitchen flags it adds when that
//! library is installed, and the ModelOpt flags `pretrain_gpt.py` adds when ModelOpt is). Each
//! spelling of a flag is its own entry (`--no-tp-comm-bulk-wgrad` and
//! `--disable-tp-comm-bulk-wgrad`). The flags ferrotron implements are not here.

use self::Takes::{List, Nothing, One};

/// How many values a Megatron flag takes on the command line (argparse's `nargs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Takes {
    /// A switch (`store_true`, `store_false`, one side of a `BooleanOptionalAction`).
    Nothing,
    /// Exactly one value.
    One,
    /// One or more values (`nargs` `+`, `*` or a count): everything up to the next flag.
    List,
}

/// What ferrotron does with a Megatron flag it does not implement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handling {
    /// Steers only Megatron's own performance or bookkeeping machinery: accepted, named in one warning.
    Ignored,
    /// Would change the math: refused with this reason, unless the value given is `harmless`.
    Refused {
        /// What the user reads in the error, after the flag's name.
        reason: &'static str,
        /// Megatron's default, where passing exactly it changes nothing (for a `List` flag, that
        /// one value alone; numbers compare as numbers, so `1.0` is `1`). `None` for switches
        /// and for flags whose every value turns the feature on.
        harmless: Option<&'static str>,
    },
}

/// One flag.
#[derive(Clone, Copy, Debug)]
pub struct MegatronFlag {
    /// The spelling, with the leading `--`.
    pub name: &'static str,
    /// How many values follow it.
    pub takes: Takes,
    /// What `pretrain` does with it.
    pub handling: Handling,
}

/// The `--fp8-*` flags, FP8 parameter gathering and the BF16 edges of an FP8 model.
const FP8: &str = "FP8 training is not implemented; drop the --fp8-* flags to train in bf16";
/// The `--fp4-*` flags.
const FP4: &str = "FP4 training is not implemented; train in bf16";
/// Quantization recipes from NVIDIA Kitchen or Transformer Engine precision configs.
const QUANT: &str =
    "quantized training (Kitchen, Transformer Engine precision recipes) is not implemented";
/// Mixture-of-experts architecture and routing (the expert kernels and dispatch are ignored).
const MOE: &str = "mixture-of-experts models are not implemented";
/// Context parallelism beyond one flat group.
const CP: &str = "hierarchical and hybrid context parallelism are not implemented \
                  (--context-parallel-size with --cp-comm-type p2p or allgather is)";
/// Multi-latent attention (DeepSeek).
const MLA: &str = "multi-latent attention is not implemented";
/// Multi-token prediction heads.
const MTP: &str = "multi-token prediction is not implemented";
/// The settings of SGD, Muon and Lion.
const OTHER_OPTIMIZER: &str = "only the Adam optimizer (--optimizer adam) is implemented";
/// `--rope-type`, multi-latent attention's choice of rotary form.
const YARN: &str =
    "--rope-type chooses the rotary form of multi-latent attention, which is not implemented; --position-embedding-type yarn gives YaRN";
/// Mamba, gated-delta and linear-attention layers.
const HYBRID: &str = "hybrid Mamba / linear-attention models are not implemented";
/// Softmax variants and sparse or experimental attention.
const ATTENTION_VARIANT: &str =
    "attention variants other than (grouped-query) softmax attention are not implemented";
/// Maximal-update parameterization.
const MUP: &str = "maximal-update parameterization (MuP) is not implemented";
/// BERT and T5 settings.
const ENCODER_MODELS: &str = "encoder and encoder-decoder models (BERT, T5) are not implemented";
/// Vision models (ViT, DINO, Swin).
const VISION: &str = "vision models are not implemented";
/// ICT/REALM biencoder retrievers.
const RETRIEVER: &str = "ICT/REALM retriever models are not implemented";
/// Reinforcement learning (GRPO) runs.
const RL: &str = "reinforcement learning (GRPO) is not implemented";
/// Supervised fine-tuning.
const SFT: &str = "supervised fine-tuning (--sft) is not implemented";
/// Saving or loading teacher logits for distillation.
const DISTILLATION: &str =
    "knowledge distillation (saving or loading teacher logits) is not implemented";
/// NVIDIA ModelOpt, which `pretrain_gpt.py` adds when it is installed.
const MODELOPT: &str =
    "NVIDIA ModelOpt (quantization, distillation, pruning, export) is not implemented";
/// Fill-in-the-middle data.
const FIM: &str = "fill-in-the-middle (FIM) data is not implemented";
/// Parameter sharding (Megatron-FSDP, PyTorch FSDP2).
const FSDP: &str =
    "fully sharded data parallelism is not implemented (--use-distributed-optimizer is)";
/// Weight sharding beyond the tensor-parallel ranks.
const GTP: &str = "weight sharding beyond --tensor-model-parallel-size (GTP) is not implemented";
/// Expert parallelism.
const EXPERT_PARALLEL: &str =
    "expert parallelism needs mixture-of-experts models, which are not implemented";
/// Multiple residual streams (mHC).
const MHC: &str = "mHC (multiple residual streams) connections are not implemented";
/// Per-layer architectures from a config file.
const HETEROGENEOUS: &str = "heterogeneous (per-layer) architectures are not implemented";
/// Lower-precision main weights, main gradients and Adam moments.
const PRECISION_AWARE_OPTIMIZER: &str =
    "main weights, gradients and Adam moments are fp32; lower precision is not implemented";
/// Settings of tokenizers ferrotron lacks, or that change the token ids.
const TOKENIZER: &str = "this tokenizer setting is not implemented";
/// Partial resumption: a resumed run is bit-exact only when all of it is restored.
const RESUME: &str =
    "partial resumption is not implemented: --load restores the whole training state";
/// Converting Megatron checkpoints between formats.
const CHECKPOINT_CONVERSION: &str =
    "checkpoint conversion is not implemented; see the import-hf and export-hf tools";
/// Samplers and dataset sizing that change which samples are drawn.
const DATA_ORDER: &str =
    "changes which samples are drawn; ferrotron has Megatron's default single-pass sampler";
/// Attention and positions restarted at each document.
const DOCUMENT_MASKING: &str = "per-document positions and attention masks are not implemented";
/// MLP activations ferrotron lacks.
const ACTIVATION: &str = "this activation is not implemented (GeLU, --openai-gelu, --swiglu)";
/// Validation on other samples than ferrotron draws.
const VALIDATION_SETS: &str =
    "this validation setup is not implemented (one set, --eval-iters global batches)";
/// QK-clip (Muon-trained MLA models).
const QK_CLIP: &str = "QK-clip is not implemented";
/// T5-style relative position buckets.
const RELATIVE_POSITIONS: &str = "relative position embeddings are not implemented";
/// Which parameters weight decay applies to.
const WEIGHT_DECAY_CONDITION: &str =
    "weight decay applies to weight matrices only; other conditions are not implemented";
/// The learning-rate schedule taken from the checkpoint.
const SCHEDULE_FROM_CHECKPOINT: &str =
    "the learning-rate schedule comes from the command line, never from the checkpoint";
/// Fine-tuning from a checkpoint with a fresh optimizer and iteration 0.
const FINETUNE: &str =
    "fine-tuning from a separate checkpoint is not implemented; use --load with --finetune";
/// The parallel layout read back from the checkpoint.
const CHECKPOINT_ARGS: &str = "the parallel layout is the run's: ferrotron loads a checkpoint saved at any layout, so give the sizes";
/// The padded vocabulary size set by hand.
const PADDED_VOCAB: &str =
    "the vocabulary is padded by --make-vocab-size-divisible-by × TP size; no other padding";
/// Fine-tuning on HuggingFace datasets (ModelOpt).
const HF_FINETUNE: &str = "fine-tuning on HuggingFace datasets is not implemented";
/// Llama 4's L2 norm of queries and keys.
const QK_L2_NORM: &str =
    "L2 normalization of queries and keys is not implemented (--qk-layernorm is)";
/// Megatron's retired `--batch-size`.
const OLD_BATCH_SIZE: &str =
    "Megatron no longer accepts --batch-size either: use --micro-batch-size";
/// Megatron's retired `--warmup`.
const OLD_WARMUP: &str =
    "Megatron no longer accepts --warmup either: use --lr-warmup-iters or --lr-warmup-samples";
/// Megatron's retired `--model-parallel-size`.
const OLD_MODEL_PARALLEL_SIZE: &str =
    "Megatron no longer uses --model-parallel-size: use --tensor-model-parallel-size";
/// Xavier-uniform initialization.
const XAVIER_INIT: &str =
    "Xavier initialization is not implemented (normal with --init-method-std)";
/// A YAML file of arguments.
const YAML_CONFIG: &str = "YAML configs are not read; pass the flags on the command line";
/// A process group whose collectives do nothing.
const FAKE_PROCESS_GROUP: &str =
    "a fake process group skips all communication, so the ranks would not train one model";
/// A separate initialization std for the embedding.
const EMBEDDING_INIT_STD: &str =
    "a separate initialization std for the embedding is not implemented";
/// An offset in the gated linear unit (GPT-OSS).
const GLU_OFFSET: &str = "an offset in the gated linear unit is not implemented";
/// Clamping the MLP activation (GPT-OSS).
const ACTIVATION_CLAMP: &str = "clamping the MLP activation is not implemented";
/// Custom layer specs.
const CUSTOM_SPEC: &str = "custom model specs are not implemented";
/// Data phases switched at given iterations.
const PHASE_TRANSITIONS: &str = "data phase transitions are not implemented";
/// Different initial weights on each data-parallel replica.
const DATA_PARALLEL_RANDOM_INIT: &str =
    "different initial weights on each data-parallel replica are not implemented";
/// Evaluation without training.
const SKIP_TRAIN: &str = "evaluation-only runs are not implemented (see the evaluate tool)";
/// Exiting when `--load` holds no checkpoint.
const EXIT_ON_MISSING_CHECKPOINT: &str =
    "exiting when --load holds no checkpoint is not implemented (ferrotron starts afresh)";
/// T5 sentinel tokens.
const VOCAB_EXTRA_IDS: &str = "extra vocabulary ids (T5 sentinels) are not implemented";
/// An fp32 residual stream under half precision.
const FP32_RESIDUAL: &str =
    "fp32 residual connections are not implemented (the residual stream is in --bf16/--fp16)";
/// Frozen layers.
const FREEZE_LAYERS: &str = "freezing layers is not implemented";
/// A gate on the attention output.
const ATTENTION_OUTPUT_GATE: &str = "gated attention output is not implemented";
/// Loading a chosen iteration.
const CKPT_STEP: &str =
    "loading a chosen iteration is not implemented: --load resumes from the latest";
/// Loss masking of tokens equal to the pad token.
const AMBIGUOUS_PAD_TOKENS: &str =
    "masking tokens that collide with the pad token is not implemented";
/// Multimodal rotary embedding.
const MROPE: &str = "multimodal rotary embedding (mrope) is not implemented";
/// The loss averaged over the global batch's tokens instead of per micro-batch.
/// Rotary position interpolation.
const ROPE_INTERPOLATION: &str = "rotary position interpolation is not implemented";
/// A decoder layer count apart from `--num-layers`.
const DECODER_NUM_LAYERS: &str =
    "separate decoder layer counts are for encoder-decoder models; use --num-layers";
/// Iterations skipped by number.
const SKIP_ITERATIONS: &str = "skipping iterations is not implemented";
/// Layers without the rotary embedding.
const NO_ROPE_LAYERS: &str = "skipping the rotary embedding in some layers is not implemented";
/// The encoder's sequence length.
const ENCODER_SEQ_LENGTH: &str = "use --seq-length (ferrotron has no encoder)";

/// A flag accepted with a warning.
const fn ignored(name: &'static str, takes: Takes) -> MegatronFlag {
    MegatronFlag {
        name,
        takes,
        handling: Handling::Ignored,
    }
}

/// A flag refused whatever its value.
const fn refused(name: &'static str, takes: Takes, reason: &'static str) -> MegatronFlag {
    MegatronFlag {
        name,
        takes,
        handling: Handling::Refused {
            reason,
            harmless: None,
        },
    }
}

/// A flag refused unless its value is `harmless`.
const fn refused_unless(
    name: &'static str,
    takes: Takes,
    reason: &'static str,
    harmless: &'static str,
) -> MegatronFlag {
    MegatronFlag {
        name,
        takes,
        handling: Handling::Refused {
            reason,
            harmless: Some(harmless),
        },
    }
}

/// Sorted by name.
pub const MEGATRON_FLAGS: &[MegatronFlag] = &[
    ignored("--account-for-embedding-in-pipeline-split", Nothing),
    ignored("--account-for-loss-in-pipeline-split", Nothing),
    refused("--activation-func-clamp-value", One, ACTIVATION_CLAMP),
    ignored("--activation-offload-fraction", One),
    ignored("--adlr-autoresume", Nothing),
    ignored("--adlr-autoresume-interval", One),
    refused(
        "--allow-ambiguous-pad-tokens",
        Nothing,
        AMBIGUOUS_PAD_TOKENS,
    ),
    ignored("--app-tag-run-name", One),
    ignored("--app-tag-run-version", One),
    ignored("--apply-query-key-layer-scaling", Nothing),
    refused(
        "--apply-residual-connection-post-layernorm",
        Nothing,
        ENCODER_MODELS,
    ),
    refused(
        "--apply-wd-to-qk-layernorm",
        Nothing,
        WEIGHT_DECAY_CONDITION,
    ),
    ignored("--async-ckpt-cpu-priority", One),
    ignored("--async-ckpt-io-priority", One),
    ignored("--async-ckpt-use-cpu-shm", Nothing),
    ignored("--async-save", Nothing),
    ignored("--async-strategy", One),
    refused("--attention-output-gate", Nothing, ATTENTION_OUTPUT_GATE),
    ignored("--auto-detect-ckpt-format", Nothing),
    ignored("--batch-invariant-backend", One),
    ignored("--batch-invariant-mode", Nothing),
    refused("--batch-size", One, OLD_BATCH_SIZE),
    ignored("--bert-embedder-type", One),
    refused("--bert-load", One, RETRIEVER),
    refused("--bert-no-binary-head", Nothing, ENCODER_MODELS),
    refused_unless("--biencoder-projection-dim", One, RETRIEVER, "0"),
    refused("--biencoder-shared-query-context-model", Nothing, RETRIEVER),
    refused("--block-data-path", One, RETRIEVER),
    ignored("--cache-mla-latents", Nothing),
    ignored("--calc-ft-timeouts", Nothing),
    refused("--chat-template", One, SFT),
    ignored("--check-for-large-grads", Nothing),
    ignored("--check-for-spiky-loss", Nothing),
    ignored("--check-weight-hash-across-dp-replicas-interval", One),
    ignored("--ckpt-assume-constant-structure", Nothing),
    refused("--ckpt-convert-format", One, CHECKPOINT_CONVERSION),
    refused("--ckpt-convert-save", One, CHECKPOINT_CONVERSION),
    ignored("--ckpt-convert-update-legacy-dist-opt-format", Nothing),
    ignored("--ckpt-drop-redundant-extra-state", Nothing),
    ignored("--ckpt-fully-parallel-load", Nothing),
    ignored("--ckpt-fully-parallel-load-exchange-algo", One),
    ignored("--ckpt-fully-parallel-load-per-rank-objects", Nothing),
    ignored("--ckpt-fully-parallel-load-process-group", One),
    ignored("--ckpt-fully-parallel-save", Nothing),
    ignored("--ckpt-fully-parallel-save-process-group", One),
    ignored("--ckpt-pg-tensors-cache-create", Nothing),
    ignored("--ckpt-pg-tensors-cache-path", One),
    refused("--ckpt-step", One, CKPT_STEP),
    refused_unless("--classes-fraction", One, VISION, "1.0"),
    ignored("--config-logger-dir", One),
    ignored("--cpu-offloading-num-layers", One),
    ignored("--cpu-offloading-retain-pinned-cpu-buffers", Nothing),
    ignored("--create-all-gather-group", Nothing),
    ignored("--cross-entropy-fusion-impl", One),
    ignored("--cross-entropy-loss-fusion", Nothing),
    ignored("--cuda-graph-modules", List),
    refused(
        "--data-parallel-random-init",
        Nothing,
        DATA_PARALLEL_RANDOM_INIT,
    ),
    ignored("--data-parallel-sharding-strategy", One),
    refused_unless("--data-per-class-fraction", One, VISION, "1.0"),
    ignored("--dataloader-defer-npy-index-mmap", Nothing),
    ignored("--dataloader-fast-cache-load", Nothing),
    refused(
        "--dataloader-inter-document-masking",
        Nothing,
        DOCUMENT_MASKING,
    ),
    refused_unless("--dataloader-type", One, DATA_ORDER, "single"),
    ignored("--ddp-average-in-collective", Nothing),
    ignored("--ddp-num-buckets", One),
    ignored("--ddp-pad-buckets-for-high-nccl-busbw", Nothing),
    ignored(
        "--ddp-param-name-patterns-for-fp32-local-accumulation",
        List,
    ),
    ignored("--ddp-reduce-scatter-with-fp32-accumulation", Nothing),
    ignored("--decode-only-cuda-graphs", Nothing),
    refused("--decoder-num-layers", One, DECODER_NUM_LAYERS),
    refused("--decoder-seq-length", One, ENCODER_MODELS),
    ignored("--defer-embedding-wgrad-compute", Nothing),
    ignored("--delay-offload-until-cuda-graph", Nothing),
    ignored("--delay-wgrad-compute", Nothing),
    ignored("--delta-offload-bytes-across-pp-ranks", One),
    ignored("--deterministic-mode", Nothing),
    refused_unless("--dino-bottleneck-size", One, VISION, "256"),
    refused_unless("--dino-freeze-last-layer", One, VISION, "1"),
    refused_unless("--dino-head-hidden-size", One, VISION, "2048"),
    refused_unless("--dino-local-crops-number", One, VISION, "10"),
    refused_unless("--dino-local-img-size", One, VISION, "96"),
    refused("--dino-norm-last-layer", Nothing, VISION),
    refused_unless("--dino-teacher-temp", One, VISION, "0.07"),
    refused_unless("--dino-warmup-teacher-temp", One, VISION, "0.04"),
    refused_unless("--dino-warmup-teacher-temp-epochs", One, VISION, "30"),
    ignored("--disable-align-grad-reduce", Nothing),
    ignored("--disable-bf16-reduced-precision-matmul", Nothing),
    ignored("--disable-ckpt-load-validate-sharding-integrity", Nothing),
    ignored("--disable-clone-scatter-output-in-embedding", Nothing),
    refused(
        "--disable-dsa-indexer-rotate-activation",
        Nothing,
        ATTENTION_VARIANT,
    ),
    refused(
        "--disable-dsa-indexer-scoring-relu",
        Nothing,
        ATTENTION_VARIANT,
    ),
    ignored("--disable-flight-recorder-dump-on-timeout", Nothing),
    ignored("--disable-flight-recorder-extra-dump-on-exec", Nothing),
    ignored("--disable-flight-recorder-include-only-active", Nothing),
    refused("--disable-fp8-wgrad", Nothing, FP8),
    ignored("--disable-gloo-process-groups", Nothing),
    ignored("--disable-jit-fuser", Nothing),
    ignored("--disable-log-loss-scale-to-tensorboard", Nothing),
    ignored("--disable-mamba-mem-eff-path", Nothing),
    ignored("--disable-manual-gc-eval", Nothing),
    ignored("--disable-msc", Nothing),
    refused("--disable-pad-vocab-size", Nothing, PADDED_VOCAB),
    ignored("--disable-save-tokenizer-assets", Nothing),
    ignored("--disable-straggler-on-startup", Nothing),
    ignored("--disable-strict-fsdp-dtensor-load", Nothing),
    ignored("--disable-symmetric-registration", Nothing),
    refused(
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
        Nothing,
        TOKENIZER,
    ),
    ignored("--disable-tp-comm-bulk-dgrad", Nothing),
    ignored("--disable-tp-comm-bulk-wgrad", Nothing),
    ignored("--disable-tp-comm-overlap-ag", Nothing),
    ignored("--disable-tp-comm-overlap-rs", Nothing),
    ignored("--disable-tp-comm-split-ag", Nothing),
    ignored("--disable-tp-comm-split-rs", Nothing),
    ignored(
        "--disable-use-tokenizer-model-from-checkpoint-args",
        Nothing,
    ),
    ignored("--dist-ckpt-format", One),
    ignored("--dist-ckpt-optim-fully-reshardable", Nothing),
    ignored("--dist-ckpt-save-pre-mcore-014", Nothing),
    ignored("--dist-ckpt-strictness", One),
    ignored("--dist-ckpt-workers", One),
    ignored("--distrib-optim-fully-reshardable-mem-efficient", Nothing),
    ignored("--distribute-saved-activations", Nothing),
    ignored("--distributed-timeout-minutes", One),
    ignored("--distributed-timeout-seconds-after-init", One),
    refused("--dsa-indexer-head-dim", One, ATTENTION_VARIANT),
    refused("--dsa-indexer-k-norm-epsilon", One, ATTENTION_VARIANT),
    refused("--dsa-indexer-k-norm-fp32", Nothing, ATTENTION_VARIANT),
    refused("--dsa-indexer-loss-coeff", One, ATTENTION_VARIANT),
    refused("--dsa-indexer-n-heads", One, ATTENTION_VARIANT),
    refused("--dsa-indexer-rope-interleaved", Nothing, ATTENTION_VARIANT),
    refused_unless(
        "--dsa-indexer-skip-topk-offset",
        One,
        ATTENTION_VARIANT,
        "0",
    ),
    refused("--dsa-indexer-topk", One, ATTENTION_VARIANT),
    refused_unless("--dsa-indexer-topk-freq", One, ATTENTION_VARIANT, "1"),
    refused("--dsa-indexer-use-sparse-loss", Nothing, ATTENTION_VARIANT),
    ignored("--dsa-kernel-backend", One),
    ignored("--dump-param-to-param-group-map", One),
    refused("--embedding-init-method-std", One, EMBEDDING_INIT_STD),
    refused("--embedding-path", One, RETRIEVER),
    ignored("--empty-unused-memory-level", One),
    ignored("--enable-chunked-prefill", Nothing),
    ignored("--enable-cuda-graph", Nothing),
    ignored("--enable-experimental", Nothing),
    ignored("--enable-ft-package", Nothing),
    ignored("--enable-full-sharding-in-hsdp", Nothing),
    refused("--enable-gpt-oss", Nothing, YARN),
    refused("--enable-mhc-connections", Nothing, MHC),
    ignored("--enable-msc", Nothing),
    refused("--encoder-num-layers", One, ENCODER_MODELS),
    refused("--encoder-seq-length", One, ENCODER_SEQ_LENGTH),
    ignored("--ep-overlap-early-attn-memory-release", Nothing),
    ignored("--error-injection-rate", One),
    ignored("--error-injection-type", One),
    refused("--eval-global-batch-size", One, VALIDATION_SETS),
    ignored("--eval-micro-batch-size", One),
    refused("--evidence-data-path", One, RETRIEVER),
    refused(
        "--exit-on-missing-checkpoint",
        Nothing,
        EXIT_ON_MISSING_CHECKPOINT,
    ),
    ignored("--exit-signal-handler-for-dataloader", Nothing),
    ignored("--exit-signal-handler-for-training", Nothing),
    refused_unless("--exp-avg-dtype", One, PRECISION_AWARE_OPTIMIZER, "fp32"),
    refused_unless("--exp-avg-sq-dtype", One, PRECISION_AWARE_OPTIMIZER, "fp32"),
    refused("--experimental-attention-variant", One, ATTENTION_VARIANT),
    refused_unless("--expert-model-parallel-size", One, EXPERT_PARALLEL, "1"),
    refused(
        "--expert-tensor-parallel-num-weight-shards",
        One,
        EXPERT_PARALLEL,
    ),
    refused_unless("--expert-tensor-parallel-size", One, EXPERT_PARALLEL, "1"),
    ignored("--export-default-te-spec", Nothing),
    ignored("--export-force-local-attention", Nothing),
    refused("--export-kd-cfg", One, MODELOPT),
    refused("--export-kd-teacher-ckpt-format", One, MODELOPT),
    refused("--export-kd-teacher-load", One, MODELOPT),
    refused("--export-kd-teacher-model-config", One, MODELOPT),
    refused_unless("--export-kv-cache-quant", One, MODELOPT, "none"),
    refused("--export-legacy-megatron", Nothing, MODELOPT),
    refused_unless("--export-model-type", One, MODELOPT, "GPTModel"),
    refused("--export-moe-apply-probs-on-input", Nothing, MODELOPT),
    refused("--export-offline-model", Nothing, MODELOPT),
    refused("--export-qk-l2-norm", Nothing, MODELOPT),
    refused("--export-quant-cfg", One, MODELOPT),
    refused_unless("--export-real-quant-cfg", One, MODELOPT, "None"),
    refused("--export-te-mcore-model", Nothing, MODELOPT),
    ignored("--external-cuda-graph", Nothing),
    refused("--fake-process-group", Nothing, FAKE_PROCESS_GROUP),
    ignored("--fault-injector-delay-start-iteration", One),
    ignored("--fault-injector-fault-delay", One),
    ignored("--fault-injector-fault-probabilities", One),
    ignored("--fault-injector-fault-types", One),
    ignored("--fault-injector-mtti-seconds", One),
    ignored("--fault-injector-num-ranks", One),
    ignored("--fault-injector-offset-seconds", One),
    ignored("--fault-injector-ranks", One),
    ignored("--fault-injector-seed", One),
    refused("--fim-data", Nothing, FIM),
    refused_unless("--fim-eod-token", One, FIM, "<|endoftext|>"),
    refused("--fim-fragment-rate", One, FIM),
    refused_unless("--fim-middle-token", One, FIM, "<fim_middle>"),
    refused("--fim-no-prefix", One, FIM),
    refused_unless("--fim-pad-token", One, FIM, "<fim_pad>"),
    refused_unless("--fim-prefix-token", One, FIM, "<fim_prefix>"),
    refused_unless("--fim-rate", One, FIM, "0.5"),
    refused("--fim-split-sample", One, FIM),
    refused_unless("--fim-spm-rate", One, FIM, "0.5"),
    refused_unless("--fim-suffix-token", One, FIM, "<fim_suffix>"),
    ignored("--fine-grained-activation-offloading", Nothing),
    ignored("--fine-grained-offloading-max-inflight-offloads", One),
    refused("--finetune-data-files", List, HF_FINETUNE),
    refused_unless("--finetune-data-split", One, HF_FINETUNE, "train"),
    refused("--finetune-hf-dataset", One, HF_FINETUNE),
    refused("--first-last-layers-bf16", Nothing, FP8),
    ignored("--flash-attention-version", One),
    ignored("--flash-decode", Nothing),
    ignored("--flight-recorder-dump-path", One),
    ignored("--flight-recorder-include-stack-trace", Nothing),
    ignored("--flight-recorder-trace-buffer-size", One),
    ignored("--fp16-lm-cross-entropy", Nothing),
    refused("--fp32-residual-connection", Nothing, FP32_RESIDUAL),
    refused("--fp4-format", One, FP4),
    refused("--fp4-param-gather", Nothing, FP4),
    refused("--fp4-quantizer-factory", One, FP4),
    refused_unless("--fp4-recipe", One, FP4, "nvfp4"),
    refused_unless("--fp8-amax-compute-algo", One, FP8, "most_recent"),
    refused_unless("--fp8-amax-history-len", One, FP8, "1"),
    refused("--fp8-format", One, FP8),
    refused_unless("--fp8-interval", One, FP8, "1"),
    refused_unless("--fp8-margin", One, FP8, "0"),
    refused("--fp8-output-proj", Nothing, FP8),
    refused("--fp8-param-gather", Nothing, FP8),
    refused("--fp8-quantizer-factory", One, FP8),
    refused_unless("--fp8-recipe", One, FP8, "delayed"),
    refused("--freeze-all-layers", Nothing, FREEZE_LAYERS),
    refused("--freeze-base-for-mtp", Nothing, MODELOPT),
    ignored("--fsdp-db-use-persist-buf-on-alloc-fail", Nothing),
    ignored("--fsdp-double-buffer", Nothing),
    ignored("--fsdp-manual-registration", Nothing),
    ignored("--ft-num-warmup-iters", One),
    refused("--full-validation", Nothing, VALIDATION_SETS),
    ignored("--fused-residual-rmsnorm", Nothing),
    ignored("--gdp-cutedsl-kernel", Nothing),
    ignored("--gdp-num-chunk-states-to-recompute", One),
    refused_unless("--gdp-num-householder", One, HYBRID, "3"),
    refused_unless("--glu-linear-offset", One, GLU_OFFSET, "0.0"),
    ignored("--gpu-sniff-test-interval", One),
    ignored("--grad-reduce-in-bf16", Nothing),
    refused_unless("--grpo-clamp-eps-lower", One, RL, "0.01"),
    refused_unless("--grpo-clamp-eps-upper", One, RL, "0.01"),
    refused_unless("--grpo-entropy-term-weight", One, RL, "0.0"),
    refused("--grpo-filter-groups-with-same-reward", Nothing, RL),
    refused_unless("--grpo-group-size", One, RL, "2"),
    refused_unless("--grpo-iterations", One, RL, "2"),
    refused_unless("--grpo-kl-beta", One, RL, "0.001"),
    refused_unless("--grpo-prompts-per-step", One, RL, "32"),
    ignored("--gtp-expert-remat-nccl-ub", Nothing),
    ignored("--gtp-remat-nccl-ub", Nothing),
    ignored("--gtp-remat-opt-in-modules", List),
    ignored("--gtp-remat-reduce-scatter-with-fp32-accumulation", Nothing),
    refused_unless("--head-lr-mult", One, VISION, "1.0"),
    refused(
        "--heterogeneous-layers-config-encoded-json",
        One,
        HETEROGENEOUS,
    ),
    refused("--heterogeneous-layers-config-path", One, HETEROGENEOUS),
    refused("--hierarchical-context-parallel-sizes", List, CP),
    ignored("--high-priority-a2a-comm-stream", Nothing),
    ignored("--high-priority-stream-groups", List),
    refused("--hybrid-context-parallel", Nothing, CP),
    refused("--hybrid-layer-pattern", One, HYBRID),
    refused("--hybrid-override-pattern", One, HYBRID),
    refused("--ict-head-size", One, RETRIEVER),
    refused("--ict-load", One, RETRIEVER),
    refused_unless("--img-h", One, VISION, "224"),
    refused_unless("--img-w", One, VISION, "224"),
    refused_unless("--indexer-batch-size", One, RETRIEVER, "128"),
    refused_unless("--indexer-log-interval", One, RETRIEVER, "1000"),
    ignored("--inference-batch-times-seqlen-threshold", One),
    ignored("--inference-coordinator-port", One),
    ignored("--inference-cuda-graph-all-prefills", Nothing),
    ignored("--inference-cuda-graph-max-tokens", One),
    ignored("--inference-cuda-graph-scope", One),
    ignored("--inference-disable-ep-consensus", Nothing),
    ignored("--inference-disable-triton-nvls-kernels", Nothing),
    ignored("--inference-dynamic-batching", Nothing),
    ignored("--inference-dynamic-batching-async-sched-mode", One),
    ignored("--inference-dynamic-batching-block-size", One),
    ignored("--inference-dynamic-batching-buffer-size-gb", One),
    ignored(
        "--inference-dynamic-batching-cuda-graph-mixed-prefill-count",
        One,
    ),
    ignored(
        "--inference-dynamic-batching-cuda-graph-sizing-distribution",
        One,
    ),
    ignored("--inference-dynamic-batching-logprobs-mode", One),
    ignored("--inference-dynamic-batching-mamba-memory-ratio", One),
    ignored("--inference-dynamic-batching-max-requests", One),
    ignored("--inference-dynamic-batching-max-tokens", One),
    ignored("--inference-dynamic-batching-num-cuda-graphs", One),
    ignored("--inference-dynamic-batching-paused-buffer-size-gb", One),
    ignored("--inference-dynamic-batching-prefix-caching", Nothing),
    ignored(
        "--inference-dynamic-batching-prefix-caching-coordinator-policy",
        One,
    ),
    ignored(
        "--inference-dynamic-batching-prefix-caching-eviction-policy",
        One,
    ),
    ignored("--inference-dynamic-batching-prefix-caching-mamba-gb", One),
    ignored(
        "--inference-dynamic-batching-prefix-caching-routing-alpha",
        One,
    ),
    ignored("--inference-dynamic-batching-sampling-backend", One),
    ignored(
        "--inference-dynamic-batching-track-generated-token-events",
        Nothing,
    ),
    ignored(
        "--inference-dynamic-batching-track-paused-request-events",
        Nothing,
    ),
    ignored("--inference-dynamic-batching-unified-memory-level", One),
    ignored("--inference-fuse-tp-communication", Nothing),
    ignored("--inference-grouped-gemm-backend", One),
    ignored("--inference-logging-step-interval", One),
    ignored("--inference-max-requests", One),
    ignored("--inference-max-seq-length", One),
    ignored("--inference-moe-disable-fused-quant-kernels", Nothing),
    ignored("--inference-moe-token-dispatcher-type", One),
    ignored("--inference-rng-tracker", Nothing),
    ignored("--inference-shards", One),
    ignored("--inference-text-gen-server-logging", Nothing),
    ignored("--inference-use-synchronous-zmq-collectives", Nothing),
    ignored("--inference-wandb-logging", Nothing),
    refused("--init-method-xavier-uniform", Nothing, XAVIER_INIT),
    ignored("--init-model-with-meta-device", Nothing),
    ignored("--inprocess-active-world-size", One),
    ignored("--inprocess-barrier-timeout", One),
    ignored("--inprocess-completion-timeout", One),
    ignored("--inprocess-empty-cuda-cache", Nothing),
    ignored("--inprocess-granularity", One),
    ignored("--inprocess-hard-timeout", One),
    ignored("--inprocess-heartbeat-interval", One),
    ignored("--inprocess-heartbeat-timeout", One),
    ignored("--inprocess-last-call-wait", One),
    ignored("--inprocess-max-iterations", One),
    ignored("--inprocess-monitor-process-interval", One),
    ignored("--inprocess-monitor-thread-interval", One),
    ignored("--inprocess-progress-watchdog-interval", One),
    ignored("--inprocess-restart", Nothing),
    ignored("--inprocess-soft-timeout", One),
    ignored("--inprocess-termination-grace-time", One),
    refused("--is-hybrid-model", Nothing, HYBRID),
    refused_unless("--iter-per-epoch", One, VISION, "1250"),
    refused("--iterations-to-skip", List, SKIP_ITERATIONS),
    ignored("--keep-fp8-transpose-cache", Nothing),
    refused_unless("--kitchen-attention-backend", One, QUANT, "sdpa"),
    refused("--kitchen-config-file", One, QUANT),
    refused("--kitchen-recipe-number", One, QUANT),
    refused_unless("--kv-lora-rank", One, MLA, "32"),
    refused("--langrl-env-config", One, RL),
    ignored("--lazy-mpu-init", Nothing),
    refused("--linear-attention-freq", One, HYBRID),
    refused_unless("--linear-conv-kernel-dim", One, HYBRID, "4"),
    refused_unless("--linear-key-head-dim", One, HYBRID, "128"),
    refused_unless("--linear-num-key-heads", One, HYBRID, "16"),
    refused_unless("--linear-num-value-heads", One, HYBRID, "32"),
    refused_unless("--linear-value-head-dim", One, HYBRID, "128"),
    refused_unless("--lion-beta1", One, OTHER_OPTIMIZER, "0.95"),
    refused_unless("--lion-beta2", One, OTHER_OPTIMIZER, "0.98"),
    refused("--load-main-params-from-ckpt", Nothing, RESUME),
    ignored("--local-rank", One),
    ignored("--log-device-memory-used", Nothing),
    ignored("--log-energy", Nothing),
    ignored("--log-max-attention-logit", Nothing),
    ignored("--log-memory-interval", One),
    ignored("--log-memory-to-tensorboard", Nothing),
    ignored("--log-progress", Nothing),
    ignored("--log-straggler", Nothing),
    ignored("--log-timers-to-tensorboard", Nothing),
    ignored("--log-validation-ppl-to-tensorboard", Nothing),
    ignored("--log-world-size-to-tensorboard", Nothing),
    ignored("--logging-level", One),
    refused_unless("--logits-load-decode-threads", One, DISTILLATION, "4"),
    refused("--logits-load-dir", One, DISTILLATION),
    refused("--logits-load-ignore-errors", Nothing, DISTILLATION),
    refused_unless("--logits-load-kd-loss-alpha", One, DISTILLATION, "1.0"),
    refused_unless("--logits-load-msc-prefetch-depth", One, DISTILLATION, "2"),
    refused_unless("--logits-load-prefetch-factor", One, DISTILLATION, "3"),
    refused("--logits-save-dir", One, DISTILLATION),
    refused_unless("--logits-save-dtype", One, DISTILLATION, "fp16"),
    refused("--logits-save-top-k", One, DISTILLATION),
    refused("--logits-save-top-p", One, DISTILLATION),
    refused_unless("--logits-save-top-p-min-k", One, DISTILLATION, "1"),
    refused_unless("--main-grads-dtype", One, PRECISION_AWARE_OPTIMIZER, "fp32"),
    refused_unless(
        "--main-params-dtype",
        One,
        PRECISION_AWARE_OPTIMIZER,
        "fp32",
    ),
    refused_unless("--mamba-head-dim", One, HYBRID, "64"),
    ignored("--mamba-inference-conv-states-dtype", One),
    ignored("--mamba-inference-ssm-states-dtype", One),
    refused_unless("--mamba-num-groups", One, HYBRID, "8"),
    refused("--mamba-num-heads", One, HYBRID),
    refused_unless("--mamba-state-dim", One, HYBRID, "128"),
    refused("--mamba-training-ssm-states-dtype", One, HYBRID),
    ignored("--manual-gc", Nothing),
    ignored("--manual-gc-interval", One),
    refused_unless("--mask-factor", One, VISION, "1.0"),
    refused_unless("--mask-prob", One, ENCODER_MODELS, "0.15"),
    refused_unless("--mask-type", One, VISION, "random"),
    refused("--max-seqlen-per-dp-cp-rank", One, CP),
    ignored("--max-tokens-to-oom", One),
    ignored("--megatron-fsdp-enable-fine-grained-param-gather", Nothing),
    refused_unless(
        "--megatron-fsdp-grad-comm-dtype",
        One,
        PRECISION_AWARE_OPTIMIZER,
        "auto",
    ),
    refused_unless(
        "--megatron-fsdp-main-grads-dtype",
        One,
        PRECISION_AWARE_OPTIMIZER,
        "auto",
    ),
    refused_unless(
        "--megatron-fsdp-main-params-dtype",
        One,
        PRECISION_AWARE_OPTIMIZER,
        "fp32",
    ),
    ignored("--megatron-fsdp-max-pool-double-buffer", Nothing),
    ignored("--megatron-fsdp-version", One),
    ignored("--memory-snapshot-path", One),
    refused_unless("--mhc-init-gating-factor", One, MHC, "0.01"),
    refused_unless("--mhc-num-residual-streams", One, MHC, "4"),
    ignored("--mhc-recompute-layer-num", One),
    refused_unless("--mhc-sinkhorn-iterations", One, MHC, "20"),
    ignored("--microbatch-group-size-per-virtual-pipeline-stage", One),
    refused_unless("--mid-level-dataset-surplus", One, DATA_ORDER, "0.005"),
    ignored("--min-offloaded-tensor-size", One),
    ignored("--mla-down-proj-fusion", Nothing),
    ignored("--mlp-chunks-for-prefill", One),
    ignored("--mlp-chunks-for-training", One),
    refused("--model-parallel-size", One, OLD_MODEL_PARALLEL_SIZE),
    refused("--modelopt-enabled", Nothing, MODELOPT),
    refused("--moe-apply-probs-on-input", Nothing, MOE),
    refused_unless("--moe-aux-loss-coeff", List, MOE, "0.0"),
    refused_unless("--moe-combine-bwd-dtype", One, MOE, "bf16"),
    ignored("--moe-deepep-num-sms", One),
    refused_unless("--moe-dispatch-fwd-dtype", One, MOE, "bf16"),
    ignored("--moe-enable-deepep", Nothing),
    refused("--moe-enable-routing-replay", Nothing, MOE),
    refused("--moe-expert-capacity-factor", One, MOE),
    refused("--moe-expert-rank-capacity-factor", One, MOE),
    refused("--moe-ffn-hidden-size", One, MOE),
    ignored("--moe-flex-dispatcher-backend", One),
    ignored("--moe-flex-dispatcher-num-sms", One),
    ignored("--moe-grouped-gemm", Nothing),
    ignored("--moe-hybridep-num-blocks-permute", One),
    ignored("--moe-hybridep-num-blocks-unpermute", One),
    ignored("--moe-hybridep-num-sms", One),
    ignored("--moe-hybridep-num-sms-preprocessing", One),
    ignored("--moe-hybridep-pad-uneven-dispatch-inputs", Nothing),
    refused("--moe-input-jitter-eps", One, MOE),
    refused("--moe-latent-size", One, MOE),
    refused_unless("--moe-layer-freq", One, MOE, "1"),
    ignored("--moe-layer-recompute", Nothing),
    refused("--moe-mlp-glu-interleave-size", One, MOE),
    ignored("--moe-ncclep-zero-copy", Nothing),
    refused("--moe-pad-expert-input-to-capacity", Nothing, MOE),
    ignored("--moe-pad-experts-for-cuda-graph-inference", Nothing),
    ignored("--moe-paged-stash", Nothing),
    ignored("--moe-paged-stash-buffer-size-factor-cpu", One),
    ignored("--moe-paged-stash-buffer-size-factor-cuda", One),
    ignored("--moe-paged-stash-page-size", One),
    ignored("--moe-per-layer-logging", Nothing),
    ignored("--moe-permute-fusion", Nothing),
    ignored("--moe-permute-fusion-into-hybridep", Nothing),
    refused_unless("--moe-router-bias-update-rate", One, MOE, "0.001"),
    refused("--moe-router-dtype", One, MOE),
    refused("--moe-router-enable-expert-bias", Nothing, MOE),
    refused("--moe-router-force-biased", One, MOE),
    refused("--moe-router-force-load-balancing", Nothing, MOE),
    ignored("--moe-router-fusion", Nothing),
    refused("--moe-router-group-topk", One, MOE),
    refused_unless("--moe-router-load-balancing-type", List, MOE, "aux_loss"),
    refused("--moe-router-num-groups", One, MOE),
    refused("--moe-router-padding-for-fp8", Nothing, MOE),
    refused("--moe-router-padding-for-quantization", Nothing, MOE),
    refused("--moe-router-pre-softmax", Nothing, MOE),
    refused_unless("--moe-router-quantile-balancing-ema", One, MOE, "0.0"),
    refused_unless("--moe-router-score-function", One, MOE, "softmax"),
    refused_unless("--moe-router-topk", One, MOE, "2"),
    refused("--moe-router-topk-scaling-factor", One, MOE),
    ignored("--moe-routing-trace-capture-hidden-states", Nothing),
    ignored("--moe-routing-trace-capture-logits", Nothing),
    ignored("--moe-routing-trace-dump-weights", Nothing),
    ignored("--moe-routing-trace-max-training-iters", One),
    ignored("--moe-routing-trace-path", One),
    refused("--moe-shared-expert-gate", Nothing, MOE),
    refused("--moe-shared-expert-glu-interleave-size", One, MOE),
    refused("--moe-shared-expert-intermediate-size", One, MOE),
    ignored("--moe-shared-expert-overlap", Nothing),
    ignored("--moe-single-grouped-bias", Nothing),
    ignored("--moe-single-grouped-weight", Nothing),
    ignored("--moe-token-dispatcher-type", One),
    refused_unless("--moe-token-drop-policy", One, MOE, "probs"),
    refused_unless("--moe-upcycling-granularity", One, MOE, "1"),
    ignored("--moe-use-grouped-tensor", Nothing),
    refused("--moe-use-upcycling", Nothing, MOE),
    refused("--moe-z-loss-coeff", One, MOE),
    refused("--mrope-section", List, MROPE),
    refused("--mtp-detach-heads", Nothing, MTP),
    refused("--mtp-hsm", Nothing, MTP),
    refused("--mtp-hybrid-override-pattern", One, MTP),
    refused_unless("--mtp-loss-scaling-factor", One, MTP, "0.1"),
    refused("--mtp-num-layers", One, MTP),
    refused("--mtp-standalone", Nothing, MTP),
    refused("--mtp-use-repeated-layer", Nothing, MTP),
    refused("--multi-latent-attention", Nothing, MLA),
    refused("--multiple-validation-sets", Nothing, VALIDATION_SETS),
    refused_unless("--muon-coefficient-type", One, OTHER_OPTIMIZER, "quintic"),
    refused_unless("--muon-extra-scale-factor", One, OTHER_OPTIMIZER, "1.0"),
    refused_unless("--muon-fp32-matmul-prec", One, OTHER_OPTIMIZER, "medium"),
    refused_unless("--muon-momentum", One, OTHER_OPTIMIZER, "0.9"),
    refused("--muon-nesterov", Nothing, OTHER_OPTIMIZER),
    refused("--muon-no-split-qkv", Nothing, OTHER_OPTIMIZER),
    refused_unless("--muon-num-ns-steps", One, OTHER_OPTIMIZER, "5"),
    refused_unless("--muon-scalar-optimizer", One, OTHER_OPTIMIZER, "adam"),
    refused_unless("--muon-scale-mode", One, OTHER_OPTIMIZER, "spectral"),
    refused_unless("--muon-tp-mode", One, OTHER_OPTIMIZER, "duplicated"),
    ignored("--muon-use-syrk", Nothing),
    refused_unless("--mup-attn-scale-power", One, MUP, "1.0"),
    refused("--mup-base-head-dim", One, MUP),
    refused("--mup-base-hidden-size", One, MUP),
    refused_unless("--mup-embedding-mult", One, MUP, "1.0"),
    refused_unless("--mup-output-mult", One, MUP, "1.0"),
    refused_unless("--mup-width-mult", One, MUP, "1.0"),
    ignored("--nccl-all-reduce-for-prefill", Nothing),
    ignored("--nccl-communicator-config-path", One),
    ignored("--no-align-grad-reduce", Nothing),
    ignored("--no-align-param-gather", Nothing),
    ignored("--no-barrier-with-level-1-timing", Nothing),
    ignored("--no-check-for-nan-in-loss-and-grad", Nothing),
    ignored("--no-ckpt-fully-parallel-save", Nothing),
    ignored("--no-ckpt-load-validate-sharding-integrity", Nothing),
    ignored("--no-clone-scatter-output-in-embedding", Nothing),
    ignored("--no-create-attention-mask-in-dataloader", Nothing),
    refused("--no-data-sharding", Nothing, VISION),
    refused(
        "--no-dsa-indexer-rotate-activation",
        Nothing,
        ATTENTION_VARIANT,
    ),
    refused("--no-dsa-indexer-scoring-relu", Nothing, ATTENTION_VARIANT),
    ignored("--no-flight-recorder-dump-on-timeout", Nothing),
    ignored("--no-flight-recorder-extra-dump-on-exec", Nothing),
    ignored("--no-flight-recorder-include-only-active", Nothing),
    refused("--no-fp8-wgrad", Nothing, FP8),
    ignored("--no-gradient-accumulation-fusion", Nothing),
    ignored("--no-gradient-reduce-div-fusion", Nothing),
    ignored("--no-inference-disable-ep-consensus", Nothing),
    ignored("--no-inference-dynamic-batching-prefix-caching", Nothing),
    ignored("--no-inference-text-gen-server-logging", Nothing),
    ignored("--no-inference-use-synchronous-zmq-collectives", Nothing),
    ignored("--no-inference-wandb-logging", Nothing),
    ignored("--no-initialization", Nothing),
    ignored("--no-log-loss-scale-to-tensorboard", Nothing),
    ignored("--no-manual-gc-eval", Nothing),
    ignored("--no-mmap-bin-files", Nothing),
    ignored("--no-one-logger", Nothing),
    ignored("--no-overlap-p2p-communication", Nothing),
    refused("--no-pad-vocab-size", Nothing, PADDED_VOCAB),
    ignored("--no-pin-cpu-grads", Nothing),
    ignored("--no-pin-cpu-params", Nothing),
    ignored("--no-rl-inference-logprobs-is-correction", Nothing),
    ignored("--no-rl-offload-inference-model-weights-when-idle", Nothing),
    ignored("--no-rl-partial-rollouts", Nothing),
    ignored("--no-rl-persist-cuda-graphs", Nothing),
    ignored("--no-rl-skip-bos-token", Nothing),
    ignored("--no-rl-training-cuda-graphs", Nothing),
    ignored("--no-rl-use-sequence-packing", Nothing),
    ignored("--no-rl-verify-model-weights-swap", Nothing),
    refused("--no-rope-freq", One, NO_ROPE_LAYERS),
    ignored("--no-save-optim", Nothing),
    ignored("--no-save-rng", Nothing),
    ignored("--no-save-tokenizer-assets", Nothing),
    ignored("--no-strict-fsdp-dtensor-load", Nothing),
    refused(
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
        Nothing,
        TOKENIZER,
    ),
    ignored("--no-tp-comm-bulk-dgrad", Nothing),
    ignored("--no-tp-comm-bulk-wgrad", Nothing),
    ignored("--no-tp-comm-overlap-ag", Nothing),
    ignored("--no-tp-comm-overlap-rs", Nothing),
    ignored("--no-tp-comm-split-ag", Nothing),
    ignored("--no-tp-comm-split-rs", Nothing),
    ignored("--no-use-layer-wise-param-layout", Nothing),
    ignored("--no-use-tokenizer-model-from-checkpoint-args", Nothing),
    refused("--no-weight-decay-cond-type", One, WEIGHT_DECAY_CONDITION),
    ignored("--non-persistent-ckpt-type", One),
    ignored("--non-persistent-global-ckpt-dir", One),
    ignored("--non-persistent-local-ckpt-algo", One),
    ignored("--non-persistent-local-ckpt-dir", One),
    ignored("--non-persistent-save-interval", One),
    refused("--null-tokenizer-eod-id", One, TOKENIZER),
    refused_unless("--null-tokenizer-pad-id", One, TOKENIZER, "-1"),
    refused_unless("--num-channels", One, VISION, "3"),
    refused_unless("--num-classes", One, VISION, "1000"),
    ignored("--num-dataset-builder-threads", One),
    ignored("--num-distributed-optimizer-instances", One),
    refused("--num-experts", One, MOE),
    refused_unless("--num-layers-at-end-in-bf16", One, FP8, "1"),
    refused_unless("--num-layers-at-start-in-bf16", One, FP8, "1"),
    ignored("--num-speculative-tokens", One),
    ignored("--num-virtual-stages-per-pipeline-rank", One),
    ignored("--num-workers", One),
    ignored("--nvtx-ranges", Nothing),
    ignored("--object-storage-cache-path", One),
    ignored("--offload-modules", List),
    ignored("--one-logger-async", Nothing),
    ignored("--one-logger-project", One),
    ignored("--one-logger-run-name", One),
    ignored("--onnx-safe", One),
    ignored("--optimizer-cpu-offload", Nothing),
    ignored("--optimizer-cuda-graph", Nothing),
    ignored("--optimizer-offload-fraction", One),
    ignored("--otel-enabled", Nothing),
    ignored("--otel-service-name", One),
    ignored("--otel-span-groups", One),
    ignored("--outer-dp-sharding-strategy", One),
    ignored("--output-bert-embeddings", Nothing),
    ignored("--output-logit-dtype", One),
    ignored("--overlap-cpu-optimizer-d2h-h2d", Nothing),
    ignored("--overlap-dispatch-backward-with-experts-wgrad", Nothing),
    ignored("--overlap-moe-expert-parallel-comm", Nothing),
    ignored("--overlap-p2p-communication-warmup-flush", Nothing),
    ignored("--overlap-param-gather", Nothing),
    ignored("--overlap-param-gather-with-optimizer-step", Nothing),
    refused("--override-ckpt-iteration", One, RESUME),
    ignored("--override-opt-param-scheduler", Nothing),
    ignored("--override-opt_param-scheduler", Nothing),
    refused("--padded-vocab-size", One, PADDED_VOCAB),
    refused_unless("--patch-dim", One, VISION, "16"),
    ignored("--per-dataset-sequences-path", One),
    refused("--perform-rl-step", Nothing, RL),
    refused("--phase-transition-iterations", One, PHASE_TRANSITIONS),
    ignored("--pipeline-model-parallel-comm-backend", One),
    ignored("--pipeline-model-parallel-layout", One),
    refused("--pretrained-checkpoint", One, FINETUNE),
    ignored("--profile", Nothing),
    ignored("--profile-ranks", List),
    ignored("--profile-step-end", One),
    ignored("--profile-step-start", One),
    ignored("--pytorch-profiler-collect-callstack", Nothing),
    ignored("--pytorch-profiler-collect-chakra", Nothing),
    ignored("--pytorch-profiler-collect-shapes", Nothing),
    refused("--q-lora-rank", One, MLA),
    refused("--qad-train-target", One, MODELOPT),
    refused("--qk-clip", Nothing, QK_CLIP),
    refused_unless("--qk-clip-alpha", One, QK_CLIP, "0.5"),
    refused_unless("--qk-clip-threshold", One, QK_CLIP, "100"),
    refused_unless("--qk-head-dim", One, MLA, "128"),
    refused("--qk-l2-norm", Nothing, QK_L2_NORM),
    refused_unless("--qk-pos-emb-head-dim", One, MLA, "64"),
    refused_unless("--query-in-block-prob", One, RETRIEVER, "0.1"),
    refused("--quick-geglu", Nothing, ACTIVATION),
    ignored("--recompute-modules", List),
    ignored("--record-memory-history", Nothing),
    ignored("--record-shapes", Nothing),
    refused_unless("--refit-method", One, RL, "gloo"),
    refused_unless(
        "--relative-attention-max-distance",
        One,
        RELATIVE_POSITIONS,
        "128",
    ),
    refused_unless(
        "--relative-attention-num-buckets",
        One,
        RELATIVE_POSITIONS,
        "32",
    ),
    ignored("--replication", Nothing),
    ignored("--replication-factor", One),
    ignored("--replication-jump", One),
    ignored("--rerun-mode", One),
    ignored("--result-rejected-tracker-filename", One),
    refused("--retriever-report-topk-accuracies", List, RETRIEVER),
    refused("--retriever-score-scaling", Nothing, RETRIEVER),
    ignored("--reuse-grad-buf-for-mxfp8-param-ag", Nothing),
    refused_unless("--rl-consumption-granularity", One, RL, "B"),
    refused_unless("--rl-default-temperature", One, RL, "1.0"),
    refused_unless("--rl-default-top-k", One, RL, "-1"),
    refused_unless("--rl-default-top-p", One, RL, "0"),
    refused("--rl-durable-rollout-bank", Nothing, RL),
    refused("--rl-generation-lag", One, RL),
    refused("--rl-importance-sampling-truncation-coef", One, RL),
    refused("--rl-inference-expert-model-parallel-size", One, RL),
    refused("--rl-inference-expert-tensor-model-parallel-size", One, RL),
    refused("--rl-inference-logprobs-is-correction", Nothing, RL),
    refused_unless("--rl-inference-model-unified-memory-level", One, RL, "0"),
    refused("--rl-inference-parsers", List, RL),
    refused("--rl-inference-pipeline-model-parallel-size", One, RL),
    refused("--rl-inference-tensor-model-parallel-size", One, RL),
    refused_unless("--rl-kv-cache-management-mode", One, RL, "persist"),
    refused("--rl-max-inflight-requests", One, RL),
    refused(
        "--rl-offload-inference-model-weights-when-idle",
        Nothing,
        RL,
    ),
    refused("--rl-offload-optimizer-during-inference", Nothing, RL),
    refused("--rl-partial-rollouts", Nothing, RL),
    refused("--rl-persist-cuda-graphs", Nothing, RL),
    refused("--rl-profile", Nothing, RL),
    refused("--rl-profile-dir", One, RL),
    refused_unless("--rl-prompts-per-eval", One, RL, "32"),
    refused("--rl-rollout-bank-dir", One, RL),
    refused_unless("--rl-rollout-bank-max-bytes", One, RL, "0"),
    refused_unless("--rl-sequence-packing-algo", One, RL, "fifo"),
    refused_unless("--rl-sequence-packing-max-sequences-per-bin", One, RL, "50"),
    refused("--rl-skip-bos-token", Nothing, RL),
    refused_unless("--rl-submission-granularity", One, RL, "B"),
    refused("--rl-training-cuda-graphs", Nothing, RL),
    refused("--rl-use-sequence-packing", Nothing, RL),
    refused("--rl-verify-model-weights-swap", Nothing, RL),
    refused_unless("--rope-type", One, YARN, "rope"),
    refused(
        "--rotary-seq-len-interpolation-factor",
        One,
        ROPE_INTERPOLATION,
    ),
    ignored("--run-workload-inspector-server", Nothing),
    ignored("--sample-rate", One),
    ignored("--save-activations-interval", One),
    ignored("--save-dgrads-interval", One),
    ignored("--save-params-interval", One),
    ignored("--save-retain-interval", One),
    ignored("--save-tokens-per-expert-interval", One),
    ignored("--save-wgrads-interval", One),
    refused("--sft", Nothing, SFT),
    refused_unless(
        "--sft-tokenizer-prompt-format",
        One,
        SFT,
        "nemotron-h-aligned",
    ),
    refused_unless("--sgd-momentum", One, OTHER_OPTIMIZER, "0.9"),
    ignored("--sharp-enabled-group", One),
    refused_unless("--short-seq-prob", One, ENCODER_MODELS, "0.1"),
    refused("--skip-train", Nothing, SKIP_TRAIN),
    refused_unless("--softmax-type", One, ATTENTION_VARIANT, "vanilla"),
    refused("--spec", List, CUSTOM_SPEC),
    refused("--squared-relu", Nothing, ACTIVATION),
    ignored("--start-eval-at-iter", One),
    ignored("--straggler-ctrlr-port", One),
    ignored("--straggler-minmax-count", One),
    ignored("--suggested-communication-unit-size", One),
    refused_unless("--swin-backbone-type", One, VISION, "tiny"),
    ignored("--symmetric-ar-type", One),
    refused("--te-precision-config-file", One, QUANT),
    ignored("--te-rng-tracker", Nothing),
    refused("--tensor-parallel-num-weight-shards", One, GTP),
    ignored("--tensorboard-queue-size", One),
    ignored("--test-mode", Nothing),
    refused("--tiktoken-special-tokens", List, TOKENIZER),
    ignored("--timing-log-level", One),
    ignored("--timing-log-option", One),
    refused("--titles-data-path", One, RETRIEVER),
    refused(
        "--tokenizer-hf-no-include-special-tokens",
        Nothing,
        TOKENIZER,
    ),
    ignored("--tokenizer-hf-no-use-fast", Nothing),
    refused("--tokenizer-metadata", One, TOKENIZER),
    refused("--tokenizer-sentencepiece-legacy", Nothing, TOKENIZER),
    refused("--tokenizer-special-tokens", List, TOKENIZER),
    ignored("--torch-fsdp2-no-reshard-after-forward", Nothing),
    ignored("--tp-comm-bootstrap-backend", One),
    ignored("--tp-comm-overlap", Nothing),
    ignored("--tp-comm-overlap-cfg", One),
    ignored("--tp-comm-overlap-rs-dgrad", Nothing),
    ignored("--train-sync-interval", One),
    ignored("--trust-remote-code", Nothing),
    refused(
        "--use-checkpoint-opt-param-scheduler",
        Nothing,
        SCHEDULE_FROM_CHECKPOINT,
    ),
    refused(
        "--use-checkpoint-opt_param-scheduler",
        Nothing,
        SCHEDULE_FROM_CHECKPOINT,
    ),
    ignored("--use-cpu-initialization", Nothing),
    ignored("--use-dist-ckpt", Nothing),
    ignored("--use-fused-weighted-squared-relu", Nothing),
    ignored("--use-gigatoken", Nothing),
    ignored("--use-grouped-gemm-for-dense-mlp", Nothing),
    ignored("--use-grouped-gemm-for-shared-expert", Nothing),
    refused("--use-kitchen-attention", Nothing, QUANT),
    ignored("--use-legacy-static-engine", Nothing),
    ignored("--use-mcore-models", Nothing),
    refused("--use-megatron-fsdp", Nothing, FSDP),
    refused(
        "--use-mp-args-from-checkpoint-args",
        Nothing,
        CHECKPOINT_ARGS,
    ),
    refused("--use-mup", Nothing, MUP),
    ignored("--use-nccl-ub", Nothing),
    refused("--use-one-sent-docs", Nothing, RETRIEVER),
    ignored("--use-persistent-ckpt-worker", Nothing),
    ignored("--use-precision-aware-optimizer", Nothing),
    ignored("--use-pytorch-profiler", Nothing),
    ignored("--use-ring-exchange-p2p", Nothing),
    ignored("--use-same-sampling-seed-across-dp-ranks", Nothing),
    ignored("--use-sharp", Nothing),
    ignored("--use-te-activation-func", Nothing),
    refused("--use-torch-fsdp2", Nothing, FSDP),
    ignored("--use-torch-optimizer-for-cpu-offload", Nothing),
    ignored("--use-tp-pp-dp-mapping", Nothing),
    ignored("--use-transformer-engine-op-fuser", Nothing),
    refused_unless("--v-head-dim", One, MLA, "128"),
    refused("--validation-set-names", List, VALIDATION_SETS),
    ignored("--verify-integrity", Nothing),
    refused_unless("--vision-backbone-type", One, VISION, "vit"),
    refused("--vision-pretraining", Nothing, VISION),
    refused_unless("--vision-pretraining-type", One, VISION, "classify"),
    refused_unless("--vocab-extra-ids", One, VOCAB_EXTRA_IDS, "0"),
    ignored("--wandb-entity", One),
    ignored("--wandb-exp-name", One),
    ignored("--wandb-project", One),
    ignored("--wandb-save-dir", One),
    refused("--warmup", One, OLD_WARMUP),
    ignored("--wgrad-deferral-limit", One),
    refused("--yaml-cfg", One, YAML_CONFIG),
];
