//! `sluice shed simulate`: runs the worker utilization controller on a utilization
//! schedule (`--utilization`), or the adaptive concurrency limit in front of a simulated
//! service on a load schedule (`--load`, in [`adaptive`]), under a simulated clock, so
//! operators can see what either will do before enabling it. Prints CSV; `--plot
//! FILE.svg` also draws it.

mod adaptive;

use sluice::algo::shedder::{Shedder, ShedderParams};
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The worker utilization controller's schedule: UTILIZATION:DURATION pairs, like
    /// 1.0:300s,0.5:300s.
    #[arg(long, value_parser = parse_schedule, required_unless_present = "load", conflicts_with = "load")]
    pub utilization: Option<std::vec::Vec<(f64, u64)>>,
    #[command(flatten)]
    pub adaptive: adaptive::LoadArgs,
    /// Time between samples.
    #[arg(long, default_value = "1s", value_parser = sluice::config::Duration::parse)]
    pub step: sluice::config::Duration,
    /// Priority classes (the last is critical and never shed).
    #[arg(long, default_value_t = 4)]
    pub classes: usize,
    /// Also draw the run as an SVG chart.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// End of good utilization.
    #[arg(long, default_value_t = 0.7)]
    pub good: f64,
    /// Start of bad utilization.
    #[arg(long, default_value_t = 0.8)]
    pub bad: f64,
    /// How long bad utilization lasts before shedding starts.
    #[arg(long, default_value = "28s", value_parser = sluice::config::Duration::parse)]
    pub before: sluice::config::Duration,
    /// How long full-speed shedding takes to shed everything.
    #[arg(long, default_value = "120s", value_parser = sluice::config::Duration::parse)]
    pub to_shed_all: sluice::config::Duration,
}

/// Why a simulation cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ShedError {
    #[error(transparent)]
    Params(#[from] sluice::algo::shedder::ShedderError),
    #[error("--classes must be at least 2 (the last class is critical and never shed)")]
    Classes,
    #[error(transparent)]
    Adaptive(#[from] sluice::algo::overload::GradientError),
    #[error("{0}")]
    Setup(String),
    #[error("cannot write {path}: {source}")]
    Plot {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// One row of the simulation.
struct Row {
    t: f64,
    utilization: f64,
    amount: f64,
    drops: Vec<f64>,
}

/// Parses `1.0:300s,0.5:300s`: utilization and how long it lasts, in order.
pub fn parse_schedule(s: &str) -> Result<Vec<(f64, u64)>, String> {
    s.split(',')
        .map(|part| {
            let (u, d) =
                part.split_once(':').ok_or_else(|| format!("`{part}`: write UTILIZATION:DURATION, like 0.9:60s"))?;
            let u: f64 = u.trim().parse().map_err(|_| format!("`{u}` is not a utilization between 0 and 1"))?;
            if !(0.0..=1.0).contains(&u) {
                return Err(format!("utilization {u} is outside 0 to 1"));
            }
            Ok((u, sluice::config::Duration::parse(d)?.0))
        })
        .collect()
}

/// The most rows one simulation prints: each is kept until the run ends (a schedule of
/// three years at the default step grew to 8 GB in 20 s).
const MAX_ROWS: u64 = 1_000_000;

/// Refuses a step of 0 (no time would pass) and a schedule of more than [`MAX_ROWS`]
/// steps, naming both ways out.
fn bounded(schedule: &[(f64, u64)], step: u64) -> Result<(), ShedError> {
    if step == 0 {
        return Err(ShedError::Setup("--step must be above 0 (time would not pass), e.g. 1s".into()));
    }
    let length: u64 = schedule.iter().map(|&(_, d)| d).fold(0, u64::saturating_add);
    let rows = length / step;
    if rows > MAX_ROWS {
        return Err(ShedError::Setup(format!(
            "the schedule lasts {} at a --step of {}: {rows} rows, past the {MAX_ROWS} one run prints; raise --step or \
             shorten the schedule",
            sluice::config::Duration(length),
            sluice::config::Duration(step)
        )));
    }
    Ok(())
}

/// Runs the simulation and prints CSV.
pub fn simulate(args: Args) -> Result<(), ShedError> {
    let schedule = args.utilization.as_deref().or(args.adaptive.load.as_deref()).unwrap_or_default();
    bounded(schedule, args.step.0)?;
    let Some(schedule) = args.utilization.clone() else {
        return adaptive::simulate(&args.adaptive, args.classes, args.step.0, args.plot.as_deref());
    };
    let params =
        ShedderParams { good: args.good, bad: args.bad, before: args.before.0, to_shed_all: args.to_shed_all.0 };
    params.validate()?;
    if args.classes < 2 {
        return Err(ShedError::Classes);
    }
    let step = args.step.0;
    let mut shedder = Shedder::new(params);
    let mut rows = Vec::new();
    let mut now = 0;
    for (utilization, length) in &schedule {
        let end = now + length;
        while now < end {
            let amount = shedder.update(*utilization, now);
            let drops = (0..args.classes).map(|c| shedder.drop_probability(c, args.classes)).collect();
            rows.push(Row { t: now as f64 / 1000.0, utilization: *utilization, amount, drops });
            now += step;
        }
    }
    let mut out = String::from("t,utilization,shed,amount");
    for c in 0..args.classes {
        let _ = write!(out, ",class{c}");
    }
    out.push('\n');
    for r in &rows {
        // rounded before printing, so a value a hair below zero prints as 0, not -0
        let amount = (r.amount * 1e4).round() / 1e4 + 0.0;
        let _ = write!(out, "{},{},{:.4},{:.4}", r.t, r.utilization, amount.max(0.0), amount);
        for d in &r.drops {
            let _ = write!(out, ",{d:.4}");
        }
        out.push('\n');
    }
    print!("{out}");
    if let Some(path) = &args.plot {
        std::fs::write(path, svg(&rows, args.classes))
            .map_err(|source| ShedError::Plot { path: path.display().to_string(), source })?;
    }
    Ok(())
}

/// A line chart: utilization, shed amount and each class's drop probability over time,
/// on labelled axes (time in seconds, ticks at a round step; share from 0 to 1).
fn svg(rows: &[Row], classes: usize) -> String {
    let plot = Plot::shares(900.0, 400.0, 40.0, 50.0);
    let t_max = rows.last().map_or(1.0, |r| r.t.max(1.0));
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"12\">\n",
        plot.w, plot.h
    );
    s += &format!("<rect width=\"{}\" height=\"{}\" fill=\"white\"/>\n", plot.w, plot.h);
    s += &plot.axes(t_max);
    let line = |values: &dyn Fn(&Row) -> f64, color: &str, dash: &str| {
        let points: Vec<String> =
            rows.iter().map(|r| format!("{:.1},{:.1}", plot.x(r.t, t_max), plot.y(values(r)))).collect();
        format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" stroke-dasharray=\"{dash}\" points=\"{}\"/>\n",
            points.join(" ")
        )
    };
    s += &line(&|r: &Row| r.utilization, "#999999", "6,4");
    s += &line(&|r: &Row| r.amount.max(0.0), "#d62728", "");
    let colors = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
    for c in 0..classes.saturating_sub(1) {
        s += &line(&move |r: &Row| r.drops[c], colors[c % colors.len()], "2,2");
    }
    let mut legend = vec![("utilization".to_string(), "#999999"), ("shed".to_string(), "#d62728")];
    for c in 0..classes.saturating_sub(1) {
        legend.push((format!("class {c} dropped"), colors[c % colors.len()]));
    }
    for (i, (name, color)) in legend.iter().enumerate() {
        let lx = plot.left + i as f64 * 120.0;
        s += &format!(
            "<rect x=\"{lx}\" y=\"12\" width=\"12\" height=\"12\" fill=\"{color}\"/><text x=\"{}\" y=\"22\">{name}</text>\n",
            lx + 16.0
        );
    }
    s + "</svg>\n"
}

/// Where a chart draws: its size and margins, in pixels, and what its y axis shows
/// (from 0 to `y_max`).
struct Plot {
    w: f64,
    h: f64,
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
    y_max: f64,
    y_title: String,
}

impl Plot {
    /// A chart of shares, from 0 to 1.
    fn shares(w: f64, h: f64, top: f64, bottom: f64) -> Self {
        Plot { w, h, left: 60.0, right: 20.0, top, bottom, y_max: 1.0, y_title: "share (0 to 1)".into() }
    }

    fn x(&self, t: f64, t_max: f64) -> f64 {
        self.left + t / t_max * (self.w - self.left - self.right)
    }

    fn y(&self, value: f64) -> f64 {
        self.h - self.bottom - (value / self.y_max).clamp(0.0, 1.0) * (self.h - self.top - self.bottom)
    }

    /// The axes, their ticks and grid lines, and their titles.
    fn axes(&self, t_max: f64) -> String {
        let (x0, x1, y0, y1) = (self.left, self.w - self.right, self.h - self.bottom, self.top);
        let mut s = String::new();
        for share in [0.0, 0.25, 0.5, 0.75, 1.0] {
            let (value, y) = (share * self.y_max, self.y(share * self.y_max));
            s += &format!("<line x1=\"{x0}\" y1=\"{y:.1}\" x2=\"{x1}\" y2=\"{y:.1}\" stroke=\"#e5e5e5\"/>\n");
            s += &format!("<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{value}</text>\n", x0 - 6.0, y + 4.0);
        }
        // a round step giving 4 to 12 ticks
        let step = [1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0]
            .into_iter()
            .find(|step| t_max / step <= 12.0)
            .unwrap_or(7200.0);
        let mut t = 0.0;
        while t <= t_max + 1e-9 {
            let x = self.x(t, t_max);
            s += &format!("<line x1=\"{x:.1}\" y1=\"{y0}\" x2=\"{x:.1}\" y2=\"{}\" stroke=\"black\"/>\n", y0 + 5.0);
            s += &format!("<text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{t}</text>\n", y0 + 18.0);
            t += step;
        }
        s += &format!("<line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x1}\" y2=\"{y0}\" stroke=\"black\"/>\n");
        s += &format!("<line x1=\"{x0}\" y1=\"{y1}\" x2=\"{x0}\" y2=\"{y0}\" stroke=\"black\"/>\n");
        s += &format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">time (s)</text>\n",
            (x0 + x1) / 2.0,
            self.h - 12.0
        );
        s + &format!(
            "<text x=\"16\" y=\"{:.1}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {:.1})\">{}</text>\n",
            (y0 + y1) / 2.0,
            (y0 + y1) / 2.0,
            self.y_title
        )
    }
}
