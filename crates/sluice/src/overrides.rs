//! Stored overrides: other limits for some clients, set and removed live, in force on
//! every instance of the fleet.
//!
//! GitHub gives an app installation more than a user, and its support staff raise one
//! customer's limit without a deploy; Stripe raises limits for particular users. An
//! [`Override`] names a domain and a descriptor (exact values, or a value ending in `*`
//! for every value it prefixes) and replaces the limit of one (`policy`) or every policy
//! that descriptor matches, optionally until an expiry time.
//!
//! Where they live: in the store's registry ([`crate::store::RegistryOp`]), beside the
//! counters, so the fleet shares one truth (a hash and a version counter in Redis, in one
//! slot of a cluster; process memory for the memory store). Where they are read: never
//! on the hot path. Each instance keeps the whole set in memory, indexed for matching,
//! and [`Overrides::watch`] reads the version every [`REFRESH`] and the set only when
//! the version moved; a decision costs one lock-free pointer load, and when its domain
//! has overrides, one hash lookup per descriptor. An override changes only which limit
//! an op carries: the decision is still the one atomic store call it was.
//!
//! Precedence, for one policy of one descriptor: an exact override beats a prefix one;
//! among prefix overrides the one with more exact entries, then the longer prefix; then
//! one naming the policy beats one for every policy; then the one set last. Config
//! `replaces` are applied first: an override replaces limits of the policies that are
//! left. Stored state is keyed without the limit, so a client's usage stays when an
//! override raises or lowers its limit mid-window.

use crate::algo::{Limit, MAX_EXACT};
use crate::config::Duration;
use crate::request::Entry;
use crate::store::StoreError;
use crate::time::Millis;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::hash::Hasher;
use std::sync::Arc;

mod fleet;
mod sharded;
pub use fleet::{Overrides, PAGE};
use sharded::Sharded;

/// How often an instance looks at the registry's version.
pub const REFRESH: std::time::Duration = std::time::Duration::from_millis(250);

/// How long after a change every watching instance has seen it: two looks at the
/// version and the read of the set. A reset answers only after this, so when it
/// returns no instance's near-cache still refuses the client.
pub const PROPAGATION: std::time::Duration = std::time::Duration::from_millis(600);

/// Other limits for the clients one descriptor names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Override {
    /// Its name, chosen by whoever sets it (`PUT /v1/overrides/{id}`).
    #[serde(default)]
    pub id: String,
    pub domain: String,
    /// The descriptor's entries, in order; a value ending in `*` matches every value it
    /// prefixes.
    pub entries: Vec<Entry>,
    /// The new limit: requests per window, a token bucket's burst, or concurrent leases.
    pub limit: u64,
    /// The one policy it replaces; None: every policy the descriptor matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// A fixed window's new length (from the client's next window: the stored reset stays).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<Duration>,
    /// A token bucket's new rate, in tokens per the bucket's `per`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<u64>,
    /// When it lapses, in ms since the epoch; None: until removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<Millis>,
    /// Why, in words, for the next operator and the audit log.
    #[serde(default)]
    pub reason: String,
    /// When it was stored, in ms since the epoch (set by [`crate::Limiter::set_override`]).
    #[serde(default)]
    pub set_at_ms: Millis,
    /// Who stored it: an identifier of the credential used, never the credential.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub set_by: String,
    /// Says that an entry's value of exactly `*` is meant: it puts every client of that
    /// key under this one override, so it is refused without this.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub all_clients: bool,
}

/// The shortest `window` an override may give a fixed window. A window restarts when a
/// request finds its stored reset passed: with windows of a few ms, every request of a
/// fleet (clocks a ms apart, a round trip of a ms) starts a fresh one, so no limit holds
/// (`window: 1ms` admitted 8 of 8 against a limit of 5). From a second on, the stored
/// reset is what decides, as for the config's windows.
pub const MIN_WINDOW: Duration = Duration(1_000);

impl Override {
    /// Whether it replaces the limit of the policy named `policy`.
    fn names(&self, policy: &str) -> bool {
        self.policy.as_deref().is_none_or(|p| p == policy)
    }

    /// Whether it has lapsed at `now`.
    pub fn expired(&self, now: Millis) -> bool {
        self.expires_at_ms.is_some_and(|t| now >= t)
    }

    /// Whether its entries name the descriptor `entries`.
    fn matches(&self, entries: &[(&str, &str)]) -> bool {
        self.entries.len() == entries.len()
            && self.entries.iter().zip(entries).all(|(e, (k, v))| {
                e.key == *k
                    && match e.value.strip_suffix('*') {
                        Some(prefix) => v.starts_with(prefix),
                        None => e.value == *v,
                    }
            })
    }

    fn exact(&self) -> bool {
        !self.entries.iter().any(|e| e.value.ends_with('*'))
    }

    /// Its rank among overrides that match one descriptor: higher wins.
    fn rank(&self) -> (bool, usize, usize, bool, Millis) {
        let exact_entries = self.entries.iter().filter(|e| !e.value.ends_with('*')).count();
        let literal: usize = self.entries.iter().map(|e| e.value.trim_end_matches('*').len()).sum();
        (self.exact(), exact_entries, literal, self.policy.is_some(), self.set_at_ms)
    }

    /// The limit `base` becomes under this override. Only what fits the algorithm
    /// changes: `window` a fixed window's, `rate` a token bucket's.
    pub fn limit_for(&self, base: Limit) -> Limit {
        match base {
            Limit::FixedWindow { window, aligned, .. } => {
                Limit::FixedWindow { limit: self.limit, window: self.window.map_or(window, |w| w.0), aligned }
            }
            Limit::SlidingWindow { window, .. } => Limit::SlidingWindow { limit: self.limit, window },
            Limit::TokenBucket { rate, per, .. } => {
                Limit::TokenBucket { rate: self.rate.unwrap_or(rate), per, burst: self.limit }
            }
            Limit::Concurrency { lease_ttl, .. } => Limit::Concurrency { limit: self.limit, lease_ttl },
        }
    }

    /// What is wrong with it on its own (ids, sizes, bounds), before any rule is asked.
    pub fn check(&self, now: Millis) -> Result<(), String> {
        let id_ok = !self.id.is_empty()
            && self.id.len() <= 128
            && self.id.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-:@".contains(&b));
        if !id_ok {
            return Err(format!(
                "override id {:?} must be 1 to 128 characters of letters, digits and _ . - : @",
                self.id.chars().take(140).collect::<String>()
            ));
        }
        if self.entries.is_empty() {
            return Err("`entries` must name at least one {\"key\", \"value\"}".into());
        }
        if self.limit == 0 {
            return Err("`limit` must be at least 1".into());
        }
        if self.limit > MAX_EXACT {
            return Err(format!(
                "`limit` {} is above 2^53 - 1 ({MAX_EXACT}), the largest count kept exactly",
                self.limit
            ));
        }
        if self.expires_at_ms.is_some_and(|t| t <= now) {
            return Err(format!("`expires_at_ms` is not in the future (now is {now})"));
        }
        if let Some(w) = self.window
            && w.0 < MIN_WINDOW.0
        {
            return Err(format!(
                "`window` {w} is shorter than {MIN_WINDOW}: a window that short restarts between one request and the next across a fleet, so its limit holds nothing; give {MIN_WINDOW} or more"
            ));
        }
        let bare = self.entries.iter().find(|e| e.value == "*");
        match (bare, self.all_clients) {
            (Some(e), false) => {
                return Err(format!(
                    "the value \"*\" of entry '{}' puts every client of that key under this override; if that is meant, add \"all_clients\": true (sluice admin override set --all-clients)",
                    e.key
                ));
            }
            (None, true) => {
                return Err("`all_clients` is for an override whose entry value is exactly \"*\"; remove it".into());
            }
            _ => {}
        }
        if self.reason.len() > 1024 {
            return Err("`reason` is longer than 1024 bytes".into());
        }
        Ok(())
    }
}

/// How a class of overrides reads a descriptor: per entry, the whole value (`None`) or
/// its first `n` bytes (`Some(n)`, a prefix of `n` bytes then `*`).
type Shape = Box<[Option<usize>]>;

/// Overrides of one shape matching one descriptor, best rank first.
type Bucket = Arc<[Arc<Override>]>;

/// The overrides of one domain, indexed for matching: by shape, then by a hash of the
/// bytes that shape reads, so a descriptor costs one hash lookup per shape held
/// (exact overrides of one-entry descriptors are one shape; each prefix length is
/// another), however many overrides there are.
#[derive(Debug, Default, Clone)]
pub(crate) struct DomainOverrides {
    classes: Vec<(Shape, Sharded<u64, Bucket>)>,
}

fn shape_of(o: &Override) -> Shape {
    o.entries.iter().map(|e| e.value.strip_suffix('*').map(str::len)).collect()
}

/// The hash of what `shape` reads of `entries`; None when they do not fit it (another
/// length, or a value shorter than its prefix).
fn read_hash<'a>(shape: &[Option<usize>], entries: impl ExactSizeIterator<Item = (&'a str, &'a str)>) -> Option<u64> {
    if entries.len() != shape.len() {
        return None;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for ((k, v), cut) in entries.zip(shape) {
        let v = match cut {
            Some(n) => v.as_bytes().get(..*n)?,
            None => v.as_bytes(),
        };
        // keys are UTF-8, so never 0xff: the separator keeps ("ab", "c") from ("a", "bc")
        h.write(k.as_bytes());
        h.write_u8(0xff);
        h.write(v);
        h.write_u8(0xff);
    }
    Some(h.finish())
}

/// Best first: higher rank, then the smaller id.
fn best_first(a: &Arc<Override>, b: &Arc<Override>) -> std::cmp::Ordering {
    b.rank().cmp(&a.rank()).then(a.id.cmp(&b.id))
}

/// The overrides that may apply to one descriptor: the bucket each shape held reads of
/// it. Looked up once per descriptor (a hash per shape), then asked once per policy.
#[derive(Debug, Default)]
pub(crate) struct Candidates<'o, 'e> {
    entries: &'e [(&'e str, &'e str)],
    buckets: Vec<&'o [Arc<Override>]>,
}

impl<'o> Candidates<'o, '_> {
    /// The override in force at `now` for policy `policy`: the best usable one of any
    /// bucket (each is best first).
    pub(crate) fn find(&self, policy: &str, now: Millis) -> Option<&'o Arc<Override>> {
        // `matches` guards against two descriptors whose read bytes share a hash
        let usable = |o: &&Arc<Override>| o.names(policy) && !o.expired(now) && o.matches(self.entries);
        self.buckets.iter().filter_map(|bucket| bucket.iter().find(usable)).min_by(|a, b| best_first(a, b))
    }
}

impl DomainOverrides {
    /// The overrides that may apply to the descriptor `entries`.
    pub(crate) fn candidates<'e>(&self, entries: &'e [(&'e str, &'e str)]) -> Candidates<'_, 'e> {
        let buckets = self
            .classes
            .iter()
            .filter_map(|(shape, buckets)| buckets.get(&read_hash(shape, entries.iter().copied())?))
            .map(|bucket| &bucket[..])
            .collect();
        Candidates { entries, buckets }
    }

    /// The override in force at `now` for policy `policy` of the descriptor `entries`.
    #[cfg(test)]
    pub(crate) fn find(&self, entries: &[(&str, &str)], policy: &str, now: Millis) -> Option<&Arc<Override>> {
        self.candidates(entries).find(policy, now)
    }

    fn key(o: &Override) -> (Shape, u64) {
        let shape = shape_of(o);
        let entries = o.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()));
        let hash = read_hash(&shape, entries).expect("an override fits its own shape");
        (shape, hash)
    }

    fn insert(&mut self, o: &Arc<Override>) {
        let (shape, hash) = Self::key(o);
        let i = match self.classes.iter().position(|(s, _)| *s == shape) {
            Some(i) => i,
            None => {
                self.classes.push((shape, Sharded::default()));
                self.classes.len() - 1
            }
        };
        let bucket = self.classes[i].1.get_or_insert_with(hash, || Arc::from(Vec::new()));
        let mut next = bucket.to_vec();
        let at = next.partition_point(|x| best_first(x, o).is_lt());
        next.insert(at, o.clone());
        *bucket = next.into();
    }

    fn remove(&mut self, o: &Arc<Override>) {
        let (shape, hash) = Self::key(o);
        let Some(i) = self.classes.iter().position(|(s, _)| *s == shape) else { return };
        let buckets = &mut self.classes[i].1;
        if let Some(bucket) = buckets.get_mut(&hash) {
            let next: Vec<_> = bucket.iter().filter(|x| !Arc::ptr_eq(x, o)).cloned().collect();
            match next.is_empty() {
                true => _ = buckets.remove(&hash),
                false => *bucket = next.into(),
            }
        }
        if buckets.is_empty() {
            self.classes.swap_remove(i);
        }
    }
}

/// The override stored as `text` under `id` (the registry's id wins over the text's).
fn parse(id: &str, text: &str) -> Result<Override, serde_json::Error> {
    serde_json::from_str(text).map(|o| Override { id: id.to_string(), ..o })
}

/// An override and the text it is stored as.
type Stored = (Arc<Override>, Arc<str>);

/// Every override, as one instance holds them. Cheap to copy (its maps are [`Sharded`]:
/// a copy shares every part, a change copies the part it writes), so a change makes a new
/// set from the last one in about the same time whatever the number of overrides.
#[derive(Debug, Default, Clone)]
pub(crate) struct OverrideSet {
    /// Each override and the text it is stored as (what an expiry removes, only if
    /// unchanged).
    by_id: Sharded<Arc<str>, Stored>,
    domains: HashMap<Arc<str>, DomainOverrides>,
    /// The earliest `expires_at_ms` of the set: before it, nothing has lapsed.
    next_expiry: Option<Millis>,
    /// Whether an override of that expiry was removed since it was computed.
    expiry_stale: bool,
}

impl OverrideSet {
    #[cfg(test)]
    fn new<O: Into<Arc<Override>>, T: Into<Arc<str>>>(stored: impl IntoIterator<Item = (O, T)>) -> Self {
        let mut set = Self::default();
        for (o, text) in stored {
            set.insert((o.into(), text.into()));
        }
        set
    }

    /// Adds an override, replacing the one of the same id.
    fn insert(&mut self, (o, text): Stored) {
        self.remove(&o.id);
        self.domains.entry(o.domain.as_str().into()).or_default().insert(&o);
        self.next_expiry = self.next_expiry.into_iter().chain(o.expires_at_ms).min();
        self.by_id.insert(o.id.as_str().into(), (o, text));
    }

    /// Removes the override `id`, if held.
    fn remove(&mut self, id: &str) {
        let Some((o, _)) = self.by_id.remove(id) else { return };
        if let Some(d) = self.domains.get_mut(o.domain.as_str()) {
            d.remove(&o);
            if d.classes.is_empty() {
                self.domains.remove(o.domain.as_str());
            }
        }
        // recomputed once after a batch of changes (`settle`), not once per removal: a
        // set of many overrides of one expiry changed one by one would be quadratic
        self.expiry_stale |= o.expires_at_ms.is_some() && o.expires_at_ms == self.next_expiry;
    }

    /// Makes `next_expiry` exact again after removals (until then it is early: harmless,
    /// [`Overrides::expire`] only looks once more).
    fn settle(&mut self) {
        if std::mem::take(&mut self.expiry_stale) {
            self.next_expiry = self.by_id.values().filter_map(|(o, _)| o.expires_at_ms).min();
        }
    }

    /// The overrides of `domain`, if it has any.
    pub(crate) fn domain(&self, domain: &str) -> Option<&DomainOverrides> {
        if self.domains.is_empty() {
            return None;
        }
        self.domains.get(domain)
    }
}

/// Why an override was not stored.
#[derive(Debug, thiserror::Error)]
pub enum OverrideError {
    /// The override is malformed: the message says what to change.
    #[error("{0}")]
    Invalid(String),
    /// It does not fit the rules in force.
    #[error(transparent)]
    Misfit(#[from] Misfit),
    /// The store keeps no overrides (Memcached): the message says what to use.
    #[error("{0}")]
    Unsupported(String),
    /// Storing it would take the registry past `limiter.max_overrides`.
    #[error(
        "the registry holds {held} overrides and storing these would pass `limiter.max_overrides` ({max}); remove overrides no longer needed (DELETE /v1/overrides/ID) or raise limiter.max_overrides"
    )]
    Full { held: u64, max: u64 },
    /// Overrides of an import that are refused, each with what to change: none was stored.
    #[error("{} of the overrides are refused and none was stored; the first: {}", .0.len(), .0.first().map(ToString::to_string).unwrap_or_default())]
    Rejected(Vec<Rejected>),
    /// An import stopped part way: the first `stored` of `total` were stored.
    #[error(
        "{stored} of {total} overrides were stored, then: {error} (storing the same ones again is safe: each id is replaced)"
    )]
    Incomplete { stored: usize, total: usize, error: Box<OverrideError> },
    /// The store did not answer.
    #[error(transparent)]
    Store(StoreError),
}

/// Why an override does not fit the rules in force (`Limiter::set_override` checks it).
#[derive(Debug, thiserror::Error)]
pub enum Misfit {
    #[error("unknown domain '{domain}'; the config has: {known}")]
    UnknownDomain { domain: String, known: String },
    /// Its entries are not what a request may name.
    #[error(transparent)]
    Bounds(#[from] crate::request::RequestError),
    #[error("these entries reach no limit of domain '{0}': an override replaces a configured limit")]
    NoLimit(String),
    #[error("policy '{policy}' is not a limit of the rule these entries reach (its limits: {limits})")]
    NoPolicy { policy: String, limits: String },
    /// `window` or `rate` set for limits of another algorithm.
    #[error("`{field}` applies to {algorithm} limits, and none of these is one: {limits}")]
    Inapplicable { field: &'static str, algorithm: &'static str, limits: String },
    #[error("policy '{policy}': {source}")]
    BadLimit { policy: String, source: crate::algo::LimitError },
}

/// One override of an import that is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("overrides[{index}] (id '{id}'): {message}")]
pub struct Rejected {
    /// Its place in the import, from 0.
    pub index: usize,
    pub id: String,
    /// What is wrong, and what to change.
    pub message: String,
}

impl From<StoreError> for OverrideError {
    fn from(e: StoreError) -> Self {
        OverrideError::Store(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(id: &str, entries: &[(&str, &str)], policy: Option<&str>, limit: u64) -> (Override, String) {
        let entries = entries.iter().map(|(k, v)| Entry { key: k.to_string(), value: v.to_string() }).collect();
        let o = Override {
            id: id.into(),
            domain: "api".into(),
            entries,
            limit,
            policy: policy.map(Into::into),
            window: None,
            rate: None,
            expires_at_ms: None,
            reason: String::new(),
            set_at_ms: 1,
            set_by: String::new(),
            all_clients: false,
        };
        let text = serde_json::to_string(&o).unwrap();
        (o, text)
    }

    fn winner(set: &OverrideSet, entries: &[(&str, &str)], policy: &str) -> Option<String> {
        set.domain("api")?.find(entries, policy, 10).map(|o| o.id.clone())
    }

    #[test]
    fn exact_beats_longer_prefix_beats_shorter_and_a_named_policy_beats_all() {
        let set = OverrideSet::new(vec![
            o("acme-all", &[("user", "acme*")], None, 10),
            o("acme-corp", &[("user", "acme-corp*")], None, 20),
            o("acme-corp-minute", &[("user", "acme-corp*")], Some("minute"), 30),
            o("alice", &[("user", "acme-corp-alice")], None, 40),
        ]);
        assert_eq!(winner(&set, &[("user", "acme-corp-alice")], "minute").as_deref(), Some("alice"));
        assert_eq!(winner(&set, &[("user", "acme-corp-bob")], "minute").as_deref(), Some("acme-corp-minute"));
        assert_eq!(winner(&set, &[("user", "acme-corp-bob")], "hour").as_deref(), Some("acme-corp"));
        assert_eq!(winner(&set, &[("user", "acme-x")], "hour").as_deref(), Some("acme-all"));
        assert_eq!(winner(&set, &[("user", "other")], "hour"), None);
        // entries must have the same keys, in order, and as many
        assert_eq!(winner(&set, &[("user", "acme-x"), ("route", "/")], "hour"), None);
        assert_eq!(winner(&set, &[("team", "acme-x")], "hour"), None);
        assert!(set.domain("other").is_none());
    }

    #[test]
    fn changed_in_place_it_finds_what_a_set_read_anew_finds() {
        let all = [
            o("acme-all", &[("user", "acme*")], None, 10),
            o("acme-corp", &[("user", "acme-corp*")], None, 20),
            o("alice", &[("user", "acme-corp-alice")], None, 40),
            o("any", &[("user", "*")], None, 50),
            o("two", &[("user", "acme*"), ("route", "/a")], None, 60),
        ];
        let mut set = OverrideSet::default();
        for (x, text) in all.iter().cloned() {
            set.insert((Arc::new(x), text.into()));
        }
        set.remove("acme-corp");
        set.insert((Arc::new(o("alice", &[("user", "acme-corp-alice")], None, 41).0), "".into()));
        let fresh = OverrideSet::new(all.iter().filter(|(x, _)| x.id != "acme-corp").cloned());
        for entries in [
            &[("user", "acme-corp-alice")][..],
            &[("user", "acme-corp-bob")],
            &[("user", "ac")],
            &[("user", "")],
            &[("user", "acme-x"), ("route", "/a")],
            &[("user", "acme-x"), ("route", "/b")],
        ] {
            assert_eq!(winner(&set, entries, "p"), winner(&fresh, entries, "p"), "{entries:?}");
        }
        assert_eq!(set.domain("api").unwrap().find(&[("user", "acme-corp-alice")], "p", 0).unwrap().limit, 41);
        assert_eq!(winner(&set, &[("user", "acme-corp-bob")], "p").as_deref(), Some("acme-all"));
        assert_eq!(winner(&set, &[("user", "zed")], "p").as_deref(), Some("any"), "a bare * matches every value");
        set.remove("any");
        set.remove("acme-all");
        set.remove("alice");
        set.remove("two");
        assert!(set.domain("api").is_none() && set.by_id.is_empty(), "{set:?}");
    }

    #[test]
    fn a_lapsed_override_is_not_applied() {
        let (mut lapsing, _) = o("soon", &[("user", "a")], None, 5);
        lapsing.expires_at_ms = Some(10);
        let text = serde_json::to_string(&lapsing).unwrap();
        let set = OverrideSet::new(vec![(lapsing, text), o("prefix", &[("user", "a*")], None, 7)]);
        let d = set.domain("api").unwrap();
        assert_eq!(d.find(&[("user", "a")], "p", 9).unwrap().id, "soon");
        assert_eq!(d.find(&[("user", "a")], "p", 10).unwrap().id, "prefix");
    }

    #[test]
    fn only_what_fits_the_algorithm_changes() {
        let (mut x, _) = o("x", &[("user", "a")], None, 50);
        x.window = Some(Duration(1000));
        x.rate = Some(3);
        let fixed = Limit::FixedWindow { limit: 5, window: 60_000, aligned: true };
        assert_eq!(x.limit_for(fixed), Limit::FixedWindow { limit: 50, window: 1000, aligned: true });
        let bucket = Limit::TokenBucket { rate: 1, per: 1000, burst: 5 };
        assert_eq!(x.limit_for(bucket), Limit::TokenBucket { rate: 3, per: 1000, burst: 50 });
        let sliding = Limit::SlidingWindow { limit: 5, window: 60_000 };
        assert_eq!(x.limit_for(sliding), Limit::SlidingWindow { limit: 50, window: 60_000 });
    }

    #[test]
    fn bad_overrides_say_what_to_change() {
        let (mut x, _) = o("x", &[("user", "a")], None, MAX_EXACT + 1);
        assert!(x.check(0).unwrap_err().contains("2^53"));
        x.limit = 5;
        x.id = "has space".into();
        assert!(x.check(0).unwrap_err().contains("override id"));
        x.id = "ok".into();
        x.expires_at_ms = Some(5);
        assert!(x.check(5).unwrap_err().contains("expires_at_ms"));
        x.expires_at_ms = None;
        x.window = Some(Duration(999));
        assert!(x.check(0).unwrap_err().contains("shorter than 1s"));
        x.window = Some(MIN_WINDOW);
        assert_eq!(x.check(0), Ok(()));
        x.entries[0].value = "*".into();
        assert!(x.check(0).unwrap_err().contains("all_clients"), "a bare * must be meant");
        x.all_clients = true;
        assert_eq!(x.check(0), Ok(()));
        x.entries[0].value = "a*".into();
        assert!(x.check(0).unwrap_err().contains("exactly"), "all_clients on a prefix says nothing");
        x.entries.clear();
        assert!(x.check(0).unwrap_err().contains("entries"));
    }
}
