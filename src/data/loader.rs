//! A prefetching loader: a thread prepares the next micro-batches while the model trains.

use std::sync::Arc;
use std::thread::JoinHandle;

use burn::tensor::{Device, Int, Tensor, TensorData};
use crossbeam_channel::{bounded, Receiver};

use crate::data::{SampleDataset, SampleMasks};
use crate::model::Documents;
use crate::parallel::context::{context_rows, context_slice};

/// One micro-batch on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct MicroBatch {
    /// Input ids, `[batch × seq]` row-major.
    pub tokens: Vec<u32>,
    /// Target ids.
    pub labels: Vec<u32>,
    /// Loss mask.
    pub loss_mask: Vec<f32>,
    /// Each token's position in its document (`--reset-position-ids`).
    pub positions: Option<Vec<u32>>,
    /// Each token's first visible key (`--reset-attention-mask`).
    pub first_keys: Option<Vec<u32>>,
    /// Samples in the batch.
    pub batch_size: usize,
    /// Tokens per sample.
    pub seq_length: usize,
    /// Where the batch holds a context-parallel rank's part of each sequence: the whole
    /// micro-batch's `Σ loss mask`, which this rank's `Σ loss · mask` is divided by, so that
    /// the ranks' losses sum to the micro-batch's (`None`: whole sequences, the masked mean).
    pub loss_normalizer: Option<f64>,
}

/// Which tokens of each sequence a rank reads: all of them, or context-parallel rank `rank`'s
/// two chunks of `size` ([`crate::parallel::context`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SequencePart {
    /// Ranks each sequence is split over (1: whole sequences).
    pub size: usize,
    /// This rank's place among them.
    pub rank: usize,
}

impl SequencePart {
    /// Whole sequences.
    pub const WHOLE: Self = Self { size: 1, rank: 0 };
}

impl MicroBatch {
    /// Samples `start..start + batch_size` of `dataset` (wrapping around its end), with the
    /// masks and positions `masks` asks for.
    pub fn from_dataset(
        dataset: &dyn SampleDataset,
        start: u64,
        batch_size: usize,
        masks: &SampleMasks,
    ) -> Self {
        let mut out = MicroBatch {
            tokens: vec![],
            labels: vec![],
            loss_mask: vec![],
            positions: masks.reset_position_ids.then(Vec::new),
            first_keys: masks.reset_attention_mask.then(Vec::new),
            batch_size,
            seq_length: 0,
            loss_normalizer: None,
        };
        for i in 0..batch_size as u64 {
            let s = dataset.sample(((start + i) % dataset.len() as u64) as usize, masks);
            out.seq_length = s.tokens.len();
            out.tokens.extend(s.tokens);
            out.labels.extend(s.labels);
            out.loss_mask.extend(s.loss_mask);
            for (all, mine) in [
                (&mut out.positions, s.positions),
                (&mut out.first_keys, s.first_keys),
            ] {
                if let (Some(all), Some(mine)) = (all.as_mut(), mine) {
                    all.extend(mine);
                }
            }
        }
        out
    }

    /// The part of this batch `part` reads: its tokens, targets, positions and attention
    /// starts at those rows. Positions are always kept (those of the whole sequence where the
    /// run does not reset them), since the rows are no longer `0..seq`; attention starts
    /// keep their whole-sequence key indices.
    pub fn part(self, part: SequencePart) -> Self {
        if part.size == 1 {
            return self;
        }
        let shape = [self.batch_size, self.seq_length];
        let slice = |v: &[u32]| context_slice(v, shape, part.size, part.rank);
        let positions = match &self.positions {
            Some(reset) => slice(reset),
            None => {
                let rows = context_rows(part.size, part.rank, self.seq_length);
                let rows: Vec<u32> = rows.into_iter().map(|p| p as u32).collect();
                rows.repeat(self.batch_size)
            }
        };
        Self {
            tokens: slice(&self.tokens),
            labels: slice(&self.labels),
            loss_mask: context_slice(&self.loss_mask, shape, part.size, part.rank),
            positions: Some(positions),
            first_keys: self.first_keys.as_deref().map(slice),
            batch_size: self.batch_size,
            seq_length: self.seq_length / part.size,
            loss_normalizer: Some(self.loss_mask.iter().map(|&m| m as f64).sum()),
        }
    }

    /// What `reads` of the batch uploaded to `device`.
    pub fn to_device(&self, device: &Device, reads: BatchReads) -> DeviceBatch {
        let shape = [self.batch_size, self.seq_length];
        let ids = |ids: &[u32]| {
            let ids: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
            Tensor::from_data(TensorData::new(ids, shape), device)
        };
        // Every stage's attention reads the documents, and the first stage's embedding and
        // every stage's rotary embedding their positions.
        let documents = Documents {
            positions: self.positions.as_deref().map(ids),
            first_keys: self.first_keys.as_deref().map(ids),
        };
        DeviceBatch {
            tokens: reads.tokens.then(|| ids(&self.tokens)),
            documents,
            targets: reads.targets.then(|| DeviceTargets {
                labels: ids(&self.labels),
                loss_mask: Tensor::from_data(
                    TensorData::new(self.loss_mask.clone(), shape),
                    device,
                ),
                loss_normalizer: self.loss_normalizer,
            }),
        }
    }
}

/// Which of a micro-batch's inputs a pipeline rank reads: the tokens where it holds the first
/// stage, the targets where it holds the last (as Megatron's `get_batch` hands them out), so a
/// middle stage uploads nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchReads {
    /// The input ids.
    pub tokens: bool,
    /// The target ids and the loss mask.
    pub targets: bool,
}

impl BatchReads {
    /// Every input (one stage holds the whole model).
    pub const ALL: Self = Self {
        tokens: true,
        targets: true,
    };
}

/// One micro-batch's inputs on the device, those its rank reads: what a step reads. Who put
/// them there is the caller's business (an eager step uploads each step's batch; a captured
/// step writes it into the tensors its graph reads), so the step runs the same either way.
#[derive(Clone)]
pub struct DeviceBatch {
    /// Input ids `[batch, seq]`, on the rank holding the first stage.
    pub tokens: Option<Tensor<2, Int>>,
    /// Target ids and loss mask, on the rank holding the last stage.
    pub targets: Option<DeviceTargets>,
    /// The packed documents' positions and attention starts, on every rank.
    pub documents: Documents,
}

/// A micro-batch's targets on the device.
#[derive(Clone)]
pub struct DeviceTargets {
    /// Target ids `[batch, seq]`.
    pub labels: Tensor<2, Int>,
    /// Loss mask.
    pub loss_mask: Tensor<2>,
    /// What this rank's masked loss sum is divided by, where it holds part of each sequence
    /// ([`MicroBatch::loss_normalizer`]).
    pub loss_normalizer: Option<f64>,
}

/// Micro-batches from a starting sample, every `stride` samples, prepared ahead on a thread.
///
/// A data-parallel rank starts at its own slice of the first global batch and strides over
/// the other ranks' slices, as Megatron's `MegatronPretrainingSampler` hands them out.
pub struct BatchLoader {
    receiver: Option<Receiver<MicroBatch>>,
    thread: Option<JoinHandle<()>>,
}

impl BatchLoader {
    /// Starts loading micro-batches of `batch_size` from sample `start`, the next one
    /// `stride` samples further, `prefetch` ahead, with what `masks` asks for, each the
    /// `part` of its sequences this rank reads.
    pub fn new(
        dataset: Arc<dyn SampleDataset>,
        start: u64,
        stride: u64,
        batch_size: usize,
        (masks, part): (SampleMasks, SequencePart),
        prefetch: usize,
    ) -> Self {
        let (sender, receiver) = bounded(prefetch.max(1));
        let thread = std::thread::spawn(move || {
            let mut next = start;
            loop {
                let batch =
                    MicroBatch::from_dataset(dataset.as_ref(), next, batch_size, &masks).part(part);
                next += stride;
                if sender.send(batch).is_err() {
                    return;
                }
            }
        });
        Self {
            receiver: Some(receiver),
            thread: Some(thread),
        }
    }

    /// The next micro-batch.
    pub fn next_batch(&self) -> MicroBatch {
        self.receiver
            .as_ref()
            .and_then(|r| r.recv().ok())
            .expect("the loader thread stopped")
    }
}

impl Drop for BatchLoader {
    fn drop(&mut self) {
        // Closing the channel ends the thread at its next send.
        self.receiver.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
