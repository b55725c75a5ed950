//! Top clients: the descriptors a rule refuses and admits most, in memory fixed by
//! configuration whatever the number of clients (`limiter.top_clients`; read through
//! `GET /v1/admin/top`). Never a metric label: a label per client is a series per client.
//!
//! Each list is a Space-Saving summary (Metwally, Agrawal and El Abbadi, ICDT 2005) of
//! `capacity` counters. A client already held is counted; a new one takes the place of
//! the smallest counter and inherits its count as its possible overcount (`error`). Of N
//! decisions counted, every client seen more than N / capacity times is held, and a held
//! client's count is at most its true count plus its error, itself at most N / capacity.
//! Two summaries make a sliding interval: the current one and the one before it; a
//! query adds them up.

use crate::time::Millis;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

/// The longest a client's text may be in a list (its entries, `key=value, ...`); the
/// client is counted by a hash of all of it.
pub const MAX_CLIENT_BYTES: usize = 256;

/// One Space-Saving summary: at most `capacity` clients, each under the 64-bit hash of
/// its entries.
pub struct SpaceSaving {
    capacity: usize,
    index: HashMap<u64, u32, BuildHasherDefault<Identity>>,
    slots: Vec<Slot>,
    /// Slot ids, a min-heap by count: the smallest counter is `heap[0]`.
    heap: Vec<u32>,
    total: u64,
}

struct Slot {
    hash: u64,
    count: u64,
    error: u64,
    /// Where the slot is in `heap`.
    at: u32,
    /// Rewritten in place when another client takes the slot: a long tail of clients
    /// replaces a slot at most decisions, and must not allocate for it.
    client: String,
}

impl SpaceSaving {
    /// An empty summary of `capacity` counters (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self { capacity, index: HashMap::default(), slots: Vec::new(), heap: Vec::new(), total: 0 }
    }

    /// Counts one decision of the client whose entries hash to `hash`; `client` writes
    /// its text (into an empty string), asked only when the client is not held yet.
    pub fn add(&mut self, hash: u64, client: impl FnOnce(&mut String)) {
        self.total += 1;
        if let Some(&id) = self.index.get(&hash) {
            let slot = &mut self.slots[id as usize];
            slot.count += 1;
            let at = slot.at as usize;
            self.sift_down(at);
        } else if self.slots.len() < self.capacity {
            let id = self.slots.len() as u32;
            let at = self.heap.len();
            let mut text = String::new();
            client(&mut text);
            self.slots.push(Slot { hash, count: 1, error: 0, at: at as u32, client: text });
            self.heap.push(id);
            self.index.insert(hash, id);
            self.sift_up(at);
        } else {
            let id = self.heap[0];
            let slot = &mut self.slots[id as usize];
            self.index.remove(&slot.hash);
            (slot.hash, slot.error) = (hash, slot.count);
            slot.count += 1;
            slot.client.clear();
            client(&mut slot.client);
            self.index.insert(hash, id);
            self.sift_down(0);
        }
    }

    /// Decisions counted.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The clients held: (hash, text, count, error).
    pub fn clients(&self) -> impl Iterator<Item = (u64, &str, u64, u64)> {
        self.slots.iter().map(|s| (s.hash, &*s.client, s.count, s.error))
    }

    fn count_at(&self, at: usize) -> u64 {
        self.slots[self.heap[at] as usize].count
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        self.slots[self.heap[a] as usize].at = a as u32;
        self.slots[self.heap[b] as usize].at = b as u32;
    }

    fn sift_up(&mut self, mut at: usize) {
        while at > 0 && self.count_at((at - 1) / 2) > self.count_at(at) {
            self.swap(at, (at - 1) / 2);
            at = (at - 1) / 2;
        }
    }

    fn sift_down(&mut self, mut at: usize) {
        loop {
            let (l, r) = (2 * at + 1, 2 * at + 2);
            let mut least = at;
            for child in [l, r] {
                if child < self.heap.len() && self.count_at(child) < self.count_at(least) {
                    least = child;
                }
            }
            if least == at {
                return;
            }
            self.swap(at, least);
            at = least;
        }
    }
}

/// The keys are already hashes.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// One rule's top list, as [`crate::Limiter::top_clients`] answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleTop {
    pub rule: String,
    /// Decisions counted over the list's interval.
    pub decisions: u64,
    /// Counters a list: a count overstates by at most `decisions / capacity`.
    pub capacity: usize,
    pub clients: Vec<TopClient>,
}

/// Why there is no top list to show.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopError {
    #[error("unknown domain '{domain}'; configured domains: {known}")]
    UnknownDomain { domain: String, known: String },
    #[error("no rule '{rule}' in this domain; its rules: {known}")]
    UnknownRule { rule: String, known: String },
    #[error("the top lists are off (limiter.top_clients.capacity: 0)")]
    Off,
}

/// One client of a top list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopClient {
    /// Its entries, `key=value` joined by `, ` (at most [`MAX_CLIENT_BYTES`]).
    pub client: String,
    /// Decisions counted for it: at least its true count, at most `error` more.
    pub count: u64,
    /// How much `count` may overstate.
    pub error: u64,
}

/// A top list over a sliding interval: the summary of the interval running and of the
/// one before it.
pub struct Recent {
    capacity: usize,
    interval: Millis,
    /// When the current summary's interval began.
    started: Millis,
    current: SpaceSaving,
    previous: SpaceSaving,
}

impl Recent {
    /// Empty, `capacity` counters a summary, intervals of `interval` ms from `now`.
    pub fn new(capacity: usize, interval: Millis, now: Millis) -> Self {
        let interval = interval.max(1);
        let empty = || SpaceSaving::new(capacity);
        Self { capacity, interval, started: now, current: empty(), previous: empty() }
    }

    /// Counts one decision of a client at `now`.
    pub fn add(&mut self, now: Millis, hash: u64, client: impl FnOnce(&mut String)) {
        let elapsed = now.saturating_sub(self.started);
        if elapsed >= self.interval {
            let fresh = SpaceSaving::new(self.capacity);
            let ended = std::mem::replace(&mut self.current, fresh);
            // the interval just ended is the one before, unless a whole one passed idle
            self.previous = if elapsed < 2 * self.interval { ended } else { SpaceSaving::new(self.capacity) };
            self.started = now - elapsed % self.interval;
        }
        self.current.add(hash, client);
    }

    /// The summaries that cover the last one to two intervals before `now`.
    fn live(&self, now: Millis) -> Vec<&SpaceSaving> {
        match now.saturating_sub(self.started) / self.interval {
            0 => vec![&self.current, &self.previous],
            1 => vec![&self.current],
            _ => Vec::new(),
        }
    }

    /// The `k` clients counted most over the last one to two intervals before `now`,
    /// most first, and the decisions counted over them.
    pub fn top(&self, now: Millis, k: usize) -> (Vec<TopClient>, u64) {
        merge(self.live(now), k)
    }
}

/// The `k` clients counted most in `summaries` together, most first, and the decisions
/// they counted.
fn merge<'a>(summaries: impl IntoIterator<Item = &'a SpaceSaving>, k: usize) -> (Vec<TopClient>, u64) {
    let mut merged: HashMap<u64, TopClient> = HashMap::new();
    let mut total = 0;
    for summary in summaries {
        total += summary.total();
        for (hash, client, count, error) in summary.clients() {
            let e = merged.entry(hash).or_insert_with(|| TopClient { client: client.into(), count: 0, error: 0 });
            e.count += count;
            e.error += error;
        }
    }
    let mut top: Vec<TopClient> = merged.into_values().collect();
    top.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.client.cmp(&b.client)));
    top.truncate(k);
    (top, total)
}

/// A rule's two lists: the clients it refused most, and those it admitted most.
pub struct RuleLists {
    refused: Mutex<Recent>,
    admitted: Mutex<Recent>,
    capacity: usize,
}

impl RuleLists {
    /// Lists of `capacity` counters over intervals of `interval` ms; None when
    /// `capacity` is 0 (lists off).
    pub fn new(capacity: usize, interval: Millis) -> Option<Self> {
        let list = || Mutex::new(Recent::new(capacity, interval, 0));
        (capacity > 0).then(|| Self { refused: list(), admitted: list(), capacity })
    }

    /// Counts one decision at `now` of the client whose descriptor `entries` gives.
    pub fn count<'a, I: Iterator<Item = (&'a str, &'a str)>>(
        &self,
        allowed: bool,
        now: Millis,
        entries: impl Fn() -> I,
    ) {
        let list = if allowed { &self.admitted } else { &self.refused };
        let hash = client_hash(entries());
        list.lock().unwrap_or_else(|p| p.into_inner()).add(now, hash, |text| client_text(text, entries()));
    }

    /// Counters a list.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The `k` clients that `lists` (one rule's, wherever it is in the rule tree)
    /// refused (or admitted) most lately, and the decisions counted.
    pub fn top(lists: &[&RuleLists], refused: bool, now: Millis, k: usize) -> (Vec<TopClient>, u64) {
        let locked: Vec<_> = lists
            .iter()
            .map(|l| if refused { &l.refused } else { &l.admitted })
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
            .collect();
        merge(locked.iter().flat_map(|r| r.live(now)), k)
    }
}

/// Writes a client's text into `s`: its entries, `key=value` joined by `, `, cut at
/// [`MAX_CLIENT_BYTES`] (on a character boundary).
pub fn client_text<'a>(s: &mut String, entries: impl Iterator<Item = (&'a str, &'a str)>) {
    for (i, (k, v)) in entries.enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(k);
        s.push('=');
        s.push_str(v);
        if s.len() >= MAX_CLIENT_BYTES {
            break;
        }
    }
    if s.len() > MAX_CLIENT_BYTES {
        let mut cut = MAX_CLIENT_BYTES;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}

/// The hash a client is counted under: every entry, length-prefixed.
pub fn client_hash<'a>(entries: impl Iterator<Item = (&'a str, &'a str)>) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (k, v) in entries {
        for part in [k, v] {
            h.write_usize(part.len());
            h.write(part.as_bytes());
        }
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic stream (splitmix64).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn unit(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    fn text(i: u64) -> String {
        format!("user=u{i}")
    }

    fn write(i: u64) -> impl FnOnce(&mut String) {
        move |s| s.push_str(&text(i))
    }

    /// Space-Saving's guarantees on a skewed random stream: counts add up to the
    /// decisions, every client seen more than N / capacity times is held, and each held
    /// count is between its true count and its true count plus its error.
    #[test]
    fn space_saving_keeps_its_bounds() {
        let mut rng = Rng(1);
        let mut s = SpaceSaving::new(64);
        let mut truth: HashMap<u64, u64> = HashMap::new();
        for _ in 0..50_000 {
            let i = (rng.unit().powi(4) * 5_000.0) as u64;
            s.add(i, write(i));
            *truth.entry(i).or_default() += 1;
        }
        let held: HashMap<u64, (u64, u64)> = s.clients().map(|(h, _, c, e)| (h, (c, e))).collect();
        assert_eq!(held.values().map(|(c, _)| c).sum::<u64>(), 50_000);
        assert_eq!(held.len(), 64);
        for (i, &n) in &truth {
            if n > 50_000 / 64 {
                assert!(held.contains_key(i), "client {i} seen {n} times is not held");
            }
            if let Some(&(c, e)) = held.get(i) {
                assert!(c >= n && c - e <= n && e <= 50_000 / 64, "client {i}: true {n}, count {c}, error {e}");
            }
        }
    }

    /// The accuracy target: on a Zipf stream (s = 1) over 10^6 distinct clients,
    /// the 20 a default list (256 counters) reports are at least 19 of the true top 20.
    #[test]
    fn recall_of_the_top_20_on_a_zipf_stream() {
        let n = 1_000_000usize;
        let mut cdf = Vec::with_capacity(n);
        let mut sum = 0.0;
        for i in 1..=n {
            sum += 1.0 / i as f64;
            cdf.push(sum);
        }
        let mut rng = Rng(7);
        let mut recent = Recent::new(256, 60_000, 0);
        let mut truth = vec![0u32; n];
        for _ in 0..1_000_000 {
            let x = rng.unit() * sum;
            let i = cdf.partition_point(|&c| c < x).min(n - 1);
            truth[i] += 1;
            recent.add(0, i as u64, write(i as u64));
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(truth[i]));
        let (top, total) = recent.top(0, 20);
        assert_eq!(total, 1_000_000);
        let found = order[..20].iter().filter(|&&i| top.iter().any(|t| t.client == text(i as u64))).count();
        assert!(found >= 19, "recall {found}/20");
    }

    /// The list slides: a client counted two intervals ago is gone, one counted in the
    /// interval before is still there, added to the current interval's.
    #[test]
    fn the_interval_slides() {
        let mut r = Recent::new(8, 1_000, 0);
        r.add(10, 1, write(1));
        r.add(1_500, 2, write(2));
        r.add(1_600, 2, write(2));
        r.add(1_700, 1, write(1));
        let (top, total) = r.top(1_800, 10);
        assert_eq!(total, 4);
        assert_eq!(top[0], TopClient { client: "user=u1".into(), count: 2, error: 0 });
        assert_eq!(top[1].count, 2);
        let (top, total) = r.top(2_100, 10);
        assert_eq!((top.len(), total), (2, 3), "the first interval has slid out: {top:?}");
        r.add(3_200, 3, write(3));
        assert_eq!(r.top(3_200, 10).0.iter().map(|t| t.count).collect::<Vec<_>>(), vec![1]);
        assert!(r.top(9_000, 10).0.is_empty(), "nothing counted lately");
    }

    #[test]
    fn a_client_text_is_bounded() {
        let long = "x".repeat(1_000);
        let text = |entries: &[(&str, &str)]| {
            let mut s = String::new();
            client_text(&mut s, entries.iter().copied());
            s
        };
        assert_eq!(text(&[("user", long.as_str()), ("route", "/a")]).len(), MAX_CLIENT_BYTES);
        assert_eq!(text(&[("route", "/a"), ("user", "é")]), "route=/a, user=é");
        let a = client_hash([("ab", "c")].into_iter());
        assert_ne!(a, client_hash([("a", "bc")].into_iter()));
    }
}
