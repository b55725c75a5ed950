//! The `sluice` binary: parses the command line and hands over. Nothing else lives here.

mod api;
mod bench;
mod cli;
mod http;
mod load;
mod reload;
mod rls;
mod serve;
mod shed;

use clap::Parser;
use cli::{Cli, Command, ConfigCommand, ShedCommand};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => {
            let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
            tracing_subscriber::fmt()
                .with_max_level(args.log_level)
                .with_target(false)
                .with_ansi(tty)
                .with_writer(std::io::stderr)
                .init();
            tokio::runtime::Runtime::new()
                .map_err(|e| format!("cannot start the async runtime: {e}"))
                .and_then(|rt| rt.block_on(serve::serve(args)))
        }
        Command::Bench(args) => tokio::runtime::Runtime::new()
            .map_err(|e| format!("cannot start the async runtime: {e}"))
            .and_then(|rt| rt.block_on(bench::bench(args))),
        Command::Shed(ShedCommand::Simulate(args)) => shed::simulate(args),
        Command::Config(ConfigCommand::Check { file }) => {
            load::load_file(&file).map(|_| println!("{}: ok", file.display())).map_err(|e| e.to_string())
        }
        Command::Config(ConfigCommand::Default) => {
            print!("{}", load::DEFAULT_CONFIG);
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
