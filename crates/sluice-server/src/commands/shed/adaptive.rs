//! `sluice shed simulate --load`: the adaptive concurrency limit in front of a
//! simulated service (`sluice::algo::overload::sim`): a service that runs `--capacity`
//! requests at once for `--service-time` each, offered a multiple of its capacity on a
//! schedule. Prints a CSV row per `--step` and draws the limit, the requests in flight,
//! latency and the share shed per class.

use super::{Plot, ShedError};
use sluice::algo::overload::GradientParams;
use sluice::algo::overload::sim::{self, Period, Setup};
use std::fmt::Write as _;
use std::path::Path;

/// The most requests one simulation offers (each is held until the run ends: about
/// 32 bytes, so 640 MB at most).
const MAX_REQUESTS: f64 = 20_000_000.0;

/// The adaptive simulation's arguments (with `--load`).
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// The adaptive limit's schedule: LOAD:DURATION pairs, the load a multiple of the
    /// service's capacity, like 0.5:10s,3:15s,0.5:10s.
    #[arg(long, value_parser = parse_load)]
    pub load: Option<std::vec::Vec<(f64, u64)>>,
    /// Requests the simulated service runs at once.
    #[arg(long, default_value_t = 10, requires = "load")]
    pub capacity: u32,
    /// How long the simulated service takes a request (give or take a tenth).
    #[arg(long, default_value = "2ms", value_parser = sluice::config::Duration::parse, requires = "load")]
    pub service_time: sluice::config::Duration,
    /// Each class's share of the requests, least important first (Stripe's: test mode,
    /// GETs, POSTs, critical).
    #[arg(long, default_value = "0.2,0.45,0.25,0.1", value_delimiter = ',', requires = "load")]
    pub mix: Vec<f64>,
    /// The arrivals' and service times' seed.
    #[arg(long, default_value_t = 1, requires = "load")]
    pub seed: u64,
}

/// Parses `0.5:10s,3:15s`: a load (a multiple of capacity) and how long it lasts.
fn parse_load(s: &str) -> Result<Vec<(f64, u64)>, String> {
    s.split(',')
        .map(|part| {
            let (l, d) = part.split_once(':').ok_or_else(|| format!("`{part}`: write LOAD:DURATION, like 3:15s"))?;
            let l: f64 = l.trim().parse().map_err(|_| format!("`{l}` is not a load (a multiple of capacity)"))?;
            if !(0.0..=100.0).contains(&l) {
                return Err(format!("load {l} is outside 0 to 100 times the capacity"));
            }
            Ok((l, sluice::config::Duration::parse(d)?.0))
        })
        .collect()
}

/// Runs the simulation and prints CSV (and draws it to `plot`).
pub fn simulate(args: &LoadArgs, classes: usize, step: u64, plot: Option<&Path>) -> Result<(), ShedError> {
    let schedule = args.load.clone().unwrap_or_default();
    if args.mix.len() != classes
        || args.mix.iter().any(|m| m.is_nan() || *m < 0.0)
        || args.mix.iter().sum::<f64>() <= 0.0
    {
        return Err(ShedError::Setup(format!("--mix needs {classes} shares (one a class), not all 0")));
    }
    if args.capacity == 0 || args.service_time.0 == 0 {
        return Err(ShedError::Setup("--capacity and --service-time must be above 0".into()));
    }
    // the simulation holds every request it offers: bound what one run may ask for
    let per_ms = f64::from(args.capacity) / args.service_time.0 as f64;
    let offered: f64 = schedule.iter().map(|&(load, ms)| load * per_ms * ms as f64).sum();
    if offered > MAX_REQUESTS {
        return Err(ShedError::Setup(format!(
            "the schedule offers about {offered:.0} requests; at most {MAX_REQUESTS:.0} are simulated (shorten it or lower the load)"
        )));
    }
    let params = GradientParams::default();
    params.validate()?;
    let periods = sim::run(Setup {
        capacity: args.capacity,
        service_time: args.service_time.0 * 1000,
        schedule: schedule.iter().map(|&(l, d)| (l, d * 1000)).collect(),
        mix: args.mix.clone(),
        params: Some(params),
        period: step.max(1) * 1000,
        seed: args.seed,
    });
    print!("{}", csv(&periods, classes));
    if let Some(path) = plot {
        std::fs::write(path, svg(&periods, args.capacity, classes))
            .map_err(|source| ShedError::Plot { path: path.display().to_string(), source })?;
    }
    Ok(())
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// The share of a period's class `c` shed.
fn shed_share(p: &Period, c: usize) -> f64 {
    p.shed[c] as f64 / p.offered[c].max(1) as f64
}

fn csv(periods: &[Period], classes: usize) -> String {
    let mut out = String::from("t,load,limit,in_flight,base_ms,p50_ms,p99_ms");
    for kind in ["offered", "served", "shed"] {
        for c in 0..classes {
            let _ = write!(out, ",{kind}_class{c}");
        }
    }
    out.push('\n');
    for p in periods {
        let (t, base, p50, p99) = (ms(p.end) / 1000.0, ms(p.base), ms(p.quantile(0.5)), ms(p.quantile(0.99)));
        let _ = write!(out, "{t},{},{},{},{base:.3},{p50:.3},{p99:.3}", p.load, p.limit, p.in_flight);
        for counts in [&p.offered, &p.served, &p.shed] {
            for n in counts.iter() {
                let _ = write!(out, ",{n}");
            }
        }
        out.push('\n');
    }
    out
}

/// Three charts over one time axis: the limit and the most requests in flight (against
/// the service's capacity), the p50 and p99 latency of the requests served, and the
/// share of each class shed.
fn svg(periods: &[Period], capacity: u32, classes: usize) -> String {
    let (w, h) = (900.0, 840.0);
    let t_max = periods.last().map_or(1.0, |p| ms(p.end) / 1000.0);
    let top_limit = periods.iter().map(|p| p.limit.max(p.in_flight)).max().unwrap_or(1).max(capacity) as f64;
    let top_latency = periods.iter().map(|p| ms(p.quantile(0.99))).fold(1.0, f64::max);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n"
    );
    let mut requests = Chart::new(0, top_limit, "requests", t_max);
    requests.series(periods, &|p| f64::from(p.limit), "#d62728", "", "limit");
    requests.series(periods, &|p| f64::from(p.in_flight), "#1f77b4", "", "most in flight");
    requests.series(periods, &|_| f64::from(capacity), "#999999", "6,4", "capacity");
    let mut latency = Chart::new(1, top_latency, "latency (ms)", t_max);
    latency.series(periods, &|p| ms(p.quantile(0.5)), "#2ca02c", "", "p50 served");
    latency.series(periods, &|p| ms(p.quantile(0.99)), "#9467bd", "", "p99 served");
    let mut shed = Chart::new(2, 1.0, "share shed", t_max);
    let colors = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
    for c in 0..classes {
        shed.series(periods, &move |p| shed_share(p, c), colors[c % colors.len()], "2,2", &format!("class {c} shed"));
    }
    for chart in [requests, latency, shed] {
        s += &chart.svg;
    }
    s + "</svg>\n"
}

/// A round number at or above `v`: 1, 2 or 5 times a power of ten.
fn nice(v: f64) -> f64 {
    let p = 10f64.powf(v.max(1e-9).log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * p).find(|n| *n >= v).unwrap_or(10.0 * p)
}

/// One of the three charts, stacked: its axes, lines and legend.
struct Chart {
    plot: Plot,
    t_max: f64,
    svg: String,
    legend: usize,
}

impl Chart {
    /// Chart `i` from the top, its y axis from 0 to about `y_max`.
    fn new(i: usize, y_max: f64, title: &str, t_max: f64) -> Self {
        let (h, panel) = (840.0, 260.0);
        let top = 50.0 + i as f64 * panel;
        let plot = Plot {
            w: 900.0,
            h,
            left: 70.0,
            right: 20.0,
            top,
            bottom: h - top - (panel - 70.0),
            y_max: nice(y_max),
            y_title: title.into(),
        };
        Chart { svg: plot.axes(t_max), plot, t_max, legend: 0 }
    }

    /// A series as a polyline, and its entry in the legend above the chart.
    fn series(&mut self, periods: &[Period], value: &dyn Fn(&Period) -> f64, color: &str, dash: &str, name: &str) {
        let (plot, t_max) = (&self.plot, self.t_max);
        let points: Vec<String> = periods
            .iter()
            .map(|p| format!("{:.1},{:.1}", plot.x(ms(p.end) / 1000.0, t_max), plot.y(value(p))))
            .collect();
        let (lx, ly) = (plot.left + self.legend as f64 * 150.0, plot.top - 22.0);
        self.legend += 1;
        let _ = write!(
            self.svg,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" stroke-dasharray=\"{dash}\" points=\"{}\"/>\n<rect x=\"{lx}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{color}\"/><text x=\"{}\" y=\"{ly}\">{name}</text>\n",
            points.join(" "),
            ly - 10.0,
            lx + 16.0
        );
    }
}
