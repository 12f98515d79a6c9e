//! The training loop: a resumed run reproduces the uninterrupted run's losses exactly, the
//! checkpoint layout is Megatron's, and the command line refuses what it cannot do.

use std::path::Path;

use burn::tensor::Device;
use ferrotron::data::DataSources;
use ferrotron::model::{GptConfig, Recompute};
use ferrotron::training::{pretrain, LrDecayStyle, LrSchedule, ParallelConfig, PretrainConfig};

use crate::common::*;

fn tiny(cache: &Path) -> PretrainConfig {
    PretrainConfig {
        seq_length: 16,
        micro_batch_size: 2,
        global_batch_size: 4,
        train_iters: 6,
        schedule: LrSchedule {
            max_lr: 3e-3,
            min_lr: 1e-4,
            warmup_steps: 8.0,
            decay_steps: 24.0,
            style: LrDecayStyle::Cosine,
            ..Default::default()
        },
        seed: 42,
        split: "90,10,0".into(),
        data_cache_path: Some(cache.to_path_buf()),
        log_interval: 1,
        eval_interval: 3,
        eval_iters: 1,
        ..PretrainConfig::new(
            GptConfig::new(1, 16, 2, 16, 50304)
                .with_hidden_dropout(0.1)
                .with_attention_dropout(0.1),
            DataSources::single(golden("wikitext2_valid", "text")),
        )
    }
}

#[test]
fn resuming_reproduces_the_uninterrupted_run_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let device = Device::flex().autodiff();
    let base = tiny(dir.path());
    let full = pretrain(
        &PretrainConfig {
            save: Some(dir.path().join("full")),
            ..base.clone()
        },
        &device,
    )
    .unwrap();
    assert_eq!(full.losses.len(), 6);

    let ckpt = dir.path().join("ckpt");
    let first = pretrain(
        &PretrainConfig {
            save: Some(ckpt.clone()),
            exit_interval: Some(3),
            ..base.clone()
        },
        &device,
    )
    .unwrap();
    assert_eq!(first.iteration, 3);
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt"))
            .unwrap()
            .trim(),
        "3"
    );
    assert!(ckpt
        .join("iter_0000003/mp_rank_00/model_optim_rng.safetensors")
        .is_file());
    let second = pretrain(
        &PretrainConfig {
            save: Some(ckpt.clone()),
            load: Some(ckpt.clone()),
            ..base
        },
        &device,
    )
    .unwrap();

    let resumed: Vec<(u64, f64)> = first.losses.iter().chain(&second.losses).copied().collect();
    assert_eq!(
        resumed, full.losses,
        "losses after resume differ from the uninterrupted run"
    );
    assert_eq!(second.validation.last(), full.validation.last());
    // The staging directory of a save never stays behind.
    assert!(
        list_dir(&ckpt).iter().all(|n| !n.starts_with('.')),
        "{:?}",
        list_dir(&ckpt)
    );

    // Loading it into another model shape is refused with a one-line reason.
    let mut deeper = tiny(dir.path());
    deeper.model = GptConfig::new(2, 16, 2, 16, 50304);
    deeper.load = Some(ckpt.clone());
    let err = format!("{:#}", pretrain(&deeper, &device).unwrap_err());
    assert!(
        err.contains("the checkpoint is a model of 1 layers, hidden size 16, 2 heads, 16 positions, FFN width 64")
            && err.contains("this run asks for 2 layers")
            && !err.contains('\n'),
        "{err}"
    );
}

/// The bundled sample, GPT-2's vocabulary and merges, and a data cache under `dir`.
fn seed_tutorial_paths(dir: &Path) -> [String; 4] {
    [
        golden("wikitext2_valid", "text"),
        fixture("../../assets/gpt2/vocab.json"),
        fixture("../../assets/gpt2/merges.txt"),
        dir.join("cache"),
    ]
    .map(|p| p.to_str().unwrap().to_owned())
}

/// The flags of Megatron-LM's seed tutorial as its scripts pass them (`--flag=value`, a
/// repeated flag whose last value wins, flags for Megatron's own machinery), on the bundled
/// sample, with a tensor-parallel size of 4.
fn seed_tutorial_args(paths: &[String; 4]) -> Vec<&str> {
    let [data, vocab, merges, cache] = paths.each_ref().map(String::as_str);
    vec![
        "--use-mcore-models",
        "--num-workers",
        "2",
        "--distributed-timeout-minutes=10",
        "--context-parallel-size",
        "1",
        "--train-iters",
        "7",
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--lr",
        "0.00015",
        "--train-iters",
        "2",
        "--lr-decay-iters",
        "300",
        "--lr-decay-style",
        "cosine",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--lr-warmup-fraction",
        ".01",
        "--fp16",
        "--log-interval",
        "1",
        "--save-interval",
        "500",
        "--eval-interval",
        "100",
        "--eval-iters=1",
        // Megatron's default 969,30,1 leaves the test split of these 60 documents empty: it
        // has no dataset and no evaluation, as in the Megatron-LM of the seed tutorial.
        "--split",
        "969,30,1",
        "--activations-checkpoint-method",
        "uniform",
        "--save",
        "ckpt",
        "--load",
        "ckpt",
        "--data-path",
        data,
        "--tensor-model-parallel-size",
        "4",
        "--pipeline-model-parallel-size",
        "1",
        "--DDP-impl",
        "torch",
        "--data-cache-path",
        cache,
    ]
}

/// Runs `pretrain` with `args` and `extra`, and checks that it exits with `code` before any
/// work, saying `message`, without a panic.
fn assert_refused(dir: &Path, args: &[&str], extra: &[&str], code: i32, message: &str) {
    let mut bad = args.to_vec();
    bad.extend_from_slice(extra);
    let out = run_tool(env!("CARGO_BIN_EXE_pretrain"), &bad, dir);
    assert_eq!(out.status.code(), Some(code), "{extra:?}: {}", stderr(&out));
    assert_refused_saying(&out, message);
}

/// `args` with the value of `flag` replaced by `value`.
fn with_value<'a>(args: &[&'a str], flag: &str, value: &'a str) -> Vec<&'a str> {
    let mut changed = args.to_vec();
    let at = changed.iter().position(|a| *a == flag).expect("the flag");
    changed[at + 1] = value;
    changed
}

#[test]
fn pretrain_cli_runs_the_seed_tutorial_flags() {
    let dir = tempfile::tempdir().unwrap();
    let paths = seed_tutorial_paths(dir.path());
    let args = seed_tutorial_args(&paths);
    let out = run_tool(env!("CARGO_BIN_EXE_pretrain"), &args, dir.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}\n{stdout}");
    assert!(
        stdout.contains(" > padded vocab (size: 50257) with 431 dummy tokens (new size: 50688)"),
        "{stdout}"
    );
    assert!(
        stdout.contains(" iteration        2/       2 | consumed samples:            8 |"),
        "{stdout}"
    );
    assert!(
        stdout.contains(" > tensor model parallel size: 4"),
        "{stdout}"
    );
    assert_eq!(
        list_dir(&dir.path().join("ckpt/iter_0000002")),
        ["mp_rank_00", "mp_rank_01", "mp_rank_02", "mp_rank_03"]
    );
    assert!(
        stdout.contains("using world size: 4, data-parallel size: 1, context-parallel size: 1, hierarchical context-parallel sizes: None, tensor-model-parallel size: 4, pipeline-model-parallel size: 1"),
        "{stdout}"
    );
    assert!(
        err.contains("warning: accepted and ignored")
            && err.contains("the math is unchanged): --use-mcore-models --num-workers --distributed-timeout-minutes\n"),
        "{err}"
    );
    assert!(
        stdout.contains("the test split of") && stdout.contains("gets none of its 60 documents: there is no test dataset and its evaluation is skipped")
            && !stdout.contains("for test data"),
        "{stdout}"
    );
    // --DDP-impl torch is accepted silently: it names ferrotron's data-parallel all-reduce.
    assert!(!err.contains("--DDP-impl"), "{err}");
    // --fp16 is mixed precision now: fp16 model, dynamic loss scale from 2^32, whose first
    // iterations overflow and are skipped (the forward losses stay finite).
    assert!(!err.contains("--fp16"), "{err}");
    assert!(
        stdout.contains(" > mixed precision: model in torch.float16, fp32 main weights")
            && stdout.contains("| loss scale: 2147483648.0 |")
            && stdout.contains("| number of skipped iterations:   1 |")
            // Megatron leaves out the loss of a line whose iterations were all skipped.
            && !stdout.contains("lm loss: 0"),
        "{stdout}"
    );
    // --activations-checkpoint-method uniform is Megatron's recompute now, not a warning.
    assert!(!err.contains("checkpoint"), "{err}");
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 4 {
        assert!(
            err.contains("more than the"),
            "no warning about cores: {err}"
        );
    }
}

#[test]
fn pretrain_cli_refuses_what_it_cannot_split_and_contradicting_flags() {
    let dir = tempfile::tempdir().unwrap();
    let paths = seed_tutorial_paths(dir.path());
    let args = seed_tutorial_args(&paths);
    let dir = dir.path();
    // A flag that would change the math is refused with its reason; a misspelt one gets the
    // nearest real flag; neither starts any work (argparse's exit code 2).
    for (extra, message) in [
        (&["--fp8-format", "hybrid"][..], "--fp8-format hybrid: FP8 training is not implemented"),
        (&["--hybrid-context-parallel"][..], "--hybrid-context-parallel: hierarchical and hybrid context parallelism are not implemented"),
        (&["--num-layer", "2"][..], "unrecognized argument --num-layer (neither Megatron-LM nor ferrotron has it); did you mean --num-layers?"),
    ] {
        assert_refused(dir, &args, extra, 2, message);
    }
    // Heads that do not split over the ranks, a pipeline of one layer over two stages, and
    // heads that do not divide the hidden size: refused before any work.
    let heads = "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3";
    assert_refused(
        dir,
        &with_value(&args, "--tensor-model-parallel-size", "3"),
        &[],
        1,
        heads,
    );
    assert_refused(
        dir,
        &with_value(&args, "--pipeline-model-parallel-size", "2"),
        &[],
        1,
        "pipeline",
    );
    // A context-parallel split that leaves unequal chunks, and an exchange not implemented.
    assert_refused(
        dir,
        &with_value(
            &with_value(&args, "--tensor-model-parallel-size", "1"),
            "--context-parallel-size",
            "3",
        ),
        &[],
        1,
        "--seq-length 16 is not divisible by 2 × 3",
    );
    assert_refused(
        dir,
        &args,
        &["--cp-comm-type", "a2a"],
        1,
        "--cp-comm-type a2a is not implemented (p2p and allgather are)",
    );
    let odd_heads = with_value(
        &with_value(&args, "--hidden-size", "10"),
        "--num-attention-heads",
        "3",
    );
    let odd_heads = with_value(&odd_heads, "--tensor-model-parallel-size", "1");
    assert_refused(
        dir,
        &odd_heads,
        &[],
        1,
        "not divisible by --num-attention-heads",
    );
    // Precision flags that contradict each other, or a scale that is not one: one-line
    // errors, exit code 1, before any work.
    for (extra, message) in [
        (&["--bf16"][..], "--fp16 and --bf16 exclude each other"),
        (
            &["--loss-scale", "0"][..],
            "--loss-scale 0 must be a positive number",
        ),
        (&["--hysteresis", "0"][..], "--hysteresis of at least 1"),
        // Megatron's --recompute-activations makes the granularity selective, over the
        // legacy flag's full: the method is then an error, as in its arguments.py.
        (
            &["--recompute-activations"][..],
            "--recompute-method is for --recompute-granularity full, not selective",
        ),
        (
            &["--attention-backend", "sdpa"][..],
            "--attention-backend sdpa: expected flash, fused, unfused, local or auto",
        ),
        (
            &["--use-flash-attn", "--attention-backend", "unfused"][..],
            "--use-flash-attn asks for the flash backend and --attention-backend for unfused",
        ),
        // The kernel choices are flags, checked however the run's device is: a misspelled
        // value must not fall back on the default silently.
        (
            &["--cublas-ordering", "device-caller"][..],
            "--cublas-ordering device-caller: expected device or host",
        ),
    ] {
        assert_refused(dir, &args, extra, 1, message);
    }
}

/// A split that `--split` leaves without documents has no dataset: training runs and its
/// evaluation is skipped (as the Megatron-LM of the seed tutorial did), neither an error nor
/// a hang.
#[test]
fn a_split_without_documents_has_no_evaluation() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = PretrainConfig {
        split: "999,1,0".into(),
        train_iters: 3,
        ..tiny(dir.path())
    };
    let outcome = pretrain(&cfg, &Device::flex().autodiff()).unwrap();
    assert_eq!(outcome.losses.len(), 3);
    assert!(outcome.validation.is_empty() && outcome.test_loss.is_none());
}

/// CRC-32C bit by bit (the Castagnoli polynomial, reflected), independent of the writer's
/// table-driven crate.
fn crc32c_bitwise(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn read_varint(bytes: &[u8], pos: &mut usize) -> u64 {
    let (mut v, mut shift) = (0u64, 0);
    loop {
        let b = bytes[*pos];
        *pos += 1;
        v |= ((b & 0x7f) as u64) << shift;
        if b < 0x80 {
            return v;
        }
        shift += 7;
    }
}

/// Protobuf fields of `bytes`: (field number, wire type, raw value bytes or varint).
fn fields(bytes: &[u8]) -> Vec<(u64, u64, Vec<u8>, u64)> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < bytes.len() {
        let key = read_varint(bytes, &mut pos);
        let (field, wire) = (key >> 3, key & 7);
        match wire {
            0 => {
                let v = read_varint(bytes, &mut pos);
                out.push((field, wire, vec![], v));
            }
            1 => {
                out.push((field, wire, bytes[pos..pos + 8].to_vec(), 0));
                pos += 8;
            }
            2 => {
                let n = read_varint(bytes, &mut pos) as usize;
                out.push((field, wire, bytes[pos..pos + n].to_vec(), 0));
                pos += n;
            }
            5 => {
                out.push((field, wire, bytes[pos..pos + 4].to_vec(), 0));
                pos += 4;
            }
            w => panic!("unexpected wire type {w}"),
        }
    }
    out
}

/// Reads a TensorBoard event file independently: every record's checksums, then the scalars
/// as (tag, step, value).
fn read_event_file(path: &Path) -> (String, Vec<(String, u64, f32)>) {
    let data = std::fs::read(path).unwrap();
    let mask = |c: u32| c.rotate_right(15).wrapping_add(0xa282_ead8);
    let (mut pos, mut version, mut scalars) = (0, String::new(), Vec::new());
    while pos < data.len() {
        let len_bytes = &data[pos..pos + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(data[pos + 8..pos + 12].try_into().unwrap());
        assert_eq!(len_crc, mask(crc32c_bitwise(len_bytes)), "length checksum");
        let payload = &data[pos + 12..pos + 12 + len];
        let crc = u32::from_le_bytes(data[pos + 12 + len..pos + 16 + len].try_into().unwrap());
        assert_eq!(crc, mask(crc32c_bitwise(payload)), "payload checksum");
        pos += 16 + len;
        let event = fields(payload);
        let step = event.iter().find(|f| f.0 == 2).map_or(0, |f| f.3);
        for (field, _, raw, _) in &event {
            match field {
                3 => version = String::from_utf8(raw.clone()).unwrap(),
                5 => {
                    for value in fields(raw).into_iter().filter(|f| f.0 == 1) {
                        let parts = fields(&value.2);
                        let tag = parts.iter().find(|f| f.0 == 1).unwrap();
                        let v = parts.iter().find(|f| f.0 == 2 && f.1 == 5).unwrap();
                        scalars.push((
                            String::from_utf8(tag.2.clone()).unwrap(),
                            step,
                            f32::from_le_bytes(v.2.clone().try_into().unwrap()),
                        ));
                    }
                }
                _ => {}
            }
        }
    }
    (version, scalars)
}

#[test]
fn tensorboard_event_files_hold_megatrons_scalars() {
    let dir = tempfile::tempdir().unwrap();
    let tb = dir.path().join("tb");
    let cfg = PretrainConfig {
        tensorboard_dir: Some(tb.clone()),
        tensorboard_log_interval: 2,
        recompute: Default::default(),
        precision: Default::default(),
        loss_scale: None,
        dynamic_loss_scale: Default::default(),
        log_interval: 3,
        ..tiny(dir.path())
    };
    let out = pretrain(&cfg, &Device::flex().autodiff()).unwrap();
    let files = list_dir(&tb);
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].starts_with("events.out.tfevents."), "{files:?}");
    let (version, scalars) = read_event_file(&tb.join(&files[0]));
    assert_eq!(version, "brain.Event:2");
    let of = |tag: &str| -> Vec<(u64, f32)> {
        scalars
            .iter()
            .filter(|s| s.0 == tag)
            .map(|s| (s.1, s.2))
            .collect()
    };
    // Every --tensorboard-log-interval iterations: the same losses the run reports.
    let want: Vec<(u64, f32)> = out
        .losses
        .iter()
        .filter(|(i, _)| i % 2 == 0)
        .map(|&(i, l)| (i, l as f32))
        .collect();
    assert_eq!(of("lm loss"), want);
    for tag in ["learning-rate", "batch-size", "grad-norm", "loss-scale"] {
        assert_eq!(of(tag).len(), 3, "{tag}");
    }
    assert!(of("loss-scale").iter().all(|&(_, v)| v == 1.0));
    // The same against consumed samples (4 per iteration).
    let by_samples: Vec<(u64, f32)> = want.iter().map(|&(i, l)| (4 * i, l)).collect();
    assert_eq!(of("lm loss vs samples"), by_samples);
    assert!(of("batch-size").iter().all(|&(_, v)| v == 4.0));
    // Every --log-interval: timing; every --eval-interval: validation loss and perplexity.
    assert_eq!(
        of("iteration-time").iter().map(|s| s.0).collect::<Vec<_>>(),
        [3, 6]
    );
    assert!(of("tokens-per-sec").iter().all(|&(_, v)| v > 0.0));
    let valid = of("lm loss validation");
    let at_3 = out.validation.iter().find(|v| v.0 == 3).unwrap().1;
    assert_eq!(valid[0], (3, at_3 as f32));
    let ppl = of("lm loss validation ppl");
    assert!((ppl[0].1 - (at_3 as f32).exp()).abs() <= 1e-3 * ppl[0].1);
}

/// Decoded pixels of a PNG (RGB or RGBA, 8 bits).
fn png_pixels(path: &Path) -> (u32, u32, Vec<[u8; 3]>) {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let step = info.color_type.samples();
    let pixels = buf[..info.buffer_size()]
        .chunks(step)
        .map(|c| [c[0], c[1], c[2]])
        .collect();
    (info.width, info.height, pixels)
}

#[test]
fn the_loss_plot_is_drawn_from_the_metrics_and_the_plot_tool_redraws_runs() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = PretrainConfig {
        save: Some(dir.path().join("run")),
        ..tiny(dir.path())
    };
    pretrain(&cfg, &Device::flex().autodiff()).unwrap();
    let (w, h, pixels) = png_pixels(&dir.path().join("run/loss.png"));
    assert_eq!((w, h), (800, 500));
    let count = |c: [u8; 3]| pixels.iter().filter(|&&p| p == c).count();
    // The training line (blue), validation points (red) and dark text and axes.
    assert!(count([31, 119, 180]) > 200, "training line");
    assert!(count([214, 39, 40]) > 20, "validation points");
    let dark = pixels.iter().filter(|p| p.iter().all(|&v| v < 80)).count();
    assert!(dark > 1000, "axes and text: {dark} dark pixels");

    // Two runs on one SVG figure, with titled axes and a legend entry per run.
    let second = PretrainConfig {
        save: Some(dir.path().join("other")),
        seed: 43,
        ..tiny(dir.path())
    };
    pretrain(&second, &Device::flex().autodiff()).unwrap();
    let out = run_tool(
        env!("CARGO_BIN_EXE_plot"),
        &["run", "other/metrics.jsonl", "--output", "both.svg"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let svg = std::fs::read_to_string(dir.path().join("both.svg")).unwrap();
    for text in [
        "iteration",
        "lm loss",
        "run train",
        "other/metrics.jsonl validation",
    ] {
        assert!(svg.contains(text), "no {text:?} in the SVG");
    }
    // One colour per run (the line and its legend swatch).
    for colour in ["#1F77B4", "#2CA02C"] {
        assert!(
            svg.contains(&format!("stroke=\"{colour}\"")),
            "no {colour} line"
        );
    }
    // Against training tokens: the metrics count them (consumed samples × seq length), and
    // the axis says so.
    let metrics = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    assert_eq!(
        first["tokens"].as_u64().unwrap(),
        first["consumed_samples"].as_u64().unwrap() * cfg.seq_length as u64
    );
    let out = run_tool(
        env!("CARGO_BIN_EXE_plot"),
        &["run", "--x-axis", "tokens", "--output", "tokens.svg"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let svg = std::fs::read_to_string(dir.path().join("tokens.svg")).unwrap();
    assert!(svg.contains("training tokens"), "no token axis title");
    let out = run_tool(env!("CARGO_BIN_EXE_plot"), &["missing"], dir.path());
    assert!(!out.status.success());
    assert!(stderr(&out).contains("missing"), "{}", stderr(&out));
}

/// The lm-loss values of a pretrain log.
fn lm_losses(stdout: &str) -> Vec<String> {
    logged_losses(stdout)
        .into_iter()
        .map(|(_, loss)| loss)
        .collect()
}

#[test]
fn pretrain_cli_blends_datasets_from_each_of_megatrons_data_flags() {
    let dir = tempfile::tempdir().unwrap();
    let a = golden("wikitext2_valid", "text");
    let b = golden("wikitext2_test", "text");
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let cache = dir.path().join("cache");
    let common = [
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--lr",
        "0.00015",
        "--train-iters",
        "3",
        "--log-interval",
        "1",
        "--eval-interval",
        "100",
        "--eval-iters",
        "1",
        "--split",
        "90,5,5",
        "--data-cache-path",
        cache.to_str().unwrap(),
    ];
    let run = |extra: &[&str]| {
        let args: Vec<&str> = common.iter().chain(extra).copied().collect();
        run_tool(env!("CARGO_BIN_EXE_pretrain"), &args, dir.path())
    };
    let blended = run(&["--data-path", "0.3", a, "0.7", b]);
    let stdout = String::from_utf8_lossy(&blended.stdout).into_owned();
    assert!(blended.status.success(), "{}\n{stdout}", stderr(&blended));
    assert!(
        stdout.contains(" > train blend: 13 samples from 2 datasets, weights [0.3, 0.7]"),
        "{stdout}"
    );
    let losses = lm_losses(&stdout);
    assert_eq!(losses.len(), 3, "{stdout}");
    // ceil(12 · 0.3) + ceil(12 · 0.7) = 4 + 9 samples, as Megatron-Core counts them.
    // The same blend from a --data-args-path file trains on the same samples.
    std::fs::write(dir.path().join("blend.txt"), format!("0.3 {a}\n0.7 {b}\n")).unwrap();
    let from_file = run(&["--data-args-path", "blend.txt"]);
    assert!(from_file.status.success(), "{}", stderr(&from_file));
    assert_eq!(
        lm_losses(&String::from_utf8_lossy(&from_file.stdout)),
        losses
    );
    // One dataset alone trains on other samples.
    let single = run(&["--data-path", a]);
    assert!(single.status.success(), "{}", stderr(&single));
    assert_ne!(lm_losses(&String::from_utf8_lossy(&single.stdout)), losses);
    // Per split: a blend for training, whole datasets for validation and test.
    let per_split = run(&[
        "--train-data-path",
        "0.3",
        a,
        "0.7",
        b,
        "--valid-data-path",
        b,
        "--test-data-path",
        a,
    ]);
    let stdout = String::from_utf8_lossy(&per_split.stdout).into_owned();
    assert!(per_split.status.success(), "{}", stderr(&per_split));
    assert!(stdout.contains(" > train blend: 13 samples"), "{stdout}");
    assert!(
        stdout.contains("validation loss at the end of training"),
        "{stdout}"
    );
    // Mixed weights and prefixes, and both kinds of flags: clear errors, exit code 1.
    let bad = run(&["--data-path", "0.3", a, b, a]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(
        stderr(&bad).contains("stands where a weight should be"),
        "{}",
        stderr(&bad)
    );
    let bad = run(&["--data-path", a, "--train-data-path", b]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr(&bad).contains("not both"), "{}", stderr(&bad));
}

/// Recomputing layers (or only their attention cores) replays their dropout masks, so the run
/// is the same run: bitwise equal losses (training and validation) with every recompute
/// method and with selective recomputation, at TP = 1 and TP = 2.
#[test]
fn recomputation_gives_the_losses_of_keeping_activations() {
    let dir = tempfile::tempdir().unwrap();
    for tp in [1, 2] {
        let cfg = |recompute| PretrainConfig {
            model: GptConfig::new(3, 16, 2, 16, 50304)
                .with_hidden_dropout(0.1)
                .with_attention_dropout(0.1),
            train_iters: 30,
            eval_interval: 10,
            recompute,
            parallel: ParallelConfig {
                tensor_model_parallel_size: tp,
                pipeline_model_parallel_size: 1,
                num_layers_per_virtual_pipeline_stage: None,
                decoder_first_pipeline_num_layers: None,
                decoder_last_pipeline_num_layers: None,
                ..ParallelConfig::default()
            },
            ..tiny(dir.path())
        };
        let kept = pretrain(&cfg(Recompute::None), &Device::flex().autodiff()).unwrap();
        assert_eq!(kept.losses.len(), 30);
        for recompute in [
            Recompute::Uniform(1),
            Recompute::Uniform(2),
            Recompute::Block(1),
            Recompute::Selective,
        ] {
            let run = pretrain(&cfg(recompute), &Device::flex().autodiff()).unwrap();
            assert_eq!(run.losses, kept.losses, "{recompute:?}, TP {tp}");
            assert_eq!(run.validation, kept.validation, "{recompute:?}, TP {tp}");
        }
    }
}

/// Whole training runs follow Megatron-Core's schedules iteration by iteration: the
/// batch-size ramp-up (the step's global batch, hence its micro-batch count) and the
/// weight-decay increment reach the optimizer as in `tests/fixtures/megatron_schedules.json`
/// (Megatron-Core's `OptimizerParamScheduler` and batch-size calculator in a replay of its
/// training loop).
#[test]
fn training_runs_follow_megatron_cores_schedules() {
    use clap::Parser;
    use ferrotron::training::ScheduleArgs;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        schedule: ScheduleArgs,
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/megatron_schedules.json"
    );
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let device = Device::flex().autodiff();
    for name in ["rampup_cosine", "wd_cosine"] {
        let case = fixture["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap();
        let mut argv = vec!["pretrain".to_owned()];
        for (key, value) in case["args"].as_object().unwrap() {
            argv.push(format!("--{}", key.replace('_', "-")));
            match value {
                serde_json::Value::Array(v) => argv.extend(v.iter().map(|x| x.to_string())),
                serde_json::Value::String(s) => argv.push(s.clone()),
                other => argv.push(other.to_string()),
            }
        }
        let args = Cli::parse_from(argv).schedule;
        let r = args.resolve(16).unwrap();
        let outcome = pretrain(
            &PretrainConfig {
                micro_batch_size: args.micro_batch_size,
                global_batch_size: r.global_batch_size,
                train_iters: r.train_iters,
                train_samples: r.train_samples,
                batch_size_schedule: r.batch_size_schedule.clone(),
                schedule: r.lr.clone(),
                weight_decay_schedule: Some(r.weight_decay.clone()),
                eval_interval: 0,
                eval_iters: 0,
                log_interval: 100,
                ..tiny(dir.path())
            },
            &device,
        )
        .unwrap();
        let want = case["steps"].as_array().unwrap();
        assert_eq!(outcome.schedule.len(), want.len(), "{name}");
        for (got, want) in outcome.schedule.iter().zip(want) {
            let at = got.iteration;
            assert_eq!(at, want["iteration"].as_u64().unwrap());
            assert_eq!(
                got.global_batch_size as u64,
                want["global_batch_size"].as_u64().unwrap(),
                "{name} {at}"
            );
            for (value, key) in [(got.lr, "lr_used"), (got.weight_decay, "wd_used")] {
                let expected = want[key].as_f64().unwrap();
                assert!(
                    (value - expected).abs() <= 1e-12 * expected.abs().max(1e-300),
                    "{name} {at} {key}: {value} vs {expected}"
                );
            }
        }
        assert!(outcome.losses.iter().all(|(_, l)| l.is_finite()));
    }
}

/// `--decoupled-lr`: the word embedding and the output layer follow their own peak (here 0:
/// they stay at their initial values while everything else trains), and the other way round
/// (a base rate of 0 trains only them), with the replicated and the distributed optimizer.
#[test]
fn the_decoupled_learning_rate_trains_only_the_embedding_and_output_layer() {
    use ferrotron::model::named_parameters::named_parameters;
    let dir = tempfile::tempdir().unwrap();
    let device = Device::flex().autodiff();
    let base = tiny(dir.path());
    let model = base
        .model
        .clone()
        .with_untie_embeddings_and_output_weights(true);
    let initial: std::collections::HashMap<String, Vec<f32>> =
        named_parameters(&model.init(base.seed, &Device::flex()).unwrap())
            .into_iter()
            .map(|p| (p.name, p.values))
            .collect();
    let decoupled =
        |name: &str| name.starts_with("word_embeddings.") || name.starts_with("output_layer.");
    for (lr, decoupled_lr, distributed) in [(3e-3, 0.0, false), (0.0, 3e-3, true)] {
        let save = dir.path().join(format!("ckpt-{distributed}"));
        let schedule = LrSchedule {
            max_lr: lr,
            min_lr: 0.0,
            ..base.schedule.clone()
        };
        pretrain(
            &PretrainConfig {
                model: model.clone(),
                decoupled_schedule: Some(LrSchedule {
                    max_lr: decoupled_lr,
                    ..schedule.clone()
                }),
                schedule,
                save: Some(save.clone()),
                train_iters: 3,
                eval_interval: 0,
                parallel: ParallelConfig {
                    use_distributed_optimizer: distributed,
                    ..ParallelConfig::default()
                },
                ..base.clone()
            },
            &device,
        )
        .unwrap();
        let (trained, _) = ferrotron::checkpoint::load_model(&save, &Device::flex()).unwrap();
        let mut seen = 0;
        for p in named_parameters(&trained) {
            let moved = p.values != initial[&p.name];
            assert_eq!(
                moved,
                decoupled(&p.name) == (decoupled_lr > 0.0),
                "{} lr {lr} decoupled {decoupled_lr}",
                p.name
            );
            seen += usize::from(decoupled(&p.name));
        }
        assert_eq!(seen, 2);
    }
}
