//! `plot`: loss curves of one or more runs, from their `metrics.jsonl`, as PNG or SVG.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;

use ferrotron::logging::loss_plot::{draw_loss_plot_against, read_metrics, XAxis};

/// Draw the training and validation loss of runs (their `--save` directories or
/// `metrics.jsonl` files) on one figure.
#[derive(Parser, Debug)]
#[command(name = "plot", version, args_override_self = true)]
struct Args {
    /// Runs: `--save` directories or `metrics.jsonl` files; each is a legend entry.
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// Output image: `.svg` for SVG, otherwise PNG.
    #[arg(long, short, default_value = "loss.png")]
    output: PathBuf,
    /// Horizontal axis: iteration, or tokens (training tokens consumed, to compare runs of
    /// different batch or sequence sizes).
    #[arg(long, default_value = "iteration", value_parser = ["iteration", "tokens"])]
    x_axis: String,
}

fn run(args: Args) -> Result<()> {
    let runs = args
        .runs
        .iter()
        .map(|p| {
            let file = if p.is_dir() {
                p.join("metrics.jsonl")
            } else {
                p.clone()
            };
            let label = if args.runs.len() == 1 {
                String::new()
            } else {
                p.display().to_string()
            };
            read_metrics(&file, &label)
        })
        .collect::<Result<Vec<_>>>()?;
    let axis = if args.x_axis == "tokens" {
        XAxis::Tokens
    } else {
        XAxis::Iteration
    };
    draw_loss_plot_against(&args.output, &runs, axis)?;
    eprintln!("wrote {}", args.output.display());
    Ok(())
}

fn main() -> ExitCode {
    ferrotron::util::cli::finish("plot", run(Args::parse()))
}
