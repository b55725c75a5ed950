//! The commands: the command line collects each one's arguments, which the command's
//! own module defines (`serve::Args`, `bench::Args`, `shed::Args`, `admin::Args`). A
//! command uses the rooms below it (front-ends, state, config), never another command.

pub mod admin;
pub mod bench;
pub mod config;
pub mod serve;
pub mod shed;

use clap::{Parser, Subcommand};
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
    /// Run the rate limit service (HTTP API, and Envoy's gRPC rate limit service).
    Serve(serve::Args),
    /// Work with config files.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Generate load: against a running server over HTTP, or in process against the
    /// store a config names. Prints decisions/s and latency percentiles.
    Bench(bench::Args),
    /// Operate on a running server: stored overrides, inspect and reset a client.
    Admin(admin::Args),
    /// The load shedders.
    #[command(subcommand)]
    Shed(ShedCommand),
}

#[derive(Debug, Subcommand)]
pub enum ShedCommand {
    /// Run the worker utilization controller on a utilization schedule (--utilization),
    /// or the adaptive concurrency limit in front of a simulated service on a load
    /// schedule (--load), under a simulated clock; prints CSV (see docs/operations.md).
    Simulate(shed::Args),
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Check a config file: exit 0 when valid, else print file:line:col and the problem.
    Check {
        /// The config file.
        file: PathBuf,
        /// Also contact the stores it names: each must answer (and a Redis be new
        /// enough), and the regions running now must configure its global rules alike.
        #[arg(long)]
        online: bool,
    },
    /// Print the built-in config.
    Default,
    /// Print the config `sluice serve --ratelimit-env` makes of envoyproxy/ratelimit's
    /// environment variables (see docs/envoy.md).
    FromEnv,
}

/// The command line, as `sluice` was called. Called by the name `ratelimit` (the image's
/// `/bin/ratelimit`, the path Envoy Gateway and Istio run envoyproxy/ratelimit's image
/// by), it is `sluice serve --ratelimit-env`: their environment, their way. That name
/// takes no arguments, as theirs takes none: arguments given to it (a Deployment that
/// sets `args: [serve, ...]` and no `command` on the image, whose entry point it is) are
/// refused, saying to call `/bin/sluice`.
pub fn arguments() -> Result<Vec<std::ffi::OsString>, String> {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let called = args.first().and_then(|a| std::path::Path::new(a).file_name().map(|n| n == "ratelimit"));
    if called == Some(true) {
        if args.len() > 1 {
            let given: Vec<_> = args[1..].iter().map(|a| a.to_string_lossy()).collect();
            return Err(format!(
                "/bin/ratelimit takes no arguments (it is envoyproxy/ratelimit's entry point: `sluice serve \
                 --ratelimit-env`, configured by their environment variables), but was given `{}`; to run \
                 Sluice's own commands call /bin/sluice (in a Kubernetes container: command: [\"/bin/sluice\"])",
                given.join(" ")
            ));
        }
        args.splice(1..1, ["serve".into(), "--ratelimit-env".into()]);
    }
    Ok(args)
}
