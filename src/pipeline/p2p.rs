//! Point-to-point transfers between pipeline stages (Megatron's `p2p_communication.py`):
//! activations go forward to the next virtual stage, their gradients back to the previous.
//!
//! Each direction has a communicator of its own (two splits of the pipeline group), so the
//! activations and the gradients that cross between the same two ranks (with two ranks and
//! interleaving, both go both ways) are two ordered streams that never mix. Sends do not
//! wait for the receiver, so two stages that send to each other and then receive (1F1B's
//! steady state) cannot deadlock.

use std::sync::Arc;

use burn::tensor::TensorData;

use crate::comm::{CommError, Communicator, Expect, Group};

/// One pipeline rank's links to its neighbours.
#[derive(Debug)]
pub struct PipelineP2p {
    forward: Option<Arc<dyn Communicator>>,
    backward: Option<Arc<dyn Communicator>>,
    rank: usize,
    size: usize,
    chunks: usize,
    /// Shape and dtype of an activation (and of its gradient).
    expect: Expect,
}

impl PipelineP2p {
    /// Links over `pipeline` (every rank of it calls this) for `chunks` model chunks per rank,
    /// exchanging activations of shape and dtype `expect`.
    pub fn new(pipeline: &Group, chunks: usize, expect: Expect) -> Result<Self, CommError> {
        let (rank, size) = (pipeline.rank(), pipeline.size());
        let (forward, backward) = match pipeline.communicator() {
            Some(comm) => (Some(comm.split(0, rank)?), Some(comm.split(0, rank)?)),
            None => (None, None),
        };
        Ok(Self {
            forward,
            backward,
            rank,
            size,
            chunks,
            expect,
        })
    }

    /// This rank's virtual stage for model chunk `chunk` (`chunk · PP + rank`).
    pub fn virtual_stage(&self, chunk: usize) -> usize {
        chunk * self.size + self.rank
    }

    /// Whether `chunk` is the model's first virtual stage (it embeds the tokens).
    pub fn is_first(&self, chunk: usize) -> bool {
        self.virtual_stage(chunk) == 0
    }

    /// Whether this rank holds the model's first virtual stage (it reads the tokens).
    pub fn holds_first(&self) -> bool {
        (0..self.chunks).any(|chunk| self.is_first(chunk))
    }

    /// Whether this rank holds the model's last virtual stage (it reads the targets).
    pub fn holds_last(&self) -> bool {
        (0..self.chunks).any(|chunk| self.is_last(chunk))
    }

    /// Whether `chunk` is the model's last virtual stage (it computes the loss).
    pub fn is_last(&self, chunk: usize) -> bool {
        self.virtual_stage(chunk) + 1 == self.size * self.chunks
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.size
    }

    fn previous(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    fn link(comm: &Option<Arc<dyn Communicator>>) -> Result<&Arc<dyn Communicator>, CommError> {
        comm.as_ref().ok_or_else(|| {
            CommError::Invalid("one pipeline stage has no neighbour to talk to".into())
        })
    }

    /// Receives chunk's input activation from the previous virtual stage.
    pub fn recv_forward(&self) -> Result<TensorData, CommError> {
        Self::link(&self.forward)?.recv(&self.expect, self.previous())
    }

    /// Sends a chunk's output activation to the next virtual stage.
    pub fn send_forward(&self, activation: TensorData) -> Result<(), CommError> {
        Self::link(&self.forward)?.send(activation, self.next())
    }

    /// Receives the gradient of a chunk's output from the next virtual stage.
    pub fn recv_backward(&self) -> Result<TensorData, CommError> {
        Self::link(&self.backward)?.recv(&self.expect, self.next())
    }

    /// Sends the gradient of a chunk's input to the previous virtual stage.
    pub fn send_backward(&self, gradient: TensorData) -> Result<(), CommError> {
        Self::link(&self.backward)?.send(gradient, self.previous())
    }
}
