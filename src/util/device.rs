//! `--device`: which burn backend a run uses.
//!
//! burn 0.22 chooses the backend at run time from the device, so one build can offer several;
//! the GPU ones exist only when ferrotron is built with the `cuda` or `wgpu` feature.

use burn::tensor::{DType, Device, FloatDType, Tensor};

/// The devices this build can run on, for messages.
pub fn available_devices() -> &'static str {
    match (cfg!(feature = "cuda"), cfg!(feature = "wgpu")) {
        (true, true) => "cpu, cuda, cuda:N, wgpu, wgpu-cpu",
        (true, false) => "cpu, cuda, cuda:N",
        (false, true) => "cpu, wgpu, wgpu-cpu",
        (false, false) => "cpu (build with --features cuda or wgpu for GPUs)",
    }
}

/// Parses `cpu` (burn's Flex backend), `cuda`/`cuda:N`, `wgpu` (the best adapter) or
/// `wgpu-cpu` (a software Vulkan device such as Mesa's lavapipe).
pub fn parse_device(spec: &str) -> Result<Device, String> {
    match spec {
        "cpu" => Ok(Device::flex()),
        #[cfg(feature = "cuda")]
        "cuda" => cuda_device(0),
        #[cfg(feature = "cuda")]
        s if s.starts_with("cuda:") => s["cuda:".len()..]
            .parse::<usize>()
            .map_err(|_| format!("--device {s}: expected cuda:N with N a GPU index"))
            .and_then(cuda_device),
        #[cfg(feature = "wgpu")]
        "wgpu" => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
        #[cfg(feature = "wgpu")]
        "wgpu-cpu" => Ok(Device::wgpu(burn::tensor::DeviceKind::Cpu)),
        other => Err(format!(
            "--device {other} is not available in this build; use one of: {}",
            available_devices()
        )),
    }
}

/// CUDA GPU `index`, once the machine is known to run it: CubeCL would panic on the first
/// kernel (from a thread of its own) where the driver library or the GPU is missing; here that
/// is an error naming what is missing. NVRTC is not asked for: cubecl-cuda's default backend
/// (this build enables no `cpp` feature) lowers the kernels to PTX in-process through LLVM, and
/// the driver loads the PTX; only its C++ backend hands source to NVRTC.
#[cfg(feature = "cuda")]
fn cuda_device(index: usize) -> Result<Device, String> {
    let flag = format!("--device cuda:{index}");
    // SAFETY: each check only tries to load the library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(format!(
            "{flag}: the CUDA driver library (libcuda.so) is not on this machine or not on \
             LD_LIBRARY_PATH; does it have an NVIDIA GPU and its driver?"
        ));
    }
    cudarc::driver::result::init()
        .map_err(|e| format!("{flag}: the CUDA driver did not start: {e}"))?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| format!("{flag}: the CUDA driver cannot count its GPUs: {e}"))?;
    if index >= count.max(0) as usize {
        return Err(format!("{flag}: this machine has {count} CUDA GPU(s)"));
    }
    Ok(Device::cuda(index))
}

/// Whether `device` (autodiff or not) is a CubeCL backend (CUDA, wgpu), where the fused
/// kernels run.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub fn is_cube(device: &Device) -> bool {
    matches!(
        device.clone().inner().as_dispatch(),
        burn::backend::DispatchDevice::Cube(_)
    )
}

thread_local! {
    /// The last device [`cube_client`] was asked for, and its client.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    static CUBE_CLIENT: std::cell::RefCell<Option<(Device, burn_cubecl::cubecl::client::Client)>> =
        const { std::cell::RefCell::new(None) };
}

/// The CubeCL client of `device` (autodiff or not), which launches on this thread's stream,
/// or `None` off CubeCL: found with a probe tensor (an allocation and a launch) once per
/// thread and device, then kept.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub fn cube_client(device: &Device) -> Option<burn_cubecl::cubecl::client::Client> {
    let cached = CUBE_CLIENT.with(|c| {
        let c = c.borrow();
        c.as_ref()
            .filter(|(d, _)| d == device)
            .map(|(_, client)| client.clone())
    });
    if cached.is_some() {
        return cached;
    }
    let probe = Tensor::<1>::zeros([1], &device.clone().inner());
    let client = probe
        .try_into_primitive::<burn_cubecl::CubeBackend>()
        .ok()?
        .client;
    CUBE_CLIENT.with(|c| *c.borrow_mut() = Some((device.clone(), client.clone())));
    Some(client)
}

/// Whether `device` (autodiff or not) is the Flex CPU backend.
pub fn is_flex(device: &Device) -> bool {
    matches!(
        device.clone().inner().as_dispatch(),
        burn::backend::DispatchDevice::Flex(_)
    )
}

/// `x` in fp32 if it is in half precision (bf16, fp16), else unchanged (fp32, or the f64 of
/// gradient checks): what the precision-sensitive reductions (LayerNorm statistics, softmax,
/// cross-entropy) compute in.
pub fn at_least_f32<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    match x.dtype() {
        DType::F16 | DType::BF16 => x.cast(FloatDType::F32),
        _ => x,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_always_there_and_unknown_devices_are_refused() {
        assert!(parse_device("cpu").is_ok());
        let err = parse_device("tpu").unwrap_err();
        assert!(err.contains("--device tpu") && err.contains("cpu"), "{err}");
    }
}
