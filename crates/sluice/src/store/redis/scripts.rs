//! The Lua scripts and how they are called: each with its SHA, sent by `EVALSHA` and,
//! where a node lacks it, as `EVAL` with its source (`lua/`, sharing `lib.lua`).

/// One Lua script: its source and SHA1.
pub(super) struct Script {
    pub(super) code: String,
    pub(super) sha: String,
}

impl Script {
    pub(super) fn new(code: String) -> Self {
        let sha = redis::Script::new(&code).get_hash().to_string();
        Self { code, sha }
    }
}

/// The scripts: those that run the algorithms are the prelude and `lib.lua` followed by
/// their body.
pub(super) struct Scripts {
    pub(super) apply: Script,
    pub(super) peek: Script,
    pub(super) refund: Script,
    pub(super) release: Script,
    pub(super) reset: Script,
    pub(super) registry: Script,
    pub(super) grant: Script,
    pub(super) give_back: Script,
    pub(super) pool: Script,
    pub(super) reserve: Script,
    pub(super) commit: Script,
}

pub(super) const LIB: &str = include_str!("lua/lib.lua");

impl Scripts {
    pub(super) fn new() -> Self {
        let lib = format!("{}{LIB}", Kind::prelude());
        Self {
            apply: Script::new(format!("{lib}{}", include_str!("lua/apply.lua"))),
            // the no-writes flag lets replicas run it (EVALSHA_RO); it must come first
            peek: Script::new(format!("#!lua flags=no-writes\n{lib}{}", include_str!("lua/peek.lua"))),
            refund: Script::new(format!("{lib}{}", include_str!("lua/refund.lua"))),
            release: Script::new(include_str!("lua/release.lua").to_string()),
            reset: Script::new(include_str!("lua/reset.lua").to_string()),
            registry: Script::new(format!(
                "local TOMBSTONES = {}\n{}",
                crate::store::registry::TOMBSTONES,
                include_str!("lua/registry.lua")
            )),
            grant: Script::new(format!("{lib}{}", include_str!("lua/grant.lua"))),
            give_back: Script::new(format!("{lib}{}", include_str!("lua/give_back.lua"))),
            pool: Script::new(format!("{lib}{}", include_str!("lua/pool.lua"))),
            reserve: Script::new(format!("{lib}{}", include_str!("lua/reserve.lua"))),
            commit: Script::new(format!("{lib}{}", include_str!("lua/commit.lua"))),
        }
    }
}

/// The Lua source of the apply script exactly as Sluice sends it to Redis (prelude,
/// `lib.lua`, `apply.lua`): to audit it, or to load it by hand (`SCRIPT LOAD`) and
/// measure Redis alone with `redis-benchmark`, as `scripts/bench` does.
pub fn apply_script() -> String {
    Scripts::new().apply.code
}

/// The algorithms as the scripts number them. The one place these numbers are written:
/// every script starts with a prelude naming them (`local FIXED_WINDOW, ... = 1, ...`),
/// and `lib.lua` uses only the names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    FixedWindow = 1,
    TokenBucket = 2,
    SlidingWindow = 3,
    Concurrency = 4,
}

impl Kind {
    const ALL: [(Kind, &'static str); 4] = [
        (Kind::FixedWindow, "FIXED_WINDOW"),
        (Kind::TokenBucket, "TOKEN_BUCKET"),
        (Kind::SlidingWindow, "SLIDING_WINDOW"),
        (Kind::Concurrency, "CONCURRENCY"),
    ];

    /// The Lua line that names every algorithm's number, the grants' constants
    /// (`algo::grant`: the most grants a book holds, a bucket grant's time to live and
    /// the skew the store allows it) and the reservations' (`algo::reservation`: the most
    /// holds a window keeps open, and settlements it remembers).
    pub(super) fn prelude() -> String {
        use crate::algo::MAX_EXACT;
        use crate::algo::grant::{BUCKET_TTL, MAX_OPEN, SKEW};
        use crate::algo::reservation::{MAX_OPEN as HOLDS_MAX, MAX_SETTLED};
        let names: Vec<&str> = Self::ALL.iter().map(|(_, n)| *n).collect();
        let numbers: Vec<String> = Self::ALL.iter().map(|(k, _)| (*k as u8).to_string()).collect();
        format!(
            "local {}, MAX_OPEN, BUCKET_TTL, SKEW, HOLDS_MAX, SETTLED_MAX, MAX_EXACT = {}, {MAX_OPEN}, {BUCKET_TTL}, \
             {SKEW}, {HOLDS_MAX}, {MAX_SETTLED}, {MAX_EXACT}\n",
            names.join(", "),
            numbers.join(", ")
        )
    }
}
