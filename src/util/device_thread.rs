//! CubeCL's device thread, reached directly: work queued there runs after the launches
//! queued before it, with the server at hand, while the thread that queued it goes on.
//!
//! Why: CubeCL's client hands every launch to one thread per device, the one that owns the
//! server, and returns at once; a call that needs the server's answer (a buffer's device
//! address, a flush) waits until that thread has run everything queued before it. Made by
//! the thread that builds a training step, such calls make the two threads take turns where
//! they would overlap: cuBLAS's side of a step's ordering windows made one per flush and
//! operand lookup when it was queued from the calling thread (`util::cublas`; the count for
//! GPT-2 345M: benchmarks/results/2026-12-03-figures-from-comments.md). Queued as a
//! task of the device thread itself, the same work runs in the same order, and nobody waits.

use std::any::TypeId;

use burn_cubecl::cubecl::client::Client;
use burn_cubecl::cubecl::device_handle::DeviceHandle;
use burn_cubecl::cubecl::server::ServerStorage;

/// The device thread of `client`, whose tasks see its server as `S`; `None` unless `S` is the
/// server type of `client`'s runtime (asked for another type, CubeCL would start a server of
/// that type on the same device).
pub fn device_thread<S: ServerStorage>(client: &Client) -> Option<DeviceHandle<S>> {
    let service = client.service_id();
    (service.service == TypeId::of::<S>()).then(|| DeviceHandle::new(service.device))
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::tensor::Tensor;
    use burn_cubecl::cubecl::server::Server as _;
    use burn_cubecl::CubeBackend;

    type WgpuServer =
        <burn_cubecl::cubecl::wgpu::WgpuRuntime as burn_cubecl::cubecl::__private::Runtime>::Server;

    /// A task queued on lavapipe's device thread runs there (not on the test's thread), after
    /// what was queued before it, and sees the buffer of a tensor the client made as the
    /// client's own lookup does: the same server, not a second one.
    #[test]
    fn a_device_thread_task_sees_the_clients_server() {
        let device = crate::util::device::parse_device("wgpu-cpu").unwrap();
        let x = Tensor::<1>::from_floats([1.0, 2.0, 3.0, 4.0], &device)
            .try_into_primitive::<CubeBackend>()
            .unwrap();
        let thread = device_thread::<WgpuServer>(&x.client).expect("wgpu's server type");
        let (sent, received) = std::sync::mpsc::channel();
        let handle = x.handle.clone();
        thread.submit(move |server: &mut WgpuServer| {
            let seen = server
                .get_resource(handle.clone().binding(), handle.stream)
                .map(|r| (r.resource().offset, r.resource().size));
            let flushed = server.flush(handle.stream).is_ok();
            let _ = sent.send((seen.ok(), flushed, std::thread::current().id()));
        });
        // Hands the queued tasks to the device thread and waits for them.
        x.client.flush().unwrap();
        let (seen, flushed, on) = received
            .try_recv()
            .expect("the task ran before the flush returned");
        let own = x
            .client
            .get_resource::<WgpuServer>(x.handle.clone())
            .unwrap();
        assert_eq!(seen, Some((own.resource().offset, own.resource().size)));
        assert!(flushed);
        assert_ne!(on, std::thread::current().id());
    }
}
