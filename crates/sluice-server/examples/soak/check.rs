//! The checker: every decision the clients saw and the fault log in, the promises
//! verified, the first violation named with the decisions and faults around it.
//!
//! Each check is sound for times seen from outside: a decision happened somewhere
//! between its request's sending and its answer, so every bound is taken over the widest
//! interval that could hold it (a count is a violation only if no ordering of the
//! decisions within their intervals could explain it).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

/// How long after a fault ends its decisions may still be degraded (the store's
/// breaker cooling down, a failover settling, a restarted instance's connections).
pub const EXACT_WITHIN_MS: u64 = 5_000;

/// How late past the deadline an answer may come.
pub const LATE_MS: u64 = 50;

/// The run's clock: ms since it began, read from the wall clock, the clock the servers
/// decide by (a window's bounds and a bucket's refill are wall-clock times). A monotonic
/// clock would judge them by another time: on a CI machine whose wall clock gained 5 ms a
/// second on its monotonic one, a token bucket's refill over 21 s of the monotonic clock
/// held a token more, and windows were a hundred ms off, all called over the limit. Read
/// so that it never goes back: a wall clock stepped back is held, as the limiter's
/// algorithms hold it.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    epoch: u64,
}

/// The latest wall-clock ms read, which later reads never go below.
static LATEST_MS: AtomicU64 = AtomicU64::new(0);

impl Clock {
    pub fn now() -> Self {
        Self { epoch: Self::epoch_ms() }
    }

    pub fn epoch_ms() -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
    }

    /// ms since the run began.
    pub fn ms(&self) -> u64 {
        let now = Self::epoch_ms();
        LATEST_MS.fetch_max(now, Ordering::Relaxed).max(now).saturating_sub(self.epoch)
    }

    /// A run time as wall-clock ms.
    pub fn epoch_of(&self, run_ms: u64) -> u64 {
        self.epoch + run_ms
    }
}

/// The rules decided one request at a time (see `fleet::domains`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    /// A fixed window of 20 (12 while a reload lowers it, 5 for an overridden client) in 2 s.
    Fw,
    /// A token bucket: 10 a second, a burst of 10.
    Tb,
    /// A sliding window of 20 in 2 s.
    Sw,
    /// A fixed window of 40 in 2 s, decided from quota grants.
    Gr,
    /// A fixed window of 40 in 2 s shared by every region (`--regions`).
    Gl,
}

impl Rule {
    pub fn key(self) -> &'static str {
        match self {
            Rule::Fw => "fw",
            Rule::Tb => "tb",
            Rule::Sw => "sw",
            Rule::Gr => "gr",
            Rule::Gl => "gl",
        }
    }
}

/// The window of every windowed rule, ms.
pub const WINDOW_MS: u64 = 2_000;

/// One decision as its client saw it.
#[derive(Debug, Clone)]
pub struct Decision {
    pub rule: Rule,
    pub client: u32,
    pub instance: u8,
    pub grpc: bool,
    pub sent: u64,
    pub answered: u64,
    pub allowed: bool,
    pub limit: u64,
    pub used: u64,
    pub remaining: u64,
    /// The window's end, wall-clock ms: exact over HTTP, within the call's duration
    /// over gRPC (Envoy's answer says how long until it).
    pub reset: u64,
    pub exact_reset: bool,
    pub degraded: bool,
}

/// A concurrency lease held: from its grant's answer to its release's sending (it was
/// held at least that long).
#[derive(Debug, Clone)]
pub struct Lease {
    pub client: u32,
    pub acquired: u64,
    pub released: u64,
}

/// A reservation admitted and how it was settled.
#[derive(Debug, Clone)]
pub struct Reserved {
    pub client: u32,
    pub reset: u64,
    pub limit: u64,
    pub estimate: u64,
    pub actual: u64,
    /// Its commit answered `committed` (not a late report, not lost with an instance).
    pub committed: bool,
    /// The failure policy granted it (the store did not answer): counted apart.
    pub degraded: bool,
}

/// One fault, from its injection to its repair.
#[derive(Debug, Clone)]
pub struct Fault {
    pub kind: &'static str,
    pub start: u64,
    pub end: u64,
    pub detail: String,
}

/// Everything the clients saw.
#[derive(Default)]
pub struct Seen {
    pub decisions: Vec<Decision>,
    pub leases: Vec<Lease>,
    pub reservations: Vec<Reserved>,
    /// Calls that got no answer (an instance killed under them).
    pub unanswered: u64,
    /// The regions sharing gl (instances go round them); 1 without `--regions`.
    pub regions: usize,
}

#[derive(Debug)]
pub struct Violation {
    pub at: u64,
    /// Which promise it breaks.
    pub kind: &'static str,
    pub what: String,
    pub rule: Option<Rule>,
    pub client: Option<u32>,
}

pub struct Report {
    pub decisions: usize,
    /// Of the decisions, those over gRPC.
    pub grpc: usize,
    pub degraded: usize,
    pub violations: Vec<Violation>,
    /// The longest time from a fault's end to its last degraded decision.
    pub longest_to_exact: u64,
    pub kinds: BTreeMap<&'static str, usize>,
    /// Refusals of the shared limit judged against the fleet's count, and the wrongful
    /// ones (refused while the fleet had units).
    pub refusals: (u64, Vec<Violation>),
}

/// Every check over what was seen.
pub fn check(seen: &Seen, faults: &[Fault], clock: Clock) -> Report {
    let mut v = Vec::new();
    fixed_windows(&seen.decisions, &mut v);
    token_bucket(&seen.decisions, &mut v);
    sliding_window(&seen.decisions, clock, &mut v);
    leases(&seen.leases, &mut v);
    reservations(&seen.reservations, &mut v);
    let longest_to_exact = timing(&seen.decisions, faults, &mut v);
    let refusals = wrongful_refusals(&seen.decisions, seen.regions.max(1), faults, clock);
    v.sort_by_key(|x| x.at);
    let mut kinds = BTreeMap::new();
    for f in faults {
        *kinds.entry(f.kind).or_default() += 1;
    }
    Report {
        decisions: seen.decisions.len() + seen.leases.len() + seen.reservations.len(),
        grpc: seen.decisions.iter().filter(|d| d.grpc).count(),
        degraded: seen.decisions.iter().filter(|d| d.degraded).count()
            + seen.reservations.iter().filter(|r| r.degraded).count(),
        violations: v,
        longest_to_exact,
        kinds,
        refusals,
    }
}

/// What a region cannot know of: the units the other regions hold unspent in a client's
/// window (about their demand for a horizon), as a part of the limit.
const UNSEEN_SHARE: u64 = 4;

/// The faults after which a global limit may refuse under it: a region cut off from the
/// global store (refusals while waiting), an instance killed or stopped (what it held is
/// idle until the window ends). Until a window after the repair, and the time to exact.
const REFUSING_FAULTS: [&str; 3] = ["partition", "kill-instance", "term-instance"];

/// A refusal of the shared limit that fit: the fleet had units when it was refused, and
/// its window ended with units unspent.
const FIT: &str = "refused what fit";

/// The shared limit (gl) refuses only when the fleet has spent it: a refusal is wrongful
/// when the fleet had admitted, in the window the refusal names, less than the limit
/// less what the other regions may hold unseen ([`UNSEEN_SHARE`]), counting every
/// admission sent before the refusal's answer (the most it could have spent then), the
/// limit the one the refusal names (a reload changes it). Outside the faults that may refuse ([`REFUSING_FAULTS`]), outside the documented wait
/// ([`GLOBAL_WAIT_MS`]) from a region's first decision of the client in the window (its
/// pool may be filled only then: issue #56 allows that wait), and in windows the run
/// saw to their end. Returns the refusals judged and the wrongful ones, told apart: in a
/// window that ended at its limit ("wrongful refusal"), the units the fleet had then were
/// held by other regions for their own demand and spent by it within the window, so
/// admitting the refusal would have passed the limit or refused another decision in its
/// place; in one that ended under it ([`FIT`]), the fleet left unspent units the refusal
/// could have had. Both are reported, not yet violations: ten minutes of the release
/// build refuse hundreds that fit (issue #56, docs/operations.md).
fn wrongful_refusals(ds: &[Decision], regions: usize, faults: &[Fault], clock: Clock) -> (u64, Vec<Violation>) {
    let (mut judged, mut v) = (0, Vec::new());
    // resets are wall-clock times, the decisions' run times
    let run_end = clock.epoch_of(ds.iter().map(|d| d.answered).max().unwrap_or(0));
    let excused = |d: &Decision| {
        faults.iter().any(|f| {
            REFUSING_FAULTS.contains(&f.kind) && f.start <= d.answered && d.sent <= f.end + WINDOW_MS + EXACT_WITHIN_MS
        })
    };
    for w in windows(ds.iter().filter(|d| d.rule == Rule::Gl)) {
        if w.iter().any(|d| d.reset > run_end) {
            continue;
        }
        let mut sent: Vec<u64> = w.iter().filter(|d| d.allowed).map(|d| d.sent).collect();
        sent.sort_unstable();
        let ended = sent.len() as u64;
        // a region's first decision of the client in the window may wait for its pool
        // (the documented wait), and those sent within that wait may be refused
        let region = |d: &Decision| d.instance as usize % regions;
        let first_sight = |d: &Decision| w.iter().filter(|e| region(e) == region(d)).map(|e| e.sent).min();
        for d in w.iter().filter(|d| !d.allowed && !excused(d)) {
            let first = first_sight(d).unwrap_or(d.sent);
            if d.sent <= first + GLOBAL_WAIT_MS {
                continue;
            }
            judged += 1;
            // the limit in force for it (a reload may lower or raise it within the window)
            let limit = d.limit;
            let spent = sent.partition_point(|&s| s <= d.answered) as u64;
            if spent + limit / UNSEEN_SHARE < limit {
                // what tells a slow move from a spent one: the wait, and how long the
                // region had served the client in that window
                let what = format!(
                    "refused (used {}, remaining {}) though the fleet had admitted at most {spent} of {limit} in its \
                     window ({ended} when it ended); instance {} (region r{}), answered in {} ms, {} ms after the \
                     region's first decision of the window",
                    d.used,
                    d.remaining,
                    d.instance,
                    region(d),
                    d.answered - d.sent,
                    d.sent - first
                );
                v.push(Violation {
                    at: d.answered,
                    kind: if ended < limit { FIT } else { "wrongful refusal" },
                    what,
                    rule: Some(d.rule),
                    client: Some(d.client),
                });
            }
        }
    }
    (judged, v)
}

/// The decisions of one window: those of a client and rule whose resets lie within
/// half a window of the first (a client's windows end at least a window apart).
fn windows<'a>(of: impl Iterator<Item = &'a Decision>) -> Vec<Vec<&'a Decision>> {
    let mut by: HashMap<(Rule, u32), Vec<&Decision>> = HashMap::new();
    for d in of.filter(|d| !d.degraded) {
        by.entry((d.rule, d.client)).or_default().push(d);
    }
    let mut out = Vec::new();
    for (_, mut ds) in by {
        ds.sort_by_key(|d| d.reset);
        let mut group: Vec<&Decision> = Vec::new();
        for d in ds {
            if group.first().is_some_and(|f| d.reset > f.reset + WINDOW_MS / 2) {
                out.push(std::mem::take(&mut group));
            }
            group.push(d);
        }
        out.push(group);
    }
    out
}

/// Fixed windows (fw, gr from grants, gl across regions): a window admits at most its limit (the
/// highest any of its decisions reported: a reload or an override may lower it within
/// the window), and no admitted decision reports fewer used than the fleet admitted in
/// its window before it was even sent.
fn fixed_windows(ds: &[Decision], v: &mut Vec<Violation>) {
    for w in windows(ds.iter().filter(|d| matches!(d.rule, Rule::Fw | Rule::Gr | Rule::Gl))) {
        let Some(first) = w.first() else { continue };
        let limit = w.iter().map(|d| d.limit).max().unwrap_or(0);
        let admitted = w.iter().filter(|d| d.allowed).count() as u64;
        if admitted > limit {
            let at = w.iter().filter(|d| d.allowed).map(|d| d.answered).max().unwrap_or(0);
            let what = format!("window ending {} admitted {admitted}, past its limit {limit}", first.reset);
            v.push(Violation { at, kind: "over the limit", what, rule: Some(first.rule), client: Some(first.client) });
        }
        if first.rule != Rule::Fw {
            continue; // a grant's decisions report the grant, not the window
        }
        let mut answered: Vec<u64> = w.iter().filter(|d| d.allowed).map(|d| d.answered).collect();
        answered.sort_unstable();
        for d in w.iter().filter(|d| d.allowed && d.exact_reset) {
            let before = answered.partition_point(|&a| a < d.sent) as u64;
            if before + 1 > d.used {
                let what = format!(
                    "told used {} (remaining {}) though the fleet had admitted {before} in the window before it was asked",
                    d.used, d.remaining
                );
                v.push(Violation {
                    at: d.answered,
                    kind: "remaining contradicts the fleet",
                    what,
                    rule: Some(d.rule),
                    client: Some(d.client),
                });
            }
        }
    }
}

/// The token bucket (10 a second, a burst of 10): between any two admitted decisions'
/// widest times, no more than the burst and what refilled.
fn token_bucket(ds: &[Decision], v: &mut Vec<Violation>) {
    let mut by: HashMap<u32, Vec<&Decision>> = HashMap::new();
    for d in ds.iter().filter(|d| d.rule == Rule::Tb && d.allowed && !d.degraded) {
        by.entry(d.client).or_default().push(d);
    }
    for (client, mut ds) in by {
        ds.sort_by_key(|d| d.sent);
        for i in 0..ds.len() {
            for j in i..ds.len().min(i + 400) {
                let span = ds[j].answered.saturating_sub(ds[i].sent);
                let bound = 10 + (10 * span).div_ceil(1_000);
                if (j - i + 1) as u64 > bound {
                    let what = format!("{} admitted within {span} ms, past the burst and refill ({bound})", j - i + 1);
                    v.push(Violation {
                        at: ds[j].answered,
                        kind: "over the limit",
                        what,
                        rule: Some(Rule::Tb),
                        client: Some(client),
                    });
                    break;
                }
            }
        }
    }
}

/// The sliding window admits at most its limit (20) in any aligned 2 s window: counted
/// over the decisions known to lie in one (sent and answered in it).
fn sliding_window(ds: &[Decision], clock: Clock, v: &mut Vec<Violation>) {
    let mut count: HashMap<(u32, u64), (u64, u64)> = HashMap::new();
    for d in ds.iter().filter(|d| d.rule == Rule::Sw && d.allowed && !d.degraded) {
        let (a, b) = (clock.epoch_of(d.sent) / WINDOW_MS, clock.epoch_of(d.answered) / WINDOW_MS);
        if a == b {
            let c = count.entry((d.client, a)).or_default();
            *c = (c.0 + 1, c.1.max(d.answered));
        }
    }
    for ((client, k), (n, at)) in count {
        if n > 20 {
            let what = format!("aligned window {} admitted {n}, past its limit 20", k * WINDOW_MS);
            v.push(Violation { at, kind: "over the limit", what, rule: Some(Rule::Sw), client: Some(client) });
        }
    }
}

/// The concurrency limit (3): leases certainly held at once never more.
fn leases(ls: &[Lease], v: &mut Vec<Violation>) {
    let mut by: HashMap<u32, Vec<(u64, i64)>> = HashMap::new();
    for l in ls.iter().filter(|l| l.acquired < l.released) {
        by.entry(l.client).or_default().extend([(l.acquired, 1), (l.released, -1)]);
    }
    for (client, mut events) in by {
        // a release at the moment of an acquisition ends first
        events.sort_by_key(|&(t, d)| (t, d));
        let mut held = 0;
        for (t, d) in events {
            held += d;
            if held > 3 {
                let what = format!("{held} leases held at once, past the limit 3");
                v.push(Violation { at: t, kind: "over the concurrency limit", what, rule: None, client: Some(client) });
                break;
            }
        }
    }
}

/// Reservations (upper-bound estimates): what a window's committed reservations used
/// never passes its limit. Degraded ones are counted apart (their window is unknown: a
/// 1-hour Cluster run once summed them all into one window "ending 0"); an exact one
/// must say its window.
fn reservations(rs: &[Reserved], v: &mut Vec<Violation>) {
    let mut by: HashMap<u32, Vec<&Reserved>> = HashMap::new();
    for r in rs.iter().filter(|r| r.committed && !r.degraded) {
        if r.reset == 0 {
            let what = "an exact reservation answered without its window".to_string();
            v.push(Violation { at: 0, kind: "reservation without a window", what, rule: None, client: Some(r.client) });
            continue;
        }
        by.entry(r.client).or_default().push(r);
    }
    for (client, mut rs) in by {
        rs.sort_by_key(|r| r.reset);
        let mut i = 0;
        while i < rs.len() {
            let j = rs[i..].iter().position(|r| r.reset > rs[i].reset + WINDOW_MS / 2).map_or(rs.len(), |p| i + p);
            let used: u64 = rs[i..j].iter().map(|r| r.actual).sum();
            if used > rs[i].limit {
                let held: u64 = rs[i..j].iter().map(|r| r.estimate).sum();
                let what = format!(
                    "reservations of the window ending {} used {used} (held {held}), past its limit {}",
                    rs[i].reset, rs[i].limit
                );
                v.push(Violation {
                    at: rs[i].reset,
                    kind: "reservations over the limit",
                    what,
                    rule: None,
                    client: Some(client),
                });
            }
            i = j;
        }
    }
}

/// The deadline every instance gives the store (`limiter.deadline`), in ms: the fleet
/// runs under it (`fleet.rs` writes it into every config) and the checker bounds every
/// answer's time by it.
pub const DEADLINE_MS: u64 = 100;

/// The delay each way on a region's link to the global store: what a region's first
/// decisions of a client may wait, twice over.
pub const LINK_DELAY_MS: u64 = 20;

/// What a decision on a limit the regions share may wait besides its store calls, when
/// its region's pool is short (docs/configuration.md, "Admit what fits"): twice the
/// round trip to the global store and 100 ms.
const GLOBAL_WAIT_MS: u64 = 4 * LINK_DELAY_MS + sluice::regions::WAIT_MARGIN;

/// Every answer within the deadline and 50 ms (a global limit's: and its documented wait);
/// degraded answers only during a fault and the documented time after it. Returns the
/// longest time from a fault's end to its last degraded decision.
fn timing(ds: &[Decision], faults: &[Fault], v: &mut Vec<Violation>) -> u64 {
    let mut longest = 0;
    for d in ds {
        let took = d.answered.saturating_sub(d.sent);
        let wait = if d.rule == Rule::Gl { GLOBAL_WAIT_MS } else { 0 };
        if took > DEADLINE_MS + wait + LATE_MS {
            let what = format!("answered in {took} ms, past the deadline, {wait} ms and {LATE_MS} ms");
            v.push(Violation { at: d.answered, kind: "late", what, rule: Some(d.rule), client: Some(d.client) });
        }
        if !d.degraded {
            continue;
        }
        let during = faults.iter().filter(|f| f.start <= d.answered && d.sent <= f.end + EXACT_WITHIN_MS);
        match during.map(|f| d.sent.saturating_sub(f.end)).min() {
            Some(after) => longest = longest.max(after),
            None => {
                let what = "degraded with no fault in force or just repaired".to_string();
                v.push(Violation {
                    at: d.answered,
                    kind: "not exact again in time",
                    what,
                    rule: Some(d.rule),
                    client: Some(d.client),
                });
            }
        }
    }
    longest
}

impl Report {
    /// The first violation with what surrounds it, then the run summed up in one line.
    pub fn print(&self, seen: &Seen, faults: &[Fault]) {
        if let Some(first) = self.violations.first() {
            println!("FIRST VIOLATION at {} ms: {:?} client {:?}: {}", first.at, first.rule, first.client, first.what);
            let near = |t: u64| t + 1_000 >= first.at && t <= first.at + 1_000;
            for d in seen.decisions.iter().filter(|d| Some(d.rule) == first.rule && Some(d.client) == first.client) {
                if near(d.answered) {
                    println!("  {d:?}");
                }
            }
            for f in faults.iter().filter(|f| f.start <= first.at + 3_000 && f.end + 3_000 >= first.at) {
                println!("  fault {} {}..{} ms: {}", f.kind, f.start, f.end, f.detail);
            }
            let mut by: BTreeMap<&str, usize> = BTreeMap::new();
            for v in &self.violations {
                *by.entry(v.kind).or_default() += 1;
            }
            for v in self.violations.iter().take(10) {
                println!("violation at {} ms: {:?} client {:?}: {}", v.at, v.rule, v.client, v.what);
            }
            println!("violations by kind: {by:?}");
        }
        for f in faults {
            println!("fault {:>8} ms .. {:>8} ms  {:<16} {}", f.start, f.end, f.kind, f.detail);
        }
        println!(
            "{} over gRPC; {} degraded decisions (fail-open, counted apart); longest time to exact again {} ms; {} \
             calls unanswered",
            self.grpc, self.degraded, self.longest_to_exact, seen.unanswered
        );
        if let Some(line) = shared_use(seen) {
            println!("{line}");
            let (judged, wrongful) = (self.refusals.0, &self.refusals.1);
            println!(
                "gl refusals judged against the fleet's count: {judged}, {} while the fleet had units: {} in windows \
                 the fleet spent to the limit, {} in windows it left units unspent (reported, not yet counted as \
                 violations)",
                wrongful.len(),
                wrongful.iter().filter(|w| w.kind != FIT).count(),
                wrongful.iter().filter(|w| w.kind == FIT).count()
            );
            for w in wrongful.iter().take(10) {
                println!("  at {} ms: client {:?}: {}", w.at, w.client, w.what);
            }
        }
        let mut took: Vec<u64> =
            seen.decisions.iter().filter(|d| d.rule != Rule::Gl).map(|d| d.answered - d.sent).collect();
        took.sort_unstable();
        if let Some(&most) = took.last() {
            let p999 = took[(took.len() - 1) * 999 / 1_000];
            println!("answers (gl aside): p99.9 {p999} ms, slowest {most} ms, of at most {} ms", DEADLINE_MS + LATE_MS);
        }
        let kinds: Vec<String> = self.kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
        println!("faults by kind: {}", kinds.join(", "));
        println!(
            "{} decisions checked, {} kinds of faults ({} injected), {} violations",
            group(self.decisions as u64),
            self.kinds.len(),
            self.kinds.values().sum::<usize>(),
            self.violations.len()
        );
    }
}

/// With regions: what the hot clients' windows of the shared limit admitted (each
/// asked for far more than the limit), least, median and most, by the limit in force (a
/// reload lowers it).
fn shared_use(seen: &Seen) -> Option<String> {
    let hot = seen.decisions.iter().filter(|d| d.rule == Rule::Gl && d.client < 4);
    let mut by_limit: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for w in windows(hot) {
        let limit = w.iter().map(|d| d.limit).max().unwrap_or(0);
        by_limit.entry(limit).or_default().push(w.iter().filter(|d| d.allowed).count() as u64);
    }
    let parts: Vec<String> = by_limit
        .iter_mut()
        .rev()
        .map(|(limit, admitted)| {
            admitted.sort_unstable();
            let (least, median, most) = (admitted[0], admitted[admitted.len() / 2], admitted[admitted.len() - 1]);
            format!("{} windows of {limit} admitted {least} least, {median} median, {most} most", admitted.len())
        })
        .collect();
    (!parts.is_empty()).then(|| format!("gl, the limit the regions share, its hot clients: {}", parts.join("; ")))
}

/// 1234567 as "1,234,567".
fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(rule: Rule, sent: u64, allowed: bool, used: u64, reset: u64) -> Decision {
        Decision {
            rule,
            client: 1,
            instance: 0,
            grpc: false,
            sent,
            answered: sent + 2,
            allowed,
            limit: 3,
            used,
            remaining: 3u64.saturating_sub(used),
            reset,
            exact_reset: true,
            degraded: false,
        }
    }

    fn kinds(seen: &Seen, faults: &[Fault]) -> Vec<&'static str> {
        check(seen, faults, Clock::now()).violations.iter().map(|v| v.kind).collect()
    }

    /// The shared limit (40 a window): a refusal after 38 admitted is the fleet's spent
    /// limit; one after 20 is wrongful, unless a region was cut off then, and one that fit
    /// when the window then ends under the limit. Windows the run did not see to their end
    /// are not judged.
    #[test]
    fn a_refusal_under_the_shared_limit_is_caught() {
        let gl = |sent, allowed| Decision { limit: 40, ..d(Rule::Gl, sent, allowed, 0, 5_000) };
        // the run goes on past the window's end
        let later = d(Rule::Fw, 6_000, true, 1, 8_000);
        // the decisions' run times are the wall clock's here (resets are on it)
        let at_zero = Clock { epoch: 0 };
        let wrongful = |seen: &Seen, faults: &[Fault]| {
            let (judged, v) = check(seen, faults, at_zero).refusals;
            (judged, v.iter().map(|v| v.kind).collect::<Vec<_>>())
        };
        let mut seen = Seen { decisions: (0..38).map(|i| gl(i * 10, true)).collect(), ..Seen::default() };
        seen.decisions.extend([gl(400, false), later.clone()]);
        assert_eq!(wrongful(&seen, &[]), (1, vec![]));
        seen.decisions.truncate(20);
        seen.decisions.extend([gl(400, false), later.clone()]);
        assert_eq!(wrongful(&seen, &[]), (1, vec![FIT]));
        let cut = Fault { kind: "partition", start: 300, end: 600, detail: String::new() };
        assert_eq!(wrongful(&seen, &[cut]), (0, vec![]));
        // the fleet spent the window to its limit after it (other regions held the units)
        let mut spent = seen.decisions.clone();
        spent.extend((0..20).map(|i| gl(500 + i * 10, true)));
        let spent = Seen { decisions: spent, ..Seen::default() };
        assert_eq!(wrongful(&spent, &[]), (1, vec!["wrongful refusal"]));
        // a window the run ended in: not judged
        seen.decisions.pop();
        assert_eq!(wrongful(&seen, &[]), (0, vec![]));
        // a region's decisions within the documented wait of its first of the window may
        // be refused waiting for its pool (instances go round the regions): not judged
        let mut first = Seen { decisions: vec![gl(0, true), gl(GLOBAL_WAIT_MS, false)], regions: 2, ..Seen::default() };
        first.decisions.extend([Decision { instance: 1, ..gl(1_000, false) }, later.clone()]);
        assert_eq!(wrongful(&first, &[]), (0, vec![]));
        first.decisions.push(gl(1_000, false));
        assert_eq!(wrongful(&first, &[]), (1, vec![FIT]));
    }

    /// Three of a limit of 3 in a window, then three more in the next: exact. A fourth
    /// in the first window (another instance's, its reset a few ms off) is caught.
    #[test]
    fn a_window_past_its_limit_is_caught() {
        let decisions = (0..3).map(|i| d(Rule::Fw, i * 10, true, i + 1, 5_000)).collect();
        let mut seen = Seen { decisions, ..Seen::default() };
        seen.decisions.extend((0..3).map(|i| d(Rule::Fw, 3_000 + i * 10, true, i + 1, 7_000)));
        seen.decisions.push(d(Rule::Fw, 100, false, 3, 5_000));
        assert!(kinds(&seen, &[]).is_empty());
        seen.decisions.push(d(Rule::Fw, 200, true, 1, 5_020));
        // and it said used 1, though the fleet had admitted 3 before
        assert_eq!(kinds(&seen, &[]), ["over the limit", "remaining contradicts the fleet"]);
    }

    /// A client told it used 1 when the fleet had admitted 2 before it even asked.
    #[test]
    fn a_remaining_that_contradicts_the_fleet_is_caught() {
        let decisions = vec![d(Rule::Fw, 0, true, 1, 5_000), d(Rule::Fw, 10, true, 2, 5_000)];
        let mut seen = Seen { decisions, ..Seen::default() };
        assert!(kinds(&seen, &[]).is_empty());
        seen.decisions.push(d(Rule::Fw, 20, true, 1, 5_000));
        assert_eq!(kinds(&seen, &[]), ["remaining contradicts the fleet"]);
    }

    /// Four leases at once on a limit of 3: caught; held one after another: not.
    #[test]
    fn leases_held_at_once_are_counted() {
        let leases = (0..4).map(|i| Lease { client: 1, acquired: i * 100, released: i * 100 + 99 }).collect();
        let mut seen = Seen { leases, ..Seen::default() };
        assert!(kinds(&seen, &[]).is_empty());
        seen.leases = (0..4).map(|i| Lease { client: 1, acquired: i, released: 500 }).collect();
        assert_eq!(kinds(&seen, &[]), ["over the concurrency limit"]);
    }

    /// The bucket: a burst of 10 at once is fine, an 11th within the same instant is not.
    #[test]
    fn the_bucket_bounds_any_interval() {
        let decisions = (0..10).map(|_| d(Rule::Tb, 1_000, true, 0, 0)).collect();
        let mut seen = Seen { decisions, ..Seen::default() };
        seen.decisions.push(d(Rule::Tb, 1_200, true, 0, 0));
        assert!(kinds(&seen, &[]).is_empty(), "200 ms refill 2");
        seen.decisions.push(d(Rule::Tb, 1_000, true, 0, 0));
        seen.decisions.push(d(Rule::Tb, 1_000, true, 0, 0));
        assert_eq!(kinds(&seen, &[]), ["over the limit"]);
    }

    /// A slow answer is late; a degraded one is fine during a fault and the time after,
    /// not later.
    #[test]
    fn timing_is_checked() {
        let mut seen = Seen::default();
        let mut slow = d(Rule::Fw, 0, true, 1, 5_000);
        slow.answered = 200;
        seen.decisions = vec![slow];
        assert_eq!(kinds(&seen, &[]), ["late"]);
        let mut degraded = d(Rule::Fw, 9_000, true, 0, 5_000);
        degraded.degraded = true;
        seen.decisions = vec![degraded];
        let fault = Fault { kind: "pause-primary", start: 1_000, end: 2_000, detail: String::new() };
        assert_eq!(kinds(&seen, std::slice::from_ref(&fault)), ["not exact again in time"]);
        seen.decisions[0].sent = 6_000;
        seen.decisions[0].answered = 6_002;
        let report = check(&seen, &[fault], Clock::now());
        assert!(report.violations.is_empty());
        assert_eq!(report.longest_to_exact, 4_000);
    }

    /// Committed reservations past a window's limit are caught; degraded ones (the
    /// failure policy granted them, their window unknown) are counted apart, not summed
    /// into a window; an exact one that names no window is itself a violation.
    #[test]
    fn reservations_are_checked_per_window_degraded_apart() {
        let r = |reset, actual, degraded| Reserved {
            client: 1,
            reset,
            limit: 200,
            estimate: actual,
            actual,
            committed: true,
            degraded,
        };
        let mut seen = Seen { reservations: vec![r(5_000, 120, false), r(5_000, 70, false)], ..Seen::default() };
        assert!(kinds(&seen, &[]).is_empty());
        seen.reservations.push(r(5_001, 20, false));
        assert_eq!(kinds(&seen, &[]), ["reservations over the limit"]);
        seen.reservations.pop();
        seen.reservations.extend([r(0, 150, true), r(0, 150, true)]);
        let report = check(&seen, &[], Clock::now());
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        assert_eq!(report.degraded, 2);
        seen.reservations.push(r(0, 10, false));
        assert_eq!(kinds(&seen, &[]), ["reservation without a window"]);
    }
}
