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
use crate::store::{RegistryOp, RegistryReply, Store, StoreError};
use crate::time::{Clock, Millis};
use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::hash::Hasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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
}

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
    classes: Vec<(Shape, HashMap<u64, Bucket>)>,
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
                self.classes.push((shape, HashMap::new()));
                self.classes.len() - 1
            }
        };
        let bucket = self.classes[i].1.entry(hash).or_insert_with(|| Arc::from(Vec::new()));
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

/// Every override, as one instance holds them. Cheap to copy (every part is shared), so
/// a change makes a new set from the last one in time proportional to the number of
/// overrides with a small constant, not by indexing them all again.
#[derive(Debug, Default, Clone)]
pub(crate) struct OverrideSet {
    /// Each override and the text it is stored as (what an expiry removes, only if
    /// unchanged).
    by_id: HashMap<Arc<str>, Stored>,
    domains: HashMap<Arc<str>, DomainOverrides>,
    /// The earliest `expires_at_ms` of the set: before it, nothing has lapsed.
    next_expiry: Option<Millis>,
}

impl OverrideSet {
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
        if o.expires_at_ms.is_some() && o.expires_at_ms == self.next_expiry {
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
    /// The override is malformed or fits no rule: the message says what to change.
    #[error("{0}")]
    Invalid(String),
    /// The store keeps no overrides (Memcached): the message says what to use.
    #[error("{0}")]
    Unsupported(String),
    /// The store did not answer.
    #[error(transparent)]
    Store(StoreError),
}

impl From<StoreError> for OverrideError {
    fn from(e: StoreError) -> Self {
        OverrideError::Store(e)
    }
}

/// The fleet's overrides as this instance holds them, and the way to change them.
pub struct Overrides {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    set: ArcSwap<OverrideSet>,
    /// The registry version the set was read at.
    version: AtomicU64,
    /// Moves whenever the set is read anew (an override changed, or a client was reset,
    /// anywhere): what tells the near-cache its refusals may be stale.
    generation: AtomicU64,
    /// One refresh at a time, so an older read never replaces a newer one.
    refreshing: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Overrides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overrides").field("version", &self.version).field("len", &self.len()).finish()
    }
}

impl Overrides {
    /// The overrides kept in `store`'s registry; empty until [`Overrides::refresh`].
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Arc<Self> {
        Arc::new(Self {
            store,
            clock,
            set: ArcSwap::from_pointee(OverrideSet::default()),
            version: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            refreshing: tokio::sync::Mutex::new(()),
        })
    }

    pub(crate) fn current(&self) -> arc_swap::Guard<Arc<OverrideSet>> {
        self.set.load()
    }

    /// Moves whenever what this instance knows may have changed under its near-cache.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Whether the store keeps overrides (the memory and Redis stores do, Memcached not);
    /// the error says what to use instead.
    pub fn supported(&self) -> Result<(), OverrideError> {
        match self.store.keeps_registry() {
            true => Ok(()),
            false => Err(OverrideError::Unsupported(crate::store::no_registry_reason(self.store.kind()))),
        }
    }

    /// How many overrides are held.
    pub fn len(&self) -> usize {
        self.set.load().by_id.len()
    }

    /// Whether none are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The overrides held, by id; of one domain when `domain` is given.
    pub fn list(&self, domain: Option<&str>) -> Vec<Arc<Override>> {
        let set = self.set.load();
        let mut found: Vec<_> =
            set.by_id.values().map(|(o, _)| o.clone()).filter(|o| domain.is_none_or(|d| o.domain == d)).collect();
        found.sort_by(|a, b| a.id.cmp(&b.id));
        found
    }

    /// The override `id`, if held.
    pub fn get(&self, id: &str) -> Option<Arc<Override>> {
        self.set.load().by_id.get(id).map(|(o, _)| o.clone())
    }

    /// Reads the registry's version, and the whole set when it moved. Returns whether it
    /// had moved.
    pub async fn refresh(&self) -> Result<bool, StoreError> {
        let _one = self.refreshing.lock().await;
        let version = self.store.registry(RegistryOp::Version).await?.version;
        if version == self.version.load(Ordering::Acquire) {
            return Ok(false);
        }
        let read = self.store.registry(RegistryOp::Read).await?;
        self.install(read);
        Ok(true)
    }

    fn install(&self, read: RegistryReply) {
        let mut stored = Vec::with_capacity(read.entries.len());
        for (id, text) in read.entries {
            match parse(&id, &text) {
                Ok(o) => stored.push((o, text)),
                Err(e) => tracing::warn!(id = %id, error = %e, "a stored override cannot be read; it is not applied"),
            }
        }
        self.swap(OverrideSet::new(stored), read.version);
    }

    fn swap(&self, set: OverrideSet, version: u64) {
        metrics::gauge!(crate::telemetry::names::OVERRIDES).set(set.by_id.len() as f64);
        self.set.store(Arc::new(set));
        self.version.store(version, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Stores `o` under its id (replacing the override of that id), as it is: no rule is
    /// consulted (see [`crate::Limiter::set_override`], which checks it against the rules).
    /// In force here at once, on every watching instance within [`PROPAGATION`].
    /// Returns the override it replaced.
    pub async fn put(&self, o: &Override) -> Result<Option<Override>, OverrideError> {
        let value = serde_json::to_string(o).map_err(|e| OverrideError::Invalid(e.to_string()))?;
        let added = (Arc::new(o.clone()), Arc::from(value.as_str()));
        let reply = self.write(RegistryOp::Put { id: o.id.clone(), value }, &o.id, Some(added)).await?;
        Ok(reply.previous.and_then(|p| parse(&o.id, &p).ok()))
    }

    /// Removes the override `id`. Returns it, or None when there was none.
    pub async fn remove(&self, id: &str) -> Result<Option<Override>, OverrideError> {
        let reply = self.write(RegistryOp::Remove { id: id.to_string(), only_if: None }, id, None).await?;
        Ok(reply.previous.and_then(|p| parse(id, &p).ok()))
    }

    /// Tells every other instance that state changed under their near-caches (a reset;
    /// this instance's caller drops what it reset from its own).
    pub(crate) async fn touch(&self) -> Result<(), StoreError> {
        if self.store.keeps_registry() {
            self.store.registry(RegistryOp::Touch).await?;
        }
        Ok(())
    }

    /// Runs `op`, which puts `added` under `id` or removes `id`, and puts the result in
    /// force here: applied to the set held when no other change came between (so loading
    /// many overrides costs no read of the whole set per change), else read anew.
    async fn write(&self, op: RegistryOp, id: &str, added: Option<Stored>) -> Result<RegistryReply, OverrideError> {
        self.supported()?;
        let reply = self.store.registry(op).await?;
        {
            let _one = self.refreshing.lock().await;
            if reply.version == self.version.load(Ordering::Acquire) + 1 {
                let mut next = OverrideSet::clone(&self.set.load());
                match added {
                    Some(added) => next.insert(added),
                    None => next.remove(id),
                }
                self.swap(next, reply.version);
                return Ok(reply);
            }
        }
        // in force here now; a failed read is retried by the watcher
        if let Err(e) = self.refresh().await {
            tracing::warn!(error = %e, "an override was stored but could not be read back yet");
        }
        Ok(reply)
    }

    /// Removes the overrides that have lapsed, each by one instance of the fleet (the one
    /// whose conditional remove finds it unchanged), which writes the audit line.
    pub async fn expire(&self) -> Result<(), StoreError> {
        let now = self.clock.now();
        let set = self.set.load();
        if set.next_expiry.is_none_or(|t| now < t) {
            return Ok(());
        }
        let lapsed: Vec<Stored> = set.by_id.values().filter(|(o, _)| o.expired(now)).cloned().collect();
        drop(set);
        for (o, text) in lapsed {
            let only_if = Some(text.to_string());
            let removed = self.store.registry(RegistryOp::Remove { id: o.id.clone(), only_if }).await?;
            if removed.previous.is_some() {
                crate::telemetry::audit(&crate::telemetry::Audit {
                    action: "override_expired",
                    resource: &o.id,
                    old: serde_json::to_string(&*o).ok().as_deref(),
                    new: None,
                    reason: &o.reason,
                    by: "expiry",
                });
            }
        }
        Ok(())
    }

    /// Keeps this instance's set current: every `every` ([`REFRESH`] is what
    /// [`PROPAGATION`] assumes), reads the version and, when it moved, the set; removes
    /// lapsed overrides. Runs on the current tokio runtime until `self` is dropped; a
    /// store that cannot be read keeps the last set read in force (logged once).
    pub fn watch(self: &Arc<Self>, every: std::time::Duration) {
        if !self.store.keeps_registry() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing = false;
            loop {
                tick.tick().await;
                let Some(me) = me.upgrade() else { return };
                let result = match me.refresh().await {
                    Ok(_) => me.expire().await,
                    Err(e) => Err(e),
                };
                match result {
                    Err(e) if !failing => {
                        tracing::warn!(error = %e, "cannot read the stored overrides; the last ones read stay in force");
                        failing = true;
                    }
                    Ok(()) if failing => {
                        tracing::info!("the stored overrides can be read again");
                        failing = false;
                    }
                    _ => {}
                }
            }
        });
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
        x.entries.clear();
        assert!(x.check(0).unwrap_err().contains("entries"));
    }
}
