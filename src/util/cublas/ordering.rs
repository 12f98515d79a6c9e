//! How cuBLAS's stream is ordered against CubeCL's, window by window, and how a captured
//! step's products are recorded and queued after each replay.
//!
//! cuBLAS runs on a stream of its own (CubeCL does not lend its stream), ordered against
//! CubeCL's on the device: a CubeCL kernel counts a window once its operands are written, the
//! cuBLAS stream waits for that count (`cuStreamWaitValue32`), computes, and writes the count
//! to a second counter that a CubeCL kernel waits for before anything after the products runs
//! (`ferrotron_kernels::stream_order`). That makes the step faster than the host waiting for
//! each stream in turn (two waits per window, `--cublas-ordering host`, also the fallback where
//! a driver refuses stream memory operations), which leaves the GPU idle at each wait
//! (measured: benchmarks/results/2026-11-27-h200-device-order.md). CubeCL launches through a
//! runner thread, so the counting kernel is flushed to the device before cuBLAS's stream is
//! made to wait for it: a first version without that flush hung on a GPU (a device-wide wait in
//! the runner, queued before the kernel, waited for cuBLAS's stream, which waited for the
//! kernel). Both streams are in the device's primary context (CubeCL's and cudarc's), so the
//! device pointers are valid in either. Each thread's CubeCL stream has its own pair of
//! counters: the ranks of a threaded tensor-parallel run may share a GPU, and with one pair a
//! stream's count could release another stream's products.
//!
//! Who queues cuBLAS's side of a window: CubeCL's device thread, as a task queued
//! between the window's count and its wait (`util::device_thread`). The flush and the operands'
//! device addresses are then answers the server gives there, in order, where the thread making
//! the products had to wait for each (a flush and three lookups per product, each until the
//! device thread had run everything queued before it; how many per step:
//! benchmarks/results/2026-12-03-figures-from-comments.md): the two
//! threads took turns where they now overlap. Queued from the building thread, the step was
//! bound by the host, not the GPU, which is what this is for (measured before:
//! benchmarks/results/2026-11-27-h200-device-order.md; after:
//! benchmarks/results/2026-11-30-h200-device-thread.md, which also measured the building
//! thread's way at the same speed and a higher peak, so it was deleted).
//!
//! A captured step (`src/training/step_graph.rs`) records CubeCL's side of each window (the
//! two ordering kernels) into its graph and cuBLAS's side here ([`RecordedWindows`]: the
//! products' shapes and device addresses); after each replay the host queues the recorded
//! products on cuBLAS's stream, each window waiting for its count. The kernels compare the
//! counters with each other, not with a count baked into a launch, so every replay orders
//! itself. The addresses stay valid because the graph guards every page its launches touch,
//! and every operand and result of a product is touched by one: the results by the wait
//! kernel, the operands by the kernels that wrote them in the step (or, for weights, by the
//! step's update).
//!
//! Either way the ordering is per window, not per product: a backward pass's two gradient
//! products, which read the same output gradient and not each other's results, share one
//! ([`matmul_independent`]), so a step has about two products per window (GPT-2 345M's count:
//! benchmarks/results/2026-12-03-figures-from-comments.md); the
//! composed attention core's backward runs its three last products in one.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use burn::backend::Backend as _;
use burn::tensor::DType;
use burn_cubecl::cubecl::device_handle::DeviceHandle;
use burn_cubecl::cubecl::server::{Handle, Server as _, ServerStorage as _};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use cudarc::cublas::{result, sys};
use cudarc::driver::sys as driver;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use ferrotron_kernels::half::{bf16, f16};
use ferrotron_kernels::launch as kernels;

use super::gemm::{gemm, GemmShape, Operand, Product};
use super::{cuda_index, env_choice, env_count, CudaServer, Planned};
use crate::util::product_plan::CublasOrdering;

/// One cuBLAS handle and the stream it runs on, for one GPU, and what orders that stream
/// against CubeCL's.
struct Blas {
    context: Arc<CudaContext>,
    /// cuBLAS's handle and stream: used by the thread making the products (host ordering,
    /// replays) or by CubeCL's device thread ([`Order::DeviceThread`]).
    side: Arc<Mutex<CublasSide>>,
    /// CubeCL's device thread for this GPU, where [`Order::DeviceThread`] queues cuBLAS's side
    /// of each window.
    device_thread: Option<DeviceHandle<CudaServer>>,
    /// The ordering counters of each thread's CubeCL stream (one stream per thread: the
    /// threads of a tensor-parallel run may share a GPU, and one pair of counters for two
    /// streams would let one stream's count release the other's products).
    counters: HashMap<std::thread::ThreadId, Counters>,
    /// How the two streams are ordered (host ordering where the driver refuses the device's).
    order: Order,
    /// cuBLAS's side of the windows of a step being captured, in order.
    recorded: Vec<RecordedWindow>,
}

/// cuBLAS's handle and stream, and what its queued products hold.
struct CublasSide {
    stream: Arc<CudaStream>,
    handle: sys::cublasHandle_t,
    /// The operands and results of each window cuBLAS may still be running, oldest first,
    /// pinned in place until the event recorded on its stream after the window has passed
    /// ([`Release::AtEvent`], and another stream's buffers: [`Pins::far`]).
    /// Why per window: unpinned only once the whole stream was idle, they stayed held for
    /// about a step, since with the step queued ahead of the GPU a wait is always pending on
    /// cuBLAS's stream; per window the peak falls, though not to host ordering's, which holds
    /// none (measured: benchmarks/results/2026-11-30-h200-device-thread.md).
    in_flight: VecDeque<(CudaEvent, Box<dyn Send>)>,
    /// Events of windows that have passed, to be recorded again.
    spare_events: Vec<CudaEvent>,
    /// With [`Release::AtWait`]: the pins of each CubeCL stream's last window on buffers in
    /// that stream's memory ([`Pins::near`]), held until the stream's next window is queued
    /// here. By then the window's wait kernel is on the stream (the thread making the products
    /// queues it before its next window), and everything that could reuse the buffers runs
    /// after it, hence after cuBLAS's products. By the stream's id (`StreamId::value`).
    until_next_window: HashMap<u64, Box<dyn Send>>,
    /// The first failure of a window queued by CubeCL's device thread, for the thread making
    /// the products to report at its next window (a task of the device thread has no caller
    /// to return it to).
    failure: Option<String>,
}

// The handle is used by one thread at a time: every use goes through the mutex around it.
unsafe impl Send for CublasSide {}

/// How cuBLAS's stream is ordered against CubeCL's (`--cublas-ordering`, or host ordering
/// where the device's cannot run).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Order {
    /// `host`: the host waits for CubeCL's stream before each window's products and for
    /// cuBLAS's after them (two waits per window).
    Host,
    /// `device`, the default: the device orders the streams, and CubeCL's device thread
    /// queues cuBLAS's side as a task after the window's count, so the thread making the
    /// products waits for nothing (see the module's doc).
    DeviceThread,
}

/// When a window's pinned buffers are let go (`FERROTRON_CUBLAS_RELEASE`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Release {
    /// `event`, the default: once an event recorded on cuBLAS's stream after the window has
    /// passed (the peak stays above host ordering's: with the step queued ahead of the GPU,
    /// every window queued ahead stays pinned until the GPU reaches it; measured:
    /// benchmarks/results/2026-11-30-h200-device-thread.md).
    AtEvent,
    /// `wait`: the buffers in the memory of the CubeCL stream the window is waited on go once
    /// its wait kernel is queued there (other streams' buffers as `event`). CubeCL reuses a
    /// stream's memory only for that stream's later work (CubeCL 0.11's CUDA server: a pool
    /// per stream), which runs after the wait, i.e. after cuBLAS's products; a buffer of
    /// another stream could be reused by work not ordered after the wait. Not measured on a
    /// GPU yet.
    AtWait,
}

/// When windows' pins are to be let go (`FERROTRON_CUBLAS_RELEASE`: `event`, the default, or
/// `wait`).
fn release_asked() -> Release {
    static RELEASE: OnceLock<Release> = OnceLock::new();
    *RELEASE.get_or_init(|| {
        env_choice(
            "FERROTRON_CUBLAS_RELEASE",
            &[("event", Release::AtEvent), ("wait", Release::AtWait)],
            Release::AtEvent,
            "a window's buffers are let go once cuBLAS has run it",
        )
    })
}

/// How many windows' [`Pins::far`] may be held before the thread queuing the next waits for the
/// oldest to pass on the GPU (`FERROTRON_CUBLAS_HELD`, default 256): how far, in windows,
/// cuBLAS's products may be queued ahead of the GPU while holding their buffers. Lower, fewer
/// buffers are held (a GPT-2 345M step has 290 windows, so 256 hold about a step's products,
/// well above host ordering's peak, which holds none:
/// benchmarks/results/2026-11-30-h200-device-thread.md), and the thread queuing the step
/// (CubeCL's device thread by default, which also launches CubeCL's kernels) waits once the GPU
/// is that many windows behind. Not measured on a GPU yet.
fn held_limit() -> usize {
    static HELD: OnceLock<usize> = OnceLock::new();
    *HELD.get_or_init(|| {
        env_count(
            "FERROTRON_CUBLAS_HELD",
            256,
            "up to 256 windows' buffers are held",
        )
    })
}

/// The two `u32` counters ordering one CubeCL stream against cuBLAS's: `[0]` counted on
/// CubeCL's stream before a window, `[1]` written on cuBLAS's after it.
struct Counters {
    flags: Handle,
    /// Their device address (the allocation is pinned for the process).
    address: u64,
    /// Windows counted on the CubeCL stream so far (wrapping), eager and replayed: the value
    /// the next window's count follows.
    windows: u32,
}

impl Counters {
    /// A pair at zero on `like`'s stream (this thread's).
    fn new(like: &CubeTensor) -> Result<Self, String> {
        let flags = like.client.create_from_slice(&[0u8; 8]);
        let pinned = like
            .client
            .get_resource::<CudaServer>(flags.clone())
            .map_err(|e| format!("the counters' address: {e:?}"))?;
        let address = pinned.resource().ptr;
        // Pinned for the process: cuBLAS's stream keeps reading and writing the counters.
        std::mem::forget(pinned);
        Ok(Self {
            flags,
            address,
            windows: 0,
        })
    }

    /// Queues a window's count on `client_of`'s stream (this thread's), to run once the work
    /// queued before it has; returns where cuBLAS's stream waits for it: the counters'
    /// address and the count.
    fn count(&mut self, client_of: &CubeTensor) -> (u64, u32) {
        kernels::signal(&client_of.client, &self.flags);
        self.next_window()
    }

    /// The next window's count (the kernel counting it queued by the caller, or replayed),
    /// with the counters' address: where cuBLAS's stream waits for it.
    fn next_window(&mut self) -> (u64, u32) {
        self.windows = self.windows.wrapping_add(1);
        (self.address, self.windows)
    }
}

/// cuBLAS's side of one ordering window of a captured step: its products.
#[derive(Clone)]
struct RecordedWindow {
    products: Vec<Product>,
}

/// The cuBLAS products of a captured step, window by window, to be queued after each replay
/// of its graph ([`RecordedWindows::queue`]).
pub struct RecordedWindows {
    index: usize,
    windows: Vec<RecordedWindow>,
}

/// The handles, by GPU index; `None` once cuBLAS failed to start on that GPU.
fn handles() -> &'static Mutex<HashMap<usize, Option<Blas>>> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, Option<Blas>>>> = OnceLock::new();
    HANDLES.get_or_init(Default::default)
}

fn start(like: &CubeTensor, index: usize) -> Result<Blas, String> {
    let context = CudaContext::new(index).map_err(|e| format!("CUDA device {index}: {e}"))?;
    let stream = context
        .new_stream()
        .map_err(|e| format!("CUDA stream: {e}"))?;
    context
        .bind_to_thread()
        .map_err(|e| format!("CUDA context: {e}"))?;
    let handle = result::create_handle().map_err(|e| format!("cublasCreate: {e:?}"))?;
    // SAFETY: a live handle and a live stream of the same context.
    unsafe { result::set_stream(handle, stream.cu_stream() as sys::cudaStream_t) }
        .map_err(|e| format!("cublasSetStream: {e:?}"))?;
    let counters = Counters::new(like)?;
    let mut order = order_asked();
    if order != Order::Host {
        if let Err(e) = probe_stream_waits(&stream, counters.address) {
            eprintln!("warning: {e}; cuBLAS products are ordered by host waits");
            order = Order::Host;
        }
    }
    let device_thread = crate::util::device_thread::device_thread::<CudaServer>(&like.client);
    if order == Order::DeviceThread && device_thread.is_none() {
        eprintln!(
            "warning: CubeCL's device thread is not reachable; cuBLAS products are ordered by \
             host waits"
        );
        order = Order::Host;
    }
    Ok(Blas {
        context,
        side: Arc::new(Mutex::new(CublasSide {
            stream,
            handle,
            in_flight: VecDeque::new(),
            spare_events: Vec::new(),
            until_next_window: HashMap::new(),
            failure: None,
        })),
        device_thread,
        counters: HashMap::from([(std::thread::current().id(), counters)]),
        order,
        recorded: Vec::new(),
    })
}

/// Makes `stream` wait for a condition already true (the counter at `address` at least 0):
/// `Err` where the driver refuses stream memory operations, which device ordering needs. Asked
/// before the first window, because a window queued by CubeCL's device thread cannot fall back
/// to host ordering once its wait kernel is queued.
fn probe_stream_waits(stream: &CudaStream, address: u64) -> Result<(), String> {
    wait_for_count(stream, address, 0)
}

/// Makes `stream` wait until the counter at `address` (pinned device memory of this
/// context) reaches `count`; `Err` where the driver refuses stream memory operations.
fn wait_for_count(stream: &CudaStream, address: u64, count: u32) -> Result<(), String> {
    // SAFETY: the caller's counter is pinned device memory of this context.
    let waited = unsafe {
        driver::cuStreamWaitValue32_v2(
            stream.cu_stream(),
            address,
            count,
            driver::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
    };
    if waited == driver::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!(
            "the driver refuses stream memory operations ({waited:?})"
        ))
    }
}

/// How the streams are to be ordered: the run's plan ([`crate::util::product_plan::product_plan`]).
fn order_asked() -> Order {
    match crate::util::product_plan::product_plan().ordering {
        CublasOrdering::Device => Order::DeviceThread,
        CublasOrdering::Host => Order::Host,
    }
}

/// Whether a step making cuBLAS products can be captured into a graph: the device orders
/// them (a replay cannot wait on the host), on every GPU where cuBLAS has run so far.
pub fn capturable() -> bool {
    let handles = handles().lock().unwrap_or_else(|e| e.into_inner());
    order_asked() != Order::Host
        && handles
            .values()
            .all(|blas| blas.as_ref().is_none_or(|b| b.order != Order::Host))
}

/// Waits for cuBLAS's stream on GPU `index` and unpins what its products held. To be called
/// before a capture opens: no host wait may happen inside one (CUDA's global capture mode
/// refuses them from every thread), and the recording allocates from pools these pins would
/// otherwise keep (the recording pins nothing).
pub fn settle(index: usize) {
    let handles = handles().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(Some(blas)) = handles.get(&index) {
        let side = blas.side.clone();
        let settle = move || lock(&side).settle();
        match (&blas.device_thread, blas.order) {
            // After the windows the device thread has yet to queue.
            (Some(thread), Order::DeviceThread) => {
                let _ = thread.submit_blocking(move |_| settle());
            }
            _ => settle(),
        }
        blas.report_failure();
    }
}

/// `side` locked (a panic while it was held poisons nothing it guards: the stream and the pins
/// stay as they were).
fn lock(side: &Mutex<CublasSide>) -> std::sync::MutexGuard<'_, CublasSide> {
    side.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// Whether this thread's products are being recorded ([`recording`]).
    static RECORDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `step`, a step being captured on this thread's CubeCL stream, with cuBLAS's side of
/// its windows on GPU `index` recorded instead of run, and returns them with its result.
///
/// A flag of its own, not CubeCL's `is_capturing`: that is true from `graph_prepare` on, so
/// also during the warm-up step that sizes the pools, whose products must run.
pub fn recording<T>(index: usize, step: impl FnOnce() -> T) -> (T, RecordedWindows) {
    /// Ends the recording however `step` ends (a panic included).
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            RECORDING.with(|r| r.set(false));
        }
    }
    RECORDING.with(|r| r.set(true));
    let stop = Stop;
    let result = step();
    drop(stop);
    let mut handles = handles().lock().unwrap_or_else(|e| e.into_inner());
    let windows = match handles.get_mut(&index) {
        Some(Some(blas)) => std::mem::take(&mut blas.recorded),
        _ => Vec::new(),
    };
    (result, RecordedWindows { index, windows })
}

impl RecordedWindows {
    /// Whether the captured step made no cuBLAS product.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// Queues the recorded products on cuBLAS's stream, each window after CubeCL's count of
    /// it: to be called right after each replay of the graph they were recorded with, once
    /// the replay is flushed to the device (see the module's doc).
    pub fn queue(&self) -> Result<(), String> {
        if self.windows.is_empty() {
            return Ok(());
        }
        let mut handles = handles().lock().unwrap_or_else(|e| e.into_inner());
        let Some(Some(blas)) = handles.get_mut(&self.index) else {
            return Err(format!("cuBLAS is not running on GPU {}", self.index));
        };
        blas.context
            .bind_to_thread()
            .map_err(|e| format!("CUDA context: {e}"))?;
        let Some(counters) = blas.counters.get_mut(&std::thread::current().id()) else {
            return Err("the step's products were recorded on another thread".into());
        };
        // The replay was enqueued by a call that waited for the device thread: the windows it
        // queued before are on cuBLAS's stream, ahead of these.
        let side = lock(&blas.side);
        for window in &self.windows {
            let at = counters.next_window();
            queue_window(side.handle, &side.stream, &window.products, at).map_err(
                |(WindowError::Refused(e) | WindowError::Product(e))| {
                    format!("a replayed cuBLAS window: {e}")
                },
            )?;
        }
        Ok(())
    }
}

impl CublasSide {
    /// Unpins what the windows cuBLAS's stream has run held, oldest first; with
    /// [`held_limit`] windows held, waits for the oldest first.
    fn release_finished(&mut self) {
        if self.in_flight.len() >= held_limit() {
            if let Some((event, _)) = self.in_flight.front() {
                let _ = event.synchronize();
            }
            self.let_go_oldest();
        }
        while self
            .in_flight
            .front()
            .is_some_and(|(event, _)| event.is_complete())
        {
            self.let_go_oldest();
        }
    }

    /// Unpins the oldest window's buffers and keeps its event for a later window.
    fn let_go_oldest(&mut self) {
        if let Some((event, pins)) = self.in_flight.pop_front() {
            drop(pins);
            self.spare_events.push(event);
        }
    }

    /// Keeps `pins` until cuBLAS's stream has run what is queued on it now (an event recorded
    /// after it); where no event can be recorded, waits for the stream and lets them go.
    fn hold_until_run(&mut self, pins: Box<dyn Send>) {
        let event = match self.spare_events.pop() {
            Some(event) => Ok(event),
            None => self.stream.context().new_event(None),
        };
        match event.and_then(|event| event.record(&self.stream).map(|()| event)) {
            Ok(event) => self.in_flight.push_back((event, pins)),
            Err(_) => {
                let _ = self.stream.synchronize();
                drop(pins);
            }
        }
    }

    /// cuBLAS's side of a window, from CubeCL's device thread ([`window_on_device_thread`]):
    /// the products queued after the window's count, or, where their buffers could not be
    /// pinned or the driver refused, the count written from the host so that CubeCL's stream
    /// goes on. `Err` says what failed.
    fn queue_from_device_thread(
        &mut self,
        context: &CudaContext,
        pinned: Result<(Vec<Product>, Pins), String>,
        (address, count): (u64, u32),
        stream: u64,
    ) -> Result<(), String> {
        let bound = context
            .bind_to_thread()
            .map_err(|e| format!("CUDA context on CubeCL's device thread: {e}"));
        let (products, pins) = match bound.and(pinned) {
            Ok(pinned) => pinned,
            Err(e) => {
                release_from_host(address, count);
                return Err(format!("a cuBLAS window's buffers: {e}"));
            }
        };
        self.release_finished();
        // The stream's previous window's wait kernel was queued before this window's count.
        self.until_next_window.remove(&stream);
        let queued = queue_window(self.handle, &self.stream, &products, (address, count));
        if let Some(near) = pins.near {
            self.until_next_window.insert(stream, near);
        }
        if let Some(far) = pins.far {
            self.hold_until_run(far);
        }
        match queued {
            Ok(()) => Ok(()),
            Err(WindowError::Product(e)) => Err(e),
            Err(WindowError::Refused(e)) => {
                release_from_host(address, count);
                Err(e)
            }
        }
    }

    /// Waits for cuBLAS's stream and unpins everything its products held.
    fn settle(&mut self) {
        let _ = self.stream.synchronize();
        self.until_next_window.clear();
        let passed = self.in_flight.drain(..).map(|(event, _)| event);
        self.spare_events.extend(passed);
    }
}

impl Blas {
    /// Panics with the failure of a window CubeCL's device thread queued, if one failed.
    fn report_failure(&self) {
        if let Some(failure) = lock(&self.side).failure.take() {
            panic!("{failure}");
        }
    }
}

/// cuBLAS's side of a window, on `stream` (`handle`'s): waits until the counter at `address`
/// reaches `count`, queues the products, and writes `count` to the counter after it once they
/// are done. Every product is queued and the count written even when one fails (CubeCL's
/// stream must never wait forever); the first failure is returned. `Err` before anything is
/// queued where the driver refuses stream memory operations.
fn queue_window(
    handle: sys::cublasHandle_t,
    stream: &CudaStream,
    products: &[Product],
    (address, count): (u64, u32),
) -> Result<(), WindowError> {
    wait_for_count(stream, address, count).map_err(WindowError::Refused)?;
    let statuses: Vec<_> = products
        .iter()
        // SAFETY: the caller keeps the addresses valid until cuBLAS's stream has run the
        // products (held resources, or the captured graph's guarded pages).
        .map(|p| unsafe { gemm(handle, p.shape, p.a, p.b, p.c) })
        .collect();
    // SAFETY: as above; the write is fenced after the products (the default flags).
    let written = unsafe {
        driver::cuStreamWriteValue32_v2(
            stream.cu_stream(),
            address + 4,
            count,
            driver::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
        )
    };
    assert_eq!(
        written,
        driver::CUresult::CUDA_SUCCESS,
        "cuStreamWriteValue32 after a cuBLAS product"
    );
    for (p, status) in products.iter().zip(statuses) {
        if let Err(e) = status {
            let s = p.shape;
            return Err(WindowError::Product(format!(
                "cuBLAS gemm of [{}, {}] · [{}, {}] × {}: {e:?}",
                s.m, s.k, s.k, s.n, s.batch
            )));
        }
    }
    Ok(())
}

/// Writes `count` to the second counter at `address` from the host, for a window whose
/// products were not queued: CubeCL's wait for them ends (their results are not written; the
/// failure is reported instead).
fn release_from_host(address: u64, count: u32) {
    // SAFETY: the counters are pinned device memory of the current context.
    let _ =
        unsafe { driver::cuMemcpyHtoD_v2(address + 4, &count as *const u32 as *const c_void, 4) };
}

/// Holds CubeCL's stream until cuBLAS's count has caught up with CubeCL's, i.e. until this
/// window's products are done; `outs` are their results, all of one dtype.
fn wait_on_cubecl(flags: &Handle, outs: &[&CubeTensor]) {
    let written: Vec<_> = outs
        .iter()
        .map(|out| (&out.handle, out.meta.shape().num_elements()))
        .collect();
    let wait = match outs[0].dtype {
        DType::BF16 => kernels::wait_for::<bf16>,
        DType::F16 => kernels::wait_for::<f16>,
        _ => kernels::wait_for::<f32>,
    };
    wait(&outs[0].client, flags, &written);
}

/// Runs planned products of one GPU and dtype on cuBLAS in one ordering window: after the
/// CubeCL work queued before them, and before any queued after (see the module's doc). While
/// CubeCL's stream is being captured, the window's ordering kernels are recorded into the
/// graph and its products here, for [`RecordedWindows::queue`] to run after each replay.
pub(super) fn window<const N: usize>(products: [Planned; N]) -> Option<[CubeTensor; N]> {
    let first = &products[0];
    let index = cuda_index(&first.a)?;
    let capturing = RECORDING.with(|r| r.get());
    let mut blas = handles().lock().unwrap_or_else(|e| e.into_inner());
    let blas = blas
        .entry(index)
        .or_insert_with(|| {
            start(&first.a, index)
                .map_err(|e| {
                    eprintln!("warning: cuBLAS did not start ({e}); using CubeCL's matmul")
                })
                .ok()
        })
        .as_mut()?;
    blas.report_failure();
    if capturing && blas.order == Order::Host {
        // A replay cannot wait on the host: CubeCL's matmul is captured instead.
        return None;
    }
    let buffers: Vec<Buffers> = products.iter().map(Planned::buffers).collect();
    let outs: Vec<&CubeTensor> = products.iter().map(|p| &p.out).collect();
    if capturing {
        // The graph guards the pages (see the module's doc): the pins go with this call.
        let (queued, _pins) = addresses_from_caller(&first.a, &buffers)?;
        let counters = thread_counters(&mut blas.counters, &first.a)?;
        kernels::signal(&first.a.client, &counters.flags);
        blas.recorded.push(RecordedWindow { products: queued });
        wait_on_cubecl(&counters.flags, &outs);
        return Some(products.map(|p| p.out));
    }
    let queued = match blas.order {
        Order::DeviceThread => window_on_device_thread(blas, &buffers, &outs),
        Order::Host => None,
    };
    if queued.is_none() {
        window_host_ordered(blas, &buffers, &first.a)?;
    }
    Some(products.map(|p| p.out))
}

/// Device ordering with cuBLAS's side queued by CubeCL's device thread ([`Order::DeviceThread`]):
/// this thread queues the window's count, a task for the device thread, and the wait for the
/// products, and goes on. The task flushes the count to the device (cuBLAS's stream must not
/// wait for a kernel still in CubeCL's queue: see the module's doc), pins the buffers for their
/// addresses, and queues the products; where that fails, the count is written from the host so
/// that the wait, queued next, never waits forever, and the failure is reported at this
/// thread's next window. `None` where nothing was queued.
fn window_on_device_thread(
    blas: &mut Blas,
    buffers: &[Buffers],
    outs: &[&CubeTensor],
) -> Option<()> {
    let first = outs[0];
    let thread = blas.device_thread.clone()?;
    let counters = thread_counters(&mut blas.counters, first)?;
    let at = counters.count(first);
    // The stream the results were made on: this thread's, the one counted on.
    let stream = first.handle.stream;
    let (side, context, buffers) = (blas.side.clone(), blas.context.clone(), buffers.to_vec());
    thread.submit(move |server| {
        let flushed = server
            .flush(stream)
            .map_err(|e| format!("flushing a window's count: {e:?}"));
        let pinned = flushed.and_then(|()| {
            let pin = |h: &Handle| {
                server
                    .get_resource(h.clone().binding(), stream)
                    .map_err(|e| format!("{e:?}"))
            };
            addresses(&buffers, stream.value, pin, |r| r.resource().ptr)
        });
        let mut side = lock(&side);
        if let Err(e) = side.queue_from_device_thread(&context, pinned, at, stream.value) {
            side.failure.get_or_insert(e);
        }
    });
    wait_on_cubecl(&counters.flags, outs);
    Some(())
}

/// Host ordering: CubeCL's stream waited for, the products run, cuBLAS's stream waited for.
fn window_host_ordered(blas: &Blas, buffers: &[Buffers], like: &CubeTensor) -> Option<()> {
    let (queued, pins) = addresses_from_caller(like, buffers)?;
    CubeBackend::sync(&like.device).ok()?;
    blas.context.bind_to_thread().ok()?;
    let mut side = lock(&blas.side);
    side.release_finished();
    run_host_ordered(&side, &queued, like.dtype);
    drop(pins);
    Some(())
}

/// What keeps a window's buffers in place while cuBLAS may use them, by when each may go.
/// `None` where a half holds nothing: nothing to keep, no event to record for it.
struct Pins {
    /// With [`Release::AtWait`], the buffers in the memory of the CubeCL stream the window
    /// is waited on: they may go once its wait kernel is queued there.
    near: Option<Box<dyn Send>>,
    /// The others: held until cuBLAS's stream has run the window.
    far: Option<Box<dyn Send>>,
}

impl Pins {
    /// `near` and `far` pins as [`Pins`].
    fn of<R: Send + 'static>(near: Vec<R>, far: Vec<R>) -> Self {
        let boxed = |pins: Vec<R>| (!pins.is_empty()).then(|| Box::new(pins) as Box<dyn Send>);
        Self {
            near: boxed(near),
            far: boxed(far),
        }
    }
}

/// A planned product as its buffers, which a task of CubeCL's device thread can hold.
#[derive(Clone)]
struct Buffers {
    shape: GemmShape,
    a: (Operand, Handle),
    b: (Operand, Handle),
    c: Handle,
}

impl Planned {
    fn buffers(&self) -> Buffers {
        Buffers {
            shape: self.shape,
            a: (self.oa, self.a.handle.clone()),
            b: (self.ob, self.b.handle.clone()),
            c: self.out.handle.clone(),
        }
    }
}

/// The products of `buffers` with their device addresses, and the pins that keep those in
/// place while held: each buffer pinned by `pin`, its address read by `address`; a window
/// waited on CubeCL's stream `stream` (`StreamId::value`).
fn addresses<R: Send + 'static>(
    buffers: &[Buffers],
    stream: u64,
    mut pin: impl FnMut(&Handle) -> Result<R, String>,
    address: impl Fn(&R) -> u64,
) -> Result<(Vec<Product>, Pins), String> {
    let at_wait = release_asked() == Release::AtWait;
    let (mut near, mut far) = (Vec::new(), Vec::with_capacity(3 * buffers.len()));
    let mut products = Vec::with_capacity(buffers.len());
    for b in buffers {
        let mut pinned = |h: &Handle| -> Result<u64, String> {
            let resource = pin(h)?;
            let at = address(&resource);
            if at_wait && h.stream.value == stream {
                near.push(resource);
            } else {
                far.push(resource);
            }
            Ok(at)
        };
        let (a, bb, c) = (pinned(&b.a.1)?, pinned(&b.b.1)?, pinned(&b.c)?);
        products.push(Product {
            shape: b.shape,
            a: (b.a.0, a),
            b: (b.b.0, bb),
            c,
        });
    }
    Ok((products, Pins::of(near, far)))
}

/// [`addresses`] looked up from this thread: each a wait for CubeCL's device thread to run
/// what was queued before.
fn addresses_from_caller(like: &CubeTensor, buffers: &[Buffers]) -> Option<(Vec<Product>, Pins)> {
    let pin = |h: &Handle| {
        like.client
            .get_resource::<CudaServer>(h.clone())
            .map_err(|e| format!("{e:?}"))
    };
    addresses(buffers, like.handle.stream.value, pin, |r| r.resource().ptr).ok()
}

/// This thread's ordering counters (created at its first window: one pair per CubeCL
/// stream); `None` where they cannot be made.
fn thread_counters<'a>(
    counters: &'a mut HashMap<std::thread::ThreadId, Counters>,
    like: &CubeTensor,
) -> Option<&'a mut Counters> {
    match counters.entry(std::thread::current().id()) {
        std::collections::hash_map::Entry::Occupied(slot) => Some(slot.into_mut()),
        std::collections::hash_map::Entry::Vacant(slot) => match Counters::new(like) {
            Ok(made) => Some(slot.insert(made)),
            Err(e) => {
                eprintln!("warning: cuBLAS's ordering counters ({e}); using CubeCL's matmul");
                None
            }
        },
    }
}

/// Runs `products` on cuBLAS's stream and waits for it (CubeCL's work already waited for).
fn run_host_ordered(side: &CublasSide, products: &[Product], dtype: DType) {
    let statuses: Vec<_> = products
        .iter()
        // SAFETY: the caller holds the pointers pinned until this returns, after cuBLAS's
        // stream has run the products; shapes, leading dimensions and batch strides were
        // checked against the tensors.
        .map(|p| unsafe { gemm(side.handle, p.shape, p.a, p.b, p.c) })
        .collect();
    side.stream
        .synchronize()
        .unwrap_or_else(|e| panic!("cuBLAS gemm: {e}"));
    for (p, status) in products.iter().zip(statuses) {
        if let Err(e) = status {
            let s = p.shape;
            panic!(
                "cuBLAS gemm of [{}, {}] · [{}, {}] × {} ({dtype:?}): {e:?}",
                s.m, s.k, s.k, s.n, s.batch
            );
        }
    }
}

/// Why cuBLAS's side of a window failed.
enum WindowError {
    /// The driver refused to make cuBLAS's stream wait (nothing was queued).
    Refused(String),
    /// A product failed (the window's count was written all the same).
    Product(String),
}
