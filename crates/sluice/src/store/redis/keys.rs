//! Where a client's states live in Redis (`Location`: a bucket hash and its field, or a
//! key of its own in the same slot), the registry's keys, and how a policy is written
//! into a script's arguments.

use super::*;

/// How long a key outlives the moment its state stops mattering. Expiry is decided by
/// the scripts from stored times; the TTL only collects garbage.
pub(super) const GRACE_MS: Millis = 1_000;

/// Where one state lives: the key a script touches and, for states kept in a bucket, the
/// field inside it.
///
/// Fixed windows, token buckets and sliding windows are fields of a bucket hash
/// `s:{<bucket>}` shared by the clients whose tags fall in it: one key of its own with a TTL
/// costs Redis 7 about 165 bytes, a field in a bucket of a few dozen about 50 (see
/// docs/benchmarks.md). The bucket is also the cluster hash tag, so every state of a
/// client is in one slot. A concurrency limit is a sorted set, its own key in the same
/// slot: `s:{<bucket>}<field>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Location {
    pub key: String,
    pub field: String,
}

impl Location {
    /// The location of state `key` of the client `tag` under `limit`, with `buckets`
    /// buckets.
    pub fn of(tag: Tag, key: u64, limit: &Limit, buckets: u32) -> Self {
        match limit {
            Limit::Concurrency { .. } => Self::leases(tag, key, buckets),
            _ => Self::field(tag, key, buckets),
        }
    }

    /// The location of a concurrency state: a key of its own, in the bucket's slot.
    pub fn leases(tag: Tag, key: u64, buckets: u32) -> Self {
        let at = Self::field(tag, key, buckets);
        Self { key: at.key + &at.field, field: String::new() }
    }

    pub(super) fn field(tag: Tag, key: u64, buckets: u32) -> Self {
        // tags and keys are opaque to a store: spread them (see crate::hash) before
        // taking bits apart
        let t = crate::hash::spread_tag(tag.0);
        let bucket = ((t >> 64) as u64) % u64::from(buckets.max(1));
        let mut field = String::with_capacity(FIELD_CHARS as usize);
        b64(&mut field, crate::hash::state_name(t as u64, key) >> (128 - 6 * FIELD_CHARS), FIELD_CHARS);
        let chars = (64 - u64::from(buckets.max(2) - 1).leading_zeros()).div_ceil(6);
        let mut key = String::with_capacity(5 + chars as usize + field.len());
        key.push_str("s:{");
        b64(&mut key, u128::from(bucket), chars);
        key.push('}');
        Self { key, field }
    }
}

/// The length of a state's field name: 72 bits of [`crate::hash::state_name`]. Two live
/// states of one bucket share a name with odds of about n^2 / 2^73 for n states in it
/// (at 128 a bucket, 65,536 buckets full: one in 10^13); each character more costs
/// every state about a byte (19 characters cost 105 bytes a state at 100k clients, 12
/// cost 100: docs/benchmarks.md).
pub(super) const FIELD_CHARS: u32 = 12;

/// The registry (see [`RegistryOp`]), in one slot: the hash of overrides, its version,
/// the change log, the removed ids, the log's floor and the versions logged
/// (`lua/registry.lua`).
pub(super) const REGISTRY_KEYS: [&str; 6] = [
    "sluice:{registry}:overrides",
    "sluice:{registry}:version",
    "sluice:{registry}:log",
    "sluice:{registry}:gone",
    "sluice:{registry}:floor",
    "sluice:{registry}:logged",
];

/// Buckets when the configuration names none: fewer than one state per bucket wastes
/// the sharing, more than 128 turns a bucket from a listpack into a hash table (about 100
/// bytes a state, and pruning scans get longer). 65,536 suits up to about 8 million
/// active states.
pub const DEFAULT_BUCKETS: u32 = 65_536;

pub(super) fn keys(at: &[Location]) -> Vec<&str> {
    at.iter().map(|l| l.key.as_str()).collect()
}

/// A policy as the scripts take it: "kind:p1:p2:p3:shadow" (see `lua/lib.lua`), one
/// argument where four numbers and a flag were five (Redis parses and Lua interns every
/// argument of every decision).
pub(super) fn policy(limit: &Limit, shadow: bool) -> String {
    let (kind, p) = match *limit {
        Limit::FixedWindow { limit, window, aligned } => (Kind::FixedWindow, [limit, window, aligned as u64]),
        Limit::TokenBucket { rate, per, burst } => (Kind::TokenBucket, [rate, per, burst]),
        Limit::SlidingWindow { limit, window } => (Kind::SlidingWindow, [limit, window, 0]),
        Limit::Concurrency { limit, lease_ttl } => (Kind::Concurrency, [limit, lease_ttl, 0]),
    };
    format!("{}:{}:{}:{}:{}", kind as u8, p[0], p[1], p[2], shadow as u8)
}

pub(super) fn lease_hex(lease: Lease) -> String {
    format!("{lease:032x}")
}
