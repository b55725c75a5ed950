//! The `sluice` binary: parses the command line and hands over. Nothing else lives here.

mod alloc;
mod app;
mod commands;
mod config;
#[cfg(test)]
mod fuzz;
mod grpc;
mod http;
mod logs;
mod otel;
mod otlp;
mod rls_messages;
mod statsd;
mod tls;
mod xds;

use clap::Parser;
use commands::{Cli, Command, ShedCommand};
use std::process::ExitCode;

fn main() -> ExitCode {
    alloc::init();
    let args = match commands::arguments() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let result: Result<(), Box<dyn std::error::Error>> = match Cli::parse_from(args).command {
        Command::Serve(args) => runtime().and_then(|rt| Ok(rt.block_on(commands::serve::serve(args))?)),
        Command::Admin(args) => runtime().and_then(|rt| Ok(rt.block_on(commands::admin::run(args))?)),
        Command::Bench(args) => runtime().and_then(|rt| Ok(rt.block_on(commands::bench::bench(args))?)),
        Command::Shed(ShedCommand::Simulate(args)) => commands::shed::simulate(args).map_err(Into::into),
        Command::Config(command) => commands::config::run(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, Box<dyn std::error::Error>> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_park(alloc::on_park)
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}").into())
}
