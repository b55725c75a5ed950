//! Logs: text for people, one JSON object per line for log stores (`log.format`), on
//! stderr. The filter comes from `--log-level`, else `RUST_LOG`, else `log.level`, else
//! `info`; when it comes from the config file, a reload that changes `log.level` puts
//! the new filter in force (the format is chosen once, at start).
//!
//! A filter is a default level and levels per target, comma separated:
//! `warn,sluice::audit=info` logs warnings, and admin actions at info. Targets are
//! module paths (`sluice`, `sluice_server`, `h2`, `hyper`); the audit trail is
//! `sluice::audit`.

use serde::{Deserialize, Deserializer, de};
use std::sync::OnceLock;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry, fmt, reload};

/// `log`: how the server logs.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `text` (default) or `json`.
    pub format: LogFormat,
    /// The filter (see the module docs); default `info`.
    pub level: LogFilter,
}

/// The shape of a log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// `2026-11-23T10:00:00.000Z  INFO message key=value ...`
    #[default]
    Text,
    /// `{"timestamp":..., "level":"INFO", "target":..., "message":..., "key":value, ...}`
    Json,
}

/// A parsed filter, with the text it came from.
#[derive(Debug, Clone)]
pub struct LogFilter {
    text: String,
    targets: Targets,
}

impl LogFilter {
    fn parse(text: &str) -> Result<Self, String> {
        let explain = |why: String| {
            format!(
                "'{text}' is not a log filter ({why}): write a level (error, warn, info, debug, trace, off), optionally followed by target=level pairs, e.g. \"warn,sluice::audit=info\""
            )
        };
        // a bare word is a level here: as a target name (its meaning in RUST_LOG) a
        // misspelt level would silence every other line
        for word in text.split(',').map(str::trim).filter(|w| !w.is_empty() && !w.contains('=')) {
            word.parse::<LevelFilter>().map_err(|_| explain(format!("'{word}' is not a level")))?;
        }
        let targets = text.parse::<Targets>().map_err(|e| explain(e.to_string()))?;
        Ok(Self { text: text.to_string(), targets })
    }
}

impl Default for LogFilter {
    fn default() -> Self {
        Self::parse("info").expect("a level parses")
    }
}

impl PartialEq for LogFilter {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl<'de> Deserialize<'de> for LogFilter {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Self::parse(&String::deserialize(d)?).map_err(de::Error::custom)
    }
}

/// Where the filter in force came from, and how to change it.
struct Installed {
    handle: reload::Handle<Targets, Registry>,
    /// Whether `--log-level` or `RUST_LOG` set it (then the config's is ignored).
    fixed: bool,
}

static INSTALLED: OnceLock<Installed> = OnceLock::new();

/// Installs the process's logger. `cli` is `--log-level` when given.
pub fn init(cli: Option<tracing::Level>, config: &LogConfig) -> Result<(), String> {
    let env = std::env::var("RUST_LOG").ok().filter(|v| !v.trim().is_empty());
    let (targets, fixed) = match (cli, env) {
        (Some(level), _) => (Targets::new().with_default(level), true),
        (None, Some(env)) => (LogFilter::parse(&env).map_err(|e| format!("RUST_LOG: {e}"))?.targets, true),
        (None, None) => (config.level.targets.clone(), false),
    };
    let (filter, handle) = reload::Layer::new(targets);
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let lines = match config.format {
        LogFormat::Text => fmt::layer().with_target(false).with_ansi(tty).with_writer(std::io::stderr).boxed(),
        LogFormat::Json => fmt::layer().json().flatten_event(true).with_writer(std::io::stderr).boxed(),
    };
    Registry::default().with(filter).with(lines).try_init().map_err(|e| format!("cannot install the logger: {e}"))?;
    let _ = INSTALLED.set(Installed { handle, fixed });
    Ok(())
}

/// Puts a reloaded config's `log.level` in force, unless the command line or `RUST_LOG`
/// set the filter. Returns whether it changed anything.
pub fn reconfigure(old: &LogConfig, new: &LogConfig) -> bool {
    let Some(installed) = INSTALLED.get() else { return false };
    if installed.fixed || old.level == new.level {
        return false;
    }
    installed.handle.reload(new.level.targets.clone()).is_ok()
}

/// A log line that may be written at most every 10 s.
#[derive(Default)]
pub struct Sometimes(sluice::time::Throttle);

impl Sometimes {
    /// Whether the line may be written now (and if so, not again for 10 s).
    pub fn due(&self) -> bool {
        self.0.due(sluice::time::Clock::now(&sluice::time::SystemClock), 10_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_parse_or_explain() {
        let c: LogConfig = serde_norway::from_str("format: json\nlevel: warn,sluice::audit=info\n").unwrap();
        assert_eq!(c.format, LogFormat::Json);
        assert!(c.level.targets.would_enable("sluice::audit", &tracing::Level::INFO));
        assert!(!c.level.targets.would_enable("sluice", &tracing::Level::INFO));
        let e = serde_norway::from_str::<LogConfig>("level: loud\n").unwrap_err().to_string();
        assert!(e.contains("'loud' is not a log filter"), "{e}");
        assert!(serde_norway::from_str::<LogConfig>("format: xml\n").is_err());
    }
}
