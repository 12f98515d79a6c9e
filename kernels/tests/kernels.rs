//! Every kernel on wgpu (a GPU, or lavapipe on the CPU) against float64 references on fresh
//! random inputs: odd sizes, rows of 1, 17, 1000 and 5000, thousands of rows, and more rows
//! than one cube-count dimension holds (element-wise kernels: lengths that leave a partly
//! filled last cube). Outputs are poisoned with NaN first, so an element a
//! kernel forgets to write fails the comparison. Backward kernels are also checked against
//! central finite differences of the forward kernels.

use cubecl::device::WgpuDeviceKind;
use cubecl::prelude::*;
use cubecl::server::Handle;
use ferrotron_kernels::launch::*;
use ferrotron_kernels::rows::MAX_CUBES_PER_DIMENSION;

// Each test runs in a process of its own (one CubeCL device per process: see the module).
#[path = "../../tests/common/own_process.rs"]
mod own_process;
use own_process::{ran_in_own_process, ran_in_own_process_unoptimised};

fn client() -> Client {
    // FERROTRON_KERNEL_DEVICE=cpu runs them on cubecl-cpu instead (build with `--features cpu`).
    if std::env::var("FERROTRON_KERNEL_DEVICE").as_deref() == Ok("cpu") {
        #[cfg(feature = "cpu")]
        return cubecl::Device::cpu().expect("cubecl-cpu").client();
        #[cfg(not(feature = "cpu"))]
        panic!("FERROTRON_KERNEL_DEVICE=cpu needs `--features cpu`");
    }
    let device = cubecl::Device::wgpu(WgpuDeviceKind::Cpu)
        .or_else(|_| cubecl::Device::wgpu(WgpuDeviceKind::default()))
        .expect("this build links wgpu");
    device.client()
}

/// The launch shapes every kernel is checked with: this device's own (in vectors), NVIDIA's (a
/// 32-lane warp per row, four rows per cube, in vectors and one element at a time), one wide
/// cube per row, cubecl-cpu's one unit per row,
/// and row counts per cube that leave a partly filled last cube for the shapes below. The
/// softmaxes hold rows that fit in registers with some of them and read them in each pass with
/// the others (rows too long to hold are read in each pass by all).
///
/// A device without planes (cubecl-cpu) runs only the one-lane shapes: its barriers cost
/// seconds per cube, and the shapes with barriers are checked on wgpu.
fn launches(client: &Client) -> Vec<RowLaunch> {
    let own = RowLaunch::for_client(client);
    let mut all = vec![own];
    for (lanes, rows_per_cube, vectorized, held_in_registers) in [
        (32, 4, false, false),
        (32, 4, true, true),
        (256, 1, false, false),
        (16, 3, false, true),
        (1, 7, false, true),
    ] {
        if own.lanes == 1 && lanes > 1 {
            continue;
        }
        let launch = RowLaunch {
            lanes,
            rows_per_cube,
            plane_reduce: false,
            vectorized,
            held_in_registers,
        };
        if !all.contains(&launch) {
            all.push(launch);
        }
    }
    all
}

struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f32> {
        (0..n)
            .map(|_| (lo + (hi - lo) * self.uniform()) as f32)
            .collect()
    }
}

/// The draw keyed `(key_lo, key_hi)` that drops with probability `p`: a constant and a salt
/// whose XOR is that key, so that every kernel's masks also check that it reads the salt
/// from device memory and applies it.
fn test_draw(key_lo: u32, key_hi: u32, p: f64) -> DropoutDraw {
    let salt = 0x9E37_79B9_7F4A_7C15u64 ^ u64::from(key_lo.rotate_left(7));
    DropoutDraw {
        key_lo: key_lo ^ salt as u32,
        key_hi: key_hi ^ (salt >> 32) as u32,
        salt,
        salt_slot: u64::from(key_hi % 3),
        threshold: (p * 4294967296.0) as u32,
        scale: (1.0 / (1.0 - p)) as f32,
        slice: DrawSlice::WHOLE,
    }
}

fn upload(client: &Client, values: &[f32]) -> Handle {
    client.create_from_slice(f32::as_bytes(values))
}

/// The bit patterns of `v` (to compare results exactly, NaN and the sign of zero included).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn poisoned(client: &Client, n: usize) -> Handle {
    upload(client, &vec![f32::NAN; n.max(1)])
}

fn download(client: &Client, handle: Handle, n: usize) -> Vec<f32> {
    f32::from_bytes(&client.read_one_unchecked(handle))[..n].to_vec()
}

fn assert_close(what: &str, got: &[f32], want: &[f64], abs: f64, rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= abs + rel * w.abs(),
            "{what}: element {i}: got {g}, want {w} (error {err:e})"
        );
    }
}

/// Which keys query `i` of a `[.., sq, sk]` row sees.
fn visible(shape: ScoresShape, row: usize, j: usize, causal: bool, mask: Option<&[u32]>) -> bool {
    let i = row % shape.sq;
    let batch = row / (shape.sq * shape.heads);
    let causal_ok = !causal || j <= i + shape.sk - shape.sq;
    let mask_ok = mask.is_none_or(|m| m[(batch * shape.sq + i) * shape.sk + j] == 0);
    causal_ok && mask_ok
}

fn softmax_reference(
    x: &[f32],
    shape: ScoresShape,
    scale: f64,
    causal: bool,
    mask: Option<&[u32]>,
) -> Vec<f64> {
    let sk = shape.sk;
    let mut out = vec![0.0; x.len()];
    for row in 0..shape.rows() {
        let keep: Vec<usize> = (0..sk)
            .filter(|&j| visible(shape, row, j, causal, mask))
            .collect();
        if keep.is_empty() {
            continue;
        }
        let max = keep
            .iter()
            .map(|&j| scale * x[row * sk + j] as f64)
            .fold(f64::MIN, f64::max);
        let sum: f64 = keep
            .iter()
            .map(|&j| (scale * x[row * sk + j] as f64 - max).exp())
            .sum();
        for &j in &keep {
            out[row * sk + j] = (scale * x[row * sk + j] as f64 - max).exp() / sum;
        }
    }
    out
}

fn run_softmax(
    client: &Client,
    launch: RowLaunch,
    x: &[f32],
    shape: ScoresShape,
    scale: f32,
    causal: bool,
    mask: Option<&[u32]>,
) -> Vec<f32> {
    let input = upload(client, x);
    let output = poisoned(client, shape.len());
    let mask_handle = mask.map(|m| client.create_from_slice(u32::as_bytes(m)));
    let kind = match &mask_handle {
        Some(h) => SoftmaxMask::Padding(h),
        None => SoftmaxMask::Causal,
    };
    assert!(causal == mask.is_none());
    softmax_forward::<f32>(client, launch, &input, kind, &output, None, shape, scale);
    download(client, output, shape.len())
}

/// The softmax backward kernel's `dx` (with `causal`, for a causal softmax's `y`).
fn run_softmax_backward(
    client: &Client,
    launch: RowLaunch,
    y: &[f32],
    dy: &[f32],
    s: ScoresShape,
    causal: bool,
    scale: f32,
) -> Vec<f32> {
    let (yh, dyh, dx) = (
        upload(client, y),
        upload(client, dy),
        poisoned(client, y.len()),
    );
    softmax_backward::<f32>(client, launch, &yh, &dyh, &dx, s, causal, scale, None, None);
    download(client, dx, y.len())
}

/// `v` with NaN at the keys a causal softmax hides, in the vectors of `vector` wholly after
/// each query's last key (a vector holding a visible key is read whole).
fn poison_after_causal_limit(v: &[f32], s: ScoresShape, vector: usize) -> Vec<f32> {
    let mut v = v.to_vec();
    for (row, chunk) in v.chunks_mut(s.sk).enumerate() {
        let limit = row % s.sq + 1 + s.sk - s.sq;
        chunk[limit.div_ceil(vector) * vector..].fill(f32::NAN);
    }
    v
}

fn softmax_backward_reference(y: &[f32], dy: &[f32], sk: usize, scale: f64) -> Vec<f64> {
    let mut out = vec![0.0; y.len()];
    for (r, (yr, dyr)) in y.chunks(sk).zip(dy.chunks(sk)).enumerate() {
        let dot: f64 = yr.iter().zip(dyr).map(|(&a, &b)| a as f64 * b as f64).sum();
        for j in 0..sk {
            out[r * sk + j] = scale * yr[j] as f64 * (dyr[j] as f64 - dot);
        }
    }
    out
}

fn shape(batch: usize, heads: usize, sq: usize, sk: usize) -> ScoresShape {
    ScoresShape {
        batch,
        heads,
        sq,
        sk,
    }
}

#[test]
fn causal_softmax_forward_and_backward_match_float64() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(1);
    for launch in launches(&client) {
        for s in [
            shape(1, 1, 1, 1),
            shape(3, 5, 17, 17),
            shape(2, 3, 7, 17), // fewer queries than keys: query i sees keys up to i + 10
            shape(1, 2, 1000, 1000),
            shape(1, 1, 3, 5000),
            shape(4, 4, 128, 128),  // 2048 rows
            shape(1, 70_000, 1, 3), // more rows than one cube-count dimension
        ] {
            let scale = 0.125f32;
            let x = rng.vec(s.len(), -40.0, 40.0);
            let y = run_softmax(&client, launch, &x, s, scale, true, None);
            let want = softmax_reference(&x, s, scale as f64, true, None);
            assert_close(
                &format!("causal forward {s:?} {launch:?}"),
                &y,
                &want,
                1e-6,
                1e-5,
            );
            let dy = rng.vec(s.len(), -1.0, 1.0);
            let dx = run_softmax_backward(&client, launch, &y, &dy, s, true, scale);
            let want = softmax_backward_reference(&y, &dy, s.sk, scale as f64);
            assert_close(
                &format!("causal backward {s:?} {launch:?}"),
                &dx,
                &want,
                1e-6,
                1e-4,
            );
            // The hidden keys are never read: NaN there changes nothing, in either pass.
            let vector = launch.vector_size::<f32>(&client, s.sk);
            let x = poison_after_causal_limit(&x, s, vector);
            let poisoned_y = run_softmax(&client, launch, &x, s, scale, true, None);
            assert_eq!(
                bits(&poisoned_y),
                bits(&y),
                "causal forward read a hidden key {s:?}"
            );
            let (y, dy) = (
                poison_after_causal_limit(&y, s, vector),
                poison_after_causal_limit(&dy, s, vector),
            );
            let poisoned_dx = run_softmax_backward(&client, launch, &y, &dy, s, true, scale);
            assert_eq!(
                bits(&poisoned_dx),
                bits(&dx),
                "causal backward read a hidden key {s:?}"
            );
        }
    }
}

#[test]
fn padding_mask_softmax_matches_float64_and_zeroes_fully_masked_rows() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(2);
    for launch in launches(&client) {
        for s in [
            shape(2, 3, 5, 1),
            shape(2, 4, 9, 17),
            shape(3, 2, 64, 1000),
            shape(1, 2, 2, 5000),
            shape(2, 16, 64, 64),
        ] {
            let mut mask: Vec<u32> = (0..s.batch * s.sq * s.sk)
                .map(|_| (rng.uniform() < 0.3) as u32)
                .collect();
            // The first query of every batch sees nothing.
            for b in 0..s.batch {
                mask[b * s.sq * s.sk..b * s.sq * s.sk + s.sk].fill(1);
            }
            let x = rng.vec(s.len(), -20.0, 20.0);
            let y = run_softmax(&client, launch, &x, s, 0.5, false, Some(&mask));
            let want = softmax_reference(&x, s, 0.5, false, Some(&mask));
            assert_close(
                &format!("masked forward {s:?} {launch:?}"),
                &y,
                &want,
                1e-6,
                1e-5,
            );
            for b in 0..s.batch {
                for h in 0..s.heads {
                    let row = (b * s.heads + h) * s.sq;
                    assert!(
                        y[row * s.sk..(row + 1) * s.sk].iter().all(|&v| v == 0.0),
                        "fully masked row {row} of {s:?} {launch:?}"
                    );
                }
            }
            let dy = rng.vec(s.len(), -1.0, 1.0);
            let dx = run_softmax_backward(&client, launch, &y, &dy, s, false, 0.5);
            let want = softmax_backward_reference(&y, &dy, s.sk, 0.5);
            assert_close(
                &format!("masked backward {s:?} {launch:?}"),
                &dx,
                &want,
                1e-6,
                1e-4,
            );
        }
    }
}

#[test]
fn softmax_backward_matches_finite_differences_of_the_forward_kernel() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let launch = RowLaunch::for_client(&client);
    let mut rng = Rng(3);
    let s = shape(1, 2, 6, 6);
    let scale = 0.7f32;
    let x = rng.vec(s.len(), -2.0, 2.0);
    let dy = rng.vec(s.len(), -1.0, 1.0);
    // L(x) = Σ dy ⊙ softmax(x), evaluated in f64 from the kernel's f32 output.
    let loss = |x: &[f32]| -> f64 {
        let y = run_softmax(&client, launch, x, s, scale, true, None);
        y.iter().zip(&dy).map(|(&a, &b)| a as f64 * b as f64).sum()
    };
    let y = run_softmax(&client, launch, &x, s, scale, true, None);
    let dx = run_softmax_backward(&client, launch, &y, &dy, s, true, scale);
    let h = 1e-2f32;
    for i in 0..s.len() {
        let (mut plus, mut minus) = (x.clone(), x.clone());
        plus[i] += h;
        minus[i] -= h;
        let fd = (loss(&plus) - loss(&minus)) / (2.0 * h as f64);
        assert!(
            (dx[i] as f64 - fd).abs() < 2e-3,
            "element {i}: kernel {} vs finite difference {fd}",
            dx[i]
        );
    }
}

struct LayerNormRun {
    y: Vec<f32>,
    mean: Vec<f32>,
    rstd: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn run_layer_norm(
    client: &Client,
    launch: RowLaunch,
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    rows: usize,
    cols: usize,
    eps: f32,
) -> LayerNormRun {
    let (xh, gh, bh) = (
        upload(client, x),
        upload(client, gamma),
        upload(client, beta),
    );
    let (y, mean, rstd) = (
        poisoned(client, x.len()),
        poisoned(client, rows),
        poisoned(client, rows),
    );
    layer_norm_forward::<f32>(
        client, launch, &xh, &gh, &bh, &y, &mean, &rstd, rows, cols, eps,
    );
    LayerNormRun {
        y: download(client, y, x.len()),
        mean: download(client, mean, rows),
        rstd: download(client, rstd, rows),
    }
}

/// dx, dγ, dβ from the backward kernels, outputs poisoned first.
#[allow(clippy::too_many_arguments)]
fn run_layer_norm_backward(
    client: &Client,
    launch: RowLaunch,
    x: &[f32],
    gamma: &[f32],
    dy: &[f32],
    mean: &[f32],
    rstd: &[f32],
    rows: usize,
    cols: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let [xh, gh, dyh, mh, rh] = [x, gamma, dy, mean, rstd].map(|v| upload(client, v));
    let (dx, dg, db) = (
        poisoned(client, x.len()),
        poisoned(client, cols),
        poisoned(client, cols),
    );
    layer_norm_backward::<f32>(
        client, launch, &xh, &gh, &dyh, &mh, &rh, None, &dx, &dg, &db, rows, cols,
    );
    (
        download(client, dx, x.len()),
        download(client, dg, cols),
        download(client, db, cols),
    )
}

/// LayerNorm in float64: `(y, mean, 1/σ)` of `[rows, cols]` `x`, the variance in two passes.
fn layer_norm_reference(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    rows: usize,
    cols: usize,
    eps: f32,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; x.len()];
    let (mut means, mut rstds) = (vec![0.0; rows], vec![0.0; rows]);
    for r in 0..rows {
        let row: Vec<f64> = x[r * cols..(r + 1) * cols]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let mean = row.iter().sum::<f64>() / cols as f64;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / cols as f64;
        let rstd = 1.0 / (var + eps as f64).sqrt();
        means[r] = mean;
        rstds[r] = rstd;
        for j in 0..cols {
            y[r * cols + j] = (row[j] - mean) * rstd * gamma[j] as f64 + beta[j] as f64;
        }
    }
    (y, means, rstds)
}

/// LayerNorm's backward in float64 from the reference's `means` and `rstds`: `(dx, dγ, dβ)`.
fn layer_norm_backward_reference(
    x: &[f32],
    gamma: &[f32],
    dy: &[f32],
    means: &[f64],
    rstds: &[f64],
    cols: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut dx = vec![0.0; x.len()];
    let (mut dg, mut db) = (vec![0.0; cols], vec![0.0; cols]);
    for (r, (&mean, &rstd)) in means.iter().zip(rstds).enumerate() {
        let xhat: Vec<f64> = (0..cols)
            .map(|j| (x[r * cols + j] as f64 - mean) * rstd)
            .collect();
        let g: Vec<f64> = (0..cols)
            .map(|j| dy[r * cols + j] as f64 * gamma[j] as f64)
            .collect();
        let mean_g = g.iter().sum::<f64>() / cols as f64;
        let mean_gx = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / cols as f64;
        for j in 0..cols {
            dx[r * cols + j] = rstd * (g[j] - mean_g - xhat[j] * mean_gx);
            dg[j] += dy[r * cols + j] as f64 * xhat[j];
            db[j] += dy[r * cols + j] as f64;
        }
    }
    (dx, dg, db)
}

#[test]
fn layer_norm_forward_and_backward_match_float64() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(4);
    for launch in launches(&client) {
        for (rows, cols) in [
            (1, 1),
            (3, 17),
            (5, 1000),
            (7, 5000),
            (2048, 64),
            (70_000, 3),
            (130, 257),
        ] {
            let eps = 1e-5f32;
            // An offset mean tests the two-pass variance.
            let x = rng.vec(rows * cols, 95.0, 105.0);
            let gamma = rng.vec(cols, 0.5, 1.5);
            let beta = rng.vec(cols, -0.5, 0.5);
            let run = run_layer_norm(&client, launch, &x, &gamma, &beta, rows, cols, eps);
            let (want_y, want_mean, want_rstd) =
                layer_norm_reference(&x, &gamma, &beta, rows, cols, eps);
            let what = format!("layer norm {rows}×{cols} {launch:?}");
            // f32 rounding of x − μ is relative to |x| (≈ 100), and 1/σ magnifies it: the bound is
            // a few ulps of |x| times 1/σ · |γ| per row.
            for r in 0..rows {
                let tol = 1e-5 + 8.0 * f32::EPSILON as f64 * 105.0 * want_rstd[r] * 1.5;
                assert_close(
                    &format!("{what} y row {r}"),
                    &run.y[r * cols..(r + 1) * cols],
                    &want_y[r * cols..(r + 1) * cols],
                    tol,
                    1e-5,
                );
            }
            assert_close(&format!("{what} mean"), &run.mean, &want_mean, 1e-4, 1e-6);
            for r in 0..rows {
                // Relative error of 1/σ ≈ that of the variance: ulps of |x|² over var.
                let rel = 1e-5 + 16.0 * f32::EPSILON as f64 * 105.0 * want_rstd[r];
                assert_close(
                    &format!("{what} rstd row {r}"),
                    &run.rstd[r..r + 1],
                    &want_rstd[r..r + 1],
                    0.0,
                    rel,
                );
            }

            let dy = rng.vec(rows * cols, -1.0, 1.0);
            let (dx, dg, db) = run_layer_norm_backward(
                &client, launch, &x, &gamma, &dy, &run.mean, &run.rstd, rows, cols,
            );
            let (want_dx, want_dg, want_db) =
                layer_norm_backward_reference(&x, &gamma, &dy, &want_mean, &want_rstd, cols);
            let scale = (rows as f64).sqrt();
            for r in 0..rows {
                // x̂ carries the forward's rounding (ulps of |x| times 1/σ), and dx scales it by 1/σ
                // again.
                let tol = 2e-4 + 32.0 * f32::EPSILON as f64 * 105.0 * want_rstd[r].powi(2) * 1.5;
                assert_close(
                    &format!("{what} dx row {r}"),
                    &dx[r * cols..(r + 1) * cols],
                    &want_dx[r * cols..(r + 1) * cols],
                    tol,
                    1e-3,
                );
            }
            assert_close(&format!("{what} dgamma"), &dg, &want_dg, 2e-4 * scale, 1e-3);
            assert_close(&format!("{what} dbeta"), &db, &want_db, 1e-4 * scale, 1e-4);
        }
    }
}

#[test]
fn layer_norm_backward_matches_finite_differences_of_the_forward_kernel() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let launch = RowLaunch::for_client(&client);
    let mut rng = Rng(5);
    let (rows, cols) = (3, 7);
    let x = rng.vec(rows * cols, -2.0, 2.0);
    let gamma = rng.vec(cols, 0.5, 1.5);
    let beta = rng.vec(cols, -0.5, 0.5);
    let dy = rng.vec(rows * cols, -1.0, 1.0);
    let loss = |x: &[f32], gamma: &[f32], beta: &[f32]| -> f64 {
        let y = run_layer_norm(&client, launch, x, gamma, beta, rows, cols, 1e-5).y;
        y.iter().zip(&dy).map(|(&a, &b)| a as f64 * b as f64).sum()
    };
    let run = run_layer_norm(&client, launch, &x, &gamma, &beta, rows, cols, 1e-5);
    let (dx, dg, db) = run_layer_norm_backward(
        &client, launch, &x, &gamma, &dy, &run.mean, &run.rstd, rows, cols,
    );
    let h = 1e-2f32;
    let fd = |f: &dyn Fn(f32) -> f64| (f(h) - f(-h)) / (2.0 * h as f64);
    for i in 0..x.len() {
        let d = fd(&|e| {
            let mut v = x.clone();
            v[i] += e;
            loss(&v, &gamma, &beta)
        });
        assert!((dx[i] as f64 - d).abs() < 3e-3, "dx[{i}]: {} vs {d}", dx[i]);
    }
    for j in 0..cols {
        let d = fd(&|e| {
            let mut v = gamma.clone();
            v[j] += e;
            loss(&x, &v, &beta)
        });
        assert!(
            (dg[j] as f64 - d).abs() < 3e-3,
            "dgamma[{j}]: {} vs {d}",
            dg[j]
        );
        let d = fd(&|e| {
            let mut v = beta.clone();
            v[j] += e;
            loss(&x, &gamma, &v)
        });
        assert!(
            (db[j] as f64 - d).abs() < 3e-3,
            "dbeta[{j}]: {} vs {d}",
            db[j]
        );
    }
}

struct RmsNormRun {
    y: Vec<f32>,
    rstd: Vec<f32>,
}

fn run_rms_norm(
    client: &Client,
    launch: RowLaunch,
    x: &[f32],
    gamma: &[f32],
    rows: usize,
    cols: usize,
    eps: f32,
) -> RmsNormRun {
    let (xh, gh) = (upload(client, x), upload(client, gamma));
    let (y, rstd) = (poisoned(client, x.len()), poisoned(client, rows));
    rms_norm_forward::<f32>(client, launch, &xh, &gh, &y, &rstd, rows, cols, eps);
    RmsNormRun {
        y: download(client, y, x.len()),
        rstd: download(client, rstd, rows),
    }
}

/// dx, dγ from the RMSNorm backward kernels, outputs poisoned first.
#[allow(clippy::too_many_arguments)]
fn run_rms_norm_backward(
    client: &Client,
    launch: RowLaunch,
    x: &[f32],
    gamma: &[f32],
    dy: &[f32],
    rstd: &[f32],
    rows: usize,
    cols: usize,
) -> (Vec<f32>, Vec<f32>) {
    let [xh, gh, dyh, rh] = [x, gamma, dy, rstd].map(|v| upload(client, v));
    let (dx, dg) = (poisoned(client, x.len()), poisoned(client, cols));
    rms_norm_backward::<f32>(
        client, launch, &xh, &gh, &dyh, &rh, None, &dx, &dg, rows, cols,
    );
    (download(client, dx, x.len()), download(client, dg, cols))
}

/// RMSNorm's output, 1/rms, dx and dγ in float64.
struct RmsNormReference {
    y: Vec<f64>,
    rstd: Vec<f64>,
    dx: Vec<f64>,
    dgamma: Vec<f64>,
}

fn rms_norm_reference(
    x: &[f32],
    gamma: &[f32],
    dy: &[f32],
    cols: usize,
    eps: f64,
) -> RmsNormReference {
    let rows = x.len() / cols;
    let mut out = RmsNormReference {
        y: vec![0.0; x.len()],
        rstd: vec![0.0; rows],
        dx: vec![0.0; x.len()],
        dgamma: vec![0.0; cols],
    };
    for r in 0..rows {
        let row: Vec<f64> = x[r * cols..(r + 1) * cols]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let rstd = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
        out.rstd[r] = rstd;
        let xhat: Vec<f64> = row.iter().map(|v| v * rstd).collect();
        let g: Vec<f64> = (0..cols)
            .map(|j| dy[r * cols + j] as f64 * gamma[j] as f64)
            .collect();
        let mean_gx = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / cols as f64;
        for j in 0..cols {
            out.y[r * cols + j] = xhat[j] * gamma[j] as f64;
            out.dx[r * cols + j] = rstd * (g[j] - xhat[j] * mean_gx);
            out.dgamma[j] += dy[r * cols + j] as f64 * xhat[j];
        }
    }
    out
}

#[test]
fn rms_norm_forward_and_backward_match_float64() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(6);
    for launch in launches(&client) {
        for (rows, cols) in [
            (1, 1),
            (3, 17),
            (5, 1000),
            (7, 5000),
            (2048, 64),
            (70_000, 3),
            (130, 257),
        ] {
            let eps = 1e-5f32;
            // Off-centre, so that the root mean square is not the standard deviation.
            let x = rng.vec(rows * cols, -3.0, 5.0);
            let gamma = rng.vec(cols, 0.5, 1.5);
            let dy = rng.vec(rows * cols, -1.0, 1.0);
            let run = run_rms_norm(&client, launch, &x, &gamma, rows, cols, eps);
            let want = rms_norm_reference(&x, &gamma, &dy, cols, eps as f64);
            let what = format!("rms norm {rows}×{cols} {launch:?}");
            // A sum of squares has no cancellation: a few ulps, relative, whatever the row.
            assert_close(&format!("{what} y"), &run.y, &want.y, 1e-6, 1e-5);
            assert_close(&format!("{what} rstd"), &run.rstd, &want.rstd, 0.0, 1e-5);

            let (dx, dg) =
                run_rms_norm_backward(&client, launch, &x, &gamma, &dy, &run.rstd, rows, cols);
            // dx = r · (g − x̂ · mean(g x̂)) is O(r) (≈ 0.4 here); dγ sums `rows` terms of
            // either sign, its rounding growing as their square root.
            assert_close(&format!("{what} dx"), &dx, &want.dx, 1e-5, 1e-4);
            let scale = (rows as f64).sqrt();
            assert_close(
                &format!("{what} dgamma"),
                &dg,
                &want.dgamma,
                2e-5 * scale,
                1e-4,
            );
        }
    }
}

#[test]
fn rms_norm_backward_matches_finite_differences_of_the_forward_kernel() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let launch = RowLaunch::for_client(&client);
    let mut rng = Rng(7);
    let (rows, cols) = (3, 7);
    let x = rng.vec(rows * cols, -2.0, 2.0);
    let gamma = rng.vec(cols, 0.5, 1.5);
    let dy = rng.vec(rows * cols, -1.0, 1.0);
    let loss = |x: &[f32], gamma: &[f32]| -> f64 {
        let y = run_rms_norm(&client, launch, x, gamma, rows, cols, 1e-5).y;
        y.iter().zip(&dy).map(|(&a, &b)| a as f64 * b as f64).sum()
    };
    let run = run_rms_norm(&client, launch, &x, &gamma, rows, cols, 1e-5);
    let (dx, dg) = run_rms_norm_backward(&client, launch, &x, &gamma, &dy, &run.rstd, rows, cols);
    let h = 1e-2f32;
    let fd = |f: &dyn Fn(f32) -> f64| (f(h) - f(-h)) / (2.0 * h as f64);
    for i in 0..x.len() {
        let d = fd(&|e| {
            let mut v = x.clone();
            v[i] += e;
            loss(&v, &gamma)
        });
        assert!((dx[i] as f64 - d).abs() < 3e-3, "dx[{i}]: {} vs {d}", dx[i]);
    }
    for j in 0..cols {
        let d = fd(&|e| {
            let mut v = gamma.clone();
            v[j] += e;
            loss(&x, &v)
        });
        assert!(
            (dg[j] as f64 - d).abs() < 3e-3,
            "dgamma[{j}]: {} vs {d}",
            dg[j]
        );
    }
}

/// The norms' dx joined with the gradient the same input has from the residual add
/// (`residual_grad`, one launch): the bits of dx stored, then the two added in the storage
/// type, as autodiff's separate add gives them — in each half type the device stores, for
/// every row launch shape; in f32 the same up to dx's own rounding.
#[test]
fn norm_backward_joins_the_residual_gradient_with_the_bits_of_a_separate_add() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    for launch in launches(&client) {
        for (rows, cols) in [(3, 17), (5, 256)] {
            joined_norm_backward_matches_a_separate_add::<f32>(&client, launch, rows, cols);
            joined_norm_backward_matches_a_separate_add::<half::f16>(&client, launch, rows, cols);
            joined_norm_backward_matches_a_separate_add::<half::bf16>(&client, launch, rows, cols);
        }
    }
}

/// [`norm_backward_joins_the_residual_gradient_with_the_bits_of_a_separate_add`] for `H`:
/// LayerNorm's and RMSNorm's dx, without and with the join (nothing where the device does not
/// store `H`).
fn joined_norm_backward_matches_a_separate_add<H: Storage>(
    client: &Client,
    launch: RowLaunch,
    rows: usize,
    cols: usize,
) {
    if !client.properties().supports_type(H::cube_type()) {
        return;
    }
    let mut rng = Rng(23);
    let x = rounded::<H>(&rng.vec(rows * cols, -3.0, 3.0));
    let gamma = rounded::<H>(&rng.vec(cols, 0.5, 1.5));
    let dy = rounded::<H>(&rng.vec(rows * cols, -1.0, 1.0));
    let residual = rounded::<H>(&rng.vec(rows * cols, -1.0, 1.0));
    let stats = run_layer_norm(
        client,
        launch,
        &x,
        &gamma,
        &vec![0.0; cols],
        rows,
        cols,
        1e-5,
    );
    let rms_stats = run_rms_norm(client, launch, &x, &gamma, rows, cols, 1e-5);
    let [xh, gh, dyh, rh] = [&x, &gamma, &dy, &residual].map(|v| upload_as::<H>(client, v));
    let [mean, rstd, rms_rstd] =
        [&stats.mean, &stats.rstd, &rms_stats.rstd].map(|v| upload(client, v));
    let n = rows * cols;
    let dx = |rms: bool, join: Option<&Handle>| {
        let (dxh, dgh, dbh) = (
            poisoned_as::<H>(client, n),
            poisoned_as::<H>(client, cols),
            poisoned_as::<H>(client, cols),
        );
        if rms {
            rms_norm_backward::<H>(
                client, launch, &xh, &gh, &dyh, &rms_rstd, join, &dxh, &dgh, rows, cols,
            );
        } else {
            layer_norm_backward::<H>(
                client, launch, &xh, &gh, &dyh, &mean, &rstd, join, &dxh, &dgh, &dbh, rows, cols,
            );
        }
        download_as::<H>(client, dxh, n)
    };
    for rms in [false, true] {
        let separate = dx(rms, None);
        let want: Vec<f32> = rounded::<H>(
            &separate
                .iter()
                .zip(&residual)
                .map(|(a, b)| a + b)
                .collect::<Vec<_>>(),
        );
        let joined = dx(rms, Some(&rh));
        let what = format!("{} rms {rms} {rows}×{cols} {launch:?}", H::NAME);
        for (i, ((g, w), d)) in joined.iter().zip(&want).zip(&separate).enumerate() {
            // In f32 dx is not converted before the add, and a compiler may fuse its last
            // multiply with the add (cubecl-cpu's LLVM does): dx then skips one rounding.
            let skipped_rounding = match H::NAME {
                "f32" => H::ULP * d.abs() as f64 / 2.0 + H::ULP * w.abs() as f64,
                _ => 0.0,
            };
            let err = (g - w).abs() as f64;
            assert!(err <= skipped_rounding, "{what}: element {i}: {g} vs {w}");
        }
    }
}

/// Loss, log-sum-exp and `(softmax − one-hot) · dloss` of one row in float64.
/// `target` −1: the target is in another shard (no target term).
fn cross_entropy_reference(x: &[f32], target: i32, dloss: f64) -> (f64, f64, Vec<f64>) {
    let max = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let lse = max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    let grad = x
        .iter()
        .enumerate()
        .map(|(j, &v)| ((v as f64 - lse).exp() - f64::from(j as i32 == target)) * dloss)
        .collect();
    let picked = if target < 0 {
        0.0
    } else {
        x[target as usize] as f64
    };
    (lse - picked, lse, grad)
}

/// The column-sum launch shapes checked: this device's own, a GPU's (one vector per cube,
/// 256 row lanes), several vectors per cube with a shallow tree, a cube wider than the
/// columns, and no tree at all. A device without planes (cubecl-cpu, whose barriers cost
/// seconds per cube) runs only the shapes without a tree.
fn column_launches(client: &Client) -> Vec<ColumnLaunch> {
    let own = ColumnLaunch::for_client(client);
    let barriers = RowLaunch::for_client(client).lanes > 1;
    let mut all = vec![own];
    for (vectors, row_lanes) in [(1, 256), (4, 8), (3, 2), (64, 1), (5, 1), (1, 1)] {
        let launch = ColumnLaunch { vectors, row_lanes };
        if (barriers || row_lanes == 1) && !all.contains(&launch) {
            all.push(launch);
        }
    }
    all
}

/// The one-launch column sums against float64: a bias's gradient (`Σ dy`), LayerNorm's
/// `Σ dy ⊙ (x − μ)·r` and `Σ dy`, RMSNorm's `Σ dy ⊙ x·r`, for rows that are no multiple of
/// the four-row step or the row lanes, a single row, more column vectors than one
/// cube-count dimension holds, and odd widths (one element per vector). Outputs are poisoned
/// first; the sums of f32 terms may differ from float64 by the rounding of the additions.
#[test]
fn column_sums_match_float64_for_every_launch_shape() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(11);
    for launch in column_launches(&client) {
        for (rows, cols) in [
            (1, 1),
            (3, 17),
            (4099, 24),
            (130, 257),
            (2048, 64),
            (2, 70_001),
        ] {
            // So many cubes of 256 units are slow on lavapipe (the time: benchmarks/results/
            // 2026-12-03-figures-from-comments.md): more cubes than one dimension holds are
            // checked on one unit per cube (the grid is the same for every launch),
            // the trees of units on the other shapes.
            let cubes = cols.div_ceil(launch.vectors as usize);
            if cubes > MAX_CUBES_PER_DIMENSION && launch.row_lanes > 1 {
                continue;
            }
            let what = format!("column sums {rows}×{cols} {launch:?}");
            let dy = rng.vec(rows * cols, -1.0, 1.0);
            let x = rng.vec(rows * cols, 95.0, 105.0);
            let mean = rng.vec(rows, 98.0, 102.0);
            let rstd = rng.vec(rows, 0.2, 0.4);
            let [dyh, xh, mh, rh] = [&dy, &x, &mean, &rstd].map(|v| upload(&client, v));
            let bias = poisoned(&client, cols);
            bias_gradient::<f32>(&client, launch, &dyh, &bias, rows, cols);
            let (dg, db) = (poisoned(&client, cols), poisoned(&client, cols));
            layer_norm_param_gradients::<f32>(
                &client, launch, &xh, &dyh, &mh, &rh, &dg, &db, rows, cols,
            );
            let rms = poisoned(&client, cols);
            rms_norm_gamma_gradient::<f32>(&client, launch, &xh, &dyh, &rh, &rms, rows, cols);

            // Each column's float64 sums and the sums of the terms' magnitudes, which bound
            // the rounding of f32 additions.
            let mut want = [vec![0.0f64; cols], vec![0.0; cols], vec![0.0; cols]];
            let mut magnitude = [vec![0.0f64; cols], vec![0.0; cols], vec![0.0; cols]];
            for r in 0..rows {
                for j in 0..cols {
                    let (g, v) = (dy[r * cols + j] as f64, x[r * cols + j] as f64);
                    let r_std = rstd[r] as f64;
                    let terms = [g, g * (v - mean[r] as f64) * r_std, g * v * r_std];
                    for (k, t) in terms.into_iter().enumerate() {
                        want[k][j] += t;
                        magnitude[k][j] += t.abs();
                    }
                }
            }
            let got = [
                download(&client, bias, cols),
                download(&client, dg, cols),
                download(&client, rms, cols),
            ];
            let beta = download(&client, db, cols);
            assert_eq!(bits(&beta), bits(&got[0]), "{what}: dβ is the bias sum");
            for (k, name) in ["Σ dy", "LayerNorm dγ", "RMSNorm dγ"]
                .into_iter()
                .enumerate()
            {
                for j in 0..cols {
                    let err = (got[k][j] as f64 - want[k][j]).abs();
                    let tol = 1e-6 + 2e-5 * magnitude[k][j];
                    assert!(
                        err <= tol,
                        "{what}: {name} column {j}: got {}, want {} (error {err:e})",
                        got[k][j],
                        want[k][j]
                    );
                }
            }
        }
    }
}

/// The bias gradients that transform the gradient on the way, in one launch, are bit for bit
/// the element-wise kernel then the bias-gradient column sums on its output: bias-dropout-add's
/// backward (the dropout kernel; a whole draw and a sequence-parallel chunk of one),
/// bias-GELU's (the GELU backward kernel, exact and tanh) and the QKV projection's (the merge
/// kernel of the core's per-head gradients; multi-head and grouped-query), the transformed gradient and the
/// sums (for half types within their rounding of the terms where a compiler sums the
/// unrounded products), for f32 (every column launch) and each half type the device stores (its own launch),
/// rows no multiple of the four-row step, odd widths.
#[test]
fn transformed_bias_gradients_are_the_element_wise_kernel_then_the_column_sums() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let own = [ColumnLaunch::for_client(&client)];
    let ran = [
        transformed_bias_gradients_match::<f32>(&client, &column_launches(&client)),
        transformed_bias_gradients_match::<half::f16>(&client, &own),
        transformed_bias_gradients_match::<half::bf16>(&client, &own),
    ];
    assert!(ran[0] && ran[1..].iter().any(|&r| r), "{ran:?}");
}

fn transformed_bias_gradients_match<H: Storage>(
    client: &Client,
    launches: &[ColumnLaunch],
) -> bool {
    if !client.properties().supports_type(H::cube_type()) {
        return false;
    }
    let mut rng = Rng(29);
    let draw = test_draw(0x0bad_cafe, 7, 0.3);
    for &launch in launches {
        for (rows, cols) in [(1, 1), (3, 17), (4099, 24), (130, 257)] {
            let len = rows * cols;
            let mut upload_rounded =
                |lo, hi| upload_as::<H>(client, &rounded::<H>(&rng.vec(len.max(cols), lo, hi)));
            let (grad, x, bias) = (
                upload_rounded(-2.0, 2.0),
                upload_rounded(-4.0, 4.0),
                upload_rounded(-1.0, 1.0),
            );
            let (grad, x, bias) = (&grad, &x, &bias);
            // Each case: its name, the fused launch, and the element-wise kernel it replaces.
            type Launch<'a> = Box<dyn Fn(&Handle, &Handle) + 'a>;
            let mut cases: Vec<(String, Launch, Launch)> = Vec::new();
            for slice in [DrawSlice::WHOLE, DrawSlice::chunk(cols, 3, 1)] {
                let draw = draw.sliced(slice);
                let fused: Launch = Box::new(move |out, sums| {
                    dropped_bias_gradient::<H>(client, launch, grad, out, sums, rows, cols, draw)
                });
                let alone: Launch =
                    Box::new(move |out, _| dropout::<H>(client, grad, out, len, draw));
                cases.push((format!("dropout {slice:?}"), fused, alone));
            }
            for tanh in [false, true] {
                let fused: Launch = Box::new(move |out, sums| {
                    gelu_bias_gradient::<H>(
                        client, launch, x, bias, grad, out, sums, rows, cols, tanh,
                    )
                });
                let alone: Launch = Box::new(move |out, _| {
                    gelu_backward::<H>(client, x, Some((bias, cols)), grad, out, len, tanh)
                });
                cases.push((format!("GELU (tanh {tanh})"), fused, alone));
            }
            for (name, fused, alone) in cases {
                let what = format!("{} {rows}×{cols} {launch:?} {name}", H::NAME);
                let [out, out_alone] = [0; 2].map(|_| poisoned_as::<H>(client, len));
                let [sums, sums_alone] = [0; 2].map(|_| poisoned_as::<H>(client, cols));
                fused(&out, &sums);
                alone(&out_alone, &sums_alone);
                bias_gradient::<H>(client, launch, &out_alone, &sums_alone, rows, cols);
                let got = [
                    download_as::<H>(client, out, len),
                    download_as::<H>(client, sums, cols),
                ];
                let want = [
                    download_as::<H>(client, out_alone, len),
                    download_as::<H>(client, sums_alone, cols),
                ];
                assert_eq!(
                    bits(&got[0]),
                    bits(&want[0]),
                    "{what}: the transformed gradient"
                );
                if bits(&got[1]) != bits(&want[1]) {
                    // Mesa 26's SPIR-V compiler sums GELU's f16 products unrounded (it drops
                    // the f32 → f16 → f32 round trip of the stored value): then the sums may
                    // differ by the half type's rounding of each term, and no more.
                    assert!(
                        H::ULP > 1e-6,
                        "{what}: the bias gradient {:?}",
                        (&got[1], &want[1])
                    );
                    for j in 0..cols {
                        let column = (0..rows).map(|r| (want[0][r * cols + j] as f64).abs());
                        let tol = H::ULP * column.sum::<f64>();
                        let err = (got[1][j] as f64 - want[1][j] as f64).abs();
                        assert!(
                            err <= tol,
                            "{what}: the bias gradient of column {j}: {err:e}"
                        );
                    }
                }
            }
        }
        qkv_merge_bias_gradient_matches::<H>(client, launch, &mut rng);
    }
    true
}

/// The QKV projection's gradients in one launch against the merge kernel then the column
/// sums: multi-head, grouped-query (two query heads per group), one group of four, rows no
/// multiple of the four-row step.
fn qkv_merge_bias_gradient_matches<H: Storage>(
    client: &Client,
    launch: ColumnLaunch,
    rng: &mut Rng,
) {
    for (batch, seq, groups, per_group, head_dim) in
        [(2, 3, 2, 1, 8), (1, 37, 2, 2, 4), (3, 5, 1, 4, 12)]
    {
        let layout = QkvLayout {
            batch,
            seq,
            groups,
            per_group,
            head_dim,
        };
        let what = format!("{} {layout:?} {launch:?} QKV merge", H::NAME);
        let (len, width) = (layout.mixed_len(), layout.row_width());
        let heads = [0; 3].map(|_| {
            upload_as::<H>(
                client,
                &rounded::<H>(&rng.vec(layout.head_len(), -2.0, 2.0)),
            )
        });
        let heads = [&heads[0], &heads[1], &heads[2]];
        let [out, out_alone] = [0; 2].map(|_| poisoned_as::<H>(client, len));
        let [sums, sums_alone] = [0; 2].map(|_| poisoned_as::<H>(client, width));
        qkv_merge_bias_gradient::<H>(client, launch, heads, &out, &sums, layout);
        qkv_merge::<H>(client, heads, &out_alone, layout);
        bias_gradient::<H>(client, launch, &out_alone, &sums_alone, len / width, width);
        let got = [
            download_as::<H>(client, out, len),
            download_as::<H>(client, sums, width),
        ];
        let want = [
            download_as::<H>(client, out_alone, len),
            download_as::<H>(client, sums_alone, width),
        ];
        assert_eq!(bits(&got[0]), bits(&want[0]), "{what}: the rows' gradient");
        assert_eq!(bits(&got[1]), bits(&want[1]), "{what}: the bias gradient");
    }
}

/// The cross-entropy kernels against float64 over every launch shape: a single column,
/// rows shorter and longer than a cube's lanes, a GPT-2-wide row (50,304 columns), thousands
/// of rows, targets at both ends of a row, rows whose target is another shard's (every
/// fourth), logits in a wide range.
#[test]
fn cross_entropy_forward_and_backward_match_float64() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(12);
    for launch in launches(&client) {
        for (rows, cols) in [(1, 1), (3, 17), (5, 1000), (2, 50_304), (3000, 9)] {
            // Lavapipe cuts long loops short: with one lane, a row of 40,000 came out wrong
            // (30,000 right). Its own launch gives a row 8 lanes.
            if cols / launch.lanes as usize > 30_000 && launch != RowLaunch::for_client(&client) {
                continue;
            }
            let x = rng.vec(rows * cols, -30.0, 30.0);
            let targets: Vec<i32> = (0..rows)
                .map(|r| match r % 3 {
                    0 => 0,
                    1 => cols as i32 - 1,
                    _ => (rng.uniform() * cols as f64) as i32 % cols as i32,
                })
                .collect();
            let inside: Vec<f32> = (0..rows).map(|r| f32::from(r % 4 != 3)).collect();
            let dloss = rng.vec(rows, -2.0, 2.0);
            let (xh, th, ih, gh) = (
                upload(&client, &x),
                client.create_from_slice(i32::as_bytes(&targets)),
                upload(&client, &inside),
                upload(&client, &dloss),
            );
            let (loss, lse, dx) = (
                poisoned(&client, rows),
                poisoned(&client, rows),
                poisoned(&client, rows * cols),
            );
            cross_entropy_forward::<f32>(&client, launch, &xh, &th, &ih, &loss, &lse, rows, cols);
            let lse_values = download(&client, lse.clone(), rows);
            cross_entropy_backward::<f32>(
                &client, launch, &xh, &th, &ih, &lse, &gh, &dx, rows, cols,
            );
            let want: Vec<_> = (0..rows)
                .map(|r| {
                    let row = &x[r * cols..(r + 1) * cols];
                    let target = if inside[r] > 0.0 { targets[r] } else { -1 };
                    cross_entropy_reference(row, target, dloss[r] as f64)
                })
                .collect();
            let what = format!("cross-entropy {rows}x{cols} {launch:?}");
            let want_loss: Vec<f64> = want.iter().map(|w| w.0).collect();
            let want_lse: Vec<f64> = want.iter().map(|w| w.1).collect();
            let want_dx: Vec<f64> = want.iter().flat_map(|w| w.2.clone()).collect();
            assert_close(
                &what,
                &download(&client, loss, rows),
                &want_loss,
                1e-5,
                1e-6,
            );
            assert_close(&format!("{what} lse"), &lse_values, &want_lse, 1e-5, 1e-6);
            // A confident target's `p − 1` is the difference of two f32 numbers near 1, `p`
            // computed by the device's `exp` (a few ulp of 1 on lavapipe), times |dloss| ≤ 2.
            assert_close(
                &format!("{what} dx"),
                &download(&client, dx, rows * cols),
                &want_dx,
                5e-6,
                1e-5,
            );
        }
    }
}

/// GELU and its derivative in float64: exact (`x · Φ(x)`) or the tanh form.
fn gelu_reference(x: f64, tanh: bool) -> (f64, f64) {
    if tanh {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let t = (c * (x + 0.044715 * x * x * x)).tanh();
        let du = c * (1.0 + 3.0 * 0.044715 * x * x);
        (
            0.5 * x * (1.0 + t),
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du,
        )
    } else {
        let cdf = 0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2));
        let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
        (x * cdf, cdf + x * pdf)
    }
}

/// GELU forward and backward kernels against float64, exact and tanh, over lengths that leave
/// a partly filled last cube and inputs far into both tails (and past f32's `e^(x²)`); with a
/// bias over rows (bias-GELU), the reference's input is the f32 sum `x + bias`.
#[test]
fn gelu_forward_and_backward_match_float64() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(10);
    for tanh in [false, true] {
        for (n, hidden) in [
            (1, None),
            (17, None),
            (257, None),
            (10_007, None),
            (37 * 24, Some(24)),
            (333 * 31, Some(31)),
        ] {
            let mut x = rng.vec(n, -10.0, 10.0);
            for (v, extreme) in x.iter_mut().zip([-100.0, 100.0, -9.0, 9.0, 0.0, -1e4]) {
                *v = extreme;
            }
            let dy = rng.vec(n, -1.0, 1.0);
            let bias = rng.vec(hidden.unwrap_or(1), -2.0, 2.0);
            let (xh, dyh, bh) = (
                upload(&client, &x),
                upload(&client, &dy),
                upload(&client, &bias),
            );
            let (y, dx) = (poisoned(&client, n), poisoned(&client, n));
            let row_bias = hidden.map(|h| (&bh, h));
            gelu_forward::<f32>(&client, &xh, row_bias, &y, n, tanh);
            gelu_backward::<f32>(&client, &xh, row_bias, &dyh, &dx, n, tanh);
            let input = |i: usize| match hidden {
                Some(h) => (x[i] + bias[i % h]) as f64,
                None => x[i] as f64,
            };
            let want: Vec<(f64, f64)> = (0..n).map(|i| gelu_reference(input(i), tanh)).collect();
            let want_y: Vec<f64> = want.iter().map(|w| w.0).collect();
            let want_dx: Vec<f64> = want.iter().zip(&dy).map(|(w, &d)| w.1 * d as f64).collect();
            let what = format!("gelu (tanh {tanh}) {n}, bias rows {hidden:?}");
            assert_close(&what, &download(&client, y, n), &want_y, 1e-6, 1e-5);
            assert_close(
                &format!("{what} dx"),
                &download(&client, dx, n),
                &want_dx,
                1e-6,
                1e-5,
            );
        }
    }
}

fn run_swiglu(client: &Client, gate: &[f32], up: &[f32]) -> Vec<f32> {
    let (gh, uh, out) = (
        upload(client, gate),
        upload(client, up),
        poisoned(client, gate.len()),
    );
    swiglu_forward::<f32>(client, &gh, &uh, &out, gate.len());
    download(client, out, gate.len())
}

/// d_gate, d_up from the SwiGLU backward kernel, outputs poisoned first.
fn run_swiglu_backward(
    client: &Client,
    gate: &[f32],
    up: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let n = gate.len();
    let [gh, uh, dyh] = [gate, up, dy].map(|v| upload(client, v));
    let (dg, du) = (poisoned(client, n), poisoned(client, n));
    swiglu_backward::<f32>(client, &gh, &uh, &dyh, [&dg, &du], n);
    (download(client, dg, n), download(client, du, n))
}

/// `[silu(g) · u, d_gate, d_up]` in float64.
fn swiglu_reference(gate: &[f32], up: &[f32], dy: &[f32]) -> [Vec<f64>; 3] {
    let mut out = [0; 3].map(|_| Vec::with_capacity(gate.len()));
    for ((&g, &u), &d) in gate.iter().zip(up).zip(dy) {
        let (g, u, d) = (g as f64, u as f64, d as f64);
        let s = 1.0 / (1.0 + (-g).exp());
        out[0].push(g * s * u);
        out[1].push(d * u * s * (1.0 + g * (1.0 - s)));
        out[2].push(d * g * s);
    }
    out
}

/// SwiGLU forward and backward against float64 over lengths that leave a partly filled last
/// cube, gates far enough out that the sigmoid saturates (and `e^(−g)` overflows f32).
#[test]
fn swiglu_forward_and_backward_match_float64() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(8);
    for n in [1, 17, 256, 257, 10_007, 300_001] {
        let mut gate = rng.vec(n, -12.0, 12.0);
        for (g, extreme) in gate.iter_mut().zip([-100.0, 100.0, -30.0, 30.0, -1e4, 0.0]) {
            *g = extreme;
        }
        let up = rng.vec(n, -2.0, 2.0);
        let dy = rng.vec(n, -1.0, 1.0);
        let want = swiglu_reference(&gate, &up, &dy);
        // f32 arithmetic and the device's exp (a few ulps, more for large |g| on some
        // devices): a relative bound, and an absolute one near the zeros.
        let y = run_swiglu(&client, &gate, &up);
        assert_close(&format!("swiglu {n}"), &y, &want[0], 1e-6, 1e-5);
        let (dg, du) = run_swiglu_backward(&client, &gate, &up, &dy);
        assert_close(&format!("swiglu d_gate {n}"), &dg, &want[1], 1e-6, 1e-5);
        assert_close(&format!("swiglu d_up {n}"), &du, &want[2], 1e-6, 1e-5);
    }
}

#[test]
fn swiglu_backward_matches_finite_differences_of_the_forward_kernel() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(9);
    let n = 37;
    let gate = rng.vec(n, -5.0, 5.0);
    let up = rng.vec(n, -2.0, 2.0);
    let dy = rng.vec(n, -1.0, 1.0);
    let loss = |gate: &[f32], up: &[f32]| -> f64 {
        let y = run_swiglu(&client, gate, up);
        y.iter().zip(&dy).map(|(&a, &b)| a as f64 * b as f64).sum()
    };
    let (dg, du) = run_swiglu_backward(&client, &gate, &up, &dy);
    let h = 1e-2f32;
    let fd = |f: &dyn Fn(f32) -> f64| (f(h) - f(-h)) / (2.0 * h as f64);
    for i in 0..n {
        let d = fd(&|e| {
            let mut v = gate.clone();
            v[i] += e;
            loss(&v, &up)
        });
        assert!(
            (dg[i] as f64 - d).abs() < 3e-3,
            "d_gate[{i}]: {} vs {d}",
            dg[i]
        );
        let d = fd(&|e| {
            let mut v = up.clone();
            v[i] += e;
            loss(&gate, &v)
        });
        assert!(
            (du[i] as f64 - d).abs() < 3e-3,
            "d_up[{i}]: {} vs {d}",
            du[i]
        );
    }
}

/// Rotary tables `[positions, rotary_dim / 2]` for base 10000, from float64 angles.
fn rotary_tables(positions: usize, rotary_dim: usize) -> (Vec<f32>, Vec<f32>) {
    let pairs = rotary_dim / 2;
    let (mut cos, mut sin) = (vec![], vec![]);
    for p in 0..positions {
        for i in 0..pairs {
            let angle = p as f64 * 10000f64.powf(-((2 * i) as f64) / rotary_dim as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// One rotary embedding problem: `[heads, seq, head_dim]`, `rotary_dim` channels rotated,
/// the tables read from row `offset`.
#[derive(Clone, Copy, Debug)]
struct Rope {
    shape: AttentionShape,
    rotary_dim: usize,
    offset: usize,
    positions: usize,
    interleaved: bool,
}

fn rope(heads: usize, seq: usize, head_dim: usize, rotary_dim: usize, offset: usize) -> Rope {
    Rope {
        shape: AttentionShape {
            heads,
            seq,
            head_dim,
        },
        rotary_dim,
        offset,
        // Tables longer than needed: rows past `offset + seq` must not be read either.
        positions: offset + seq + 3,
        interleaved: false,
    }
}

/// The rotary kernel in storage `S` (`inverse`: the backward).
fn run_rotary<S: Storage>(
    client: &Client,
    x: &[f32],
    (cos, sin): &(Vec<f32>, Vec<f32>),
    p: Rope,
    inverse: bool,
) -> Vec<f32> {
    let n = p.shape.len();
    let (xh, out) = (upload_as::<S>(client, x), poisoned_as::<S>(client, n));
    let (ch, sh) = (upload(client, cos), upload(client, sin));
    let tables = RotaryTables {
        cos: &ch,
        sin: &sh,
        positions: p.positions,
        rotary_dim: p.rotary_dim,
        interleaved: p.interleaved,
    };
    rotary_embedding::<S>(client, &xh, &out, p.shape, tables, p.offset, inverse);
    download_as::<S>(client, out, n)
}

/// The rotation (or its transpose with `inverse`) in float64 from the same f32 tables.
fn rotary_reference(
    x: &[f32],
    (cos, sin): &(Vec<f32>, Vec<f32>),
    p: Rope,
    inverse: bool,
) -> Vec<f64> {
    let (d, r, s) = (p.shape.head_dim, p.rotary_dim, p.shape.seq);
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let sign = if inverse { -1.0 } else { 1.0 };
    for row in 0..p.shape.rows() {
        let position = row % s + p.offset;
        for i in 0..r / 2 {
            let (a, b) = if p.interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + r / 2)
            };
            let (c, sn) = (
                cos[position * r / 2 + i] as f64,
                sign * sin[position * r / 2 + i] as f64,
            );
            let (xa, xb) = (x[row * d + a] as f64, x[row * d + b] as f64);
            out[row * d + a] = xa * c - xb * sn;
            out[row * d + b] = xb * c + xa * sn;
        }
    }
    out
}

/// The rotary kernel and its backward (the rotation's transpose) against float64: both pair
/// layouts, part of a head rotated, position offsets, heads of one position, and lengths
/// that leave a partly filled last cube.
#[test]
fn rotary_embedding_and_its_backward_match_float64() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(10);
    for base in [
        rope(1, 1, 2, 2, 0),
        rope(3, 17, 8, 8, 0),
        rope(2, 5, 12, 4, 7),
        rope(4, 33, 64, 64, 1000),
        rope(2, 7, 10, 6, 2),
        rope(257, 9, 16, 8, 0),
    ] {
        for interleaved in [false, true] {
            let p = Rope {
                interleaved,
                ..base
            };
            let tables = rotary_tables(p.positions, p.rotary_dim);
            let x = rng.vec(p.shape.len(), -2.0, 2.0);
            let what = format!("{p:?}");
            // Each output is a · cos ± b · sin in f32: a few ulps of |x| ≤ 2.
            let y = run_rotary::<f32>(&client, &x, &tables, p, false);
            let want = rotary_reference(&x, &tables, p, false);
            assert_close(&format!("{what}: forward"), &y, &want, 1e-6, 1e-6);
            let dx = run_rotary::<f32>(&client, &x, &tables, p, true);
            let want = rotary_reference(&x, &tables, p, true);
            assert_close(&format!("{what}: backward"), &dx, &want, 1e-6, 1e-6);
            // The backward undoes the forward.
            let back = run_rotary::<f32>(&client, &y, &tables, p, true);
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            assert_close(&format!("{what}: round trip"), &back, &x64, 2e-6, 1e-6);
        }
    }
}

#[test]
fn rotary_backward_matches_finite_differences_of_the_forward_kernel() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(12);
    for interleaved in [false, true] {
        let p = Rope {
            interleaved,
            ..rope(2, 3, 6, 4, 5)
        };
        let tables = rotary_tables(p.positions, p.rotary_dim);
        let n = p.shape.len();
        let x = rng.vec(n, -2.0, 2.0);
        let dy = rng.vec(n, -1.0, 1.0);
        let loss = |x: &[f32]| -> f64 {
            let y = run_rotary::<f32>(&client, x, &tables, p, false);
            y.iter().zip(&dy).map(|(&a, &b)| a as f64 * b as f64).sum()
        };
        let dx = run_rotary::<f32>(&client, &dy, &tables, p, true);
        let h = 1e-2f32;
        for i in 0..n {
            let (mut plus, mut minus) = (x.clone(), x.clone());
            plus[i] += h;
            minus[i] -= h;
            let fd = (loss(&plus) - loss(&minus)) / (2.0 * h as f64);
            assert!(
                (dx[i] as f64 - fd).abs() < 2e-3,
                "{p:?}: element {i}: kernel {} vs finite difference {fd}",
                dx[i]
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Half-precision storage (what `--fp16` / `--bf16` models hand the kernels): each kernel with
// f16 or bf16 inputs and outputs against the same kernel in f32 on the same (rounded) inputs.
// The kernels compute in f32 whatever they store, so each output may differ from the f32
// reference only by its own rounding to the storage type: at most one unit in its last place.

/// A storage type the kernels take, with its conversions and precision.
trait Storage: Float + CubeElement + Copy {
    const NAME: &'static str;
    /// One unit in the last place, relative (2^-mantissa bits).
    const ULP: f64;
    /// The smallest positive normal value (below it the spacing is absolute).
    const MIN_NORMAL: f64;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Storage for half::f16 {
    const NAME: &'static str = "f16";
    const ULP: f64 = 1.0 / 1024.0;
    const MIN_NORMAL: f64 = 6.103515625e-5;
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

impl Storage for half::bf16 {
    const NAME: &'static str = "bf16";
    const ULP: f64 = 1.0 / 128.0;
    const MIN_NORMAL: f64 = 1.1754944e-38;
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

/// `values` rounded to `H` (what a half-precision model holds).
fn rounded<H: Storage>(values: &[f32]) -> Vec<f32> {
    values
        .iter()
        .map(|&v| Storage::to_f32(<H as Storage>::from_f32(v)))
        .collect()
}

fn upload_as<H: Storage>(client: &Client, values: &[f32]) -> Handle {
    let h: Vec<H> = values
        .iter()
        .map(|&v| <H as Storage>::from_f32(v))
        .collect();
    client.create_from_slice(H::as_bytes(&h))
}

fn poisoned_as<H: Storage>(client: &Client, n: usize) -> Handle {
    upload_as::<H>(client, &vec![f32::NAN; n.max(1)])
}

fn download_as<H: Storage>(client: &Client, handle: Handle, n: usize) -> Vec<f32> {
    H::from_bytes(&client.read_one_unchecked(handle))[..n]
        .iter()
        .map(|&v| Storage::to_f32(v))
        .collect()
}

/// Asserts `got` (stored in `H`) is the f32 reference `want` up to one unit in `H`'s last
/// place (plus the f32 kernels' own tolerance `abs` where the computation is not the same).
fn assert_within_an_ulp<H: Storage>(what: &str, got: &[f32], want: &[f32], abs: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst: f64 = 0.0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w as f64).abs();
        let ulp = H::ULP * (w.abs() as f64).max(H::MIN_NORMAL);
        assert!(
            err <= ulp + abs,
            "{what} ({}): element {i}: got {g}, f32 reference {w} (error {err:e}, one ulp {ulp:e})",
            H::NAME
        );
        worst = worst.max(err / (ulp + abs));
    }
    println!("{what} ({}): worst error {worst:.2} of the bound", H::NAME);
}

/// The embedding's gradient in `H`: 2,000 positions of 40 tokens, rows of 24, summed in f32
/// and rounded once (a frequent token's row is not rounded at each of its ~50 additions).
fn embedding_gradient_in_half<H: Storage>(client: &Client, rng: &mut Rng) {
    let (positions, rows, hidden) = (2_000, 40, 24);
    let tokens: Vec<i32> = (0..positions).map(|p| (p * 7 % rows) as i32).collect();
    let tokens = client.create_from_slice(i32::as_bytes(&tokens));
    let grad = rounded::<H>(&rng.vec(positions * hidden, -1.0, 1.0));
    let embedding = embedding_launches(client)[0];
    let tf = upload(client, &vec![0.0; rows * hidden]);
    let gf = upload(client, &grad);
    embedding_gradient::<f32>(
        client, embedding, &tokens, &gf, &tf, positions, rows, hidden,
    );
    let th = upload_as::<H>(client, &vec![0.0; rows * hidden]);
    let gh = upload_as::<H>(client, &grad);
    embedding_gradient::<H>(
        client, embedding, &tokens, &gh, &th, positions, rows, hidden,
    );
    assert_within_an_ulp::<H>(
        "embedding gradient",
        &download_as::<H>(client, th, rows * hidden),
        &download(client, tf, rows * hidden),
        0.0,
    );
}

/// Every kernel in storage `H` against the same kernel in f32, on inputs rounded to `H`;
/// false when this device cannot store `H`.
fn half_storage_matches_f32<H: Storage>(client: &Client) -> bool {
    if !client.properties().supports_type(H::cube_type()) {
        return false;
    }
    let mut rng = Rng(11);
    let launch = RowLaunch::for_client(client);

    half_softmax_matches_f32::<H>(client, launch, &mut rng);
    half_layer_norm_matches_f32::<H>(client, launch, &mut rng);
    half_bias_gradient_matches_f32::<H>(client, &mut rng);
    embedding_gradient_in_half::<H>(client, &mut rng);
    half_dropout_matches_f32::<H>(client, &mut rng);
    half_attention_matches_f32::<H>(client, &mut rng);
    half_rms_norm_matches_f32::<H>(client, launch, &mut rng);
    half_swiglu_matches_f32::<H>(client, &mut rng);
    half_gelu_matches_f32::<H>(client, &mut rng);
    half_rotary_matches_f32::<H>(client, &mut rng);
    true
}

/// Causal softmax and its backward on [2, 3, 37, 37] scores.
fn half_softmax_matches_f32<H: Storage>(client: &Client, launch: RowLaunch, rng: &mut Rng) {
    let s = shape(2, 3, 37, 37);
    let x = rounded::<H>(&rng.vec(s.len(), -6.0, 6.0));
    let scale = 0.125f32;
    let run = |storage_half: bool, x: &[f32]| -> Vec<f32> {
        if storage_half {
            let (input, output) = (upload_as::<H>(client, x), poisoned_as::<H>(client, s.len()));
            softmax_forward::<H>(
                client,
                launch,
                &input,
                SoftmaxMask::Causal,
                &output,
                None,
                s,
                scale,
            );
            download_as::<H>(client, output, s.len())
        } else {
            run_softmax(client, launch, x, s, scale, true, None)
        }
    };
    let (y_half, y_f32) = (run(true, &x), run(false, &x));
    assert_within_an_ulp::<H>("causal softmax", &y_half, &y_f32, 0.0);

    let y = rounded::<H>(&y_f32);
    let dy = rounded::<H>(&rng.vec(s.len(), -1.0, 1.0));
    let dx_f32 = run_softmax_backward(client, launch, &y, &dy, s, true, scale);
    let (yh, dyh, dxh) = (
        upload_as::<H>(client, &y),
        upload_as::<H>(client, &dy),
        poisoned_as::<H>(client, s.len()),
    );
    softmax_backward::<H>(client, launch, &yh, &dyh, &dxh, s, true, scale, None, None);
    let dx_half = download_as::<H>(client, dxh, s.len());
    assert_within_an_ulp::<H>("softmax backward", &dx_half, &dx_f32, 0.0);
}

/// LayerNorm forward and backward, 33 rows of 200.
fn half_layer_norm_matches_f32<H: Storage>(client: &Client, launch: RowLaunch, rng: &mut Rng) {
    let (rows, cols) = (33, 200);
    let x = rounded::<H>(&rng.vec(rows * cols, -3.0, 5.0));
    let gamma = rounded::<H>(&rng.vec(cols, 0.5, 1.5));
    let beta = rounded::<H>(&rng.vec(cols, -0.5, 0.5));
    let f32_run = run_layer_norm(client, launch, &x, &gamma, &beta, rows, cols, 1e-5);
    let [xh, gh, bh] = [&x, &gamma, &beta].map(|v| upload_as::<H>(client, v));
    let (yh, mean, rstd) = (
        poisoned_as::<H>(client, rows * cols),
        poisoned(client, rows),
        poisoned(client, rows),
    );
    layer_norm_forward::<H>(
        client, launch, &xh, &gh, &bh, &yh, &mean, &rstd, rows, cols, 1e-5,
    );
    let y_half = download_as::<H>(client, yh, rows * cols);
    assert_within_an_ulp::<H>("layer norm", &y_half, &f32_run.y, 0.0);
    // The statistics stay f32, from the same inputs: equal.
    assert_eq!(
        download(client, mean, rows),
        f32_run.mean,
        "layer norm mean"
    );
    assert_eq!(download(client, rstd, rows), f32_run.rstd, "layer norm 1/σ");

    let dy = rounded::<H>(&rng.vec(rows * cols, -1.0, 1.0));
    let (dx_f32, dg_f32, db_f32) = run_layer_norm_backward(
        client,
        launch,
        &x,
        &gamma,
        &dy,
        &f32_run.mean,
        &f32_run.rstd,
        rows,
        cols,
    );
    let [xh, gh, dyh] = [&x, &gamma, &dy].map(|v| upload_as::<H>(client, v));
    let [mh, rh] = [&f32_run.mean, &f32_run.rstd].map(|v| upload(client, v));
    let (dxh, dgh, dbh) = (
        poisoned_as::<H>(client, rows * cols),
        poisoned_as::<H>(client, cols),
        poisoned_as::<H>(client, cols),
    );
    layer_norm_backward::<H>(
        client, launch, &xh, &gh, &dyh, &mh, &rh, None, &dxh, &dgh, &dbh, rows, cols,
    );
    assert_within_an_ulp::<H>(
        "layer norm dx",
        &download_as::<H>(client, dxh, rows * cols),
        &dx_f32,
        0.0,
    );
    assert_within_an_ulp::<H>(
        "layer norm dγ",
        &download_as::<H>(client, dgh, cols),
        &dg_f32,
        0.0,
    );
    assert_within_an_ulp::<H>(
        "layer norm dβ",
        &download_as::<H>(client, dbh, cols),
        &db_f32,
        0.0,
    );
}

/// A bias's gradient (the column sums of the same rounded gradient), 4,099 rows of 24.
fn half_bias_gradient_matches_f32<H: Storage>(client: &Client, rng: &mut Rng) {
    let (rows, cols) = (4099, 24);
    let dy = rounded::<H>(&rng.vec(rows * cols, -1.0, 1.0));
    let column = ColumnLaunch::for_client(client);
    let (dyf, sf) = (upload(client, &dy), poisoned(client, cols));
    bias_gradient::<f32>(client, column, &dyf, &sf, rows, cols);
    let (dyh, sh) = (upload_as::<H>(client, &dy), poisoned_as::<H>(client, cols));
    bias_gradient::<H>(client, column, &dyh, &sh, rows, cols);
    assert_within_an_ulp::<H>(
        "bias gradient",
        &download_as::<H>(client, sh, cols),
        &download(client, sf, cols),
        0.0,
    );
}

/// Dropout: the same elements dropped, the kept ones scaled in f32 and rounded once.
fn half_dropout_matches_f32<H: Storage>(client: &Client, rng: &mut Rng) {
    let n = 10_007;
    let x = rounded::<H>(&rng.vec(n, -2.0, 2.0));
    let draw = test_draw(0x9e37_79b9, 7, 0.1);
    let (xf, of) = (upload(client, &x), poisoned(client, n));
    dropout::<f32>(client, &xf, &of, n, draw);
    let out_f32 = download(client, of, n);
    let (xh, oh) = (upload_as::<H>(client, &x), poisoned_as::<H>(client, n));
    dropout::<H>(client, &xh, &oh, n, draw);
    let out_half = download_as::<H>(client, oh, n);
    for (i, (h, f)) in out_half.iter().zip(&out_f32).enumerate() {
        assert_eq!(*h == 0.0, *f == 0.0, "dropout element {i}: {h} vs {f}");
    }
    assert_within_an_ulp::<H>("dropout", &out_half, &out_f32, 0.0);
}

/// Fused attention with dropout: the forward, then the backward fed the same (rounded)
/// output, so the f32 and half runs compute the same f32 values and differ only by the
/// final rounding. Heads of 64 and 128 (GPT-2's and Llama's), 37 positions: no multiple
/// of any tile; one head (the f32 test has several).
fn half_attention_matches_f32<H: Storage>(client: &Client, rng: &mut Rng) {
    let draw = test_draw(0x9e37_79b9, 7, 0.1);
    let documents = packed_first_keys(rng, 1, 37, 12);
    // Heads of 64 also over packed documents (the first keys' kernels).
    for (head_dim, keys) in [(64, None), (128, None), (64, Some(&documents[..]))] {
        let a = AttentionShape {
            heads: 1,
            seq: 37,
            head_dim,
        };
        let tiles = AttentionLaunch::for_client(client, head_dim);
        let inputs = [0; 4].map(|_| rounded::<H>(&rng.vec(a.len(), -1.5, 1.5)));
        let (inputs, keys) = (inputs.each_ref().map(|v| &v[..]), keys.map(|k| (k, 1)));
        let run = |storage_f32: bool, output: Option<&[f32]>| match storage_f32 {
            true => run_attention::<f32>(
                client,
                tiles,
                inputs,
                output,
                a,
                (0.25, Some(draw)),
                keys,
                None,
            ),
            false => run_attention::<H>(
                client,
                tiles,
                inputs,
                output,
                a,
                (0.25, Some(draw)),
                keys,
                None,
            ),
        };
        let (forward_f32, forward_half) = (run(true, None), run(false, None));
        let what = |name: &str| {
            format!(
                "attention {name}, head_dim {head_dim}, documents {}",
                keys.is_some()
            )
        };
        assert_within_an_ulp::<H>(&what("output"), &forward_half[0], &forward_f32[0], 0.0);
        let o = forward_half[0].clone();
        let (backward_f32, backward_half) = (run(true, Some(&o)), run(false, Some(&o)));
        for (i, name) in [(1, "dq"), (2, "dk"), (3, "dv")] {
            assert_within_an_ulp::<H>(&what(name), &backward_half[i], &backward_f32[i], 0.0);
        }
    }
}

/// RMSNorm forward and backward, 33 rows of 200.
fn half_rms_norm_matches_f32<H: Storage>(client: &Client, launch: RowLaunch, rng: &mut Rng) {
    let (rows, cols) = (33, 200);
    let x = rounded::<H>(&rng.vec(rows * cols, -3.0, 5.0));
    let gamma = rounded::<H>(&rng.vec(cols, 0.5, 1.5));
    let f32_run = run_rms_norm(client, launch, &x, &gamma, rows, cols, 1e-5);
    let [xh, gh] = [&x, &gamma].map(|v| upload_as::<H>(client, v));
    let (yh, rstd) = (
        poisoned_as::<H>(client, rows * cols),
        poisoned(client, rows),
    );
    rms_norm_forward::<H>(client, launch, &xh, &gh, &yh, &rstd, rows, cols, 1e-5);
    let y_half = download_as::<H>(client, yh, rows * cols);
    assert_within_an_ulp::<H>("rms norm", &y_half, &f32_run.y, 0.0);
    assert_eq!(download(client, rstd, rows), f32_run.rstd, "rms norm 1/rms");

    let dy = rounded::<H>(&rng.vec(rows * cols, -1.0, 1.0));
    let (dx_f32, dg_f32) =
        run_rms_norm_backward(client, launch, &x, &gamma, &dy, &f32_run.rstd, rows, cols);
    let dyh = upload_as::<H>(client, &dy);
    let rh = upload(client, &f32_run.rstd);
    let (dxh, dgh) = (
        poisoned_as::<H>(client, rows * cols),
        poisoned_as::<H>(client, cols),
    );
    rms_norm_backward::<H>(
        client, launch, &xh, &gh, &dyh, &rh, None, &dxh, &dgh, rows, cols,
    );
    assert_within_an_ulp::<H>(
        "rms norm dx",
        &download_as::<H>(client, dxh, rows * cols),
        &dx_f32,
        0.0,
    );
    assert_within_an_ulp::<H>(
        "rms norm dγ",
        &download_as::<H>(client, dgh, cols),
        &dg_f32,
        0.0,
    );
}

/// SwiGLU forward and backward.
fn half_swiglu_matches_f32<H: Storage>(client: &Client, rng: &mut Rng) {
    let n = 10_007;
    let [gate, up, dy] =
        [(-6.0, 6.0), (-2.0, 2.0), (-1.0, 1.0)].map(|(lo, hi)| rounded::<H>(&rng.vec(n, lo, hi)));
    let y_f32 = run_swiglu(client, &gate, &up);
    let (dg_f32, du_f32) = run_swiglu_backward(client, &gate, &up, &dy);
    let [gh, uh, dyh] = [&gate, &up, &dy].map(|v| upload_as::<H>(client, v));
    let [yh, dgh, duh] = [0; 3].map(|_| poisoned_as::<H>(client, n));
    swiglu_forward::<H>(client, &gh, &uh, &yh, n);
    swiglu_backward::<H>(client, &gh, &uh, &dyh, [&dgh, &duh], n);
    assert_within_an_ulp::<H>("swiglu", &download_as::<H>(client, yh, n), &y_f32, 0.0);
    assert_within_an_ulp::<H>(
        "swiglu d_gate",
        &download_as::<H>(client, dgh, n),
        &dg_f32,
        0.0,
    );
    assert_within_an_ulp::<H>(
        "swiglu d_up",
        &download_as::<H>(client, duh, n),
        &du_f32,
        0.0,
    );
}

/// GELU forward and backward, exact and tanh.
fn half_gelu_matches_f32<H: Storage>(client: &Client, rng: &mut Rng) {
    let n = 10_007;
    for tanh in [false, true] {
        let [x, dy] = [(-6.0, 6.0), (-1.0, 1.0)].map(|(lo, hi)| rounded::<H>(&rng.vec(n, lo, hi)));
        let [x32, dy32] = [&x, &dy].map(|v| upload(client, v));
        let [y32, dx32] = [0; 2].map(|_| poisoned(client, n));
        gelu_forward::<f32>(client, &x32, None, &y32, n, tanh);
        gelu_backward::<f32>(client, &x32, None, &dy32, &dx32, n, tanh);
        let [xh, dyh] = [&x, &dy].map(|v| upload_as::<H>(client, v));
        let [yh, dxh] = [0; 2].map(|_| poisoned_as::<H>(client, n));
        gelu_forward::<H>(client, &xh, None, &yh, n, tanh);
        gelu_backward::<H>(client, &xh, None, &dyh, &dxh, n, tanh);
        assert_within_an_ulp::<H>(
            "gelu",
            &download_as::<H>(client, yh, n),
            &download(client, y32, n),
            0.0,
        );
        assert_within_an_ulp::<H>(
            "gelu dx",
            &download_as::<H>(client, dxh, n),
            &download(client, dx32, n),
            0.0,
        );
    }
}

/// Rotary embedding, both layouts, part of each head rotated, and its backward.
fn half_rotary_matches_f32<H: Storage>(client: &Client, rng: &mut Rng) {
    for interleaved in [false, true] {
        let p = Rope {
            interleaved,
            ..rope(6, 29, 24, 16, 11)
        };
        let tables = rotary_tables(p.positions, p.rotary_dim);
        let x = rounded::<H>(&rng.vec(p.shape.len(), -3.0, 3.0));
        for inverse in [false, true] {
            assert_within_an_ulp::<H>(
                &format!("rotary (interleaved {interleaved}, inverse {inverse})"),
                &run_rotary::<H>(client, &x, &tables, p, inverse),
                &run_rotary::<f32>(client, &x, &tables, p, inverse),
                0.0,
            );
        }
    }
}

impl Storage for f32 {
    const NAME: &'static str = "f32";
    const ULP: f64 = 1.0 / 8_388_608.0;
    const MIN_NORMAL: f64 = 1.1754944e-38;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

/// Fused attention stored in `S`: `[o, dq, dk, dv]` for `[q, k, v, do]`, the backward given
/// `output` in place of the forward's when it is `Some`.
#[allow(clippy::too_many_arguments)]
fn run_attention<S: Storage>(
    client: &Client,
    launch: AttentionLaunch,
    [q, k, v, dout]: [&[f32]; 4],
    output: Option<&[f32]>,
    shape: AttentionShape,
    (scale, dropout): (f32, Option<DropoutDraw>),
    first_keys: Option<(&[u32], usize)>,
    chunk: Option<(usize, usize)>,
) -> [Vec<f32>; 4] {
    let n = shape.len();
    let [qh, kh, vh, dh] = [q, k, v, dout].map(|x| upload_as::<S>(client, x));
    let keys = first_keys.map(|(keys, _)| client.create_from_slice(u32::as_bytes(keys)));
    let inputs = AttentionInputs {
        first_keys: keys.as_ref().zip(first_keys).map(|(handle, (_, batch))| {
            let (queries_from, draw_seq) = chunk.unwrap_or((0, shape.seq));
            FirstKeys {
                queries_from,
                draw_seq,
                ..FirstKeys::of(handle, batch, shape.seq)
            }
        }),
        ..AttentionInputs::causal(&qh, &kh, &vh)
    };
    let (oh, lh) = (poisoned_as::<S>(client, n), poisoned(client, shape.rows()));
    flash_attention_forward::<S>(client, launch, inputs, &oh, &lh, shape, scale, dropout);
    let oh = output.map_or(oh, |o| upload_as::<S>(client, o));
    let grads = [0; 3].map(|_| poisoned_as::<S>(client, n));
    let delta = poisoned(client, shape.rows());
    let grad_handles = [&grads[0], &grads[1], &grads[2]];
    let (o, d) = (&oh, &dh);
    flash_attention_backward::<S>(
        client,
        launch,
        inputs,
        o,
        d,
        &lh,
        grad_handles,
        &delta,
        shape,
        scale,
        dropout,
    );
    let [dq, dk, dv] = grads.map(|g| download_as::<S>(client, g, n));
    [download_as::<S>(client, oh, n), dq, dk, dv]
}

#[test]
fn half_precision_storage_matches_the_f32_kernels_within_an_ulp() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    let client = client();
    let ran: Vec<&str> = [
        ("f16", half_storage_matches_f32::<half::f16>(&client)),
        ("bf16", half_storage_matches_f32::<half::bf16>(&client)),
    ]
    .into_iter()
    .filter_map(|(name, ran)| ran.then_some(name))
    .collect();
    println!("half-precision storage checked on this device: {ran:?}");
    // lavapipe stores f16 (WGSL has no bf16); cubecl-cpu both. A device storing neither
    // would leave this test empty: fail instead.
    assert!(!ran.is_empty(), "this device stores neither f16 nor bf16");
}

/// Dropout's bits in plain Rust (`ferrotron_kernels::dropout::dropout_bits` on the host).
fn host_dropout_bits(key_lo: u32, key_hi: u32, index: u32) -> u32 {
    fn fmix32(mut h: u32) -> u32 {
        h ^= h >> 16;
        h = h.wrapping_mul(0x85eb_ca6b);
        h ^= h >> 13;
        h = h.wrapping_mul(0xc2b2_ae35);
        h ^ (h >> 16)
    }
    fmix32(fmix32(index ^ key_lo).wrapping_add(key_hi) ^ 0x9e37_79b9)
}

/// The draw element of element `i` of a tensor holding `slice` of the draw (its definition:
/// runs of `own` starting at `first` in rows of `row`).
fn draw_index(slice: DrawSlice, i: usize) -> u32 {
    let own = slice.own as usize;
    ((i / own) * slice.row as usize + slice.first as usize + i % own) as u32
}

/// A tensor-parallel rank's draw: rank 1 of 2 holding one head of each batch element's two,
/// the probabilities of heads of `seq` positions.
fn second_rank_heads(draw: DropoutDraw, seq: usize) -> DropoutDraw {
    draw.sliced(DrawSlice::chunk(seq * seq, 2, 1))
}

/// Output and gradients of causal attention in float64, the scores and probabilities
/// materialised (the unfused math), the probabilities dropped by the draw's bits of their
/// elements in the tensor's slice of it: `[o, dq, dk, dv]`.
fn attention_reference(
    inputs: [&[f32]; 4],
    shape: AttentionShape,
    scale: f64,
    dropout: Option<DropoutDraw>,
) -> [Vec<f64>; 4] {
    let everything = vec![0; shape.seq];
    document_attention_reference(inputs, shape, scale, dropout, &everything)
}

/// [`attention_reference`] with query `i` of batch element `b` seeing keys
/// `first_keys[b · seq + i] ..= i` (`first_keys` holds `batch` rows; the heads are
/// `[batch · heads]`): each key outside that range is simply left out of the row.
fn document_attention_reference(
    [q, k, v, dout]: [&[f32]; 4],
    shape: AttentionShape,
    scale: f64,
    dropout: Option<DropoutDraw>,
    first_keys: &[u32],
) -> [Vec<f64>; 4] {
    let (s, d) = (shape.seq, shape.head_dim);
    let sample_heads = shape.heads / (first_keys.len() / s);
    let at = |t: &[f32], row: usize, c: usize| t[row * d + c] as f64;
    let mut out = [0; 4].map(|_| vec![0.0; shape.len()]);
    for h in 0..shape.heads {
        let row = |i: usize| h * s + i;
        let firsts = &first_keys[(h / sample_heads) * s..][..s];
        for i in 0..s {
            let first = firsts[i] as usize;
            let scores: Vec<f64> = (first..=i)
                .map(|j| {
                    scale
                        * (0..d)
                            .map(|c| at(q, row(i), c) * at(k, row(j), c))
                            .sum::<f64>()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
            let sum: f64 = scores.iter().map(|x| (x - max).exp()).sum();
            let p: Vec<f64> = scores.iter().map(|x| (x - max).exp() / sum).collect();
            let z: Vec<f64> = (first..=i)
                .map(|j| match dropout {
                    Some(dr) => {
                        let (lo, hi) = dr.key();
                        let index = draw_index(dr.slice, row(i) * s + j);
                        let bits = host_dropout_bits(lo, hi, index);
                        if bits >= dr.threshold {
                            dr.scale as f64
                        } else {
                            0.0
                        }
                    }
                    None => 1.0,
                })
                .collect();
            let dp: Vec<f64> = (first..=i)
                .map(|j| {
                    z[j - first]
                        * (0..d)
                            .map(|c| at(dout, row(i), c) * at(v, row(j), c))
                            .sum::<f64>()
                })
                .collect();
            let delta: f64 = (0..p.len()).map(|j| p[j] * dp[j]).sum();
            for (x, j) in (first..=i).enumerate() {
                let (p, z) = (p[x], z[x]);
                let ds = p * (dp[x] - delta);
                for c in 0..d {
                    out[0][row(i) * d + c] += p * z * at(v, row(j), c);
                    out[1][row(i) * d + c] += scale * ds * at(k, row(j), c);
                    out[2][row(j) * d + c] += scale * ds * at(q, row(i), c);
                    out[3][row(j) * d + c] += p * z * at(dout, row(i), c);
                }
            }
        }
    }
    out
}

/// The attention launch shapes a test runs: the device's own; the tiled layout with the
/// smallest block (8 rows of 4 units, so that most sequences end inside a tile and rows
/// outnumber units), which is the GPUs' layout whatever this device's own; on a device with
/// the plane layout, one row per unit (narrow heads); and for heads of 8 the loops unrolled (a GPU's own
/// shape; wide unrolled heads take lavapipe tens of seconds to compile).
fn attention_launches(client: &Client, head_dim: usize) -> Vec<AttentionLaunch> {
    let own = AttentionLaunch::for_client(client, head_dim);
    let mut all = vec![own];
    let mut add = |launch| {
        if !all.contains(&launch) {
            all.push(launch);
        }
    };
    let tiles = AttentionLaunch {
        block: 8,
        unroll: false,
        plane: None,
        matrix_units: false,
    };
    add(tiles);
    // One row per unit only for narrow heads: the plane kernels are unrolled over the head
    // row, and lavapipe is slow to compile them for wide heads (benchmarks/results/
    // 2026-12-03-figures-from-comments.md).
    if let Some(plane) = own.plane.filter(|_| head_dim <= 16) {
        add(AttentionLaunch::planes(plane, plane));
    }
    if head_dim == 8 && client.properties().hardware.plane_size_max > 1 {
        add(AttentionLaunch {
            unroll: true,
            ..tiles
        });
    }
    all
}

/// Fused attention forward and backward against float64 with the scores materialised, with
/// and without dropout inside (of the whole draw, and of a tensor-parallel rank's heads of it),
/// for every block that fits: heads of one position, sequences
/// that are not a multiple of the block, head widths 1 to 128.
#[test]
fn flash_attention_forward_and_backward_match_float64() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    let client = client();
    let mut rng = Rng(11);
    let draw = test_draw(0x1234_5678, 99, 0.2);
    // Several heads once (their offsets are the same code at every width): the longer
    // sequences with one head, which halves their time on cubecl-cpu (a launch there is
    // seconds: benchmarks/results/2026-12-03-figures-from-comments.md).
    let shapes = [
        (1, 1, 1),
        (3, 17, 8),
        (1, 64, 16),
        (1, 41, 64),
        (1, 70, 128),
    ];
    for (heads, seq, head_dim) in shapes {
        let shape = AttentionShape {
            heads,
            seq,
            head_dim,
        };
        let n = shape.len();
        let [q, k, v, dout] = [0; 4].map(|_| rng.vec(n, -1.5, 1.5));
        let scale = 1.0 / (head_dim as f64).sqrt();
        let mut dropouts = vec![None, Some(draw)];
        if heads > 1 {
            // A rank's heads of the draw: each head's probabilities elsewhere in it.
            dropouts.push(Some(second_rank_heads(draw, seq)));
        }
        for dropout in dropouts {
            let want = attention_reference([&q, &k, &v, &dout], shape, scale, dropout);
            for launch in attention_launches(&client, head_dim) {
                let inputs = [&q[..], &k, &v, &dout];
                check_flash_attention(&client, launch, inputs, shape, dropout, None, &want);
            }
        }
    }
}

/// `launch`'s fused attention forward and backward on `[q, k, v, do]` (with `first_keys`, of
/// their `batch` rows, if given) against `want`, `[o, dq, dk, dv]` in float64.
fn check_flash_attention(
    client: &Client,
    launch: AttentionLaunch,
    inputs: [&[f32]; 4],
    shape: AttentionShape,
    dropout: Option<DropoutDraw>,
    first_keys: Option<(&[u32], usize)>,
    want: &[Vec<f64>; 4],
) {
    let scale = (1.0 / (shape.head_dim as f64).sqrt()) as f32;
    let what = format!(
        "{shape:?}, {launch:?}, dropout {}, documents {}",
        dropout.is_some(),
        first_keys.is_some()
    );
    let draw = (scale, dropout);
    let got = run_attention::<f32>(client, launch, inputs, None, shape, draw, first_keys, None);
    assert_close(&format!("{what}: output"), &got[0], &want[0], 1e-5, 1e-4);
    for (name, i) in [("dq", 1), ("dk", 2), ("dv", 3)] {
        assert_close(&format!("{what}: {name}"), &got[i], &want[i], 1e-4, 1e-3);
    }
}

/// The first key each position sees when `batch` rows of `seq` tokens pack documents of 1 to
/// `longest` tokens (Megatron's `--reset-attention-mask`: a position sees back to where its
/// document starts), lengths drawn from `rng`.
fn packed_first_keys(rng: &mut Rng, batch: usize, seq: usize, longest: usize) -> Vec<u32> {
    let mut keys = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let mut start = 0;
        while start < seq {
            let len = 1 + (rng.uniform() * longest as f64) as usize;
            let end = (start + len).min(seq);
            keys.extend(std::iter::repeat_n(start as u32, end - start));
            start = end;
        }
    }
    keys
}

/// Fused attention over packed documents (each query seeing back to its document's start,
/// from `[batch, seq]` first keys shared by an element's heads) against float64 with the
/// keys of other documents left out of each row, on every launch shape, with and without
/// dropout: documents shorter than a block, several in a block, longer than one, and
/// batch elements packed differently; and with a sliding window inside the documents.
#[test]
fn flash_attention_over_packed_documents_matches_float64() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    let client = client();
    let mut rng = Rng(29);
    let draw = test_draw(0x0f0f_1234, 5, 0.2);
    // (batch, heads per element, seq, head_dim, longest document)
    for (batch, heads, seq, head_dim, longest) in [(2, 2, 37, 16, 12), (1, 1, 70, 64, 40)] {
        let shape = AttentionShape {
            heads: batch * heads,
            seq,
            head_dim,
        };
        let n = shape.len();
        let [q, k, v, dout] = [0; 4].map(|_| rng.vec(n, -1.5, 1.5));
        let packed = packed_first_keys(&mut rng, batch, seq, longest);
        // And a sliding window of 9 keys before each query inside the documents (the same
        // kernels: the first keys are the later of the two).
        let windowed: Vec<u32> = (0..batch * seq)
            .map(|at| packed[at].max((at % seq).saturating_sub(9) as u32))
            .collect();
        let scale = 1.0 / (head_dim as f64).sqrt();
        for (keys, dropout) in [(&packed, None), (&packed, Some(draw)), (&windowed, None)] {
            let inputs = [&q[..], &k, &v, &dout];
            let want = document_attention_reference(inputs, shape, scale, dropout, keys);
            for launch in attention_launches(&client, head_dim) {
                let documents = Some((&keys[..], batch));
                check_flash_attention(&client, launch, inputs, shape, dropout, documents, &want);
            }
        }
    }
}

/// A context-parallel chunk's attention (its queries the positions `from..seen` of a head
/// `seen` long, the positions before them padding of any value, keys `0..seen`, its dropout
/// drawn over the whole `whole`-long sequence) gives the rows of the whole sequence's attention
/// at those queries: the output and `dq` there, and the keys' and values' gradients of the
/// whole attention whose output gradient is zero off the chunk. Chunk ends off the blocks'
/// (blocks of padding and queries), packed documents, with dropout.
#[test]
fn flash_attention_of_a_context_parallel_chunk_is_the_rows_of_the_whole() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    let client = client();
    for launch in attention_launches(&client, 8) {
        let run = |inputs: [&[f32]; 4], shape, keys: &[u32], chunk| {
            let draw = (0.35, Some(test_draw(0x5eed_c0de, 17, 0.2)));
            run_attention::<f32>(
                &client,
                launch,
                inputs,
                None,
                shape,
                draw,
                Some((keys, 2)),
                chunk,
            )
        };
        check_chunk_rows(&format!("{launch:?}"), &run, 1e-5);
    }
}

/// [`flash_attention_of_a_context_parallel_chunk_is_the_rows_of_the_whole`] for the attention
/// `run` runs (`[o, dq, dk, dv]` of `[q, k, v, do]` of a shape, with first keys of 2 batch
/// elements and a chunk's `(queries_from, draw_seq)`), within `tolerance`.
#[allow(clippy::type_complexity)]
fn check_chunk_rows(
    what: &str,
    run: &dyn Fn([&[f32]; 4], AttentionShape, &[u32], Option<(usize, usize)>) -> [Vec<f32>; 4],
    tolerance: f64,
) {
    let mut rng = Rng(43);
    let (batch, whole, d, from, seen) = (2, 96, 8, 37, 70);
    let full = AttentionShape {
        heads: batch,
        seq: whole,
        head_dim: d,
    };
    let chunk = AttentionShape { seq: seen, ..full };
    let [q, k, v, dout] = [0; 4].map(|_| rng.vec(full.len(), -1.5, 1.5));
    let garbage = rng.vec(full.len(), -1.5, 1.5);
    // The whole's output gradient only at the chunk's queries; the chunk's queries after
    // padding of any value.
    let (mut masked_dout, mut cq, mut cdout) = (dout.clone(), vec![], vec![]);
    for h in 0..batch {
        for p in 0..whole {
            let row = (h * whole + p) * d..(h * whole + p + 1) * d;
            let query = (from..seen).contains(&p);
            if !query {
                masked_dout[row.clone()].fill(0.0);
            }
            if p < seen {
                cq.extend_from_slice(if query {
                    &q[row.clone()]
                } else {
                    &garbage[row.clone()]
                });
                cdout.extend(dout[row].iter().map(|&x| if query { x } else { 0.0 }));
            }
        }
    }
    let rows = |x: &[f32], range: std::ops::Range<usize>, len: usize| -> Vec<f32> {
        (0..batch)
            .flat_map(|h| x[(h * len + range.start) * d..(h * len + range.end) * d].to_vec())
            .collect()
    };
    let (ck, cv) = (rows(&k, 0..seen, whole), rows(&v, 0..seen, whole));
    // Packed documents (a chunk without them reads first keys of 0: the same code; one case,
    // each launch costing much on cubecl-cpu). The padding's first keys are 0, so that they do
    // not decrease along the head.
    let keys = packed_first_keys(&mut rng, batch, whole, 20);
    let chunk_keys: Vec<u32> = (0..batch)
        .flat_map(|b| (0..seen).map(move |p| (b, p)))
        .map(|(b, p)| if p < from { 0 } else { keys[b * whole + p] })
        .collect();
    let whole_run = run([&q, &k, &v, &masked_dout], full, &keys, None);
    let got = run(
        [&cq, &ck, &cv, &cdout],
        chunk,
        &chunk_keys,
        Some((from, whole)),
    );
    for (name, i, range) in [
        ("output", 0, from..seen),
        ("dq", 1, from..seen),
        ("dk", 2, 0..seen),
        ("dv", 3, 0..seen),
    ] {
        let want: Vec<f64> = rows(&whole_run[i], range.clone(), whole)
            .into_iter()
            .map(f64::from)
            .collect();
        let mine = rows(&got[i], range, seen);
        assert_close(
            &format!("{what}: {name}"),
            &mine,
            &want,
            tolerance,
            tolerance,
        );
    }
}

/// The tiles the attention kernels visit over packed documents are exactly those holding a
/// query–key pair the mask lets through, the forward's key tiles per query block and the
/// backward's query tiles per key block (counted from the kernels' own tile ranges against
/// the mask itself, element by element), and far fewer than causal attention visits: the
/// work and memory traffic grow with the documents' lengths, not the sequence's.
#[test]
fn attention_over_packed_documents_visits_only_the_tiles_it_sees() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(31);
    let (batch, seq) = (2, 203);
    let keys = packed_first_keys(&mut rng, batch, seq, 30);
    let shape = AttentionShape {
        heads: batch,
        seq,
        head_dim: 8,
    };
    for block in [8u32, 16] {
        let b = block as usize;
        let cubes = shape.heads * seq.div_ceil(b);
        let visited = |first_keys: Option<FirstKeys<'_>>| {
            let ranges = poisoned(&client, 4 * cubes);
            attention_tile_ranges(&client, shape, first_keys, block, &ranges);
            u32::from_bytes(&client.read_one_unchecked(ranges))[..4 * cubes].to_vec()
        };
        let keys_handle = client.create_from_slice(u32::as_bytes(&keys));
        let documents = visited(Some(FirstKeys::of(&keys_handle, batch, seq)));
        let causal = visited(None);
        let everything = vec![0u32; batch * seq];
        let count =
            |ranges: &[u32]| -> usize { ranges.chunks(2).map(|r| (r[1] - r[0]) as usize).sum() };
        for (name, ranges, firsts) in [
            ("documents", &documents, &keys),
            ("causal", &causal, &everything),
        ] {
            for cube in 0..cubes {
                let (h, start) = (cube / seq.div_ceil(b), (cube % seq.div_ceil(b)) * b);
                let first = &firsts[h * seq..][..seq];
                let sees = |i: usize, j: usize| i < seq && j <= i && j >= first[i] as usize;
                let tiles = seq.div_ceil(b);
                let block_rows = start..(start + b).min(seq);
                let key_tiles: Vec<usize> = (0..tiles)
                    .filter(|t| {
                        block_rows
                            .clone()
                            .any(|i| (t * b..(t + 1) * b).any(|j| sees(i, j)))
                    })
                    .collect();
                let query_tiles: Vec<usize> = (0..tiles)
                    .filter(|t| {
                        (t * b..(t + 1) * b).any(|i| block_rows.clone().any(|j| sees(i, j)))
                    })
                    .collect();
                let r = &ranges[cube * 4..][..4];
                let range = |lo: u32, hi: u32| (lo as usize..hi as usize).collect::<Vec<_>>();
                assert_eq!(
                    range(r[0], r[1]),
                    key_tiles,
                    "{name}: key tiles of block {cube} ({block})"
                );
                assert_eq!(
                    range(r[2], r[3]),
                    query_tiles,
                    "{name}: query tiles of block {cube} ({block})"
                );
            }
        }
        let (packed, full) = (count(&documents), count(&causal));
        println!("blocks of {block}: {packed} tiles visited over documents, {full} causal");
        assert!(
            3 * packed < full,
            "{packed} tiles visited over documents, {full} causal"
        );
    }
}

/// One Adam step per kernel against float64, first step (no moments) and a later one, with
/// and without weight decay, over a length that leaves a partly filled last cube.
/// Adam's launch scalars at step `t` (f64 hyper-parameters, as the optimizers compute them).
fn adam_scalars(beta1: f64, beta2: f64, eps: f64, lr: f64, decay: f64, t: i32) -> AdamScalars {
    AdamScalars {
        beta1: beta1 as f32,
        one_minus_beta1: (1.0 - beta1) as f32,
        beta2: beta2 as f32,
        one_minus_beta2: (1.0 - beta2) as f32,
        correction1: (1.0 - beta1.powi(t)) as f32,
        correction2: (1.0 - beta2.powi(t)) as f32,
        eps: eps as f32,
        keep: (1.0 - lr * decay) as f32,
        lr: lr as f32,
    }
}

#[test]
fn adam_step_matches_float64() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(5);
    let (beta1, beta2, eps, lr) = (0.9f64, 0.999f64, 1e-8f64, 3e-4f64);
    // An odd length (one element per unit) and one the device's vectors divide.
    for (n, t, decay, first) in [(10_007, 1, 0.0, true), (10_008, 7, 0.01, false)] {
        let (p, g) = (rng.vec(n, -1.0, 1.0), rng.vec(n, -0.1, 0.1));
        let (m, v) = (rng.vec(n, -0.05, 0.05), rng.vec(n, 0.0, 0.01));
        let scalars = adam_scalars(beta1, beta2, eps, lr, decay, t);
        let [ph, gh, mh, vh] = [&p, &g, &m, &v].map(|x| upload(&client, x));
        let out = poisoned(&client, 3 * n);
        let moments = (!first).then_some((&mh, &vh));
        adam_step::<f32>(&client, &ph, &gh, moments, &out, n, scalars);
        let got = download(&client, out, 3 * n);
        let mut want = vec![0.0; 3 * n];
        for i in 0..n {
            let (gi, mi, vi) = (g[i] as f64, m[i] as f64, v[i] as f64);
            let (mut m_new, mut v_new) = ((1.0 - beta1) * gi, (1.0 - beta2) * gi * gi);
            if !first {
                m_new += beta1 * mi;
                v_new += beta2 * vi;
            }
            let update =
                (m_new / (1.0 - beta1.powi(t))) / ((v_new / (1.0 - beta2.powi(t))).sqrt() + eps);
            want[i] = p[i] as f64 * (1.0 - lr * decay) - lr * update;
            want[n + i] = m_new;
            want[2 * n + i] = v_new;
        }
        let what = format!("adam step {t}");
        assert_close(
            &format!("{what}: parameter"),
            &got[..n],
            &want[..n],
            1e-7,
            1e-6,
        );
        // m = β₁ m + (1 − β₁) g can cancel: the bound is ulps of its terms (|β₁ m| ≤ 0.045,
        // an ulp 3.7e-9), not of the result.
        assert_close(
            &format!("{what}: m"),
            &got[n..2 * n],
            &want[n..2 * n],
            1e-8,
            1e-6,
        );
        assert_close(
            &format!("{what}: v"),
            &got[2 * n..],
            &want[2 * n..],
            1e-12,
            1e-5,
        );
    }
}

/// The in-place flat Adam step against float64: only the elements of its range change, the
/// gradient is clipped by the device coefficient first, the step's values are read from
/// their slot of the device buffer, and zero moments give the first step's values.
#[test]
fn flat_adam_step_in_place_matches_float64_on_its_range_only() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(6);
    let total = 3_000;
    let (p, g) = (rng.vec(total, -1.0, 1.0), rng.vec(total, -0.1, 0.1));
    let (beta1, beta2, eps, lr, decay, clip) = (0.9f64, 0.95f64, 1e-8f64, 1e-3f64, 0.1, 0.5f32);
    // Ranges the device's vectors divide at neither end, at one (of 2) and at both.
    for (t, zero_moments, start, len) in [
        (1, true, 512, 2_049),
        (4, false, 514, 2_048),
        (5, false, 512, 2_048),
    ] {
        let (m, v) = if zero_moments {
            (vec![0.0; total], vec![0.0; total])
        } else {
            (rng.vec(total, -0.05, 0.05), rng.vec(total, 0.0, 0.01))
        };
        let scalars = adam_scalars(beta1, beta2, eps, lr, decay, t);
        let [ph, gh, mh, vh] = [&p, &g, &m, &v].map(|x| upload(&client, x));
        let ch = upload(&client, &[clip]);
        // The step's values in the second slot, the first one a wrong step's.
        let mut per_step = vec![9.0f32; 4];
        per_step.extend(scalars.per_step());
        let per_step = (&upload(&client, &per_step), 1);
        let range = (start, len);
        let moments = (&mh, &vh);
        adam_step_in_place::<f32>(
            &client, &ph, &gh, moments, &ch, per_step, total, range, scalars,
        );
        let mut want = [p.clone(), m.clone(), v.clone()]
            .map(|x| x.iter().map(|&x| x as f64).collect::<Vec<f64>>());
        for i in start..start + len {
            let gi = (g[i] * clip) as f64;
            let m_new = beta1 * m[i] as f64 + (1.0 - beta1) * gi;
            let v_new = beta2 * v[i] as f64 + (1.0 - beta2) * gi * gi;
            let update =
                (m_new / (1.0 - beta1.powi(t))) / ((v_new / (1.0 - beta2.powi(t))).sqrt() + eps);
            want[0][i] = p[i] as f64 * (1.0 - lr * decay) - lr * update;
            want[1][i] = m_new;
            want[2][i] = v_new;
        }
        for (name, handle, want, abs) in [
            ("parameter", ph, &want[0], 1e-7),
            // (Ulps of the terms of m, which can cancel: see the test above.)
            ("m", mh, &want[1], 1e-8),
            ("v", vh, &want[2], 1e-12),
        ] {
            let got = download(&client, handle, total);
            assert_close(
                &format!("flat adam step {t} of {start}..+{len}: {name}"),
                &got,
                want,
                abs,
                1e-5,
            );
        }
    }
}

/// The pieces copying each of `handles` (`lens[k]` elements) to `offsets[k]`.
fn copy_pieces<'a>(handles: &'a [Handle], offsets: &[usize], lens: &[usize]) -> Vec<CopyPiece<'a>> {
    let places = offsets.iter().zip(lens);
    let piece = |(source, (&offset, &len))| CopyPiece {
        source,
        offset,
        len,
    };
    handles.iter().zip(places).map(piece).collect()
}

/// Gradients copied into a flat buffer, up to 32 per launch: 71 pieces (two full launches and
/// a partly used third, whichever number of sources the device binds), lengths from 0 to past
/// one cube-count dimension's worth of cubes, land at their offsets and nowhere else. Then
/// pieces whose offsets and lengths the device's vectors divide (copied in vectors), a launch
/// where one piece allows only vectors of 2, and a piece alone.
#[test]
fn gradients_copied_to_offsets_land_there_and_nowhere_else() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(13);
    let mut many = vec![5, 0, 1, 2_049, 256, 257, 65_535 * 256 + 3, 17, 3, 1, 1_000];
    many.extend((0..60).map(|k| (k * 37) % 300));
    // (pieces' lengths, the gap before each)
    let cases: [(&[usize], usize); 4] = [
        (&many, 3),
        (&[4, 0, 8, 2_048, 1_024, 1_028, 260, 12, 16], 4),
        (&[8, 6, 1_024, 4], 4),
        (&[1_000], 1),
    ];
    for (lens, gap) in cases {
        let mut offsets = Vec::new();
        let mut total = 2 * gap; // a gap before the first piece
        for &len in lens {
            offsets.push(total);
            total += len + gap; // and after each
        }
        let values: Vec<Vec<f32>> = lens.iter().map(|&n| rng.vec(n, -1.0, 1.0)).collect();
        let handles: Vec<_> = values.iter().map(|v| upload(&client, v)).collect();
        let pieces = copy_pieces(&handles, &offsets, lens);
        let flat = upload(&client, &vec![7.0; total]);
        copy_at_offsets::<f32, f32>(&client, &pieces, &flat, total, 1.0);
        let mut want = vec![7.0; total];
        for (v, &offset) in values.iter().zip(&offsets) {
            want[offset..offset + v.len()].copy_from_slice(v);
        }
        let got = download(&client, flat, total);
        let wrong = got.iter().zip(&want).position(|(a, b)| a != b);
        assert_eq!(wrong, None, "copies of {lens:?}: first wrong element");
    }
}

/// The causal softmax with the dropout of its output in the same kernel: both outputs are, bit
/// for bit, the softmax kernel's and the dropout kernel's on it (the whole tensor's draw), and
/// its backward the dropout kernel's then the softmax backward's (also when it writes the
/// dropped probabilities again, which must be the forward's), in f32 and each half type
/// the device stores, for every launch shape, with rows in vectors and not, and with fewer
/// queries than keys.
#[test]
fn softmax_with_its_dropout_is_the_softmax_and_dropout_kernels_both_ways() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let ran = [
        softmax_dropout_matches::<f32>(&client),
        softmax_dropout_matches::<half::f16>(&client),
        softmax_dropout_matches::<half::bf16>(&client),
    ];
    assert!(ran[0] && ran[1..].iter().any(|&r| r), "{ran:?}");
}

fn softmax_dropout_matches<H: Storage>(client: &Client) -> bool {
    if !client.properties().supports_type(H::cube_type()) {
        return false;
    }
    let mut rng = Rng(23);
    let whole = test_draw(0x1234_5678, 99, 0.25);
    for s in [shape(2, 3, 37, 37), shape(1, 2, 64, 64), shape(2, 1, 5, 12)] {
        let x = rounded::<H>(&rng.vec(s.len(), -6.0, 6.0));
        let input = upload_as::<H>(client, &x);
        // Also a tensor-parallel rank's heads of the draw (rank 1 of 2): the softmax kernels
        // offset each row's indices once, the dropout kernel divides per element.
        let rank_heads = DrawSlice::chunk(s.heads * s.sq * s.sk, 2, 1);
        let draws = [whole, whole.sliced(rank_heads)];
        for (launch, draw) in launches(client)
            .into_iter()
            .flat_map(|l| draws.map(|d| (l, d)))
        {
            let what = format!("{} {s:?} {launch:?} {:?}", H::NAME, draw.slice);
            let [y, dropped, y_alone, dropped_alone, dropped_only] =
                [0; 5].map(|_| poisoned_as::<H>(client, s.len()));
            let causal = SoftmaxMask::Causal;
            let with_dropout = Some((draw, &dropped));
            softmax_forward::<H>(client, launch, &input, causal, &y, with_dropout, s, 0.3);
            softmax_forward::<H>(client, launch, &input, causal, &y_alone, None, s, 0.3);
            dropout::<H>(client, &y_alone, &dropped_alone, s.len(), draw);
            causal_softmax_dropped::<H>(client, launch, &input, &dropped_only, draw, s, 0.3);
            let bits = |h: Handle| -> Vec<u32> {
                download_as::<H>(client, h, s.len())
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(bits(y), bits(y_alone.clone()), "softmax of {what}");
            let (fused, alone) = (bits(dropped), bits(dropped_alone));
            assert_eq!(fused, alone, "dropout of {what}");
            // Without the probabilities: the same dropped bits.
            assert_eq!(bits(dropped_only), alone, "dropout alone of {what}");
            let zeros = fused.iter().filter(|&&b| b == 0).count();
            assert!(zeros > s.len() / 5, "{what}: {zeros} zeros of {}", s.len());
            // The backward from the dropped output's gradient: the dropout kernel's backward
            // (the same kernel) then the softmax backward, or one kernel.
            let g = upload_as::<H>(client, &rounded::<H>(&rng.vec(s.len(), -1.0, 1.0)));
            let [dx, dy_alone, dx_alone, dx_redropping, redropped] =
                [0; 5].map(|_| poisoned_as::<H>(client, s.len()));
            let y = &y_alone;
            dropout::<H>(client, &g, &dy_alone, s.len(), draw);
            let draw = Some(draw);
            softmax_backward::<H>(client, launch, y, &g, &dx, s, true, 0.3, draw, None);
            let (dy, dx2) = (&dy_alone, &dx_alone);
            softmax_backward::<H>(client, launch, y, dy, dx2, s, true, 0.3, None, None);
            // Writing the dropped probabilities again as well: the forward's bits, and the
            // same gradient.
            let (dx3, again) = (&dx_redropping, Some(&redropped));
            softmax_backward::<H>(client, launch, y, &g, dx3, s, true, 0.3, draw, again);
            let dx = bits(dx);
            assert_eq!(dx, bits(dx_alone), "backward of {what}");
            assert_eq!(
                dx,
                bits(dx_redropping),
                "backward writing the dropped of {what}"
            );
            assert_eq!(
                bits(redropped),
                alone,
                "the dropped again in the backward of {what}"
            );
        }
    }
    true
}

/// Softmax rows held in registers give, bit for bit, what rows read in each pass give: the
/// causal forward with its dropout, the backward through the dropout writing the dropped
/// probabilities again, and the backward from the scores, in f32 and each half type the device
/// stores, with this device's launch and NVIDIA's (a warp per row, in vectors; not on
/// cubecl-cpu), for rows of one to eight vectors per unit, a row ending inside a unit's last
/// vector, and fewer queries than keys.
#[test]
fn softmax_rows_held_in_registers_give_the_bits_of_rows_read_in_each_pass() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let ran = [
        held_rows_match::<f32>(&client),
        held_rows_match::<half::f16>(&client),
        held_rows_match::<half::bf16>(&client),
    ];
    assert!(ran[0] && ran[1..].iter().any(|&r| r), "{ran:?}");
}

fn held_rows_match<H: Storage>(client: &Client) -> bool {
    if !client.properties().supports_type(H::cube_type()) {
        return false;
    }
    let mut rng = Rng(31);
    let draw = test_draw(0x0bad_cafe, 3, 0.25);
    let own = RowLaunch::for_client(client);
    let warp = RowLaunch {
        lanes: 32,
        rows_per_cube: 4,
        plane_reduce: false,
        vectorized: true,
        held_in_registers: true,
    };
    let mut held_some = false;
    for s in [
        shape(2, 3, 37, 37),
        shape(1, 2, 64, 64),
        shape(1, 1, 9, 300),
        shape(2, 1, 5, 12),
    ] {
        let scores = upload_as::<H>(client, &rounded::<H>(&rng.vec(s.len(), -6.0, 6.0)));
        let g = upload_as::<H>(client, &rounded::<H>(&rng.vec(s.len(), -1.0, 1.0)));
        // A device without planes (cubecl-cpu) runs its own one-lane shape only (see
        // `launches`).
        let shapes = if own.lanes == 1 {
            vec![own]
        } else {
            vec![own, warp]
        };
        for launch in shapes {
            let what = format!("{} {s:?} {launch:?}", H::NAME);
            let width = s.sk / launch.vector_size::<H>(client, s.sk);
            held_some |= ferrotron_kernels::softmax::held_vectors(width, launch.lanes) > 0;
            let [held, read] = [true, false].map(|held_in_registers| {
                let launch = RowLaunch {
                    held_in_registers,
                    ..launch
                };
                let [y, dropped, dx, redropped, dx_scores, p_scores] =
                    [0; 6].map(|_| poisoned_as::<H>(client, s.len()));
                let (causal, d) = (SoftmaxMask::Causal, Some(draw));
                softmax_forward::<H>(
                    client,
                    launch,
                    &scores,
                    causal,
                    &y,
                    Some((draw, &dropped)),
                    s,
                    0.3,
                );
                softmax_backward::<H>(
                    client,
                    launch,
                    &y,
                    &g,
                    &dx,
                    s,
                    true,
                    0.3,
                    d,
                    Some(&redropped),
                );
                let (dxs, ps) = (&dx_scores, &p_scores);
                softmax_backward_from_scores::<H>(client, launch, &scores, &g, dxs, ps, s, 0.3, d);
                [y, dropped, dx, redropped, dx_scores, p_scores].map(|h| {
                    download_as::<H>(client, h, s.len())
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<u32>>()
                })
            });
            let names = [
                "probabilities",
                "dropped",
                "dx",
                "dropped again",
                "dx from the scores",
                "dropped from the scores",
            ];
            for ((name, a), b) in names.iter().zip(&held).zip(&read) {
                assert_eq!(
                    a, b,
                    "{name} of {what}: held in registers against read in each pass"
                );
            }
        }
    }
    assert!(held_some, "no shape was held in registers");
    true
}

/// The causal softmax's backward from its scores (the probabilities formed again inside it)
/// is, bit for bit, the forward kernel then the backward kernel on the forward's stored
/// output: the input gradient, and the dropped probabilities with a draw (the plain ones
/// without), in f32 and each half type the device stores, for every launch shape, with rows
/// in vectors and not, and with fewer queries than keys.
#[test]
fn softmax_backward_from_the_scores_is_the_forward_then_the_backward() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let ran = [
        softmax_from_scores_matches::<f32>(&client),
        softmax_from_scores_matches::<half::f16>(&client),
        softmax_from_scores_matches::<half::bf16>(&client),
    ];
    assert!(ran[0] && ran[1..].iter().any(|&r| r), "{ran:?}");
}

fn softmax_from_scores_matches<H: Storage>(client: &Client) -> bool {
    if !client.properties().supports_type(H::cube_type()) {
        return false;
    }
    let mut rng = Rng(29);
    let bits = |h: Handle, len: usize| -> Vec<u32> {
        download_as::<H>(client, h, len)
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    for s in [shape(2, 3, 37, 37), shape(1, 2, 64, 64), shape(2, 1, 5, 12)] {
        let scores = upload_as::<H>(client, &rounded::<H>(&rng.vec(s.len(), -6.0, 6.0)));
        let g = upload_as::<H>(client, &rounded::<H>(&rng.vec(s.len(), -1.0, 1.0)));
        for launch in launches(client) {
            for draw in [Some(test_draw(0x9abc_def0, 7, 0.25)), None] {
                let what = format!("{} {s:?} {launch:?} dropout {}", H::NAME, draw.is_some());
                let [y, dx, redropped, dx_fused, probabilities] =
                    [0; 5].map(|_| poisoned_as::<H>(client, s.len()));
                let causal = SoftmaxMask::Causal;
                softmax_forward::<H>(client, launch, &scores, causal, &y, None, s, 0.3);
                let again = draw.is_some().then_some(&redropped);
                softmax_backward::<H>(client, launch, &y, &g, &dx, s, true, 0.3, draw, again);
                let (dxf, p) = (&dx_fused, &probabilities);
                softmax_backward_from_scores::<H>(
                    client, launch, &scores, &g, dxf, p, s, 0.3, draw,
                );
                let want = download_as::<H>(client, dx, s.len());
                assert!(
                    want.iter().any(|&v| v != 0.0),
                    "{what}: an all-zero gradient"
                );
                let got = download_as::<H>(client, dx_fused, s.len());
                if got
                    .iter()
                    .zip(&want)
                    .any(|(a, b)| a.to_bits() != b.to_bits())
                {
                    // Mesa 26's SPIR-V compiler drops the f32 → f16 → f32 round trip of the
                    // probabilities formed in the kernel (as of GELU's products above): dx may
                    // then differ by the half type's rounding of y in `y (dy − Σ dy y)`, where
                    // |dy| ≤ the draw's scale and Σ y = 1, and no more. Elsewhere: bits.
                    assert!(H::ULP > 1e-6, "input gradient of {what}: {got:?} {want:?}");
                    let y = download_as::<H>(client, y.clone(), s.len());
                    let keep = draw.map_or(1.0, |d| d.scale as f64);
                    for i in 0..s.len() {
                        let (g, w) = (got[i] as f64, want[i] as f64);
                        let tol = H::ULP * (w.abs() + 3.0 * 0.3 * keep * (y[i] as f64).abs())
                            + H::ULP * H::MIN_NORMAL;
                        assert!(
                            (g - w).abs() <= tol,
                            "input gradient {i} of {what}: {g} {w}"
                        );
                    }
                }
                let read_by_pv = if draw.is_some() { redropped } else { y };
                assert_eq!(
                    bits(probabilities, s.len()),
                    bits(read_by_pv, s.len()),
                    "probabilities of {what}"
                );
            }
        }
    }
    true
}

/// A half-precision model's gradients copied into the fp32 flat buffer with a scale (fp16's
/// `1 / loss scale`): every element is the host's `f32(g) · scale`, bit for bit, infinities
/// and NaN carried through (the overflow check reads them after the copy), pieces in vectors
/// and not, and nothing outside the pieces written. Runs for each half type the device stores.
#[test]
fn half_gradients_are_cast_and_scaled_into_the_fp32_buffer() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let ran = [
        copy_half_into_fp32::<half::f16>(&client),
        copy_half_into_fp32::<half::bf16>(&client),
    ];
    assert!(
        ran.iter().any(|&r| r),
        "this device stores neither f16 nor bf16"
    );
}

fn copy_half_into_fp32<H: Storage>(client: &Client) -> bool {
    if !client.properties().supports_type(H::cube_type()) {
        return false;
    }
    let mut rng = Rng(19);
    for (lens, gap, scale) in [
        (&[5usize, 1_024, 3, 2_052, 0, 17][..], 3usize, 1.0f32),
        (&[8, 1_024, 4, 6][..], 4, 1.0 / 3.0),
        (&[1_024, 2_048, 512][..], 8, 1.0 / 65_536.0),
    ] {
        let mut offsets = Vec::new();
        let mut total = gap;
        for &len in lens {
            offsets.push(total);
            total += len + gap;
        }
        let values: Vec<Vec<f32>> = lens
            .iter()
            .map(|&n| {
                let mut v = rounded::<H>(&rng.vec(n, -3.0e4, 3.0e4));
                if n > 4 {
                    (v[1], v[2], v[3]) = (f32::INFINITY, f32::NEG_INFINITY, f32::NAN);
                }
                v
            })
            .collect();
        let handles: Vec<_> = values.iter().map(|v| upload_as::<H>(client, v)).collect();
        let pieces = copy_pieces(&handles, &offsets, lens);
        let flat = upload(client, &vec![7.0; total]);
        copy_at_offsets::<H, f32>(client, &pieces, &flat, total, scale);
        let mut want = vec![7.0f32; total];
        for (v, &offset) in values.iter().zip(&offsets) {
            for (w, &g) in want[offset..offset + v.len()].iter_mut().zip(v) {
                *w = g * scale;
            }
        }
        let got = download(client, flat, total);
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        let wrong = (0..total).find(|&i| !same(got[i], want[i]));
        assert_eq!(
            wrong.map(|i| (i, got[i], want[i])),
            None,
            "{} copies of {lens:?} scaled by {scale}: first wrong element (index, got, want)",
            H::NAME
        );
    }
    true
}

/// The stream-ordering counters: `signal` adds one to the first counter and leaves the second;
/// a `wait_for` whose second counter has caught up with the first returns (one that has not
/// would hang, which is why the product that uses them writes its counter even when it fails),
/// also across the counters' wrap and when the second is ahead, and leaves the buffers it is
/// bound to (one to three: a window's products) as they were.
#[test]
fn stream_order_counters_are_raised_and_waited_for() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let flags = client.create_from_slice(u32::as_bytes(&[3, 4]));
    signal(&client, &flags);
    let written = upload(&client, &[1.5, -2.0]);
    let other = upload(&client, &[0.25, 7.0, -1.0]);
    wait_for::<f32>(&client, &flags, &[(&written, 2)]);
    signal(&client, &flags);
    let counters = u32::from_bytes(&client.read_one_unchecked(flags.clone())).to_vec();
    assert_eq!(counters, vec![5, 4]);
    // The other stream's write, done here by the host.
    let flags = client.create_from_slice(u32::as_bytes(&[5, 5]));
    wait_for::<f32>(&client, &flags, &[(&written, 2), (&other, 3)]);
    // Across the wrap: the first counter goes from 2³² − 1 to 0, the second is at 0 (caught
    // up) and then at 1 (ahead, as after a window the host counted but did not signal).
    let flags = client.create_from_slice(u32::as_bytes(&[u32::MAX, 0]));
    signal(&client, &flags);
    let third = upload(&client, &[4.0]);
    let all = [(&written, 2), (&other, 3), (&third, 1)];
    wait_for::<f32>(&client, &flags, &all);
    let counters = u32::from_bytes(&client.read_one_unchecked(flags)).to_vec();
    assert_eq!(counters, vec![0, 0]);
    let flags = client.create_from_slice(u32::as_bytes(&[u32::MAX, 1]));
    wait_for::<f32>(&client, &flags, &[(&third, 1)]);
    let counters = u32::from_bytes(&client.read_one_unchecked(flags)).to_vec();
    assert_eq!(counters, vec![u32::MAX, 1]);
    assert_eq!(download(&client, written, 2), vec![1.5, -2.0]);
    assert_eq!(download(&client, other, 3), vec![0.25, 7.0, -1.0]);
    assert_eq!(download(&client, third, 1), vec![4.0]);
}

/// Megatron's per-group QKV layout, read with nested loops: element `(b, i, g, part, c)` of
/// the mixed rows, `part` < `per_group` a query head of group `g`, then its key and value.
fn mixed_index(l: &QkvLayout, b: usize, i: usize, g: usize, part: usize, c: usize) -> usize {
    (((b * l.seq + i) * l.groups + g) * (l.per_group + 2) + part) * l.head_dim + c
}

/// The split's outputs, the merge's gradient and the core's output moved to rows and back
/// against the layouts read with nested loops:
/// multi-head (one query per group), grouped-query (four per group) and one group; sizes
/// that leave a partly filled last cube, and one longer than a cube-count dimension holds.
#[test]
fn qkv_split_and_merge_follow_megatrons_group_layout() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(17);
    for (batch, seq, groups, per_group, head_dim) in [
        (2, 5, 3, 1, 7),
        (1, 9, 2, 4, 5),
        (3, 1, 1, 3, 1),
        (2, 3, 2, 2, 6),      // vectors of 2
        (1, 4097, 8, 2, 128), // vectors of 4 (wgpu) or 8 (CUDA f16)
    ] {
        let l = QkvLayout {
            batch,
            seq,
            groups,
            per_group,
            head_dim,
        };
        let what = format!("{l:?}");
        let mixed = rng.vec(l.mixed_len(), -1.0, 1.0);
        let input = upload(&client, &mixed);
        let split = |bias: Option<&Handle>| {
            let parts = [0; 3].map(|_| poisoned(&client, l.head_len()));
            qkv_split::<f32>(&client, &input, bias, [&parts[0], &parts[1], &parts[2]], l);
            parts.map(|h| download(&client, h, l.head_len()))
        };
        let got = split(None);
        // The projection's bias (one row's width), added to each element on the way.
        let bias = rng.vec(l.row_width(), -1.0, 1.0);
        let biased = split(Some(&upload(&client, &bias)));
        let grads = [0; 3].map(|_| rng.vec(l.head_len(), -1.0, 1.0));
        let handles = grads.clone().map(|g| upload(&client, &g));
        let merged = poisoned(&client, l.mixed_len());
        qkv_merge::<f32>(&client, [&handles[0], &handles[1], &handles[2]], &merged, l);
        let merged = download(&client, merged, l.mixed_len());
        // The core's output `[b, heads, s, d]` as rows `[b, s, heads · d]` and back.
        let context = rng.vec(l.head_len(), -1.0, 1.0);
        let rows = poisoned(&client, l.head_len());
        heads_to_rows::<f32>(&client, &upload(&client, &context), &rows, l);
        let back = poisoned(&client, l.head_len());
        rows_to_heads::<f32>(&client, &rows, &back, l);
        let (rows, back) = (
            download(&client, rows, l.head_len()),
            download(&client, back, l.head_len()),
        );
        let mut want_merged = vec![0.0f64; l.mixed_len()];
        for b in 0..batch {
            for g in 0..groups {
                for j in 0..per_group {
                    let h = g * per_group + j;
                    for i in 0..seq {
                        for c in 0..head_dim {
                            let at = ((b * l.heads() + h) * seq + i) * head_dim + c;
                            let row_at = ((b * seq + i) * l.heads() + h) * head_dim + c;
                            assert_eq!(rows[row_at], context[at], "{what}: row element {row_at}");
                            assert_eq!(back[at], context[at], "{what}: head element {at}");
                            let sources = [j, per_group, per_group + 1];
                            for (part, &source) in sources.iter().enumerate() {
                                let m = mixed_index(&l, b, i, g, source, c);
                                assert_eq!(got[part][at], mixed[m], "{what}: part {part} at {at}");
                                let with_bias = mixed[m] + bias[m % l.row_width()];
                                assert_eq!(
                                    biased[part][at], with_bias,
                                    "{what}: part {part} at {at}, with the bias"
                                );
                                want_merged[m] += grads[part][at] as f64;
                            }
                        }
                    }
                }
            }
        }
        // A query element is copied; a key or value element sums `per_group` f32 values.
        assert_close(&what, &merged, &want_merged, 1e-6, 1e-6);
    }
}

/// The embedding-gradient shapes checked: a GPU's, and cubes of 1, 3 and 32 units; on a
/// device without planes (cubecl-cpu, whose barriers are slow) only the one-unit cubes, which
/// have no barrier.
fn embedding_launches(client: &Client) -> Vec<EmbeddingLaunch> {
    if RowLaunch::for_client(client).lanes == 1 {
        return vec![EmbeddingLaunch { units: 1 }];
    }
    let mut all = vec![EmbeddingLaunch::gpu(client)];
    for units in [1, 3, 32] {
        if !all.contains(&EmbeddingLaunch { units }) {
            all.push(EmbeddingLaunch { units });
        }
    }
    all
}

/// The embedding's gradient against the sums written out: each row of the table the f32 sum,
/// in position order, of the gradient's rows at its token's positions (bit for bit:
/// `select_assign`'s order), rows no token names left as they were (zero), ids that are
/// negative or past the table ignored. Tokens from a small vocabulary (a token repeated
/// across many chunks), rows wider than a cube's units, one position, for a GPU's launch
/// shape and others (a chunk of four positions with one unit).
#[test]
fn embedding_gradient_sums_each_token_s_rows_in_position_order() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(23);
    for launch in embedding_launches(&client) {
        for (positions, rows, hidden) in [(1, 1, 1), (9, 3, 5), (1_030, 17, 24), (700, 900, 70)] {
            let what = format!("{launch:?}, {positions} positions, {rows} rows of {hidden}");
            let tokens: Vec<i32> = (0..positions)
                .map(|p| match p % 97 {
                    13 => -1,
                    41 => rows as i32,
                    _ => (rng.uniform() * rows as f64) as i32 % rows as i32,
                })
                .collect();
            let grad = rng.vec(positions * hidden, -1.0, 1.0);
            let table = upload(&client, &vec![0.0; rows * hidden]);
            embedding_gradient::<f32>(
                &client,
                launch,
                &client.create_from_slice(i32::as_bytes(&tokens)),
                &upload(&client, &grad),
                &table,
                positions,
                rows,
                hidden,
            );
            let got = download(&client, table, rows * hidden);
            let mut want = vec![0.0f32; rows * hidden];
            for (p, &token) in tokens.iter().enumerate() {
                if (0..rows as i32).contains(&token) {
                    let row = token as usize * hidden;
                    for c in 0..hidden {
                        want[row + c] += grad[p * hidden + c];
                    }
                }
            }
            assert_eq!(bits(&got), bits(&want), "{what}");
        }
    }
}

/// The masked mean against float64: masks of zeros and ones (Megatron's) and fractional
/// weights, lengths below, at and past the lanes of one cube, one element; the backward is
/// `mask · g / Σ mask` for a gradient other than 1.
#[test]
fn masked_mean_and_its_gradient_match_float64() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(19);
    let launch = RowLaunch::for_client(&client);
    for len in [1, 7, 32, 33, 1000, 8192 + 5] {
        for fractional in [false, true] {
            let values = rng.vec(len, 0.0, 12.0);
            let mut mask = rng.vec(len, 0.0, 1.0);
            if !fractional {
                mask.iter_mut().for_each(|m| *m = (*m > 0.3) as u8 as f32);
            }
            mask[0] = 1.0; // at least one counted element
            let (mean, masked) = (poisoned(&client, 1), poisoned(&client, 1));
            let (v, m) = (upload(&client, &values), upload(&client, &mask));
            masked_mean_forward(&client, launch, &v, &m, [&mean, &masked], len);
            let count: f64 = mask.iter().map(|&m| m as f64).sum();
            let weighted: f64 = values
                .iter()
                .zip(&mask)
                .map(|(&v, &m)| v as f64 * m as f64)
                .sum();
            let what = format!("masked mean of {len}, fractional {fractional}");
            let got = [mean, masked.clone()].map(|h| download(&client, h, 1)[0]);
            assert_close(&what, &got, &[weighted / count, count], 1e-5, 1e-5);
            let grad = upload(&client, &[0.75]);
            let dv = poisoned(&client, len);
            masked_mean_backward(&client, &m, &masked, &grad, &dv, len);
            let want: Vec<f64> = mask.iter().map(|&m| m as f64 * 0.75 / count).collect();
            assert_close(
                &format!("{what}: gradient"),
                &download(&client, dv, len),
                &want,
                1e-7,
                1e-5,
            );
        }
    }
}

/// The gradient norm and clipping coefficient against float64: lengths of one element, one
/// partly filled block, whole blocks, and hundreds of blocks with a partly filled last one;
/// a limit below the norm (clipped), above it (exactly 1) and none.
#[test]
fn grad_norm_and_clip_match_float64() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(23);
    let launch = RowLaunch::for_client(&client);
    for len in [1, 1000, 3 << 14, (300 << 14) + 3] {
        let grads = rng.vec(len, -0.01, 0.01);
        let want: f64 = grads
            .iter()
            .map(|&g| g as f64 * g as f64)
            .sum::<f64>()
            .sqrt();
        let g = upload(&client, &grads);
        let partials = poisoned(&client, grad_norm_blocks(len));
        for max_norm in [0.5 * want, 2.0 * want, 0.0] {
            let (norm, clip) = (poisoned(&client, 1), poisoned(&client, 1));
            grad_norm_and_clip(
                &client,
                launch,
                &g,
                &partials,
                [&norm, &clip],
                len,
                max_norm as f32,
            );
            let what = format!("gradient norm of {len}, limit {max_norm}");
            assert_close(&what, &download(&client, norm, 1), &[want], 0.0, 1e-5);
            let clip = download(&client, clip, 1)[0];
            if max_norm > want || max_norm == 0.0 {
                assert_eq!(clip, 1.0, "{what}: no clipping");
            } else {
                assert_close(&what, &[clip], &[max_norm / (want + 1e-6)], 0.0, 1e-5);
            }
        }
    }
}

/// The fused bias-dropout-add against the same sum in float64 with the host's dropout bits:
/// with and without bias and draw, a whole draw and a sequence-parallel chunk of one, rows
/// that leave a partly filled last cube.
#[test]
fn bias_dropout_add_matches_float64_with_the_host_dropout_bits() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let mut rng = Rng(29);
    let (rows, hidden) = (37, 24);
    let len = rows * hidden;
    let draw = test_draw(0x1234_5678, 0x9abc_def0, 0.3);
    let residual = rng.vec(len, -1.0, 1.0);
    let input = rng.vec(len, -1.0, 1.0);
    let bias = rng.vec(hidden, -1.0, 1.0);
    let handles = [&residual, &input, &bias].map(|v| upload(&client, v));
    // Runs of 3 · hidden elements from element hidden of rows of 5 · hidden: a rank's chunk.
    let chunk = DrawSlice {
        own: (3 * hidden) as u32,
        row: (5 * hidden) as u32,
        first: hidden as u32,
    };
    for slice in [DrawSlice::WHOLE, chunk] {
        for with_bias in [false, true] {
            for dropout in [None, Some(draw.sliced(slice))] {
                let out = poisoned(&client, len);
                let bias_handle = with_bias.then_some(&handles[2]);
                bias_dropout_add::<f32>(
                    &client,
                    [&handles[0], &handles[1]],
                    bias_handle,
                    &out,
                    len,
                    hidden,
                    dropout,
                );
                let want: Vec<f64> = (0..len)
                    .map(|i| {
                        let b = if with_bias {
                            bias[i % hidden] as f64
                        } else {
                            0.0
                        };
                        let mut y = input[i] as f64 + b;
                        if let Some(d) = dropout {
                            let own = slice.own as usize;
                            let index =
                                (i / own) * slice.row as usize + slice.first as usize + i % own;
                            let kept = host_dropout_bits(d.key().0, d.key().1, index as u32)
                                >= d.threshold;
                            y = if kept { y * d.scale as f64 } else { 0.0 };
                        }
                        residual[i] as f64 + y
                    })
                    .collect();
                let what = format!(
                    "bias-dropout-add, {slice:?}, bias {with_bias}, dropout {}",
                    dropout.is_some()
                );
                assert_close(&what, &download(&client, out, len), &want, 1e-6, 1e-6);
            }
        }
    }
}

/// On lavapipe (a CPU Vulkan device: its planes are its vector unit, plane operations run
/// though CubeCL does not advertise them) the row kernels reduce a row with plane operations
/// and load it in vectors, and attention runs in planes for heads up to 64: the layouts the kernel tests above check
/// as the device's own, and the ones the benchmarks measure.
#[test]
fn lavapipe_reduces_rows_and_runs_attention_in_its_planes() {
    if ran_in_own_process() {
        return;
    }
    let client = client();
    let name = &client.properties().identity.name;
    if !name.starts_with("llvmpipe") {
        println!("not lavapipe ({name}): nothing to check");
        return;
    }
    assert!(ferrotron_kernels::rows::vector_unit_plane(&client).is_some());
    let rows = RowLaunch::for_client(&client);
    assert!(rows.plane_reduce, "{rows:?}");
    // Rows whose length allows it are loaded in vectors of 4 (WGSL's widest); others one
    // element at a time.
    assert_eq!(rows.vector_size::<f32>(&client, 1024), 4);
    assert_eq!(rows.vector_size::<f32>(&client, 1002), 2);
    assert_eq!(rows.vector_size::<f32>(&client, 257), 1);
    let narrow = AttentionLaunch::for_client(&client, 64);
    assert_eq!(narrow.plane, Some(8), "{narrow:?}");
    assert_eq!(AttentionLaunch::for_client(&client, 128).plane, None);
}

/// Fused attention on matrix units (f16 in, f32 accumulated; a `spirv` build on a device
/// with cooperative matrices, e.g. Mesa 26's lavapipe: see docs/testing.md) against float64
/// on the same f16 inputs: heads of one position, sequences that end inside a block, head
/// widths 8 to 128; one, two and four planes per cube (those that fit the device's shared
/// memory) with one to three units sharing a row's keys in the softmax, each with dropout,
/// and the first launch of a shape also without. The forward's tolerance is the
/// probabilities' rounding to f16 before `p̃ v` (≤ 2⁻¹¹ of each term, the terms summing to at
/// most `keep_scale · max |v|`) plus the output's own rounding; its log-sum-exp is exact to
/// f32 rounding. The backward on matrix units gives float64's gradients within the f16
/// rounding of the score gradients and probabilities it multiplies; so does the CUDA-core
/// backward fed the matrix units' forward (first launch of a shape). Each kernel variant is
/// compiled by lavapipe on first use, minutes for these cold (benchmarks/results/
/// 2026-12-03-figures-from-comments.md), hence not every combination.
#[cfg(feature = "spirv")]
#[test]
fn mma_attention_forward_and_backward_match_float64() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    let client = client();
    let mut rng = Rng(23);
    let draw = test_draw(0x0bad_cafe, 7, 0.2);
    let shapes = [
        (1, 1, 8),
        (3, 17, 8),
        (2, 64, 16),
        (1, 41, 64),
        (2, 70, 64),
        (1, 33, 128),
    ];
    for (heads, seq, head_dim) in shapes {
        let shape = AttentionShape {
            heads,
            seq,
            head_dim,
        };
        let own = MmaAttention::for_client::<half::f16>(&client, head_dim)
            .expect("this device has no f16 matrix units (cooperative matrices) for these heads");
        let n = shape.len();
        let inputs = [0; 4].map(|_| rounded::<half::f16>(&rng.vec(n, -1.5, 1.5)));
        let shared = client.properties().hardware.max_shared_memory_size;
        let launches = [(1, 1), (2, 3), (4, 2)]
            .map(|(planes, groups)| MmaAttention {
                planes,
                groups,
                ..own
            })
            .into_iter()
            .filter(|l| l.shared_bytes(head_dim, 2) <= shared);
        for (i, launch) in launches.enumerate() {
            // With and without dropout are two kernels, each slow for lavapipe to compile:
            // both for narrow heads; heads of 64 (GPT-2's, trained with dropout) with it,
            // heads of 128 (Llama's, trained without) without.
            let dropouts: &[Option<DropoutDraw>] = match (i, head_dim) {
                (0, ..=16) => &[Some(draw), None],
                (_, 128) => &[None],
                _ => &[Some(draw)],
            };
            for &dropout in dropouts {
                check_mma_attention(&client, launch, &inputs, shape, dropout, i == 0, None);
            }
            // A rank's heads of the draw (the same kernel: the slice is the launch's scalars).
            if i == 0 && heads > 1 && head_dim <= 16 {
                let sliced = Some(second_rank_heads(draw, seq));
                check_mma_attention(&client, launch, &inputs, shape, sliced, false, None);
            }
            // Packed documents (each head its own packing), with dropout: one more variant of
            // each kernel for lavapipe to compile, so once, on narrow heads.
            if i == 0 && seq == 64 {
                let keys = packed_first_keys(&mut rng, heads, seq, 20);
                let documents = Some((&keys[..], heads));
                check_mma_attention(
                    &client,
                    launch,
                    &inputs,
                    shape,
                    Some(draw),
                    false,
                    documents,
                );
            }
        }
    }
}

/// [`flash_attention_of_a_context_parallel_chunk_is_the_rows_of_the_whole`] on matrix units
/// (f16 heads): a chunk's attention is the whole attention's rows there too.
#[cfg(feature = "spirv")]
#[test]
fn mma_attention_of_a_context_parallel_chunk_is_the_rows_of_the_whole() {
    if ran_in_own_process_unoptimised() {
        return;
    }
    let client = client();
    let launch = MmaAttention::for_client::<half::f16>(&client, 8)
        .expect("this device has no f16 matrix units (cooperative matrices) for these heads");
    let run = |inputs: [&[f32]; 4],
               shape: AttentionShape,
               keys: &[u32],
               chunk: Option<(usize, usize)>| {
        let n = shape.len();
        let [qh, kh, vh, dh] = inputs.map(|x| upload_as::<half::f16>(&client, x));
        let keys_handle = client.create_from_slice(u32::as_bytes(keys));
        let (queries_from, draw_seq) = chunk.unwrap_or((0, shape.seq));
        let handles = AttentionInputs {
            first_keys: Some(FirstKeys {
                queries_from,
                draw_seq,
                ..FirstKeys::of(&keys_handle, 2, shape.seq)
            }),
            ..AttentionInputs::causal(&qh, &kh, &vh)
        };
        let (oh, lh) = (
            poisoned_as::<half::f16>(&client, n),
            poisoned(&client, shape.rows()),
        );
        let draw = Some(test_draw(0x5eed_c0de, 17, 0.2));
        mma_attention_forward::<half::f16>(&client, launch, handles, &oh, &lh, shape, 0.35, draw);
        let grads = [0; 3].map(|_| poisoned_as::<half::f16>(&client, n));
        let delta = poisoned(&client, shape.rows());
        let refs = [&grads[0], &grads[1], &grads[2]];
        mma_attention_backward::<half::f16>(
            &client, launch, handles, &oh, &dh, &lh, refs, &delta, shape, 0.35, draw,
        );
        let o = download_as::<half::f16>(&client, oh, n);
        let [dq, dk, dv] = grads.map(|g| download_as::<half::f16>(&client, g, n));
        [o, dq, dk, dv]
    };
    check_chunk_rows(&format!("{launch:?}"), &run, 1e-2);
}

/// One case of [`mma_attention_forward_and_backward_match_float64`]: `launch`'s forward and
/// backward (and with `tiled`, the CUDA-core backward fed its forward) on `[q, k, v, do]`.
#[cfg(feature = "spirv")]
fn check_mma_attention(
    client: &Client,
    launch: MmaAttention,
    inputs: &[Vec<f32>; 4],
    shape: AttentionShape,
    dropout: Option<DropoutDraw>,
    tiled: bool,
    first_keys: Option<(&[u32], usize)>,
) {
    let [q, k, v, dout] = inputs;
    let (n, head_dim) = (shape.len(), shape.head_dim);
    let scale = 1.0 / (head_dim as f64).sqrt();
    let everything = vec![0; shape.seq];
    let (keys, batch) = first_keys.unwrap_or((&everything, 1));
    let want = document_attention_reference([q, k, v, dout], shape, scale, dropout, keys);
    let lse = attention_logsumexp(q, k, shape, scale, keys);
    let keep = dropout.map_or(1.0, |d| d.scale as f64);
    let what = format!(
        "{shape:?}, {launch:?}, dropout {}, documents {}",
        dropout.is_some(),
        first_keys.is_some()
    );
    let [qh, kh, vh, dh] = [q, k, v, dout].map(|x| upload_as::<half::f16>(client, x));
    let keys_handle = client.create_from_slice(u32::as_bytes(keys));
    let handles = AttentionInputs {
        first_keys: first_keys.map(|_| FirstKeys::of(&keys_handle, batch, shape.seq)),
        ..AttentionInputs::causal(&qh, &kh, &vh)
    };
    let oh = poisoned_as::<half::f16>(client, n);
    let lh = poisoned(client, shape.rows());
    let scale = scale as f32;
    mma_attention_forward::<half::f16>(client, launch, handles, &oh, &lh, shape, scale, dropout);
    let got_o = download_as::<half::f16>(client, oh.clone(), n);
    let tolerance = 1.5 * keep / 2048.0 + 1.5 / 2048.0;
    assert_close(&format!("{what}: output"), &got_o, &want[0], tolerance, 0.0);
    let got_lse = download(client, lh.clone(), shape.rows());
    assert_close(&format!("{what}: log-sum-exp"), &got_lse, &lse, 1e-5, 1e-6);

    let mut backwards = vec!["matrix-unit"];
    if tiled {
        backwards.push("tiled");
    }
    for name in backwards {
        let grads = [0; 3].map(|_| poisoned_as::<half::f16>(client, n));
        let delta = poisoned(client, shape.rows());
        let refs = [&grads[0], &grads[1], &grads[2]];
        if name == "tiled" {
            let tiles = AttentionLaunch::fitting(usize::MAX, head_dim);
            let tiles = AttentionLaunch { block: 8, ..tiles };
            flash_attention_backward::<half::f16>(
                client, tiles, handles, &oh, &dh, &lh, refs, &delta, shape, scale, dropout,
            );
        } else {
            mma_attention_backward::<half::f16>(
                client, launch, handles, &oh, &dh, &lh, refs, &delta, shape, scale, dropout,
            );
        }
        let parts = [("dq", &want[1]), ("dk", &want[2]), ("dv", &want[3])];
        for ((part, want), grad) in parts.into_iter().zip(grads) {
            let got = download_as::<half::f16>(client, grad, n);
            assert_close(
                &format!("{what}: {name} backward, {part}"),
                &got,
                want,
                1e-2,
                4e-3,
            );
        }
    }
}

/// The log-sum-exp of each query row's scaled causal scores, in float64, query `i` of
/// element `b` from key `first_keys[b · seq + i]` on.
#[cfg(feature = "spirv")]
fn attention_logsumexp(
    q: &[f32],
    k: &[f32],
    shape: AttentionShape,
    scale: f64,
    first_keys: &[u32],
) -> Vec<f64> {
    let (s, d) = (shape.seq, shape.head_dim);
    let sample_heads = shape.heads / (first_keys.len() / s);
    let mut out = Vec::with_capacity(shape.rows());
    for h in 0..shape.heads {
        for i in 0..s {
            let first = first_keys[(h / sample_heads) * s + i] as usize;
            let scores: Vec<f64> = (first..=i)
                .map(|j| {
                    let (a, b) = ((h * s + i) * d, (h * s + j) * d);
                    scale
                        * (0..d)
                            .map(|c| q[a + c] as f64 * k[b + c] as f64)
                            .sum::<f64>()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
            out.push(max + scores.iter().map(|x| (x - max).exp()).sum::<f64>().ln());
        }
    }
    out
}
