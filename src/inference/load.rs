//! Loading a checkpoint for inference with the tokenizer that will read and write its text.

use anyhow::{bail, Result};
use burn::tensor::Device;
use std::path::Path;

use crate::checkpoint::{load_model_shard, LoadedCheckpoint};
use crate::comm::Group;
use crate::model::Gpt;
use crate::tokenizer::TextTokenizer;

/// This rank's shard of the checkpoint's model; an error when the tokenizer has ids the model's
/// vocabulary does not (the wrong tokenizer files for this model).
pub fn load_for_inference(
    root: &Path,
    device: &Device,
    group: &Group,
    tokenizer: &TextTokenizer,
) -> Result<(Gpt, LoadedCheckpoint)> {
    let (model, checkpoint) = load_model_shard(root, device, group)?;
    let model_vocab = checkpoint.config.padded_vocab_size;
    if tokenizer.vocab_size() > model_vocab {
        bail!(
            "the tokenizer has {} tokens but the checkpoint's vocabulary only {model_vocab}: give the --vocab-file / --merge-file (or --tokenizer-model) the model was trained with",
            tokenizer.vocab_size()
        );
    }
    Ok((model, checkpoint))
}
