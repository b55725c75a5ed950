//! The registry a store keeps for the whole fleet: values under ids (the stored overrides
//! of [`crate::overrides`]), a version that every change moves, and a change log that
//! says which ids changed after a version.
//!
//! Why a log: an instance that holds the set at version v reads only the ids changed
//! since (each id is in the log once, at the version of its last change), so a change
//! costs every instance a read of that change, not of the whole set. Why pages: a set
//! of 200,000 is tens of megabytes; read in one call it blocks a Redis for a quarter of
//! a second and misses every deadline. Every read here is one short call of at most
//! `count` entries, and the caller loops.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

/// Removed ids the change log remembers (so an instance behind learns of a removal)
/// before it forgets the oldest. An instance further behind than the forgotten ones
/// (the reply's `floor`) reads the whole set again.
pub const TOMBSTONES: usize = 10_000;

/// A read of, or a change to, the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistryOp {
    /// The version (and the moves made without logging): what every instance polls.
    Version,
    /// One page of the whole set: the entries from `cursor` (0 starts), about `count` of
    /// them (a hint, as Redis's HSCAN takes it); the reply's `cursor` is where the next
    /// page starts, 0 when the set is done. An entry changed while the pages are read
    /// may be missed or seen twice: read the changes after the version read before the
    /// first page to settle it.
    Scan { cursor: u64, count: u32 },
    /// The ids changed after version `after`, oldest change first, at most `count`.
    Changes { after: u64, count: u32 },
    /// Sets each id to its value, all or nothing: refused (the reply's `full`) when the
    /// ids not yet held would take the registry past `max` entries.
    Put { entries: Vec<(String, String)>, max: u64 },
    /// Removes `id`; with `only_if`, only while its value is still exactly that (so of
    /// several instances expiring one entry, one removes it).
    Remove { id: String, only_if: Option<String> },
    /// Moves the version without changing an entry: tells every instance that state
    /// changed under it (a client was reset).
    Touch,
}

/// One id of [`RegistryOp::Changes`]: the version of its last change and its value
/// now (None: removed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub id: String,
    pub version: u64,
    pub value: Option<String>,
}

/// What a [`RegistryOp`] answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistryReply {
    /// The version after the op.
    pub version: u64,
    /// The value the id had before a remove or a put of one entry (None: it had none,
    /// and a remove removed nothing).
    pub previous: Option<String>,
    /// A scan's page of entries.
    pub entries: Vec<(String, String)>,
    /// A scan's next cursor: 0 when the set is done.
    pub cursor: u64,
    /// The changes read, oldest first: fewer than asked means none are left.
    pub changes: Vec<Change>,
    /// The log has forgotten removals at or below this version: a reader whose version
    /// is below it must read the whole set again.
    pub floor: u64,
    /// A put refused because the registry is full: the number of entries it holds.
    pub full: Option<u64>,
    /// With the version: how many times it moved without a change logged (a writer older
    /// than the change log, on the same Redis during a rollout). When it moves, a reader
    /// must read the whole set again.
    pub unlogged: u64,
}

/// The registry held in process memory (the memory store's, and a model for the others).
#[derive(Debug, Default)]
pub(crate) struct LocalRegistry(std::sync::Mutex<Local>);

#[derive(Debug, Default)]
pub(crate) struct Local {
    version: u64,
    entries: BTreeMap<String, String>,
    /// Each id's last change (held or removed), and the log of them by version.
    last: HashMap<String, u64>,
    log: BTreeMap<u64, String>,
    /// Removed ids, oldest first, until [`TOMBSTONES`] of them.
    gone: VecDeque<String>,
    floor: u64,
}

impl Local {
    /// Moves the version and logs `id` at it.
    fn changed(&mut self, id: &str) {
        self.version += 1;
        if let Some(old) = self.last.insert(id.to_string(), self.version) {
            self.log.remove(&old);
        }
        self.log.insert(self.version, id.to_string());
    }

    /// Forgets the oldest removals past [`TOMBSTONES`] (an id stored again since is held,
    /// and stays in the log).
    fn prune(&mut self) {
        while self.gone.len() > TOMBSTONES {
            let Some(id) = self.gone.pop_front() else { return };
            if !self.entries.contains_key(&id)
                && let Some(v) = self.last.remove(&id)
            {
                self.log.remove(&v);
                self.floor = self.floor.max(v);
            }
        }
    }
}

impl LocalRegistry {
    pub(crate) fn run(&self, op: RegistryOp) -> RegistryReply {
        let mut guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let r = &mut *guard;
        let mut reply = RegistryReply::default();
        match op {
            RegistryOp::Version => {}
            // in process, nothing else waits on a page: the whole set is one
            RegistryOp::Scan { .. } => reply.entries = r.entries.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            RegistryOp::Changes { after, count } => {
                let changed = r.log.range(after + 1..).take(count as usize);
                reply.changes = changed
                    .map(|(v, id)| Change { id: id.clone(), version: *v, value: r.entries.get(id).cloned() })
                    .collect();
                reply.floor = r.floor;
            }
            RegistryOp::Put { entries, max } => {
                let held = r.entries.len() as u64;
                let new: HashSet<&String> =
                    entries.iter().map(|(id, _)| id).filter(|id| !r.entries.contains_key(*id)).collect();
                if held + new.len() as u64 > max {
                    reply.full = Some(held);
                } else {
                    if let [(id, _)] = &entries[..] {
                        reply.previous = r.entries.get(id).cloned();
                    }
                    for (id, value) in entries {
                        r.changed(&id);
                        r.entries.insert(id, value);
                    }
                }
            }
            RegistryOp::Remove { id, only_if } => {
                if r.entries.get(&id).is_some_and(|v| only_if.as_ref().is_none_or(|want| want == v)) {
                    reply.previous = r.entries.remove(&id);
                    r.changed(&id);
                    r.gone.push_back(id);
                    r.prune();
                }
            }
            RegistryOp::Touch => r.version += 1,
        }
        reply.version = r.version;
        reply
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(id: &str) -> RegistryOp {
        RegistryOp::Put { entries: vec![(id.into(), "v".into())], max: u64::MAX }
    }

    #[test]
    fn removals_past_the_tombstones_are_forgotten_and_raise_the_floor() {
        let r = LocalRegistry::default();
        r.run(put("kept"));
        for i in 0..TOMBSTONES + 3 {
            r.run(put(&format!("x{i}")));
            r.run(RegistryOp::Remove { id: format!("x{i}"), only_if: None });
        }
        let all = r.run(RegistryOp::Changes { after: 0, count: u32::MAX });
        assert!(all.floor > 0, "a reader at 0 must read the whole set again");
        assert!(all.changes.iter().any(|c| c.id == "kept" && c.value.is_some()), "a held id is never forgotten");
        assert_eq!(all.changes.iter().filter(|c| c.value.is_none()).count(), TOMBSTONES);
        assert!(all.changes.iter().all(|c| c.id == "kept" || c.version > all.floor));
    }
}
