//! A stretch of this thread's device work captured once as a graph and replayed, cuBLAS's
//! products included: the one place that knows the order of the calls (see
//! `training::step_graph` for why a training step is captured).
//!
//! CubeCL records the stream's launches (`graph_prepare` before a warm-up run that sizes the
//! pools, `start_capture` / `stop_capture` around the recorded run). On CUDA, cuBLAS's
//! products run on a stream of their own, outside that recording: their side is recorded by
//! [`super::cublas::recording`] and queued after each replay, once the replay is flushed to
//! the device (its ordering kernels are in the graph).

use anyhow::{anyhow, Result};
use burn::tensor::Device;
use burn_cubecl::cubecl::client::{Client, Graph};

/// A captured graph and what replaying it takes.
pub struct CapturedGraph {
    graph: Graph,
    /// The client (this thread's stream) the graph was captured on, flushed before cuBLAS's
    /// products are queued.
    #[cfg(feature = "cuda")]
    client: Client,
    /// cuBLAS's products of the recorded run, queued after each replay.
    #[cfg(feature = "cuda")]
    products: super::cublas::RecordedWindows,
}

/// The CubeCL client of `device` (this thread's stream).
fn client(device: &Device) -> Result<Client> {
    super::device::cube_client(device).ok_or_else(|| anyhow!("not a CubeCL device"))
}

impl CapturedGraph {
    /// Readies `device`'s stream for a capture: the next run is the warm-up whose allocations
    /// the recording reuses.
    pub fn prepare(device: &Device) -> Result<()> {
        client(device)?
            .graph_prepare()
            .map_err(|e| anyhow!("preparing the capture: {e:?}"))
    }

    /// Runs `work` with its launches recorded, not executed, and returns its result with the
    /// graph (`Err` where the recording did not become one). `Err` outright where the capture
    /// could not start (`work` did not run).
    pub fn record<T>(device: &Device, work: impl FnOnce() -> T) -> Result<(T, Result<Self>)> {
        let client = client(device)?;
        #[cfg(feature = "cuda")]
        let index = super::matmul::cuda_index(device).unwrap_or(usize::MAX);
        // No host wait inside the capture, and the warm-up's pins back to the pools.
        #[cfg(feature = "cuda")]
        super::cublas::settle(index);
        client
            .start_capture()
            .map_err(|e| anyhow!("starting the capture: {e:?}"))?;
        // Taken whatever happens: a failed capture leaves no products for the next one.
        #[cfg(feature = "cuda")]
        let (result, products) = super::cublas::recording(index, work);
        #[cfg(not(feature = "cuda"))]
        let result = work();
        let graph = client
            .stop_capture()
            .map_err(|e| anyhow!("{e:?}"))
            .map(|graph| Self {
                graph,
                #[cfg(feature = "cuda")]
                client,
                #[cfg(feature = "cuda")]
                products,
            });
        Ok((result, graph))
    }

    /// Runs the recorded work again on the device.
    ///
    /// # Safety
    /// Every buffer the recorded work read or wrote must still be allocated (held by the
    /// caller, or updated in place), and nothing run since may hold one past its end.
    pub unsafe fn replay(&self) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.graph.replay() }.map_err(|e| anyhow!("replaying the graph: {e:?}"))?;
        #[cfg(feature = "cuda")]
        if !self.products.is_empty() {
            // The replay on the device before cuBLAS's stream waits for its counts (as for
            // an eager window, see `super::cublas`).
            self.client
                .flush()
                .map_err(|e| anyhow!("flushing the replay: {e:?}"))?;
            self.products
                .queue()
                .map_err(|e| anyhow!("the replay's cuBLAS products: {e}"))?;
        }
        Ok(())
    }
}
