//! `sluice config`: check a file (offline, or `--online` against the stores it names and
//! the regions running now), print the built-in config, or the one envoyproxy/ratelimit's
//! environment describes.

use super::ConfigCommand;
use crate::config::{env, load};
use sluice::store::Store;
use sluice::time::{Clock, SystemClock};
use std::error::Error;
use std::path::Path;

/// Runs one `sluice config` command.
pub fn run(command: ConfigCommand) -> Result<(), Box<dyn Error>> {
    match command {
        ConfigCommand::Check { file, online: false } => load::check(&file, false)?,
        ConfigCommand::Check { file, online: true } => {
            load::check(&file, true)?;
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(online(&file))?;
        }
        ConfigCommand::Default => print!("{}", load::DEFAULT_CONFIG),
        ConfigCommand::FromEnv => env::print()?,
    }
    Ok(())
}

/// `config check --online`: the stores `file` names answer, and the regions running now
/// (their beats in the global store) configure each of its global rules as it does. A
/// rule they configure otherwise fails the check: the fleet would hold the smallest
/// limit of a window (docs/configuration.md, "Regions that disagree").
async fn online(file: &Path) -> Result<(), Box<dyn Error>> {
    let loaded = load::load_file(file)?;
    let (store, global) = crate::app::build::stores(&loaded.config)?;
    answers("store", &*store).await?;
    let Some(global) = global else { return Ok(()) };
    answers("global_store", &*global).await?;
    let (now, mut differ) = (SystemClock.now(), Vec::new());
    for rule in loaded.rules.global_limits() {
        let variants = sluice::regions::fleet_variants(&*global, &rule.name, now).await?;
        let here = format!("{} per {} ms", rule.limit, rule.window);
        let said = |v: &[(u64, u64)]| v.iter().map(|(l, w)| format!("{l} per {w} ms")).collect::<Vec<_>>().join(", ");
        match variants.iter().any(|&v| v != (rule.limit, rule.window)) {
            false if variants.is_empty() => println!("global rule '{}': {here}; no region beats yet", rule.name),
            false => println!("global rule '{}': {here}, as every region running now", rule.name),
            true => differ.push(format!(
                "global rule '{}': {here} here, the regions running now: {}",
                rule.name,
                said(&variants)
            )),
        }
    }
    if differ.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{}\n{}: the regions disagree; while they do, each asks for units under the smallest limit of its window (a \
         window that differs is a limit of its own): give every region the same rules (a region's beat lasts 15 s, so \
         one that changed its rules shows both for that long)",
        differ.join("\n"),
        file.display()
    )
    .into())
}

/// That `store` (the config's key `name`) answers now and can run Sluice's decisions.
async fn answers(name: &str, store: &dyn Store) -> Result<(), Box<dyn Error>> {
    let address = store.address();
    let ready = tokio::time::timeout(std::time::Duration::from_secs(5), store.ready()).await;
    if ready != Ok(true) {
        return Err(format!("`{name}` at {address} does not answer").into());
    }
    store.preflight().await.map_err(|e| format!("`{name}` at {address}: {e}"))?;
    println!("{name}: {address} answers ({})", store.kind());
    Ok(())
}
