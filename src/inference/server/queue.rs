//! The server's one model and its queue: requests wait in a bounded queue, and a single worker
//! takes everything waiting (up to a number of rows) and decodes it as one batch, so concurrent
//! clients share forward passes instead of each holding a model.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;

use burn::tensor::{Device, TensorData};
use serde::{Deserialize, Serialize};

use crate::comm::Group;
use crate::inference::batch_generate::{generate_batch, BatchRow};
use crate::inference::next_token_scores::{score_rows, OutputColumns};
use crate::inference::sampling::{Sampler, SamplingConfig};
use crate::model::Gpt;

/// One prompt to continue.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Completion {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingConfig,
}

/// What came of a [`Completion`].
#[derive(Clone, Debug, Default)]
pub struct Completed {
    /// The new tokens, without the end-of-document token that stopped them.
    pub tokens: Vec<u32>,
    /// Whether the end-of-document token stopped them (rather than the length limit).
    pub stopped: bool,
    /// `log P(t[j + 1] | t[..=j])` over `t = prompt + tokens`, when asked for.
    pub log_probs: Option<Vec<f64>>,
}

/// A request's prompts, and where its answer goes.
struct Job {
    completions: Vec<Completion>,
    log_probs: bool,
    reply: SyncSender<Result<Vec<Completed>, String>>,
}

/// The handle request threads use.
#[derive(Clone)]
pub struct Queue {
    jobs: SyncSender<Job>,
}

/// Why a request was not answered.
#[derive(Debug)]
pub enum QueueError {
    /// The queue is full: try again later (HTTP 503).
    Full,
    /// The model could not do it (HTTP 400 with the message), or the worker is gone (500).
    Failed(String),
}

/// The worker's fixed settings.
pub struct Worker {
    pub model: Gpt,
    pub device: Device,
    pub vocab_size: usize,
    pub stop_token: Option<u32>,
    /// Rows decoded together at most.
    pub max_batch_rows: usize,
    /// The tensor-parallel group the model is split over: its rank 0 runs the worker and
    /// announces every batch; the other ranks [`Worker::follow`] and decode the same batches on
    /// their shards (Megatron's server does the same with `send_do_generate`).
    pub group: Group,
}

/// What rank 0 tells the other ranks before each decode.
#[derive(Serialize, Deserialize)]
struct BatchMessage {
    completions: Vec<Completion>,
    log_probs: bool,
}

impl Queue {
    /// Starts the worker thread; it ends when every `Queue` clone is dropped.
    pub fn start(worker: Worker, capacity: usize) -> (Queue, JoinHandle<()>) {
        let (jobs, waiting) = sync_channel::<Job>(capacity);
        let handle = std::thread::spawn(move || worker.run(waiting));
        (Queue { jobs }, handle)
    }

    /// Queues `completions` and waits for their answer.
    pub fn complete(
        &self,
        completions: Vec<Completion>,
        log_probs: bool,
    ) -> Result<Vec<Completed>, QueueError> {
        let (reply, answer) = sync_channel(1);
        let job = Job {
            completions,
            log_probs,
            reply,
        };
        match self.jobs.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(QueueError::Full),
            Err(TrySendError::Disconnected(_)) => {
                return Err(QueueError::Failed("the model worker has stopped".into()))
            }
        }
        answer
            .recv()
            .map_err(|_| QueueError::Failed("the model worker has stopped".into()))?
            .map_err(QueueError::Failed)
    }
}

impl Worker {
    fn run(self, waiting: Receiver<Job>) {
        self.serve_jobs(waiting);
        if self.group.size() > 1 {
            // The followers end with the worker (nothing to do if they are already gone).
            let _ = announce(&self.group, None);
        }
    }

    /// On the tensor-parallel ranks other than 0: decodes every batch rank 0 announces, until
    /// it announces the end.
    pub fn follow(&self) -> Result<(), String> {
        while let Some(message) = receive(&self.group)? {
            let completions: Vec<&Completion> = message.completions.iter().collect();
            // Rank 0 gets the same outcome and answers its clients.
            let _ = self.decode_here(&completions, message.log_probs);
        }
        Ok(())
    }

    fn serve_jobs(&self, waiting: Receiver<Job>) {
        while let Ok(first) = waiting.recv() {
            let mut batch = vec![first];
            let mut rows = batch[0].completions.len();
            while rows < self.max_batch_rows {
                match waiting.try_recv() {
                    Ok(job) => {
                        rows += job.completions.len();
                        batch.push(job);
                    }
                    Err(_) => break,
                }
            }
            self.answer(batch);
        }
    }

    /// Decodes every job's prompts as one batch and replies to each job. If the batch fails,
    /// each job is tried alone, so that one request's failure is only its own.
    fn answer(&self, batch: Vec<Job>) {
        let all: Vec<&Completion> = batch.iter().flat_map(|j| &j.completions).collect();
        let result = self.decode(&all, batch.iter().any(|j| j.log_probs));
        if result.is_err() && batch.len() > 1 {
            batch.into_iter().for_each(|job| self.answer(vec![job]));
            return;
        }
        let mut offset = 0;
        for job in batch {
            let n = job.completions.len();
            let answer = result.as_ref().map_err(Clone::clone).map(|done| {
                let mut mine = done[offset..offset + n].to_vec();
                if !job.log_probs {
                    mine.iter_mut().for_each(|c| c.log_probs = None);
                }
                mine
            });
            offset += n;
            let _ = job.reply.send(answer);
        }
    }

    fn decode(&self, all: &[&Completion], log_probs: bool) -> Result<Vec<Completed>, String> {
        if self.group.size() > 1 {
            let message = BatchMessage {
                completions: all.iter().map(|&c| c.clone()).collect(),
                log_probs,
            };
            announce(&self.group, Some(&message))?;
        }
        self.decode_here(all, log_probs)
    }

    fn decode_here(&self, all: &[&Completion], log_probs: bool) -> Result<Vec<Completed>, String> {
        let mut rows: Vec<BatchRow> = all
            .iter()
            .map(|c| BatchRow {
                prompt: c.prompt.clone(),
                max_new_tokens: c.max_new_tokens,
                sampler: Sampler::new(c.sampling.clone()),
            })
            .collect();
        let generations = generate_batch(
            &self.model,
            &mut rows,
            self.stop_token,
            self.vocab_size,
            &self.device,
        )?;
        let mut done: Vec<Completed> = generations
            .into_iter()
            .map(|g| {
                let stopped =
                    self.stop_token.is_some() && g.tokens.last() == self.stop_token.as_ref();
                let mut tokens = g.tokens;
                if stopped {
                    tokens.pop();
                }
                Completed {
                    tokens,
                    stopped,
                    log_probs: None,
                }
            })
            .collect();
        if log_probs {
            let sequences: Vec<Vec<u32>> = all
                .iter()
                .zip(&done)
                .map(|(c, d)| [c.prompt.as_slice(), &d.tokens].concat())
                .collect();
            let columns = OutputColumns::Real(self.vocab_size);
            let scores = score_rows(&self.model, &sequences, columns, 8, &self.device)?;
            for (d, s) in done.iter_mut().zip(scores) {
                d.log_probs = Some(s.log_probs);
            }
        }
        Ok(done)
    }
}

/// Broadcasts a batch (or, `None`, the end) from rank 0: its length, then its JSON bytes.
fn announce(group: &Group, message: Option<&BatchMessage>) -> Result<(), String> {
    let bytes = match message {
        Some(m) => serde_json::to_vec(m).map_err(|e| e.to_string())?,
        None => Vec::new(),
    };
    broadcast_bytes(group, bytes).map(|_| ())
}

/// The batch rank 0 announces, or `None` at the end.
fn receive(group: &Group) -> Result<Option<BatchMessage>, String> {
    let bytes = broadcast_bytes(group, Vec::new())?;
    if bytes.is_empty() {
        return Ok(None);
    }
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| e.to_string())
}

/// Rank 0's bytes on every rank (the others pass anything): the length first, so that every
/// rank broadcasts a buffer of the same shape.
fn broadcast_bytes(group: &Group, bytes: Vec<u8>) -> Result<Vec<u8>, String> {
    let failed = |e: crate::comm::CommError| format!("tensor-parallel broadcast: {e}");
    let length = TensorData::new(vec![bytes.len() as i64], [1]);
    let length = group.broadcast(length, 0).map_err(failed)?;
    let n = length.try_to_vec::<i64>().map_err(|e| format!("{e:?}"))?[0] as usize;
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut values: Vec<i32> = bytes.into_iter().map(i32::from).collect();
    values.resize(n, 0);
    let data = group
        .broadcast(TensorData::new(values, [n]), 0)
        .map_err(failed)?;
    let values = data.try_to_vec::<i32>().map_err(|e| format!("{e:?}"))?;
    Ok(values.into_iter().map(|v| v as u8).collect())
}
