//! What the xDS client (`xds/`) and a config reload share when the rules come from a
//! management server (`xds:` in the config): the config in force, whose `domains` are the
//! rules last pushed, and whether any were. Both put rules in force holding [`XdsState::turn`],
//! so neither undoes the other: a reload keeps the pushed rules, a push keeps the
//! reloaded settings.

use crate::config::Config;
use std::sync::atomic::{AtomicBool, Ordering};

/// The rules as pushed, and the config they are in force under.
pub struct Pushed {
    /// The config in force, with the pushed domains.
    pub config: Config,
    /// The version of the resources in force ("" before the first push).
    pub version: String,
}

/// The xDS side of the state.
pub struct XdsState {
    /// The management server, for what a waiting instance answers.
    pub server: String,
    /// `xds.start_without_config`.
    pub start_without_config: bool,
    loaded: AtomicBool,
    pub turn: tokio::sync::Mutex<Pushed>,
}

impl XdsState {
    /// Before the first push, under `config` (which has no domains).
    pub fn new(config: &Config) -> Option<Self> {
        let xds = config.xds.as_ref()?;
        Some(Self {
            server: xds.server.clone(),
            start_without_config: xds.start_without_config,
            loaded: AtomicBool::new(false),
            turn: tokio::sync::Mutex::new(Pushed { config: config.clone(), version: String::new() }),
        })
    }

    /// Whether rules were pushed yet.
    pub fn loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire)
    }

    pub fn set_loaded(&self) {
        self.loaded.store(true, Ordering::Release);
    }

    /// Why decisions cannot be made yet, before the first push.
    pub fn waiting(&self) -> Option<String> {
        (!self.loaded()).then(|| {
            format!(
                "no rate limit configuration loaded yet: waiting for the first push from the xDS server at {}",
                self.server
            )
        })
    }

    /// Why the instance is not ready: waiting for the first push, unless
    /// `start_without_config`.
    pub fn unready(&self) -> Option<String> {
        self.waiting().filter(|_| !self.start_without_config)
    }
}
