//! `sluice config`: check a file, print the built-in config, or the one
//! envoyproxy/ratelimit's environment describes.

use super::ConfigCommand;
use crate::config::{env, load};

/// Runs one `sluice config` command.
pub fn run(command: ConfigCommand) -> Result<(), Box<dyn std::error::Error>> {
    match command {
        ConfigCommand::Check { file } => load::check(&file)?,
        ConfigCommand::Default => print!("{}", load::DEFAULT_CONFIG),
        ConfigCommand::FromEnv => env::print()?,
    }
    Ok(())
}
