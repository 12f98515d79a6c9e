//! Load on `serve`: requests/s, generated tokens/s and p50/p99 latency at 1, 4 and 16
//! concurrent clients, with the queue's batching (`--max-batch-rows 64`) against one request at
//! a time (`--max-batch-rows 1`, the baseline), same checkpoint, same requests, same run.
//!
//! ```text
//! cargo bench --bench serve_load
//! ```
//!
//! Model: 6 layers, hidden 384, 6 heads, 1024 positions, GPT-2 vocabulary (one training
//! iteration on the WikiText-2 fixture, fp32, CPU). Each client sends
//! `FERROTRON_BENCH_REQUESTS` (default 8) `PUT /api` requests of one prompt and 32 greedy
//! tokens, over loopback only. Also prints the server's peak RSS.

use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PROMPTS: [&str; 8] = [
    "The history of the city",
    "In 1908 the fleet",
    "Route 29 crosses back into",
    "The team then won seven matches",
    "He was cast in the 2005 theatre",
    "The Bill in 2000 was",
    "Robert is an English film",
    "The senators of Rome",
];

fn main() {
    let requests: usize = std::env::var("FERROTRON_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let dir = tempfile::tempdir().expect("temporary directory");
    train_one_iteration(dir.path());
    println!("serve, PUT /api, one prompt and 32 greedy tokens per request, {requests} requests per client (6 layers, hidden 384, CPU):");
    println!("| clients | server | requests/s | tokens/s | p50 ms | p99 ms | ratio (tokens/s) | server peak RSS MiB |");
    println!("|---|---|---|---|---|---|---|---|");
    for clients in [1, 4, 16] {
        let one = measure(dir.path(), "1", clients, requests);
        let batched = measure(dir.path(), "64", clients, requests);
        for (name, m, ratio) in [
            ("one at a time", &one, 1.0),
            ("batched", &batched, batched.tokens_per_s / one.tokens_per_s),
        ] {
            println!(
                "| {clients} | {name} | {:.2} | {:.1} | {:.0} | {:.0} | {ratio:.2}× | {:.0} |",
                m.requests_per_s, m.tokens_per_s, m.p50_ms, m.p99_ms, m.peak_rss_mib
            );
        }
    }
}

fn train_one_iteration(dir: &Path) {
    let data = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden/wikitext2_valid_text_document");
    let status = Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args([
            "--num-layers",
            "6",
            "--hidden-size",
            "384",
            "--num-attention-heads",
            "6",
        ])
        .args(["--seq-length", "128", "--max-position-embeddings", "1024"])
        .args([
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--lr",
            "1e-4",
        ])
        .args(["--train-iters", "1", "--eval-iters", "0", "--save", "ckpt"])
        .arg("--data-path")
        .arg(&data)
        .current_dir(dir)
        .stdout(Stdio::null())
        .status()
        .expect("pretrain runs");
    assert!(status.success(), "pretrain failed");
}

struct Measured {
    requests_per_s: f64,
    tokens_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    peak_rss_mib: f64,
}

fn start_server(dir: &Path, max_batch_rows: &str) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_serve"))
        .args([
            "--load",
            "ckpt",
            "--port",
            "0",
            "--max-batch-rows",
            max_batch_rows,
        ])
        .current_dir(dir)
        .stdout(Stdio::piped())
        .spawn()
        .expect("serve starts");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the listening line");
    let url = line.trim().trim_start_matches("listening on ").to_string();
    (child, url)
}

fn measure(dir: &Path, max_batch_rows: &str, clients: usize, requests: usize) -> Measured {
    let (mut child, url) = start_server(dir, max_batch_rows);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into();
    let put = |body: serde_json::Value| -> serde_json::Value {
        let mut response = agent
            .put(format!("{url}/api"))
            .content_type("application/json")
            .send(body.to_string())
            .expect("an answer");
        serde_json::from_str(&response.body_mut().read_to_string().expect("a body")).expect("JSON")
    };
    // Each prompt's own length (no new tokens), so that only generated tokens are counted.
    let prompt_lengths: Vec<usize> = PROMPTS
        .iter()
        .map(|p| {
            let answer =
                put(serde_json::json!({"prompts": [p], "tokens_to_generate": 0, "logprobs": true}));
            answer["tokens"][0].as_array().map_or(0, Vec::len)
        })
        .collect();
    let ask = |i: usize| -> (Duration, usize) {
        let i = i % PROMPTS.len();
        let body =
            serde_json::json!({"prompts": [PROMPTS[i]], "tokens_to_generate": 32, "top_k": 1});
        let start = Instant::now();
        let answer = put(body);
        let tokens = answer["tokens"][0].as_array().map_or(0, Vec::len);
        (start.elapsed(), tokens.saturating_sub(prompt_lengths[i]))
    };
    ask(0); // warm-up
    let start = Instant::now();
    let mut latencies: Vec<(Duration, usize)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                scope.spawn(move || {
                    (0..requests)
                        .map(|r| ask(c * requests + r))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("client"))
            .collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let peak_rss_mib = peak_rss_of(child.id());
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    latencies.sort();
    let ms = |q: f64| {
        latencies[((latencies.len() - 1) as f64 * q).round() as usize]
            .0
            .as_secs_f64()
            * 1e3
    };
    let total = latencies.len();
    let generated: usize = latencies.iter().map(|l| l.1).sum();
    Measured {
        requests_per_s: total as f64 / elapsed,
        tokens_per_s: generated as f64 / elapsed,
        p50_ms: ms(0.5),
        p99_ms: ms(0.99),
        peak_rss_mib,
    }
}

/// `VmHWM` of a process, in MiB.
fn peak_rss_of(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}
