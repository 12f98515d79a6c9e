//! Loss curves drawn from `metrics.jsonl` with the `plotters` crate: training loss (line) and
//! validation loss (points) against the iteration, one colour per run, to PNG or SVG (by the
//! file extension). `pretrain` draws its own run; the `plot` tool redraws any runs together.
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
}

/// Reads the curves of a `metrics.jsonl` (`{"iteration", "lm_loss"}` and
/// `{"iteration", "valid_lm_loss"}` lines); a resumed run's later lines replace earlier ones
/// for the same iteration.
pub fn read_metrics(path: &Path, label: &str) -> Result<Run> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut train = std::collections::BTreeMap::new();
    let mut valid = std::collections::BTreeMap::new();
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
    }
    Ok(Run {
        label: label.to_owned(),
        train: train.into_iter().collect(),
        valid: valid.into_iter().collect(),
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

/// Draws `runs` to `path`: `.svg` as SVG, anything else as PNG (800 × 500).
pub fn draw_loss_plot(path: &Path, runs: &[Run]) -> Result<()> {
    register_font();
    let size = (800, 500);
    let is_svg = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    let result = if is_svg {
        draw(SVGBackend::new(path, size).into_drawing_area(), runs)
    } else {
        draw(BitMapBackend::new(path, size).into_drawing_area(), runs)
    };
    result.with_context(|| format!("drawing {}", path.display()))
}

fn draw<DB: DrawingBackend>(
    area: DrawingArea<DB, plotters::coord::Shift>,
    runs: &[Run],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let finite = |v: &[(u64, f64)]| -> Vec<(u64, f64)> {
        v.iter().copied().filter(|(_, l)| l.is_finite()).collect()
    };
    let points: Vec<(u64, f64)> = runs
        .iter()
        .flat_map(|r| finite(&r.train).into_iter().chain(finite(&r.valid)))
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
        .x_desc("iteration")
        .y_desc("lm loss")
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    for (k, run) in runs.iter().enumerate() {
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
            .draw_series(LineSeries::new(finite(&run.train), colour.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?
            .label(name("train"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2)));
        chart
            .draw_series(
                finite(&run.valid)
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
            "{\"iteration\": 1, \"lm_loss\": 10.5, \"lr\": 0.1}\n\
             {\"iteration\": 2, \"lm_loss\": 9.5}\n\
             {\"iteration\": 2, \"valid_lm_loss\": 9.8}\n\
             {\"iteration\": 2, \"lm_loss\": 9.25}\n",
        )
        .unwrap();
        let run = read_metrics(&path, "a").unwrap();
        assert_eq!(run.train, [(1, 10.5), (2, 9.25)]);
        assert_eq!(run.valid, [(2, 9.8)]);
        std::fs::write(&path, "{\"iteration\": 1}\nnot json\n").unwrap();
        let err = format!("{:#}", read_metrics(&path, "a").unwrap_err());
        assert!(err.contains("metrics.jsonl:2: not a JSON object"), "{err}");
    }
}
