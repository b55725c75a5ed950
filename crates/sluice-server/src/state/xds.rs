//! What the xDS client (`xds/`) and a config reload share when the rules come from a
//! management server (`xds:` in the config): the config in force, whose `domains` are the
//! rules last pushed, and whether any were. Both put rules in force holding [`XdsState::turn`],
//! so neither undoes the other: a reload keeps the pushed rules, a push keeps the
//! reloaded settings.

use crate::config::Config;
use std::sync::atomic::{AtomicBool, Ordering};

/// The xDS side of the state.
pub struct XdsState {
    /// What a waiting instance says (see `XdsConfig::waiting`).
    waiting: String,
    /// `xds.start_without_config`.
    pub start_without_config: bool,
    loaded: AtomicBool,
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
            turn: tokio::sync::Mutex::new(config.clone()),
        })
    }

    /// Whether rules were pushed yet.
    pub fn loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire)
    }

    pub fn set_loaded(&self) {
        self.loaded.store(true, Ordering::Release);
    }

    /// Why the instance is not ready: waiting for the first push, unless
    /// `start_without_config`.
    pub fn unready(&self) -> Option<String> {
        (!self.loaded() && !self.start_without_config).then(|| self.waiting.clone())
    }
}
