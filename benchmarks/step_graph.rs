//! A GPT training step replayed from a captured graph (CubeCL's graph capture: one CUDA graph
//! launch on CUDA, prebuilt dispatches on wgpu) against the same step run eagerly, on the
//! same device in the same process.
//!
//! Why: on a GPU the host's cost per kernel launch
//! (benchmarks/results/2026-11-26-h200-gpu-profile.md), over the launches of a GPT-2 345M
//! step (docs/benchmarks.md, "Kernel launches per step"), exceeds the GPU's work: the
//! host, not the GPU, bounds the step. A captured step costs the host one launch and two small
//! writes (the dropout salt, Adam's learning rate and bias corrections). This measures what
//! that gives before the training loop captures its steps.
//!
//! ```text
//! cargo run --release --example step_graph -- [DEVICE] [LAYERS] [HIDDEN] [HEADS] [SEQ] [MBS] [REPS] [eager]
//! target/release/examples/step_graph cuda 24 1024 16 1024 4 10
//! ```
//!
//! Defaults: wgpu-cpu (lavapipe), 24 layers, hidden 64, 4 heads, seq 64, micro-batch 4 (the
//! "host floor" of `benchmarks/gpu_profile.sh`), 10 repetitions. The step: the LM loss of the
//! half-precision working copy (bf16; f16 on wgpu, which has no bf16) with dropout 0.1, its
//! backward, the flat-buffer AdamW (clipping at 1.0, a learning rate that changes every
//! step) and the working copy cast in place. It checks that the replayed steps give an eager
//! run's losses and weights bit for bit, then prints milliseconds per step of each, `REPS`
//! steps queued before one wait (the replays with their per-step values written before
//! each). On CUDA the half-precision products run on cuBLAS in both, as in training (the
//! replay queues the recorded products after the graph, `ferrotron::util::cublas`; a run
//! with `--cuda-matmul cubecl` captures CubeCL's instead). With `eager` last, only the eager
//! step is timed.

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

    use burn::tensor::{Device, Distribution, FloatDType, Int, Tensor};
    use ferrotron::model::named_parameters::named_parameters;
    use ferrotron::model::{Gpt, GptConfig};
    use ferrotron::optim::{
        AdamWConfig, FlatAdamW, GradientAccumulator, LearningRates, Optimizer, OptimizerSetup,
        Precision,
    };
    use ferrotron::parallel::random::seed_micro_batch;
    use ferrotron::training::step_graph::write_dropout_salt;
    use ferrotron::util::device::{cube_client, parse_device};
    use ferrotron::util::graph::CapturedGraph;

    fn arg(args: &[String], i: usize, default: usize) -> usize {
        args.get(i).map_or(default, |s| {
            s.parse()
                .unwrap_or_else(|_| panic!("argument {i}: a number, not {s}"))
        })
    }

    /// A model, its half-precision working copy and the flat-buffer AdamW.
    struct Training {
        main: Gpt,
        working: Gpt,
        adam: FlatAdamW,
        dtype: FloatDType,
    }

    /// The step's inputs: tokens, labels, loss mask.
    struct Batch {
        tokens: Tensor<2, Int>,
        labels: Tensor<2, Int>,
        mask: Tensor<2>,
    }

    /// A learning rate that changes every step (as a warm-up's does).
    fn learning_rates(iteration: u64) -> LearningRates {
        let base = 1e-5 * iteration as f64;
        LearningRates {
            base,
            decoupled: base,
        }
    }

    impl Training {
        fn new(config: &GptConfig, precision: Precision, device: &Device) -> Self {
            let main = config.init(7, device).expect("model");
            let adam = AdamWConfig {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            };
            let setup = OptimizerSetup::for_module(&main, adam, 1.0);
            Self {
                working: precision.working_copy(&main),
                main,
                adam: FlatAdamW::new(setup, None),
                dtype: precision.dtype(),
            }
        }

        /// One step of iteration `iteration`; its loss, on the device.
        fn step(&mut self, iteration: u64, batch: &Batch) -> Tensor<1> {
            seed_micro_batch(1, iteration, 0);
            let loss = self.working.lm_loss(
                batch.tokens.clone(),
                batch.labels.clone(),
                batch.mask.clone(),
            );
            let mut grads = GradientAccumulator::default();
            grads.add(&self.working, loss.backward());
            let lr = learning_rates(iteration);
            let (main, _norm) = self.adam.step(self.main.clone(), &mut grads, lr).unwrap();
            self.working = self
                .adam
                .working_copy(&main, self.dtype, None)
                .expect("flat");
            self.main = main;
            loss.detach().inner()
        }

        /// Steps 1 to `steps`: the last step's loss and the main weights after it, read (the
        /// reference a replayed step is held to).
        fn loss_and_weights_after(
            &mut self,
            steps: u64,
            batch: &Batch,
        ) -> (Vec<f32>, Vec<Vec<f32>>) {
            let mut loss = Vec::new();
            for iteration in 1..=steps {
                loss = self
                    .step(iteration, batch)
                    .try_into_vec_as::<f32>()
                    .unwrap();
            }
            (loss, self.weights())
        }

        /// The main weights, read.
        fn weights(&self) -> Vec<Vec<f32>> {
            named_parameters(&self.main)
                .into_iter()
                .map(|p| p.values)
                .collect()
        }
    }

    /// The command line: `[DEVICE] [LAYERS] [HIDDEN] [HEADS] [SEQ] [MBS] [REPS] [eager]`.
    struct Args {
        name: String,
        layers: usize,
        hidden: usize,
        heads: usize,
        seq: usize,
        batch: usize,
        reps: usize,
        eager_only: bool,
    }

    impl Args {
        fn parse() -> Self {
            let args: Vec<String> = std::env::args().skip(1).collect();
            Self {
                name: args.first().cloned().unwrap_or_else(|| "wgpu-cpu".into()),
                layers: arg(&args, 1, 24),
                hidden: arg(&args, 2, 64),
                heads: arg(&args, 3, 4),
                seq: arg(&args, 4, 64),
                batch: arg(&args, 5, 4),
                reps: arg(&args, 6, 10),
                eager_only: args.get(7).is_some_and(|a| a == "eager"),
            }
        }
    }

    impl Batch {
        /// Uniform random tokens and labels of a `vocab`-word model, every token counted.
        fn random(batch: usize, seq: usize, vocab: usize, device: &Device) -> Self {
            let ids = |low: f64| {
                let uniform = Distribution::Uniform(low, vocab as f64);
                Tensor::<2, Int>::random([batch, seq], uniform, device)
            };
            Self {
                tokens: ids(0.0),
                labels: ids(1.0),
                mask: Tensor::<2>::ones([batch, seq], device),
            }
        }
    }

    pub fn run() {
        let Args {
            name,
            layers,
            hidden,
            heads,
            seq,
            batch,
            reps,
            eager_only,
        } = Args::parse();
        let base = parse_device(&name).expect("device");
        let device = base.clone().autodiff();
        let client = cube_client(&base).unwrap_or_else(|| panic!("{name} is not a CubeCL device"));
        // WGSL has no bf16 (docs/gpu.md): half precision on wgpu is f16.
        let precision = if name.starts_with("wgpu") {
            Precision::Fp16
        } else {
            Precision::Bf16
        };
        let vocab = 50304;
        let config = GptConfig::new(layers, hidden, heads, seq, vocab);
        let inputs = Batch::random(batch, seq, vocab, &device);
        println!(
            "step_graph: {name}, {layers} layers, hidden {hidden}, {heads} heads, seq {seq}, \
             micro-batch {batch}, {}, dropout 0.1, AdamW on flat buffers, {reps} steps queued \
             per timing",
            precision.flag()
        );
        let sync = || burn_cubecl::cubecl::future::block_on(client.sync()).expect("sync");
        let time = |f: &mut dyn FnMut(u64)| {
            f(0);
            sync();
            let t = Instant::now();
            for k in 1..=reps as u64 {
                f(k);
            }
            sync();
            t.elapsed().as_secs_f64() * 1e3 / reps as f64
        };

        let mut eager = Training::new(&config, precision, &device);
        if eager_only {
            let ms = time(&mut |k| drop(eager.step(10 + k, &inputs)));
            println!("ms per step: eager {ms:.2}");
            return;
        }
        let want = eager.loss_and_weights_after(3, &inputs);

        let mut captured = Training::new(&config, precision, &device);
        drop(captured.step(1, &inputs));
        // The warm-up after `prepare` sizes the pools the recording allocates from.
        CapturedGraph::prepare(&device).expect("prepare the capture");
        drop(captured.step(2, &inputs));
        // What the recorded step would write itself, written before it (and each replay).
        let prepare = |training: &Training, iteration: u64| {
            seed_micro_batch(1, iteration, 0);
            write_dropout_salt(&device);
            training
                .adam
                .write_next_step_values(learning_rates(iteration));
        };
        prepare(&captured, 3);
        // cuBLAS's products included on CUDA (as training does).
        let (loss, graph) =
            CapturedGraph::record(&device, || captured.step(3, &inputs)).expect("start_capture");
        let graph = graph.expect("stop_capture");
        // SAFETY: every buffer the graph reads or writes stays allocated (the models, the
        // optimizers' buffers, the inputs, the loss held here), and what runs in between (the
        // eager steps) holds no buffer past its end.
        let replay = || unsafe { graph.replay().expect("replay") };
        replay();
        let got = (
            loss.clone().try_into_vec_as::<f32>().unwrap(),
            captured.weights(),
        );
        let same = got == want;
        println!(
            "replayed step 3 equals the eager step 3 bit for bit (loss and weights): {same} \
             (loss {:?})",
            want.0
        );
        assert!(same, "the replayed step differs from the eager one");
        // Both runs go on from step 4; a replay does not advance the optimizer's own count,
        // so its bias corrections stay those of step 4 (the time is the same).
        let eager_ms = time(&mut |k| drop(eager.step(4 + k, &inputs)));
        let replay_ms = time(&mut |k| {
            seed_micro_batch(1, 4 + k, 0);
            write_dropout_salt(&device);
            captured.adam.write_next_step_values(learning_rates(4 + k));
            replay();
        });
        println!(
            "ms per step: eager {eager_ms:.2}, replayed {replay_ms:.2}, eager / replayed {:.2}x",
            eager_ms / replay_ms
        );
    }
}
