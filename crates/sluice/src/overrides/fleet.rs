//! [`Overrides`]: the fleet's overrides as one instance holds them, kept current from the
//! store's registry, and the way to change them.
//!
//! Reading: at start the whole set, in pages ([`PAGE`] entries a call, each a short call
//! with its own deadline, never a decision's), then only the changes since the version
//! held ([`RegistryOp::Changes`]). The set in force is swapped only when a read is
//! complete, so a slow or failing read leaves the last set in force, and a decision never
//! waits for one. Writing: one call for one override, one call per [`PAGE`] for an
//! import, each followed by the read of the changes since (so concurrent writers share
//! one read, and none costs a read of the whole set).

use super::{Override, OverrideError, OverrideSet, Stored, parse};
use crate::store::{RegistryOp, Store, StoreError};
use crate::time::{Clock, Millis};
use arc_swap::ArcSwap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Entries a registry call reads or writes at most: a call of a few hundred takes Redis
/// well under a millisecond, so readers and importers never hold it for long.
pub const PAGE: u32 = 500;

/// The fleet's overrides as this instance holds them, and the way to change them.
pub struct Overrides {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    set: ArcSwap<OverrideSet>,
    /// The registry version the set was read at.
    version: AtomicU64,
    /// The registry's count of unlogged moves when the whole set was last read.
    unlogged: AtomicU64,
    /// Whether the whole set has been read once (until then `/readyz` says not ready).
    loaded: AtomicBool,
    /// When the set was last found current, in ms since the epoch (0: never).
    refreshed_at: AtomicU64,
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
            unlogged: AtomicU64::new(0),
            loaded: AtomicBool::new(false),
            refreshed_at: AtomicU64::new(0),
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

    /// Whether the set in force is the store's whole set as read at least once (always
    /// so for a store that keeps none). Until then an instance applies no overrides:
    /// what `/readyz` reports.
    pub fn loaded(&self) -> bool {
        !self.store.keeps_registry() || self.loaded.load(Ordering::Acquire)
    }

    /// When the set was last found current (ms since the epoch; 0: never).
    pub fn refreshed_at(&self) -> Millis {
        self.refreshed_at.load(Ordering::Acquire)
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

    /// Brings the set up to the store's: reads the version and, when it moved, the
    /// changes since the version held (the whole set, in pages, the first time or when
    /// the store has forgotten removals this instance missed). Returns whether it moved.
    pub async fn refresh(&self) -> Result<bool, StoreError> {
        self.refresh_past(None).await
    }

    /// [`Overrides::refresh`], or nothing when the set held is already at version
    /// `past` or later (another refresh, made while this one waited for its turn, read
    /// it): so writers at once share reads instead of each making its own.
    async fn refresh_past(&self, past: Option<u64>) -> Result<bool, StoreError> {
        let _one = self.refreshing.lock().await;
        let held = self.version.load(Ordering::Acquire);
        let loaded = self.loaded.load(Ordering::Acquire);
        if loaded && past.is_some_and(|v| held >= v) {
            return Ok(false);
        }
        let now = self.store.registry(RegistryOp::Version).await?;
        let (version, unlogged) = (now.version, now.unlogged);
        // a move the log does not hold (an older Sluice wrote): only a whole read sees it
        let logged = unlogged == self.unlogged.load(Ordering::Acquire);
        if loaded && logged && version == held {
            self.refreshed();
            return Ok(false);
        }
        if loaded && logged {
            let mut next = OverrideSet::clone(&self.set.load());
            if let Some(reached) = self.catch_up(&mut next, held).await? {
                self.swap(next, reached);
                return Ok(true);
            }
            tracing::info!(held, "the store forgot removals since the overrides held; reading them all again");
        } else if loaded {
            tracing::info!(
                unlogged,
                "an older Sluice changed the overrides (without the change log); reading them all again"
            );
        }
        let started = tokio::time::Instant::now();
        let (set, reached) = self.read_all(version).await?;
        let count = set.by_id.len();
        self.swap(set, reached);
        self.unlogged.store(unlogged, Ordering::Release);
        self.loaded.store(true, Ordering::Release);
        tracing::info!(count, ms = started.elapsed().as_millis() as u64, "stored overrides loaded");
        Ok(true)
    }

    /// The whole set, in pages, and the version it is current at; `start` is a version
    /// read before the first page: the changes after it settle the entries changed while
    /// the pages were read.
    async fn read_all(&self, start: u64) -> Result<(OverrideSet, u64), StoreError> {
        let mut set = OverrideSet::default();
        let mut cursor = 0;
        loop {
            let page = self.store.registry(RegistryOp::Scan { cursor, count: PAGE }).await?;
            for (id, text) in page.entries {
                add(&mut set, &id, text);
            }
            cursor = page.cursor;
            if cursor == 0 {
                break;
            }
        }
        match self.catch_up(&mut set, start).await? {
            Some(reached) => Ok((set, reached)),
            None => Err(StoreError::protocol(format!(
                "more than {} overrides were removed while they were being read; the next look reads them again",
                crate::store::TOMBSTONES
            ))),
        }
    }

    /// Applies to `set` the changes after version `after`, page by page. The version
    /// reached, or None when the store has forgotten removals after `after`.
    async fn catch_up(&self, set: &mut OverrideSet, mut after: u64) -> Result<Option<u64>, StoreError> {
        loop {
            let page = self.store.registry(RegistryOp::Changes { after, count: PAGE }).await?;
            if page.floor > after {
                return Ok(None);
            }
            let last = page.changes.len() < PAGE as usize;
            for change in page.changes {
                after = change.version;
                match change.value {
                    Some(text) => add(set, &change.id, text),
                    None => set.remove(&change.id),
                }
            }
            if last {
                set.settle();
                return Ok(Some(page.version.max(after)));
            }
        }
    }

    fn swap(&self, set: OverrideSet, version: u64) {
        metrics::gauge!(crate::telemetry::names::OVERRIDES).set(set.by_id.len() as f64);
        self.set.store(Arc::new(set));
        self.version.store(version, Ordering::Release);
        self.refreshed();
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Notes that the set held was found current now (what an alert on a stale set reads).
    fn refreshed(&self) {
        let now = self.clock.now();
        metrics::gauge!(crate::telemetry::names::OVERRIDES_REFRESHED).set(now as f64 / 1000.0);
        self.refreshed_at.store(now, Ordering::Release);
    }

    /// Stores `o` under its id (replacing the override of that id), as it is: no rule is
    /// consulted (see [`crate::Limiter::set_override`], which checks it against the rules).
    /// Refused when a new id would take the registry past `max` overrides. In force here
    /// at once, on every watching instance within [`super::PROPAGATION`]. Returns the
    /// override it replaced.
    pub async fn put(&self, o: &Override, max: u64) -> Result<Option<Override>, OverrideError> {
        let value = serde_json::to_string(o).map_err(|e| OverrideError::Invalid(e.to_string()))?;
        let reply = self.write(RegistryOp::Put { entries: vec![(o.id.clone(), value)], max }).await?;
        if let Some(held) = reply.full {
            return Err(OverrideError::Full { held, max });
        }
        Ok(reply.previous.and_then(|p| parse(&o.id, &p).ok()))
    }

    /// Stores every override of `all` ([`PAGE`] to a store call), each as [`Overrides::put`]
    /// would; refused before anything is stored when the new ids would take the set held
    /// past `max`. A failure part way says how many were stored (storing the same ones
    /// again is harmless: each id is replaced). Returns how many were stored.
    pub async fn put_all(&self, all: &[Override], max: u64) -> Result<usize, OverrideError> {
        self.supported()?;
        let new = {
            let set = self.set.load();
            all.iter().filter(|o| !set.by_id.contains_key(o.id.as_str())).count() as u64
        };
        let held = self.len() as u64;
        if held + new > max {
            return Err(OverrideError::Full { held, max });
        }
        let (mut stored, mut reached) = (0, 0);
        for chunk in all.chunks(PAGE as usize) {
            let entries = chunk
                .iter()
                .map(|o| serde_json::to_string(o).map(|v| (o.id.clone(), v)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| OverrideError::Invalid(e.to_string()))?;
            let failed = match self.store.registry(RegistryOp::Put { entries, max }).await {
                Ok(reply) => {
                    reached = reply.version;
                    reply.full.map(|held| OverrideError::Full { held, max })
                }
                Err(e) => Some(OverrideError::Store(e)),
            };
            if let Some(error) = failed {
                self.settle_here(reached).await;
                return Err(OverrideError::Incomplete { stored, total: all.len(), error: Box::new(error) });
            }
            stored += chunk.len();
        }
        self.settle_here(reached).await;
        Ok(stored)
    }

    /// Removes the override `id`. Returns it, or None when there was none.
    pub async fn remove(&self, id: &str) -> Result<Option<Override>, OverrideError> {
        let reply = self.write(RegistryOp::Remove { id: id.to_string(), only_if: None }).await?;
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

    /// Runs `op`, then puts what changed in force here.
    async fn write(&self, op: RegistryOp) -> Result<crate::store::RegistryReply, OverrideError> {
        self.supported()?;
        let reply = self.store.registry(op).await?;
        self.settle_here(reply.version).await;
        Ok(reply)
    }

    /// Reads the changes up to version `past` (with any made since by others: writers at
    /// once share one read); a failed read is retried by the watcher.
    async fn settle_here(&self, past: u64) {
        if let Err(e) = self.refresh_past(Some(past)).await {
            tracing::warn!(error = %e, "an override was stored but could not be read back yet");
        }
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

    /// Keeps this instance's set current: every `every` ([`super::REFRESH`] is what
    /// [`super::PROPAGATION`] assumes), reads the version and, when it moved, what
    /// changed; removes lapsed overrides. Runs on the current tokio runtime until `self`
    /// is dropped; a store that cannot be read keeps the last set read in force (logged
    /// once).
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

/// Adds the override stored as `text` under `id` to `set`; one that cannot be read is
/// logged and left out (an instance of a newer version may have written it).
fn add(set: &mut OverrideSet, id: &str, text: String) {
    match parse(id, &text) {
        Ok(o) => set.insert((Arc::new(o), Arc::from(text))),
        Err(e) => {
            set.remove(id);
            tracing::warn!(id = %id, error = %e, "a stored override cannot be read; it is not applied");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use crate::time::ManualClock;

    fn put(id: &str, user: &str) -> RegistryOp {
        let value = format!(r#"{{"domain":"api","entries":[{{"key":"user","value":"{user}"}}],"limit":5}}"#);
        RegistryOp::Put { entries: vec![(id.into(), value)], max: u64::MAX }
    }

    /// An instance that missed more removals than the store remembers reads the whole set
    /// again, and ends with what the store holds; one a change behind reads that change.
    #[tokio::test]
    async fn an_instance_behind_forgotten_removals_reads_the_whole_set_again() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new(1_000));
        let (me, other) = (Overrides::new(store.clone(), Arc::new(ManualClock::new(1))), store);
        assert!(!me.loaded(), "not loaded before the first read");
        other.registry(put("kept", "a")).await.unwrap();
        assert!(me.refresh().await.unwrap() && me.loaded() && me.get("kept").is_some());
        other.registry(put("new", "b")).await.unwrap();
        for i in 0..crate::store::TOMBSTONES + 1 {
            other.registry(put(&format!("x{i}"), "c")).await.unwrap();
            other.registry(RegistryOp::Remove { id: format!("x{i}"), only_if: None }).await.unwrap();
        }
        other.registry(RegistryOp::Remove { id: "kept".into(), only_if: None }).await.unwrap();
        assert!(me.refresh().await.unwrap());
        let ids: Vec<String> = me.list(None).iter().map(|o| o.id.clone()).collect();
        assert_eq!(ids, ["new"]);
        other.registry(put("last", "d")).await.unwrap();
        assert!(me.refresh().await.unwrap() && me.get("last").is_some() && me.len() == 2);
        assert!(!me.refresh().await.unwrap(), "nothing moved");
    }
}
