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
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Config file (YAML). Without it, the built-in config (`sluice config default`).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Listen for HTTP on this address instead of `server.http`.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
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
