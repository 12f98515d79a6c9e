//! What the fuzzer compares of a layout's run against the single-process run, and how close
//! each must be: only the order of float sums may differ between them.

use std::borrow::Cow;

use crate::model::GptConfig;
use crate::optim::Precision;
use crate::training::PretrainConfig;

/// What one run shows of itself: everything a layout must reproduce.
#[derive(Clone, Debug, Default)]
pub struct Observation {
    /// The LM loss of every iteration.
    pub losses: Vec<(u64, f64)>,
    /// The gradient norm before clipping of every iteration that stepped.
    pub grad_norms: Vec<(u64, f64)>,
    /// The validation losses.
    pub validation: Vec<(u64, f64)>,
    /// The iterations skipped for overflowing gradients (fp16).
    pub skipped: Vec<u64>,
    /// How far training moved each weight: the fp32 main weights at the end (the
    /// checkpoint's shards joined) minus their initial values. Compared rather than the
    /// weights themselves, which are mostly their initial values after a few steps.
    pub updates: Vec<WeightUpdate>,
}

/// How far a layout may be from the single process, relatively, in each quantity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// Training and validation losses.
    pub loss: f64,
    /// Gradient norms (a sum over every element, more sensitive to the sums' order).
    pub grad_norm: f64,
    /// Each weight's update, `‖a − b‖ / ‖b‖`.
    pub updates: f64,
}

impl Tolerance {
    /// What `cfg` can be held to. In fp32 every layout computes the same products in another
    /// order. In half precision without tensor parallelism the losses stay that close (the
    /// gradient sums across ranks are fp32), but tensor parallelism rounds each rank's
    /// partial sums of the row-parallel layers to bf16/fp16 before adding them, which the
    /// single process never rounds: their tolerance is the format's. The updates of a
    /// half-precision run are held to the format's precision even without tensor
    /// parallelism: a last-bit difference in an fp32 main weight flips the rounding of its
    /// half-precision copy, and from there the difference grows within a few steps. With it,
    /// a gradient that is a sum cancelling to near zero (a bias's, over the tokens) keeps
    /// little of its precision when its terms are rounded otherwise, and its update with it.
    pub fn for_run(cfg: &PretrainConfig) -> Self {
        let split_sums = cfg.parallel.tensor_model_parallel_size > 1;
        // Four units in the last place of each format.
        let format = match cfg.precision {
            Precision::Fp32 => 1e-5,
            Precision::Bf16 => 4.0 * 2f64.powi(-8),
            Precision::Fp16 => 4.0 * 2f64.powi(-11),
        };
        let (loss, updates) = match (cfg.precision, split_sums) {
            (Precision::Fp32, _) => (1e-5, 1e-4),
            (_, false) => (1e-4, 2.0 * format),
            (_, true) => (format, 8.0 * format),
        };
        Self {
            loss,
            grad_norm: 20.0 * loss,
            updates,
        }
    }
}

/// Where a layout first left the single process.
#[derive(Clone, Debug, PartialEq)]
pub struct Difference {
    /// The iteration (for a weight's update: after which it differs).
    pub iteration: u64,
    /// What differs: `loss`, `grad norm`, `validation loss`, `skipped iterations`, or a
    /// weight's name.
    pub what: String,
    /// The layout's value and the single process's, or how far apart they are.
    pub detail: String,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "iteration {}: {} differs ({})",
            self.iteration, self.what, self.detail
        )
    }
}

/// The largest relative difference found in each quantity of a passing comparison.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Closeness {
    /// Over the training and validation losses.
    pub loss: f64,
    /// Over the gradient norms.
    pub grad_norm: f64,
    /// Over the weights' updates.
    pub updates: f64,
}

fn relative(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
    }
}

/// The first iteration of `got` that is not within `tol` of `want` (or missing), and the
/// largest relative difference otherwise.
fn compare_series(
    what: &str,
    got: &[(u64, f64)],
    want: &[(u64, f64)],
    tol: f64,
) -> Result<f64, Difference> {
    if got.len() != want.len() {
        return Err(Difference {
            iteration: want.first().map_or(0, |w| w.0),
            what: what.to_owned(),
            detail: format!(
                "{} values, the single process has {}",
                got.len(),
                want.len()
            ),
        });
    }
    let mut worst = 0.0f64;
    for (&(ig, g), &(iw, w)) in got.iter().zip(want) {
        let r = relative(g, w);
        // NaN fails too.
        if ig != iw || r.is_nan() || r > tol {
            return Err(Difference {
                iteration: iw,
                what: what.to_owned(),
                detail: format!(
                    "{g} at iteration {ig}, the single process {w}: relative {r:.2e} > {tol:.0e}"
                ),
            });
        }
        worst = worst.max(r);
    }
    Ok(worst)
}

/// How far training moved one weight.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightUpdate {
    /// The weight's name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its final values minus its initial ones.
    pub update: Vec<f32>,
    /// `‖w‖` of its final values.
    pub weight_norm: f64,
}

/// What storing the weights in fp32 alone can make two runs' updates differ by, relative to
/// the weights' norm: a weight near 1 (a norm's scale) that moved by 5e-5 is stored to
/// within 2⁻²⁴ of 1, a quarter percent of its update, and a last-bit difference in the
/// optimizer's arithmetic rounds it a unit the other way. Four units in the last place of
/// every element cover the few steps a case runs.
const STORAGE_ROUNDING: f64 = 8.0 / (1u64 << 24) as f64;

/// The values of an update that a layout must reproduce: all of them but the key biases'
/// (the key part of the fused QKV bias, and the key norm's bias). A key bias adds the same
/// `q · b` to every score of a query's row, which the softmax cancels: its gradient is zero
/// in exact arithmetic and rounding noise in floats.
fn compared_values<'a>(w: &'a WeightUpdate, model: &GptConfig) -> Cow<'a, [f32]> {
    if w.name.ends_with("k_layernorm.bias") {
        return Cow::Borrowed(&[]);
    }
    if !w.name.ends_with("query_key_value.bias") {
        return Cow::Borrowed(&w.update);
    }
    let (d, groups) = (model.head_dim(), model.query_groups());
    let per_group = model.num_attention_heads / groups;
    let group_width = (per_group + 2) * d;
    let is_key = |i: usize| (per_group * d..(per_group + 1) * d).contains(&(i % group_width));
    w.update
        .iter()
        .enumerate()
        .filter(|(i, _)| !is_key(*i))
        .map(|(_, v)| *v)
        .collect::<Vec<_>>()
        .into()
}

/// `(‖a − b‖ − floor) / ‖b‖` over two equally long slices, in f64: how far apart they are
/// beyond `floor`, relative to `b` (0 when no farther than `floor`).
fn relative_difference(a: &[f32], b: &[f32], floor: f64) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        diff += (f64::from(x) - f64::from(y)).powi(2);
        norm += f64::from(y).powi(2);
    }
    let beyond = diff.sqrt() - floor;
    if beyond <= 0.0 {
        0.0
    } else {
        beyond / norm.sqrt().max(f64::MIN_POSITIVE)
    }
}

/// The first weight whose update in `got` (in the model's order) is not within `tol` of its
/// update in `want`, after iteration `iteration`, and the largest relative difference
/// otherwise: `(‖a − b‖ − r‖w‖) / ‖b‖`, `r` the fp32 storage's rounding.
pub fn compare_updates(
    iteration: u64,
    got: &[WeightUpdate],
    want: &[WeightUpdate],
    model: &GptConfig,
    tol: f64,
) -> Result<f64, Difference> {
    let differs = |what: &str, detail: String| Difference {
        iteration,
        what: what.to_owned(),
        detail,
    };
    let names = |ws: &[WeightUpdate]| ws.iter().map(|w| w.name.clone()).collect::<Vec<_>>();
    if names(got) != names(want) {
        return Err(differs(
            "the weights' names",
            format!("{:?} against {:?}", names(got), names(want)),
        ));
    }
    let mut worst = 0.0f64;
    for (g, w) in got.iter().zip(want) {
        if g.shape != w.shape {
            return Err(differs(
                &g.name,
                format!("shape {:?}, the single process {:?}", g.shape, w.shape),
            ));
        }
        let floor = STORAGE_ROUNDING * w.weight_norm;
        let (a, b) = (compared_values(g, model), compared_values(w, model));
        let r = relative_difference(&a, &b, floor);
        if r.is_nan() || r > tol {
            return Err(differs(
                &g.name,
                format!("its update: (‖a − b‖ − {floor:.1e}) / ‖b‖ = {r:.2e} > {tol:.0e}"),
            ));
        }
        worst = worst.max(r);
    }
    Ok(worst)
}

/// Compares a layout's run with the single process's: the first difference beyond `tol`, or
/// how close every quantity came.
pub fn compare(
    got: &Observation,
    want: &Observation,
    model: &GptConfig,
    tol: Tolerance,
) -> Result<Closeness, Difference> {
    if got.skipped != want.skipped {
        return Err(Difference {
            iteration: got
                .skipped
                .iter()
                .chain(&want.skipped)
                .min()
                .copied()
                .unwrap_or(0),
            what: "skipped iterations".into(),
            detail: format!("{:?}, the single process {:?}", got.skipped, want.skipped),
        });
    }
    let series = [
        compare_series("loss", &got.losses, &want.losses, tol.loss),
        compare_series(
            "grad norm",
            &got.grad_norms,
            &want.grad_norms,
            tol.grad_norm,
        ),
        compare_series(
            "validation loss",
            &got.validation,
            &want.validation,
            tol.loss,
        ),
    ];
    let last = want.losses.last().map_or(0, |l| l.0);
    let updates = compare_updates(last, &got.updates, &want.updates, model, tol.updates);
    // The earliest difference is the one to report: the later ones usually follow from it.
    let first = series
        .iter()
        .chain([&updates])
        .filter_map(|r| r.as_ref().err())
        .min_by_key(|d| d.iteration);
    if let Some(first) = first {
        return Err(first.clone());
    }
    let ok = |r: &Result<f64, Difference>| *r.as_ref().unwrap_or(&0.0);
    Ok(Closeness {
        loss: ok(&series[0]).max(ok(&series[2])),
        grad_norm: ok(&series[1]),
        updates: ok(&updates),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weight(name: &str, update: Vec<f32>) -> WeightUpdate {
        WeightUpdate {
            name: name.into(),
            shape: vec![update.len()],
            update,
            weight_norm: 0.0,
        }
    }

    fn run(losses: &[f64], norms: &[f64], updates: Vec<WeightUpdate>) -> Observation {
        let series = |v: &[f64]| (1..).zip(v.iter().copied()).collect();
        Observation {
            losses: series(losses),
            grad_norms: series(norms),
            validation: Vec::new(),
            skipped: Vec::new(),
            updates,
        }
    }

    const TOL: Tolerance = Tolerance {
        loss: 1e-5,
        grad_norm: 1e-4,
        updates: 1e-4,
    };

    #[test]
    fn the_earliest_difference_is_reported_whichever_quantity_it_is_in() {
        let model = GptConfig::new(1, 8, 2, 4, 16);
        let want = run(
            &[3.0, 2.0, 1.0],
            &[1.0, 1.0, 1.0],
            vec![weight("w", vec![1.0; 4])],
        );
        let close = run(
            &[3.0, 2.00001, 1.0],
            &[1.0, 1.00005, 1.0],
            want.updates.clone(),
        );
        let c = compare(&close, &want, &model, TOL).unwrap();
        assert!(
            c.loss > 4e-6 && c.loss < 6e-6 && c.grad_norm > 4e-5,
            "{c:?}"
        );
        assert_eq!(c.updates, 0.0);
        // The grad norm leaves at iteration 2, the loss only at 3: iteration 2 is reported.
        let late_loss = run(&[3.0, 2.0, 1.1], &[1.0, 1.1, 1.0], want.updates.clone());
        let d = compare(&late_loss, &want, &model, TOL).unwrap_err();
        assert_eq!((d.iteration, d.what.as_str()), (2, "grad norm"), "{d}");
        // A NaN is a difference, not a pass.
        let nan = run(
            &[3.0, f64::NAN, 1.0],
            &[1.0, 1.0, 1.0],
            want.updates.clone(),
        );
        let d = compare(&nan, &want, &model, TOL).unwrap_err();
        assert_eq!((d.iteration, d.what.as_str()), (2, "loss"), "{d}");
        // Updates are compared after the last iteration.
        let moved = run(
            &[3.0, 2.0, 1.0],
            &[1.0; 3],
            vec![weight("w", vec![1.0, 1.0, 1.0, 1.1])],
        );
        let d = compare(&moved, &want, &model, TOL).unwrap_err();
        assert_eq!((d.iteration, d.what.as_str()), (3, "w"), "{d}");
    }

    /// The key biases' part of the fused QKV bias is left out, and only it: 2 groups of
    /// (1 query + key + value) heads of width 4.
    #[test]
    fn only_the_key_biases_are_left_out_of_the_updates() {
        let model = GptConfig::new(1, 8, 2, 4, 16);
        let name = "layers.0.self_attention.query_key_value.bias";
        let want = vec![weight(name, vec![0.0; 24])];
        let mut keys_moved = vec![0.0f32; 24];
        for group in 0..2 {
            for k in 0..4 {
                keys_moved[group * 12 + 4 + k] = 0.5;
            }
        }
        assert!(compare_updates(1, &[weight(name, keys_moved)], &want, &model, 1e-4).is_ok());
        for moved in [0, 3, 8, 11, 12, 23] {
            let mut other = vec![0.0f32; 24];
            other[moved] = 1e-3;
            let d = compare_updates(1, &[weight(name, other)], &want, &model, 1e-4).unwrap_err();
            assert_eq!(d.what, name, "element {moved}");
        }
    }
}
