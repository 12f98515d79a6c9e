//! Offline conversion between ferrotron's checkpoints and Megatron-LM's `--ckpt-format torch`,
//! resharded to another tensor-parallel size on the way (what Megatron users otherwise do
//! with Megatron's `tools/checkpoint/convert.py`).
//!
//! The source is read whole (every tensor joined from its rank shards) by the readers
//! `pretrain --load` uses, the vocabulary re-padded for the target size, and the target
//! written by [`SaveFormat::save_model`]. ferrotron's own
//! checkpoints already load at any layout, so converting to ferrotron's format writes one
//! tensor-parallel rank.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

use super::format::CheckpointFormat;
use super::megatron_args::MegatronArgs;
use super::megatron_tensors::ParameterValues;
use super::megatron_torch_save::{LayerSpec, MegatronSaveOptions};
use super::open::Checkpoint;
use super::write::{SaveFormat, SavedModel};
use super::{read_full_model, TrainState, TRACKER_FILE};
use crate::model::{padded_vocab_size, GptConfig};
use crate::util::host_tensor::HostTensor;

/// What to write.
#[derive(Clone, Debug)]
pub struct ConvertTarget {
    /// The format (ferrotron's or `torch`: writing `torch_dist` is refused).
    pub format: CheckpointFormat,
    /// Tensor-parallel ranks to write (`None`: the source's).
    pub tensor_parallel: Option<usize>,
    /// Pipeline stages to write (`None`: the source's; a ferrotron target has none).
    pub pipeline_parallel: Option<usize>,
    /// Megatron-Core's names: Transformer Engine's or the local spec's.
    pub spec: LayerSpec,
    /// `--make-vocab-size-divisible-by`.
    pub make_vocab_size_divisible_by: usize,
    /// The real vocabulary size, when known: the target is padded from it exactly.
    pub vocab_size: Option<usize>,
    /// `--tokenizer-type`, recorded in Megatron's args (its loader compares it when the run
    /// has a `--vocab-file`, i.e. for GPT-2's BPE); `None`: a Megatron source's, else
    /// `GPT2BPETokenizer`.
    pub tokenizer_type: Option<String>,
    /// The global batch size the source was trained with: the consumed samples of a
    /// Megatron source whose arguments lack them are `iteration × global batch` (0 without
    /// it).
    pub global_batch_size: Option<u64>,
}

/// What was converted.
#[derive(Clone, Debug)]
pub struct ConvertSummary {
    /// The source's format.
    pub source: CheckpointFormat,
    /// The source's tensor-parallel size.
    pub source_tensor_parallel: usize,
    /// The source's pipeline-parallel size.
    pub source_pipeline_parallel: usize,
    /// The tensor-parallel size written.
    pub tensor_parallel: usize,
    /// The pipeline-parallel size written.
    pub pipeline_parallel: usize,
    /// The iteration.
    pub iteration: u64,
    /// The model written (its padded vocabulary is the target's).
    pub config: GptConfig,
}

/// A source checkpoint, whole.
struct Source {
    format: CheckpointFormat,
    tensor_parallel: usize,
    pipeline_parallel: usize,
    config: GptConfig,
    state: TrainState,
    values: ParameterValues,
    /// A Megatron source's saved arguments.
    args: Option<MegatronArgs>,
}

/// Converts the checkpoint in `src` (ferrotron's, or Megatron's: the model its saved
/// arguments describe, which `megatron_config`, the flags given, must agree with) into `dst`.
pub fn convert_checkpoint(
    src: &Path,
    megatron_config: Option<&GptConfig>,
    dst: &Path,
    target: &ConvertTarget,
) -> Result<ConvertSummary> {
    ensure!(
        !dst.join(TRACKER_FILE).exists(),
        "--save {}: already holds a checkpoint; choose an empty directory",
        dst.display()
    );
    let source = read_source(src, megatron_config, target)?;
    let (tensor_parallel, pipeline_parallel) = target_layout(&source, target)?;
    let padded = target_padded_vocab(&source, target, tensor_parallel)?;
    let config = GptConfig {
        padded_vocab_size: padded,
        ..source.config.clone()
    };
    config
        .validate_parallel(tensor_parallel)
        .map_err(anyhow::Error::msg)?;
    let tokenizer_type = tokenizer_type(&source, target)?;
    let values = with_vocab_rows(source.values, padded);
    let format = match target.format {
        CheckpointFormat::MegatronTorch => SaveFormat::MegatronTorch(MegatronSaveOptions {
            spec: target.spec,
            make_vocab_size_divisible_by: target.make_vocab_size_divisible_by,
            // Megatron's `vocab_size` is the tokenizer flag's value, which differs from the
            // real vocabulary for some types (NullTokenizer's is one less): unknown here.
            vocab_size: None,
            tokenizer_type: Some(tokenizer_type),
        }),
        CheckpointFormat::MegatronTorchDist => bail!(
            "writing Megatron's torch_dist format is not implemented: convert to torch and \
             let Megatron's --ckpt-convert-format torch_dist rewrite it"
        ),
        CheckpointFormat::Ferrotron => {
            ensure!(
                tensor_parallel == 1,
                "ferrotron's checkpoints load at any tensor-parallel size: convert to \
                 --ckpt-format ferrotron without --target-tensor-parallel-size"
            );
            SaveFormat::Ferrotron
        }
    };
    let model = SavedModel {
        values: &values,
        config: &config,
        state: &source.state,
        layout: (tensor_parallel, pipeline_parallel),
    };
    format
        .save_model(dst, model)
        .with_context(|| format!("{}: writing {}", src.display(), dst.display()))?;
    Ok(ConvertSummary {
        source: source.format,
        source_tensor_parallel: source.tensor_parallel,
        source_pipeline_parallel: source.pipeline_parallel,
        tensor_parallel,
        pipeline_parallel,
        iteration: source.state.iteration,
        config,
    })
}

/// The tensor- and pipeline-parallel sizes to write: the target's, else the source's; a
/// ferrotron target has one stage.
fn target_layout(source: &Source, target: &ConvertTarget) -> Result<(usize, usize)> {
    let tensor_parallel = target.tensor_parallel.unwrap_or(source.tensor_parallel);
    ensure!(
        tensor_parallel >= 1,
        "the tensor-parallel size must be at least 1"
    );
    let pipeline_parallel = match target.format {
        CheckpointFormat::MegatronTorch | CheckpointFormat::MegatronTorchDist => {
            target.pipeline_parallel.unwrap_or(source.pipeline_parallel)
        }
        CheckpointFormat::Ferrotron => {
            ensure!(
                target.pipeline_parallel.unwrap_or(1) == 1,
                "ferrotron's checkpoints load at any pipeline layout: convert to \
                 --ckpt-format ferrotron without --target-pipeline-parallel-size"
            );
            1
        }
    };
    Ok((tensor_parallel, pipeline_parallel))
}

/// The tokenizer type recorded for Megatron, which compares it on load: the flag's, else a
/// Megatron source's, else GPT-2's.
fn tokenizer_type(source: &Source, target: &ConvertTarget) -> Result<String> {
    let saved = match &source.args {
        Some(args) => args.string("tokenizer_type")?.map(str::to_owned),
        None => None,
    };
    Ok(target
        .tokenizer_type
        .clone()
        .or(saved)
        .unwrap_or_else(|| "GPT2BPETokenizer".into()))
}

/// Reads `src` whole, in ferrotron's names and orientation.
fn read_source(
    src: &Path,
    megatron_config: Option<&GptConfig>,
    target: &ConvertTarget,
) -> Result<Source> {
    let source = Checkpoint::open(src)?;
    if source.format().is_megatron() {
        let (checkpoint, config) = source.read_megatron(megatron_config, false)?;
        check_shapes(&checkpoint.values, &config).with_context(|| {
            format!(
                "{}: the model its arguments describe does not fit its tensors",
                src.display()
            )
        })?;
        return Ok(Source {
            format: source.format(),
            tensor_parallel: checkpoint.tensor_parallel,
            pipeline_parallel: checkpoint.pipeline_parallel,
            state: checkpoint.train_state(target.global_batch_size.unwrap_or(0))?,
            config,
            values: checkpoint.values,
            args: Some(checkpoint.args),
        });
    }
    ensure!(
        target.format != CheckpointFormat::Ferrotron,
        "{} is already a ferrotron checkpoint (which loads at any layout)",
        src.display()
    );
    let full =
        read_full_model(src)?.with_context(|| format!("no checkpoint in {}", src.display()))?;
    let values = full
        .tensors
        .into_iter()
        .filter_map(|(key, t)| {
            key.strip_prefix("model.")
                .map(|name| (name.to_owned(), (t.shape, t.values)))
        })
        .collect();
    Ok(Source {
        format: CheckpointFormat::Ferrotron,
        tensor_parallel: full.info.tensor_model_parallel_size,
        pipeline_parallel: full.info.pipeline_model_parallel_size,
        config: full.info.config,
        state: full.info.state,
        values,
        args: None,
    })
}

/// The shape ferrotron's model of `config` gives parameter `name` (`[in, out]` for linear
/// weights), `None` for a name it does not have. What a Megatron source is checked against
/// before its flags are written into the target's args.
pub fn parameter_shape(name: &str, config: &GptConfig) -> Option<Vec<usize>> {
    let (h, hd, ffn) = (config.hidden_size, config.head_dim(), config.ffn_size());
    let qkv = (config.num_attention_heads + 2 * config.query_groups()) * hd;
    let vocab = config.padded_vocab_size;
    let matrix_or_bias = |kind: &str, rows: usize, cols: usize| match kind {
        "weight" => Some(vec![rows, cols]),
        "bias" => Some(vec![cols]),
        _ => None,
    };
    match name {
        "word_embeddings.weight" => return Some(vec![vocab, h]),
        "position_embeddings" => return Some(vec![config.max_position_embeddings, h]),
        "output_layer.weight" => return Some(vec![h, vocab]),
        _ => {}
    }
    let (module, kind) = name.rsplit_once('.')?;
    let module = match module.strip_prefix("layers.") {
        Some(rest) => rest.split_once('.')?.1,
        None => module,
    };
    match module {
        "final_layernorm" | "input_layernorm" | "post_attention_layernorm" => Some(vec![h]),
        "self_attention.q_layernorm" | "self_attention.k_layernorm" => Some(vec![hd]),
        "self_attention.query_key_value" => matrix_or_bias(kind, h, qkv),
        "self_attention.dense" => matrix_or_bias(kind, config.num_attention_heads * hd, h),
        "mlp.dense_h_to_4h" | "mlp.dense_h_to_4h_gate" => matrix_or_bias(kind, h, ffn),
        "mlp.dense_4h_to_h" => matrix_or_bias(kind, ffn, h),
        _ => None,
    }
}

/// Every value has the shape `config` gives its parameter.
fn check_shapes(values: &ParameterValues, config: &GptConfig) -> Result<()> {
    let mut names: Vec<&String> = values.keys().collect();
    names.sort();
    for name in names {
        let shape = &values[name].0;
        match parameter_shape(name, config) {
            Some(expected) if &expected == shape => {}
            Some(expected) => bail!("{name} is {shape:?}, but the flags give it {expected:?}"),
            None => bail!("{name} is not a parameter of the model the flags describe"),
        }
    }
    Ok(())
}

/// The target's padded vocabulary: Megatron's padding of the real vocabulary when it is
/// known; otherwise the source's rows, rounded up to the target's multiple when they are not
/// one already (the rows past the real vocabulary are padding either way).
fn target_padded_vocab(
    source: &Source,
    target: &ConvertTarget,
    tensor_parallel: usize,
) -> Result<usize> {
    let rows = source.config.padded_vocab_size;
    if let Some(vocab) = target.vocab_size {
        ensure!(
            vocab <= rows,
            "--vocab-size {vocab} is larger than the checkpoint's vocabulary ({rows} rows)"
        );
        return Ok(padded_vocab_size(
            vocab,
            target.make_vocab_size_divisible_by,
            tensor_parallel,
        ));
    }
    Ok(padded_vocab_size(
        rows,
        target.make_vocab_size_divisible_by,
        tensor_parallel,
    ))
}

/// `values` with the word embedding's rows and the output layer's columns cut or
/// zero-padded to `padded`.
fn with_vocab_rows(mut values: ParameterValues, padded: usize) -> ParameterValues {
    for (name, dim) in [("word_embeddings.weight", 0), ("output_layer.weight", 1)] {
        if let Some((shape, v)) = values.remove(name) {
            let t = HostTensor::new(shape, v).resized(dim, padded);
            values.insert(name.to_owned(), (t.shape, t.values));
        }
    }
    values
}
