//! Which kernels a CUDA run's matrix products use (`--cuda-matmul`, `--cublas-ordering`),
//! chosen once per process from the run's configuration because every layer calls
//! [`super::matmul::matmul`] without a handle on the run: a choice that changed between layers
//! would mix streams mid-step. A leaf of its own so that the product ([`super::matmul`]) and
//! cuBLAS (`super::cublas`) both read it without importing each other.

use std::sync::OnceLock;

/// Where a CUDA run's half-precision products run (`--cuda-matmul`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ProductKernels {
    /// `cublas`, the default: bf16 and fp16 products on cuBLAS.
    #[default]
    Cublas,
    /// `cubecl`: CubeCL's autotuned kernels for every product (the step is then CubeCL's
    /// alone: one stream, what a reference run or a capture of CubeCL's kernels wants).
    Cubecl,
}

/// How cuBLAS's stream is ordered against CubeCL's (`--cublas-ordering`): a speed/memory
/// trade-off a user chooses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CublasOrdering {
    /// `device`, the default: counters on the device order the streams and the host waits for
    /// nothing; buffers cuBLAS reads stay pinned until the GPU has run its products, so the
    /// peak memory is higher.
    #[default]
    Device,
    /// `host`: the host waits for each stream around each window of products (slower, the
    /// lowest peak memory; a step so ordered cannot be captured).
    Host,
}

/// The products' plan of a run: [`ProductKernels`] and [`CublasOrdering`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProductPlan {
    pub kernels: ProductKernels,
    pub ordering: CublasOrdering,
}

impl ProductPlan {
    /// The plan of `--cuda-matmul` and `--cublas-ordering`, checked.
    pub fn from_flags(kernels: &str, ordering: &str) -> Result<Self, String> {
        let kernels = match kernels {
            "cublas" => ProductKernels::Cublas,
            "cubecl" => ProductKernels::Cubecl,
            other => return Err(format!("--cuda-matmul {other}: expected cublas or cubecl")),
        };
        let ordering = match ordering {
            "device" => CublasOrdering::Device,
            "host" => CublasOrdering::Host,
            other => {
                return Err(format!(
                    "--cublas-ordering {other}: expected device or host"
                ))
            }
        };
        Ok(Self { kernels, ordering })
    }

    /// The log's words for it on a CUDA device.
    pub fn describe(&self) -> &'static str {
        match (self.kernels, self.ordering) {
            (ProductKernels::Cubecl, _) => "matrix products: CubeCL's kernels",
            (ProductKernels::Cublas, CublasOrdering::Device) => {
                "matrix products: bf16/fp16 on cuBLAS, ordered on the device"
            }
            (ProductKernels::Cublas, CublasOrdering::Host) => {
                "matrix products: bf16/fp16 on cuBLAS, ordered by the host"
            }
        }
    }
}

static PLAN: OnceLock<ProductPlan> = OnceLock::new();

/// Fixes the process's products to `plan`: an error where products already ran under another
/// (two runs of one process that differ in it; the first product fixes the default).
pub fn choose_products(plan: ProductPlan) -> Result<(), String> {
    let fixed = *PLAN.get_or_init(|| plan);
    if fixed == plan {
        Ok(())
    } else {
        Err(format!(
            "this process's matrix products are already fixed ({}); a run asking for another \
             plan ({}) needs a process of its own",
            fixed.describe(),
            plan.describe()
        ))
    }
}

/// The process's products' plan: the one chosen, else the default (fixed from then on).
pub fn product_plan() -> ProductPlan {
    *PLAN.get_or_init(ProductPlan::default)
}
