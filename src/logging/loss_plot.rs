//! Loss curves drawn from `metrics.jsonl` with the `plotters` crate: training loss (line) and
//! validation loss (points) against the iteration or the training tokens consumed (to compare
//! runs of different batch sizes), one colour per run, to PNG or SVG (by the file extension). `pretrain` draws its own run; the `plot` tool redraws any runs together.
//!
//! Text is drawn with DejaVu Sans, bundled (`assets/fonts/`, Bitstream Vera licence), so the
//! plot looks the same on machines without fonts.

use std::path::Path;
use std::sync::Once;

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;

/// One run's curves.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Run {
    /// Legend label.
    pub label: String,
    /// `(iteration, training loss)`.
    pub train: Vec<(u64, f64)>,
    /// `(iteration, validation loss)`.
    pub valid: Vec<(u64, f64)>,
    /// `(iteration, training tokens consumed by then)`, where the metrics say.
    pub tokens: Vec<(u64, u64)>,
}

/// `(x, loss)` points of a curve.
pub type Curve = Vec<(u64, f64)>;

/// What the horizontal axis counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XAxis {
    /// Training iterations.
    #[default]
    Iteration,
    /// Training tokens consumed (consumed samples × sequence length).
    Tokens,
}

impl Run {
    /// The curves against `axis`: `(x, train)` and `(x, validation)`; with tokens, points of
    /// iterations the metrics give no token count for are left out.
    fn curves(&self, axis: XAxis) -> (Curve, Curve) {
        let tokens: std::collections::BTreeMap<u64, u64> = self.tokens.iter().copied().collect();
        let map = |points: &[(u64, f64)]| -> Curve {
            points
                .iter()
                .filter(|(_, l)| l.is_finite())
                .filter_map(|&(it, l)| match axis {
                    XAxis::Iteration => Some((it, l)),
                    XAxis::Tokens => tokens.get(&it).map(|&t| (t, l)),
                })
                .collect()
        };
        (map(&self.train), map(&self.valid))
    }
}

/// Reads the curves of a `metrics.jsonl` (`{"iteration", "lm_loss"}` and
/// `{"iteration", "valid_lm_loss"}` lines); a resumed run's later lines replace earlier ones
/// for the same iteration.
pub fn read_metrics(path: &Path, label: &str) -> Result<Run> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut train = std::collections::BTreeMap::new();
    let mut valid = std::collections::BTreeMap::new();
    let mut tokens = std::collections::BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a JSON object", path.display(), n + 1))?;
        let Some(it) = v.get("iteration").and_then(|x| x.as_u64()) else {
            bail!("{}:{}: no \"iteration\" number", path.display(), n + 1);
        };
        if let Some(l) = v.get("lm_loss").and_then(|x| x.as_f64()) {
            train.insert(it, l);
        }
        if let Some(l) = v.get("valid_lm_loss").and_then(|x| x.as_f64()) {
            valid.insert(it, l);
        }
        if let Some(t) = v.get("tokens").and_then(|x| x.as_u64()) {
            tokens.insert(it, t);
        }
    }
    Ok(Run {
        label: label.to_owned(),
        train: train.into_iter().collect(),
        valid: valid.into_iter().collect(),
        tokens: tokens.into_iter().collect(),
    })
}

static FONT: Once = Once::new();

fn register_font() {
    FONT.call_once(|| {
        let bytes: &'static [u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .unwrap_or_else(|_| panic!("the bundled DejaVu Sans is a valid font"));
    });
}

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Draws `runs` against the iteration to `path`: `.svg` as SVG, anything else as PNG
/// (800 × 500).
pub fn draw_loss_plot(path: &Path, runs: &[Run]) -> Result<()> {
    draw_loss_plot_against(path, runs, XAxis::Iteration)
}

/// Draws `runs` against `axis` to `path` (`.svg` as SVG, anything else as PNG).
pub fn draw_loss_plot_against(path: &Path, runs: &[Run], axis: XAxis) -> Result<()> {
    if axis == XAxis::Tokens && runs.iter().all(|r| r.tokens.is_empty()) {
        bail!(
            "{}: the metrics hold no \"tokens\" counts (written by pretrain since blending landed); plot against iterations instead",
            path.display()
        );
    }
    register_font();
    let size = (800, 500);
    let is_svg = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    let result = if is_svg {
        draw(SVGBackend::new(path, size).into_drawing_area(), runs, axis)
    } else {
        draw(
            BitMapBackend::new(path, size).into_drawing_area(),
            runs,
            axis,
        )
    };
    result.with_context(|| format!("drawing {}", path.display()))
}

fn draw<DB: DrawingBackend>(
    area: DrawingArea<DB, plotters::coord::Shift>,
    runs: &[Run],
    axis: XAxis,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let curves: Vec<_> = runs.iter().map(|r| r.curves(axis)).collect();
    let points: Vec<(u64, f64)> = curves
        .iter()
        .flat_map(|(t, v)| t.iter().chain(v).copied())
        .collect();
    let last = points.iter().map(|p| p.0).max().unwrap_or(1).max(1);
    let (lo, hi) = points
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
            (a.min(p.1), b.max(p.1))
        });
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let pad = ((hi - lo) * 0.05).max(0.05);
    area.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let mut chart = ChartBuilder::on(&area)
        .caption("language-model loss", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(0u64..last, (lo - pad)..(hi + pad))
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    chart
        .configure_mesh()
        .x_desc(match axis {
            XAxis::Iteration => "iteration",
            XAxis::Tokens => "training tokens",
        })
        .y_desc("lm loss")
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    for (k, (run, (train, valid))) in runs.iter().zip(curves).enumerate() {
        let colour = COLOURS[(2 * k) % COLOURS.len()];
        let valid_colour = COLOURS[(2 * k + 1) % COLOURS.len()];
        let name = |what: &str| {
            if run.label.is_empty() {
                what.to_owned()
            } else {
                format!("{} {what}", run.label)
            }
        };
        chart
            .draw_series(LineSeries::new(train, colour.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?
            .label(name("train"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2)));
        chart
            .draw_series(
                valid
                    .into_iter()
                    .map(|p| Circle::new(p, 4, valid_colour.filled())),
            )
            .map_err(|e| anyhow::anyhow!("{e:?}"))?
            .label(name("validation"))
            .legend(move |(x, y)| Circle::new((x + 9, y), 4, valid_colour.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    area.present().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_lines_become_curves_and_bad_lines_name_their_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(
            &path,
            "{\"iteration\": 1, \"lm_loss\": 10.5, \"lr\": 0.1, \"tokens\": 512}\n\
             {\"iteration\": 2, \"lm_loss\": 9.5}\n\
             {\"iteration\": 2, \"valid_lm_loss\": 9.8}\n\
             {\"iteration\": 2, \"lm_loss\": 9.25, \"tokens\": 1024}\n",
        )
        .unwrap();
        let run = read_metrics(&path, "a").unwrap();
        assert_eq!(run.train, [(1, 10.5), (2, 9.25)]);
        assert_eq!(run.valid, [(2, 9.8)]);
        assert_eq!(run.tokens, [(1, 512), (2, 1024)]);
        assert_eq!(
            run.curves(XAxis::Tokens),
            (vec![(512, 10.5), (1024, 9.25)], vec![(1024, 9.8)])
        );
        std::fs::write(&path, "{\"iteration\": 1}\nnot json\n").unwrap();
        let err = format!("{:#}", read_metrics(&path, "a").unwrap_err());
        assert!(err.contains("metrics.jsonl:2: not a JSON object"), "{err}");
    }
}
