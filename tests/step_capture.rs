//! The GPT's forward and backward captured as a graph on a CubeCL device (CubeCL's graph
//! capture; lavapipe here, where it records a software graph, one CUDA graph on CUDA) and
//! replayed: the replay must give the eager step's loss and gradients bit for bit. That holds
//! only while the step neither writes to nor reads from the device between its launches (a
//! host upload or a host read inside it fails the capture), which a captured training step —
//! one launch for the host where the eager step makes about 1,200 — needs
//! (docs/gpu.md, "Captured steps").
//!
//! Each test runs in a process of its own: a capture holds its device stream, and other tests'
//! reads on a stream folded onto the same one would be refused while it records.
#![cfg(feature = "wgpu")]

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};
use ferrotron::model::GptConfig;
use ferrotron::optim::Precision;
use ferrotron::parallel::random::seed_micro_batch;
use ferrotron::training::step_graph::write_dropout_salt;
use ferrotron::util::device::parse_device;
use ferrotron::util::graph::CapturedGraph;

// Each test runs in a process of its own (one CubeCL device per process: see the module), so
// that captures, which hold a device's stream, need not wait for each other.
use crate::common::own_process::ran_in_own_process;

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

fn read(loss: Tensor<1>, grads: Vec<Tensor<1>>) -> (Vec<f32>, Vec<Vec<f32>>) {
    let f32s = |t: Tensor<1>| t.try_into_vec_as::<f32>().unwrap();
    (f32s(loss), grads.into_iter().map(f32s).collect())
}

/// Two layers in f16 (the working copy cast inside the step, as training does) with dropout,
/// the fused kernels and the attention core from the QKV rows: the replay equals the eager
/// step, a second replay equals the first (the graph keeps no state of its own), and with
/// another iteration's dropout salt written between replays the replay equals that
/// iteration's eager step (the masks' only per-step input is that salt).
#[test]
fn a_captured_forward_and_backward_replays_the_eager_step() {
    if ran_in_own_process() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let base = parse_device("wgpu-cpu").unwrap();
    let device = base.clone().autodiff();
    let (b, s, vocab) = (2, 16, 96);
    let main = GptConfig::new(2, 32, 4, s, vocab).init(5, &device).unwrap();
    let ids = |shift: i64| {
        let v: Vec<i64> = (0..(b * s) as i64)
            .map(|i| (i * 7 + shift) % vocab as i64)
            .collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [b, s]), &device)
    };
    let (tokens, labels) = (ids(0), ids(1));
    let mask = Tensor::<2>::ones([b, s], &device);
    let step_of = |iteration| {
        seed_micro_batch(3, iteration, 0);
        let model = Precision::Fp16.working_copy(&main);
        let loss = model.lm_loss(tokens.clone(), labels.clone(), mask.clone());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        (loss.detach().inner(), flat_gradients(&model, grads))
    };
    let step = || step_of(1);
    let (loss, grads) = step();
    let eager = read(loss, grads);
    assert!(
        eager.0[0].is_finite() && eager.1.len() == 28,
        "{:?}",
        eager.0
    );

    CapturedGraph::prepare(&device).expect("prepare the capture");
    drop(step());
    let ((loss, grads), graph) = CapturedGraph::record(&device, step).expect("start_capture");
    let graph = graph.expect("stop_capture");
    // SAFETY: every buffer the graph touches stays allocated (the weights, the inputs and the
    // outputs held here), and what runs on the device between replays (the eager step below)
    // holds no buffer past its end.
    let replay = || unsafe { graph.replay().expect("replay") };
    for replay_index in 0..2 {
        replay();
        let replayed = read(loss.clone(), grads.clone());
        assert!(
            replayed == eager,
            "replay {replay_index}: loss {:?} against the eager {:?}, or a gradient differs",
            replayed.0,
            eager.0
        );
    }

    // Another iteration: the eager step draws other masks; the graph replays them once that
    // micro-batch's dropout salt is written into the buffer its launches read.
    let (loss_2, grads_2) = step_of(2);
    let eager_2 = read(loss_2, grads_2);
    assert!(eager_2 != eager, "another iteration drew the same masks");
    for (iteration, want) in [(2, &eager_2), (1, &eager), (2, &eager_2)] {
        seed_micro_batch(3, iteration, 0);
        write_dropout_salt(&device);
        replay();
        let replayed = read(loss.clone(), grads.clone());
        assert!(
            &replayed == want,
            "the replay with iteration {iteration}'s salt: loss {:?} against the eager {:?}",
            replayed.0,
            want.0
        );
    }
}

/// The tests of this file one at a time where they share a process: a capture holds the
/// device's stream.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A model, its f16 working copy and the flat-buffer Adam: what a training step changes.
struct Training {
    main: ferrotron::model::Gpt,
    working: ferrotron::model::Gpt,
    adam: ferrotron::optim::FlatAdamW,
}

impl Training {
    fn new(device: &burn::tensor::Device) -> Self {
        use ferrotron::optim::{AdamWConfig, FlatAdamW, OptimizerSetup};
        let main = GptConfig::new(2, 32, 4, 16, 96).init(5, device).unwrap();
        let adam = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let setup = OptimizerSetup::for_module(&main, adam, 1.0);
        Self {
            working: Precision::Fp16.working_copy(&main),
            main,
            adam: FlatAdamW::new(setup, None),
        }
    }

    /// One step of iteration `iteration` (forward, backward, flat Adam, the working copy cast
    /// in place): its loss, on the device.
    fn step(&mut self, iteration: u64, batch: &[Tensor<2, Int>; 2], mask: &Tensor<2>) -> Tensor<1> {
        use ferrotron::optim::{GradientAccumulator, Optimizer};
        seed_micro_batch(3, iteration, 0);
        let loss = self
            .working
            .lm_loss(batch[0].clone(), batch[1].clone(), mask.clone());
        let mut grads = GradientAccumulator::default();
        grads.add(&self.working, loss.backward());
        let (main, _norm) = self
            .adam
            .step(self.main.clone(), &mut grads, learning_rates(iteration))
            .unwrap();
        self.working = self
            .adam
            .working_copy(&main, burn::tensor::FloatDType::F16, None)
            .expect("a flat working copy");
        self.main = main;
        loss.detach().inner()
    }

    /// The fp32 main weights, read.
    fn weights(&self) -> Vec<Vec<f32>> {
        ferrotron::model::named_parameters::named_parameters(&self.main)
            .into_iter()
            .map(|p| p.values)
            .collect()
    }
}

/// A learning rate that changes every step (as a warm-up's does).
fn learning_rates(iteration: u64) -> ferrotron::optim::LearningRates {
    let base = 1e-3 * iteration as f64;
    ferrotron::optim::LearningRates {
        base,
        decoupled: base,
    }
}

/// Whole training steps — forward, backward, the flat-buffer Adam and the f16 working copy
/// cast in place — captured once and replayed: steps 3 and 4 replayed (each with its
/// iteration's dropout salt and its learning rate and bias corrections written before the
/// replay) give the eager run's losses and weights bit for bit.
#[test]
fn captured_training_steps_replay_the_eager_steps() {
    if ran_in_own_process() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let base = parse_device("wgpu-cpu").unwrap();
    let device = base.clone().autodiff();
    let (b, s, vocab) = (2, 16, 96);
    let ids = |shift: i64| {
        let v: Vec<i64> = (0..(b * s) as i64)
            .map(|i| (i * 5 + shift) % vocab as i64)
            .collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [b, s]), &device)
    };
    let batch = [ids(0), ids(1)];
    let mask = Tensor::<2>::ones([b, s], &device);

    let mut eager = Training::new(&device);
    let mut want = Vec::new();
    for iteration in 1..=4 {
        let loss = eager.step(iteration, &batch, &mask);
        want.push((loss.try_into_vec_as::<f32>().unwrap(), eager.weights()));
    }

    let mut captured = Training::new(&device);
    drop(captured.step(1, &batch, &mask));
    CapturedGraph::prepare(&device).expect("prepare the capture");
    drop(captured.step(2, &batch, &mask));
    // What the recorded step would write itself, written before it.
    let prepare = |training: &Training, iteration: u64| {
        seed_micro_batch(3, iteration, 0);
        write_dropout_salt(&device);
        training
            .adam
            .write_next_step_values(learning_rates(iteration));
    };
    prepare(&captured, 3);
    let (loss, graph) =
        CapturedGraph::record(&device, || captured.step(3, &batch, &mask)).expect("start_capture");
    let graph = graph.expect("stop_capture");
    for iteration in 3..=4 {
        if iteration > 3 {
            prepare(&captured, iteration);
        }
        // SAFETY: the graph's buffers stay allocated (the model, the optimizer's buffers, the
        // inputs, the loss held here) and nothing else runs on the device in between.
        unsafe { graph.replay().expect("replay") };
        let got = (
            loss.clone().try_into_vec_as::<f32>().unwrap(),
            captured.weights(),
        );
        let expected = &want[iteration as usize - 1];
        assert_eq!(got.0, expected.0, "step {iteration}: the loss");
        assert!(got.1 == expected.1, "step {iteration}: the weights differ");
    }
}

/// A small GPT trained through `pretrain` (fp32 on lavapipe, dropout, two micro-batches per
/// step, a warm-up then cosine learning rate, clipping, weight decay, a validation every
/// 4 iterations), `iters` iterations,
/// saving to `save` and resuming from `load`, the step captured after two warm-up steps when
/// `graph`.
fn small_run(
    cache: &std::path::Path,
    iters: u64,
    graph: bool,
    (save, load): (Option<&std::path::Path>, Option<&std::path::Path>),
) -> ferrotron::training::PretrainOutcome {
    let cfg = small_config(cache, iters, graph, (save, load));
    ferrotron::training::pretrain(&cfg, &parse_device("wgpu-cpu").unwrap().autodiff()).unwrap()
}

/// [`small_run`]'s configuration.
fn small_config(
    cache: &std::path::Path,
    iters: u64,
    graph: bool,
    (save, load): (Option<&std::path::Path>, Option<&std::path::Path>),
) -> ferrotron::training::PretrainConfig {
    use std::sync::Arc;

    use ferrotron::data::{DataSources, MockDocuments};
    use ferrotron::training::{LrDecayStyle, LrSchedule, PretrainConfig};
    PretrainConfig {
        seq_length: 16,
        micro_batch_size: 2,
        global_batch_size: 4,
        train_iters: iters,
        schedule: LrSchedule {
            max_lr: 2e-3,
            min_lr: 1e-4,
            warmup_steps: 3.0,
            decay_steps: 9.0,
            style: LrDecayStyle::Cosine,
            ..Default::default()
        },
        split: "90,10,0".into(),
        data_cache_path: Some(cache.to_path_buf()),
        log_interval: 1,
        eval_interval: 4,
        eval_iters: 1,
        save: save.map(|p| p.to_path_buf()),
        save_interval: save.map(|_| iters),
        load: load.map(|p| p.to_path_buf()),
        cuda_graph_warmup_steps: graph.then_some(2),
        ..PretrainConfig::new(
            GptConfig::new(2, 32, 4, 16, 512)
                .with_hidden_dropout(0.1)
                .with_attention_dropout(0.1),
            DataSources::Mock(Arc::new(MockDocuments::new(512, 511))),
        )
    }
}

/// `pretrain` with `--cuda-graph-impl local --cuda-graph-scope full_iteration`: the steps after
/// the warm-up are replays of one captured step (both micro-batches and their gradients' sum
/// in it), and the run logs the eager run's losses,
/// gradient norms and validation loss (evaluated between two replays) bit for bit; its
/// checkpoint (weights, Adam's moments and step count) resumes into the eager run's next
/// iterations.
#[test]
fn pretrain_with_a_captured_step_trains_as_the_eager_run() {
    if ran_in_own_process() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (cache, saved) = (dir.path().join("cache"), dir.path().join("checkpoint"));
    let eager = small_run(&cache, 9, false, (None, None));
    let graph = small_run(&cache, 6, true, (Some(&saved), None));
    assert_eq!(
        graph.replayed_iterations, 4,
        "iterations 3-6 replay the captured step"
    );
    assert_eq!(eager.replayed_iterations, 0);
    assert_eq!(graph.losses, eager.losses[..6], "the captured run's losses");
    assert_eq!(
        graph.grad_norms,
        eager.grad_norms[..6],
        "its gradient norms"
    );
    // Evaluation runs eagerly between two replays, on the weights the replays updated.
    assert_eq!(
        graph.validation[..1],
        eager.validation[..1],
        "the validation at iteration 4"
    );
    let resumed = small_run(&cache, 9, false, (None, Some(&saved)));
    assert_eq!(
        resumed.losses,
        eager.losses[6..],
        "the run resumed from its checkpoint"
    );
}

/// A change to [`small_config`]'s run.
type Variant = dyn Fn(&mut ferrotron::training::PretrainConfig);

/// The captured step with the model's other paths: the fused attention, selective and full
/// recomputation, and a Llama-style model (rotary embeddings, RMSNorm, SwiGLU, grouped-query
/// attention, an untied output layer, no biases): each run captures its step and logs the
/// eager run's losses bit for bit.
#[test]
fn captured_steps_cover_flash_attention_recomputation_and_llama_models() {
    if ran_in_own_process() {
        return;
    }
    use ferrotron::model::{Normalization, PositionEmbedding, Recompute};
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let device = parse_device("wgpu-cpu").unwrap().autodiff();
    let variants: [(&str, &Variant); 4] = [
        ("flash attention, selective recomputation", &|c| {
            c.model = c.model.clone().with_flash_attention(true);
            c.recompute = Recompute::Selective;
        }),
        // The GPU's candidate for PyTorch's memory (docs/gpu.md, "Measured on a GPU").
        ("composed attention, selective recomputation", &|c| {
            c.recompute = Recompute::Selective;
        }),
        ("full uniform recomputation", &|c| {
            c.recompute = Recompute::Uniform(1)
        }),
        ("Llama-style", &|c| {
            c.model = c
                .model
                .clone()
                .with_position_embedding_type(PositionEmbedding::Rope)
                .with_normalization(Normalization::RmsNorm)
                .with_swiglu(true)
                .with_num_query_groups(Some(2))
                .with_untie_embeddings_and_output_weights(true)
                .with_add_bias_linear(false);
        }),
    ];
    for (what, variant) in variants {
        let run = |graph: bool| {
            let mut cfg = small_config(dir.path(), 5, graph, (None, None));
            variant(&mut cfg);
            ferrotron::training::pretrain(&cfg, &device).unwrap()
        };
        let (eager, captured) = (run(false), run(true));
        assert_eq!(
            captured.replayed_iterations, 3,
            "{what}: iterations 3-5 replayed"
        );
        assert_eq!(captured.losses, eager.losses, "{what}: the losses");
    }
}
