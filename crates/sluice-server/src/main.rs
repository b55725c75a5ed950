//! The `sluice` binary: parses the command line and hands over. Nothing else lives here.

mod alloc;
mod commands;
mod config;
#[cfg(test)]
mod fuzz;
mod grpc;
mod http;
mod logs;
mod otel;
mod otlp;
mod state;
mod tls;

// the modules' old paths, until their code is edited to the new ones
use commands as cli;
use commands::admin as admin_cli;
use commands::serve::reload;
use commands::{bench, serve, shed};
use config::env as ratelimit_env;
use config::{checks, load};
use grpc::listen as grpc_listen;
use grpc::{rlqs, rls};
use http::envoy as envoy_http;
use http::json as api;
use http::{admin, admin_import, listen, ui};
use state::build;

use clap::Parser;
use cli::{Cli, Command, ConfigCommand, ShedCommand};
use std::process::ExitCode;

fn main() -> ExitCode {
    alloc::init();
    let result: Result<(), Box<dyn std::error::Error>> = match Cli::parse().command {
        Command::Serve(args) => runtime().and_then(|rt| Ok(rt.block_on(serve::serve(args))?)),
        Command::Admin(args) => runtime().and_then(|rt| Ok(rt.block_on(admin_cli::run(args))?)),
        Command::Bench(args) => runtime().and_then(|rt| Ok(rt.block_on(bench::bench(args))?)),
        Command::Shed(ShedCommand::Simulate(args)) => shed::simulate(args).map_err(Into::into),
        Command::Config(ConfigCommand::Check { file }) => load::check(&file).map_err(Into::into),
        Command::Config(ConfigCommand::Default) => {
            print!("{}", load::DEFAULT_CONFIG);
            Ok(())
        }
        Command::Config(ConfigCommand::FromEnv) => ratelimit_env::print().map_err(Into::into),
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
