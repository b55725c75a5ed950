//! Command-line interface.

use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;

/// Sluice: a distributed rate limiter and load shedder for HTTP APIs.
#[derive(Debug, Parser)]
#[command(name = "sluice", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the rate limit service (HTTP API).
    Serve(ServeArgs),
    /// Work with config files.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Generate load: against a running server over HTTP, or in process against the
    /// store a config names. Prints decisions/s and latency percentiles.
    Bench(BenchArgs),
    /// The load shedders.
    #[command(subcommand)]
    Shed(ShedCommand),
}

#[derive(Debug, Subcommand)]
pub enum ShedCommand {
    /// Run the worker utilization controller on a utilization schedule under a simulated
    /// clock; prints CSV (t, utilization, shed, amount, then each class's drop
    /// probability, least important first; the last class is critical).
    Simulate(SimulateArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// The schedule: UTILIZATION:DURATION pairs, like 1.0:300s,0.5:300s.
    #[arg(long, value_parser = crate::shed::parse_schedule)]
    pub utilization: std::vec::Vec<(f64, u64)>,
    /// Time between samples.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
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
    #[arg(long, default_value = "28s", value_parser = parse_duration)]
    pub before: sluice::config::Duration,
    /// How long full-speed shedding takes to shed everything.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub to_shed_all: sluice::config::Duration,
}

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// The server to load (`host:port` or `http://host:port`).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub target: String,
    /// What to ask the server for.
    #[arg(long, value_enum, default_value = "ratelimit")]
    pub endpoint: crate::bench::Endpoint,
    /// Call the engine in this process instead, on the store of `--config`.
    #[arg(long)]
    pub in_process: bool,
    /// Call Envoy's rate limit service (gRPC ShouldRateLimit) at `--target` instead of
    /// the HTTP API.
    #[arg(long, conflicts_with = "in_process")]
    pub grpc: bool,
    /// Config for `--in-process` (default: the built-in one).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Requests in flight at once (one connection each over HTTP).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// How long to run, like 10s.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub duration: sluice::config::Duration,
    /// Distinct clients to spread the requests over.
    #[arg(long, default_value_t = 1000)]
    pub clients: u64,
    /// Domain of the requests.
    #[arg(long, default_value = "demo")]
    pub domain: String,
    /// Descriptor key of the requests; values are `client-N`.
    #[arg(long, default_value = "user")]
    pub key: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

fn parse_duration(s: &str) -> Result<sluice::config::Duration, String> {
    sluice::config::Duration::parse(s)
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Config file (YAML). Without it, the built-in config (`sluice config default`).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Listen for HTTP on this address instead of `server.http`.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// Listen for gRPC (Envoy's rate limit service) on this address instead of
    /// `server.grpc`.
    #[arg(long, value_name = "ADDR")]
    pub grpc: Option<SocketAddr>,
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, default_value = "info", value_name = "LEVEL")]
    pub log_level: tracing::Level,
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Check a config file: exit 0 when valid, else print file:line:col and the problem.
    Check {
        /// The config file.
        file: PathBuf,
    },
    /// Print the built-in config.
    Default,
}
