//! What the xDS client (`xds/`) and a config reload share when the rules come from a
//! management server (`xds:` in the config): the config in force, whose `domains` are the
//! rules last pushed, and whether any were. Both put rules in force holding [`XdsState::turn`],
//! so neither undoes the other: a reload keeps the pushed rules, a push keeps the
//! reloaded settings.

use crate::config::Config;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Whether a stream to the management server is open (1) or not (0).
pub const CONNECTED: &str = "sluice_xds_connected";
/// The version of the rules in force, as the label of a series of value 1.
pub const CONFIG_INFO: &str = "sluice_xds_config_info";
/// When the rules in force were pushed, Unix seconds (0 before any push).
pub const LAST_PUSH: &str = "sluice_xds_last_push_timestamp_seconds";

/// Calls answered without a decision because no rules were pushed yet, by the API.
pub const WITHOUT_RULES: &str = "sluice_decisions_without_rules_total";

/// The xDS side of the state.
pub struct XdsState {
    /// What a waiting instance says (see `XdsConfig::waiting`).
    waiting: String,
    /// `xds.start_without_config`.
    pub start_without_config: bool,
    loaded: AtomicBool,
    /// Whether a stream to the management server is open now.
    connected: AtomicBool,
    /// The version of the rules in force, and when they were put in force (Unix ms).
    version: std::sync::Mutex<String>,
    pushed_at: AtomicU64,
    /// The config in force, its `domains` the rules last pushed; held while rules are put
    /// in force.
    pub turn: tokio::sync::Mutex<Config>,
}

impl XdsState {
    /// Before the first push, under `config` (which has no domains).
    pub fn new(config: &Config) -> Option<Self> {
        let xds = config.xds.as_ref()?;
        Some(Self {
            waiting: xds.waiting(),
            start_without_config: xds.start_without_config,
            loaded: AtomicBool::new(false),
            connected: AtomicBool::new(false),
            version: std::sync::Mutex::new(String::new()),
            pushed_at: AtomicU64::new(0),
            turn: tokio::sync::Mutex::new(config.clone()),
        })
    }

    /// Whether a stream is open, said by the client as it opens and loses one.
    pub fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Ordering::Relaxed);
    }

    /// Rules of `version` are in force, from now.
    pub fn pushed(&self, version: &str) {
        *self.version.lock().unwrap_or_else(|e| e.into_inner()) = version.to_string();
        self.pushed_at.store(sluice::time::Clock::now(&sluice::time::SystemClock), Ordering::Relaxed);
        self.set_loaded();
    }

    /// The stream's state as Prometheus text, rendered at each scrape (the version is a
    /// label of one series, which a push replaces rather than adds to): [`CONNECTED`],
    /// [`CONFIG_INFO`] once rules were pushed, and [`LAST_PUSH`] (0 before).
    pub fn exposition(&self) -> String {
        let gauge = |name: &str, help: &str, labels: &str, value: &str| {
            format!("# HELP {name} {help}\n# TYPE {name} gauge\n{name}{labels} {value}\n")
        };
        let connected = u8::from(self.connected.load(Ordering::Relaxed)).to_string();
        let mut out =
            gauge(CONNECTED, "Whether the xDS stream to the management server is open (1) or not (0).", "", &connected);
        if self.loaded() {
            let version = self.version.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let escaped = version.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
            let help = "The version of the rules pushed over xDS that are in force.";
            out += &gauge(CONFIG_INFO, help, &format!("{{version=\"{escaped}\"}}"), "1");
        }
        let at = self.pushed_at.load(Ordering::Relaxed);
        let help = "When the rules in force were pushed over xDS (0: none yet).";
        out += &gauge(LAST_PUSH, help, "", &format!("{}.{:03}", at / 1000, at % 1000));
        out
    }

    /// Whether rules were pushed yet.
    pub fn loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire)
    }

    fn set_loaded(&self) {
        self.loaded.store(true, Ordering::Release);
    }

    /// Why the instance is not ready: waiting for the first push, unless
    /// `start_without_config`.
    pub fn unready(&self) -> Option<String> {
        (!self.loaded() && !self.start_without_config).then(|| self.waiting.clone())
    }
}
