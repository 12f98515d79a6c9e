//! Training steps captured as one graph and replayed (Megatron's `--cuda-graph-impl local
//! --cuda-graph-scope full_iteration`): on a GPU the eager step is bound by the host's cost
//! per kernel launch (a step's launches cost the host more than the GPU's work; measured:
//! benchmarks/results/2026-11-26-h200-gpu-profile.md), and a replayed
//! step costs the host one graph launch and a few small writes.
//!
//! A step is captured with CubeCL's graph capture after warm-up steps, and every later step
//! replays it. A replay runs none of the step's host code, so everything that changes from
//! step to step reaches its kernels through device memory written before the replay: the
//! batch (into the resident input tensors the step reads), the dropout salt, and the
//! optimizer's learning rates and bias corrections; the step's report is read after it.
//!
//! A step is captured where it runs on one rank with a fixed number of micro-batches (all of
//! them in the one graph, each reading its own resident inputs and dropout salt), the
//! flat-buffer Adam on a CubeCL device without a loss scaler, and on CUDA with cuBLAS's
//! products ordered on the device (the default): the graph holds CubeCL's side of each
//! product's ordering, and the host queues the recorded products on cuBLAS's stream after each
//! replay (`crate::util::cublas`); elsewhere the run says why and steps eagerly.

use anyhow::{bail, Result};
use burn::tensor::Device;

use super::batch_size_schedule::BatchSizeSchedule;
use super::config::{BatchPlan, PretrainConfig};
use super::setup::RankSetup;
use super::train_step::{report_step, run_step, StepOutputs, StepReport};
use crate::data::loader::{BatchReads, DeviceBatch, MicroBatch};
use crate::optim::LearningRates;
use crate::parallel::state::ParallelState;

/// Captures and replays the training step (see the module's doc).
pub struct StepGraph {
    warmup_steps: u64,
    steps: u64,
    /// Steps run by replaying the captured graph (the captured one included).
    replayed: u64,
    /// One set of inputs per micro-batch of the step.
    resident: Vec<DeviceBatch>,
    captured: Option<Captured>,
}

/// The captured step: its graph and what it leaves to report, in buffers every replay
/// rewrites.
struct Captured {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    graph: crate::util::graph::CapturedGraph,
    outputs: StepOutputs,
}

impl StepGraph {
    /// The step graph of `--cuda-graph-impl local --cuda-graph-scope full_iteration`
    /// (`--cuda-graph-warmup-steps` eager steps before the capture), or why this run's steps
    /// cannot be captured.
    pub fn new(
        cfg: &PretrainConfig,
        parallel: &ParallelState,
        setup: &RankSetup,
        device: &Device,
    ) -> std::result::Result<Self, String> {
        let Some(warmup_steps) = cfg.cuda_graph_warmup_steps else {
            return Err("not asked for".into());
        };
        let layout = parallel.layout;
        if layout.world() > 1 {
            return Err("one rank only (the step's collectives run on the host)".into());
        }
        if !matches!(cfg.batch_size_schedule, BatchSizeSchedule::Constant) {
            return Err(
                "a fixed global batch size only (the step's micro-batches are fixed)".into(),
            );
        }
        if cfg.log_options.num_zeros_in_grad {
            return Err("--log-num-zeros-in-grad counts on the host inside the step".into());
        }
        if !setup.optimizer.replayable() {
            return Err(
                "the flat-buffer Adam on a CubeCL device without a loss scaler only (fp16's \
                 scaler reads the gradients' norm on the host)"
                    .into(),
            );
        }
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        let cube = crate::util::device::is_cube(device);
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        let cube = {
            let _ = device;
            false
        };
        if !cube {
            return Err("a CubeCL device only".into());
        }
        #[cfg(feature = "cuda")]
        if crate::util::matmul::uses_cublas(device) && !crate::util::cublas::capturable() {
            return Err(
                "cuBLAS's products ordered by the host (--cublas-ordering host) cannot be \
                 replayed: a replay does not come back to the host between products"
                    .into(),
            );
        }
        Ok(Self {
            warmup_steps: warmup_steps.max(1),
            steps: 0,
            replayed: 0,
            resident: Vec::new(),
            captured: None,
        })
    }

    /// One training step: eager during the warm-up, then captured once, then replayed.
    pub fn step(
        &mut self,
        cfg: &PretrainConfig,
        setup: &mut RankSetup,
        (parallel, plan): (&ParallelState, BatchPlan),
        batches: Vec<MicroBatch>,
        (iteration, lr): (u64, LearningRates),
        device: &Device,
    ) -> Result<StepReport> {
        self.steps += 1;
        self.write_batches(&batches, device)?;
        if let Some(captured) = &self.captured {
            prepare_replay(cfg, setup, plan, (iteration, lr), device);
            captured.replay()?;
            self.replayed += 1;
            setup.optimizer.count_replayed_step();
            return report_step(captured.outputs.clone(), setup, (parallel, plan));
        }
        let step = (iteration, lr);
        let run = |setup: &mut RankSetup| {
            run_step(cfg, setup, (parallel, plan), &self.resident, step, device)
        };
        if self.steps <= self.warmup_steps {
            if self.steps == self.warmup_steps {
                // The last warm-up step sizes the pools the recording allocates from.
                Captured::prepare(device)?;
            }
            let outputs = run(setup)?;
            return report_step(outputs, setup, (parallel, plan));
        }
        prepare_replay(cfg, setup, plan, step, device);
        let captured = Captured::record(device, || run(setup))?;
        captured.replay()?;
        self.replayed += 1;
        println!(
            " captured the training step at iteration {iteration}: later iterations replay it"
        );
        let report = report_step(captured.outputs.clone(), setup, (parallel, plan));
        self.captured = Some(captured);
        report
    }

    /// Steps run by replaying the captured graph (the captured one included).
    pub fn replayed(&self) -> u64 {
        self.replayed
    }

    /// Writes the step's micro-batches into the resident inputs (creating them at the first
    /// step): one set per micro-batch, of one shape throughout.
    fn write_batches(&mut self, batches: &[MicroBatch], device: &Device) -> Result<()> {
        if self.resident.is_empty() {
            // One rank runs a captured step: it reads every input.
            let all = BatchReads::ALL;
            self.resident = batches.iter().map(|b| b.to_device(device, all)).collect();
            return Ok(());
        }
        if batches.len() != self.resident.len() {
            bail!(
                "a captured step takes {} micro-batches, not {}",
                self.resident.len(),
                batches.len()
            );
        }
        for (batch, resident) in batches.iter().zip(&self.resident) {
            let (Some(tokens), Some(targets)) = (&resident.tokens, &resident.targets) else {
                unreachable!("a captured step's inputs are uploaded whole");
            };
            let shape = [batch.batch_size, batch.seq_length];
            if tokens.dims() != shape {
                bail!(
                    "a captured step takes micro-batches of one shape: {shape:?} after {:?}",
                    tokens.dims()
                );
            }
            write_ids(tokens, &batch.tokens)?;
            write_ids(&targets.labels, &batch.labels)?;
            write_floats(&targets.loss_mask, &batch.loss_mask)?;
            let documents = &resident.documents;
            for (resident, ids) in [
                (&documents.positions, &batch.positions),
                (&documents.first_keys, &batch.first_keys),
            ] {
                if let (Some(resident), Some(ids)) = (resident, ids) {
                    write_ids(resident, ids)?;
                }
            }
        }
        Ok(())
    }
}

/// Writes what the step would write itself before it runs: each micro-batch's dropout salt
/// (tensor-parallel rank 0: the step runs on one rank) and the optimizer's per-step values.
fn prepare_replay(
    cfg: &PretrainConfig,
    setup: &RankSetup,
    plan: BatchPlan,
    (iteration, lr): (u64, LearningRates),
    device: &Device,
) {
    for k in 0..plan.micro_batches_per_rank() {
        let micro_batch = plan.global_micro_batch(k);
        crate::parallel::random::seed_micro_batch(cfg.seed, iteration, micro_batch);
        write_dropout_salt(device);
    }
    setup.optimizer.write_next_step_values(lr);
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod device {
    //! The CubeCL side: the device's client, the capture, and writes into tensors.

    use anyhow::{anyhow, Context, Result};
    use burn::tensor::{DType, Device, Int, Tensor};
    use burn_cubecl::cubecl::bytes::Bytes;
    use burn_cubecl::cubecl::client::Client;
    use burn_cubecl::tensor::CubeTensor;
    use burn_cubecl::CubeBackend;

    use super::{Captured, StepOutputs};
    use crate::util::graph::CapturedGraph;

    /// The CubeCL client of `device` (the stream of this thread).
    fn client(device: &Device) -> Result<Client> {
        crate::util::device::cube_client(device).ok_or_else(|| anyhow!("not a CubeCL device"))
    }

    impl Captured {
        /// Readies the device's stream for a capture: the next step is the warm-up whose
        /// allocations the recording reuses.
        pub(super) fn prepare(device: &Device) -> Result<()> {
            CapturedGraph::prepare(device).context("preparing the step's capture")
        }

        /// Records `step` (which runs its host code, its launches recorded, not executed).
        pub(super) fn record(
            device: &Device,
            step: impl FnOnce() -> Result<StepOutputs>,
        ) -> Result<Self> {
            let (outputs, graph) =
                CapturedGraph::record(device, step).context("starting the step's capture")?;
            let outputs = outputs.context("the captured step")?;
            let graph = graph.map_err(|e| {
                anyhow!(
                    "the training step could not be captured ({e}); run without \
                     --cuda-graph-impl"
                )
            })?;
            Ok(Self { graph, outputs })
        }

        /// Runs the captured step again on the device.
        pub(super) fn replay(&self) -> Result<()> {
            // SAFETY: every buffer the graph reads or writes stays allocated: the model's
            // and the optimizer's buffers (updated in place), the resident inputs and the
            // outputs held in `self`; what runs between replays (evaluation, logging) holds
            // no buffer past its end.
            unsafe { self.graph.replay() }.context("replaying the step")
        }
    }

    /// Writes the ids into the resident id tensor `t` (its dtype's integers).
    pub(super) fn write_ids(t: &Tensor<2, Int>, ids: &[u32]) -> Result<()> {
        // Ids on an autodiff device are the inner backend's ids.
        let ids_on = t.clone();
        let cube = if ids_on.is_autodiff() {
            ids_on.try_into_primitive::<burn::backend::Autodiff<CubeBackend>>()
        } else {
            ids_on.try_into_primitive::<CubeBackend>()
        }
        .map_err(|_| anyhow!("the resident ids are not on a CubeCL device"))?;
        let bytes: Vec<u8> = match cube.dtype {
            DType::I64 => ids
                .iter()
                .flat_map(|&x| i64::from(x).to_le_bytes())
                .collect(),
            DType::I32 => ids.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
            other => return Err(anyhow!("resident ids stored as {other:?}")),
        };
        write(&cube, bytes)
    }

    /// Writes `values` into the resident f32 tensor `t`.
    pub(super) fn write_floats(t: &Tensor<2>, values: &[f32]) -> Result<()> {
        let cube = t
            .clone()
            .inner()
            .try_into_primitive::<CubeBackend>()
            .map_err(|_| anyhow!("the resident mask is not on a CubeCL device"))?;
        if cube.dtype != DType::F32 {
            return Err(anyhow!("a resident mask stored as {:?}", cube.dtype));
        }
        write(&cube, values.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    fn write(cube: &CubeTensor, bytes: Vec<u8>) -> Result<()> {
        // The bytes of the tensor's shape, from the start of its buffer (which may be larger).
        if !cube.is_contiguous() || bytes.len() as u64 > cube.handle.size_in_used() {
            return Err(anyhow!(
                "a resident input that is not one contiguous buffer"
            ));
        }
        cube.client
            .write(&cube.handle, Bytes::from_bytes_vec(bytes));
        Ok(())
    }

    /// Writes the current micro-batch's dropout salt (`parallel::random::seed_micro_batch`)
    /// where `device`'s kernels read it: what an eager step writes itself, written before a
    /// replay.
    pub fn write_dropout_salt(device: &Device) {
        if let Ok(client) = client(device) {
            let salt = crate::parallel::random::dropout_salt();
            ferrotron_kernels::launch::set_dropout_salt(&client, salt.slot, salt.value);
        }
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub use device::write_dropout_salt;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use device::{write_floats, write_ids};

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
mod device {
    //! Builds without a CubeCL backend never capture ([`super::StepGraph::new`] says so).

    use anyhow::{bail, Result};
    use burn::tensor::{Device, Int, Tensor};

    use super::{Captured, StepOutputs};

    impl Captured {
        pub(super) fn prepare(_: &Device) -> Result<()> {
            bail!("no CubeCL backend in this build")
        }
        pub(super) fn record(_: &Device, _: impl FnOnce() -> Result<StepOutputs>) -> Result<Self> {
            bail!("no CubeCL backend in this build")
        }
        pub(super) fn replay(&self) -> Result<()> {
            bail!("no CubeCL backend in this build")
        }
    }
    pub(super) fn write_ids(_: &Tensor<2, Int>, _: &[u32]) -> Result<()> {
        bail!("no CubeCL backend in this build")
    }
    pub(super) fn write_floats(_: &Tensor<2>, _: &[f32]) -> Result<()> {
        bail!("no CubeCL backend in this build")
    }
    pub fn write_dropout_salt(_: &Device) {}
}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
pub use device::write_dropout_salt;
#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
use device::{write_floats, write_ids};
