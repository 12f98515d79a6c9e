//! A GPT forward + backward replayed from a captured graph (CubeCL's graph capture: one CUDA
//! graph launch on CUDA, prebuilt dispatches on wgpu) against the same step run eagerly, on
//! the same device in the same process.
//!
//! Why: on an H200 the host spends ≈ 26 µs per kernel launch, and GPT-2 345M's step makes
//! about 1,200 of them (docs/benchmarks.md, "Launches per iteration"): the host, not the GPU,
//! bounds the step. A captured step costs the host one launch. This measures what that
//! would give before the training loop is made capturable (its per-step scalars — dropout
//! keys, learning rate, loss scale — are kernel arguments today, fixed in a graph).
//!
//! ```text
//! cargo run --release --example step_graph -- [DEVICE] [LAYERS] [HIDDEN] [HEADS] [SEQ] [MBS] [REPS] [eager]
//! FERROTRON_MATMUL=cubecl target/release/examples/step_graph cuda 24 1024 16 1024 4 10
//! ```
//!
//! Defaults: wgpu-cpu (lavapipe), 24 layers, hidden 64, 4 heads, seq 64, micro-batch 4 (the
//! "host floor" of `benchmarks/gpu_profile.sh`), 10 repetitions. The step: the half-precision
//! working copy of the weights (bf16; f16 on wgpu, which has no bf16), the LM loss with
//! dropout 0.1 (the same draws each time: the seeds are the graph's), its backward. Checks
//! that the replay gives the eager step's loss and gradients bit for bit, then prints the
//! milliseconds per step of each, `REPS` steps queued before one wait, after a warm-up. On
//! CUDA run it with `FERROTRON_MATMUL=cubecl`: cuBLAS's products run on a stream of their own,
//! outside CubeCL's capture. With `eager` last, only the eager step is timed (so that the
//! default cuBLAS products can be measured beside a replay with CubeCL's).

#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn main() {
    capture::run();
}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
fn main() {
    eprintln!("step_graph needs a CubeCL device: build with the wgpu or cuda feature");
    std::process::exit(2);
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod capture {
    use std::time::Instant;

    use burn::module::{Module, ModuleVisitor, Param};
    use burn::optim::GradientsParams;
    use burn::tensor::{Distribution, Int, Tensor};
    use burn_cubecl::CubeBackend;
    use ferrotron::model::GptConfig;
    use ferrotron::optim::Precision;
    use ferrotron::parallel::random::seed_micro_batch;
    use ferrotron::util::device::parse_device;

    /// The step's outputs read back: the loss and every parameter's gradient, as f32.
    type Readout = (Vec<f32>, Vec<Vec<f32>>);

    fn arg(args: &[String], i: usize, default: usize) -> usize {
        args.get(i).map_or(default, |s| {
            s.parse()
                .unwrap_or_else(|_| panic!("argument {i}: a number, not {s}"))
        })
    }

    pub fn run() {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let name = args.first().cloned().unwrap_or_else(|| "wgpu-cpu".into());
        let (layers, hidden, heads) = (arg(&args, 1, 24), arg(&args, 2, 64), arg(&args, 3, 4));
        let (seq, batch, reps) = (arg(&args, 4, 64), arg(&args, 5, 4), arg(&args, 6, 10));
        let eager_only = args.get(7).is_some_and(|a| a == "eager");
        let base = parse_device(&name).expect("device");
        let device = base.clone().autodiff();
        let client = Tensor::<1>::zeros([1], &base)
            .try_into_primitive::<CubeBackend>()
            .unwrap_or_else(|_| panic!("{name} is not a CubeCL device"))
            .client
            .clone();
        // WGSL has no bf16 (docs/gpu.md): half precision on wgpu is f16.
        let precision = if name.starts_with("wgpu") {
            Precision::Fp16
        } else {
            Precision::Bf16
        };
        let vocab = 50304;
        let config = GptConfig::new(layers, hidden, heads, seq, vocab);
        let main = config.init(7, &device).expect("model");
        let tokens = |salt: f64| {
            Tensor::<2, Int>::random(
                [batch, seq],
                Distribution::Uniform(salt, vocab as f64),
                &device,
            )
        };
        let (input, labels) = (tokens(0.0), tokens(1.0));
        let mask = Tensor::<2>::ones([batch, seq], &device);
        let step = || {
            seed_micro_batch(1, 1, 0, 0);
            let model = precision.working_copy(&main);
            let loss = model.lm_loss(input.clone(), labels.clone(), mask.clone());
            let grads = loss.backward();
            let grads = GradientsParams::from_grads(grads, &model);
            (loss.detach().inner(), flat_gradients(&model, grads))
        };
        println!(
            "step_graph: {name}, {layers} layers, hidden {hidden}, {heads} heads, seq {seq}, \
             micro-batch {batch}, {}, dropout 0.1, {reps} steps queued per timing",
            precision.flag()
        );
        let sync = || burn_cubecl::cubecl::future::block_on(client.sync()).expect("sync");
        let time = |f: &dyn Fn()| {
            f();
            sync();
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            sync();
            t.elapsed().as_secs_f64() * 1e3 / reps as f64
        };
        let eager = read(step());
        if eager_only {
            println!("ms per step: eager {:.2}", time(&|| drop(step())));
            return;
        }
        // The warm-up after `graph_prepare` sizes the pools the recording allocates from.
        client.graph_prepare().expect("graph_prepare");
        drop(step());
        client.start_capture().expect("start_capture");
        let (loss, grads) = step();
        let graph = client.stop_capture().expect("stop_capture");
        // SAFETY: every buffer the graph reads or writes stays allocated (the model, the
        // inputs, and the outputs held here; nothing else allocates between replays).
        let replay = || unsafe { graph.replay().expect("replay") };
        replay();
        let replayed = read((loss.clone(), grads.clone()));
        let same = eager == replayed;
        println!(
            "replay equals the eager step bit for bit: {same} (loss {:?}, {} gradients)",
            eager.0,
            eager.1.len()
        );
        assert!(same, "the replayed step differs from the eager one");
        let eager_ms = time(&|| drop(step()));
        let replay_ms = time(&|| replay());
        println!(
            "ms per step: eager {eager_ms:.2}, replayed {replay_ms:.2}, eager / replayed {:.2}x",
            eager_ms / replay_ms
        );
    }

    /// Every parameter's gradient, flattened, in the module's order.
    fn flat_gradients<M: Module>(module: &M, grads: GradientsParams) -> Vec<Tensor<1>> {
        struct Flat(GradientsParams, Vec<Tensor<1>>);
        impl ModuleVisitor for Flat {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(g) = self.0.remove::<D>(param.id) {
                    let n = g.shape().num_elements();
                    self.1.push(g.reshape([n]));
                }
            }
        }
        let mut flat = Flat(grads, Vec::new());
        module.visit(&mut flat);
        flat.1
    }

    fn read((loss, grads): (Tensor<1>, Vec<Tensor<1>>)) -> Readout {
        let f32s = |t: Tensor<1>| t.try_into_vec_as::<f32>().expect("read");
        (f32s(loss), grads.into_iter().map(f32s).collect())
    }
}
