//! Shares of one limit for a fleet of Envoys: the server side of Envoy's Rate Limit
//! Quota Service (RLQS), whose filter enforces each share locally as a token bucket.
//!
//! An Envoy's `rate_limit_quota` filter reports, per bucket, what it allowed and denied
//! (every 5 s), and enforces the assignment it was last sent: a token bucket of `rate`
//! tokens a second holding at most `depth`, for `ttl` whole seconds. Such a bucket admits
//! at most `depth + rate x t` in any `t` seconds of its life, so what an assignment may
//! admit is known when it is sent. Sluice takes exactly that from the shared fixed window
//! as quota grants ([`crate::algo::grant`]) *before* it sends the assignment: the store
//! never grants past the limit, so the assignments in force across every Envoy, on every
//! Sluice instance, never admit past it in a window.
//!
//! The bookkeeping, per Envoy and bucket ([`Share`]), in the store's window:
//! - a *piece* is one token bucket as the Envoy holds it, from when it was sent to when
//!   it lapses (`until`: its TTL, plus [`MARGIN`] for delivery). Re-sending the same
//!   settings keeps the Envoy's bucket (Envoy replaces a bucket only when its settings
//!   change, and then with a full one), so it extends the piece; new settings start a
//!   new piece, and the old one counts only until the new one arrives.
//! - *committed* is the sum of the pieces' bounds; *held* the units granted. A tick keeps
//!   `committed <= held`, taking the difference as a grant, and sends a smaller share (or
//!   DENY_ALL) when the store has less left.
//! - a piece never outlives the window: its TTL ends [`MARGIN`] before the window does,
//!   and the next window's assignment is sent when it starts. A TTL is whole seconds,
//!   so the window's last piece is sent again when the window's end is a whole number
//!   of seconds away ([`Share::due`]), to last to it.
//!
//! Shares follow demand: a bucket reported busy gets what it asked for plus a quarter,
//! at most a fair part of the pace at which the window can be spent by its end (a part,
//! one of the window's open grants, of what the store has left, and what the share
//! itself holds for the time left); an idle one drifts to [`FLOOR`].

use crate::Limiter;
use crate::algo::Limit;
use crate::algo::grant::Granted;
use crate::plan::{Mode, Plan, plan};
use crate::request::Request;
use crate::request::RequestError;
use crate::store::{GiveBack, GrantAsk, StoreError};
use crate::tag::Tag;
use crate::time::Millis;

/// The shortest window shared: shorter than a report interval and the time an
/// assignment outlives it, an assignment could not fit in one.
pub const MIN_WINDOW: Millis = 10_000;

/// The token buckets' fill interval: Envoy reads it in whole seconds, and compares only
/// its nanoseconds when deciding whether settings changed, so it never changes.
pub const FILL: Millis = 1_000;

/// The time an assignment may take to reach its Envoy, counted on top of its TTL.
pub const MARGIN: Millis = 100;

/// How long an assignment outlives the report interval, so the next report's answer
/// arrives before it lapses.
pub const OUTLIVE: Millis = 2_000;

/// The report interval assumed until one is measured (Envoy reports every 5 s).
pub const REPORT_INTERVAL: Millis = 5_000;

/// How long before its window ends a piece cut short by the window's end is sent again
/// to last to it ([`Share::due`]): room for the timer and the store call before it.
pub const SLOP: Millis = 50;

/// The least rate offered a bucket that is still reported: one request a second.
pub const FLOOR: u64 = 1;

/// Pieces kept per window (a piece a report: a minute's window has about 12).
const MAX_PIECES: usize = 256;

/// The limit an RLQS bucket shares, as [`Limiter::quota_target`] resolved it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaTarget {
    pub tag: Tag,
    pub key: u64,
    pub limit: Limit,
    /// A shadow-mode policy: the bucket is allowed everything.
    pub shadow: bool,
    /// The overrides' generation when resolved (it moves on a reset anywhere).
    pub generation: u64,
}

/// Why a bucket gets no share.
#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    #[error("unknown domain '{domain}': no rules are configured for it")]
    UnknownDomain { domain: String },
    #[error("the bucket id matches no rule with a limit (its entries, in some order, must walk the domain's rules)")]
    NoRule,
    #[error("the bucket's rule is `unlimited`")]
    Unlimited,
    #[error("RLQS shares one fixed-window limit of a 10 s window or longer, and {0}")]
    NotOneFixedWindow(String),
    #[error(transparent)]
    Request(#[from] RequestError),
}

/// What an Envoy is sent for one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Assignment {
    /// A token bucket of `rate` tokens a second holding `depth`, for `ttl` seconds.
    TokenBucket { rate: u64, depth: u64, ttl: u64 },
    /// Refuse every request for `ttl` seconds: nothing is left to share.
    DenyAll { ttl: u64 },
    /// Allow every request for `ttl` seconds (an unlimited rule, a shadow-mode policy).
    AllowAll { ttl: u64 },
}

impl Assignment {
    /// Its kind, as the admin view and the metrics name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Assignment::TokenBucket { .. } => "token_bucket",
            Assignment::DenyAll { .. } => "deny_all",
            Assignment::AllowAll { .. } => "allow_all",
        }
    }
}

/// One token bucket as an Envoy holds it: sent at `start`, lapsing at `expires` at the
/// earliest (its TTL from the send) and `until` at the latest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Piece {
    pub rate: u64,
    pub depth: u64,
    pub start: Millis,
    pub expires: Millis,
    pub until: Millis,
}

impl Piece {
    /// The most the bucket admits over its life: full at the start, then `rate` a second.
    pub fn bound(&self) -> u64 {
        self.depth + (self.rate * self.until.saturating_sub(self.start)).div_ceil(1_000)
    }

    /// The piece replaced by one sent `now`: it admits only until that arrives.
    fn ending(&self, now: Millis) -> Piece {
        Piece { until: self.until.min(now + MARGIN), expires: self.expires.min(now), ..*self }
    }

    /// Whether the Envoy surely still holds it when an assignment sent `now` arrives.
    fn alive(&self, now: Millis) -> bool {
        self.expires > now + MARGIN
    }
}

/// The rate to offer: the demand reported plus a quarter (and one), at most a fair part
/// of the pace at which the window can be spent in `time_left` ms: a `holders`th of what
/// the store has `remaining`, and the units the share holds for the time left (`own`).
/// At least [`FLOOR`]. Without a report yet, the fair part. Also whether the demand,
/// not the fair part, set it.
pub fn rate_for(demand: Option<f64>, remaining: u64, own: u64, time_left: Millis, holders: u64) -> (u64, bool) {
    let units = remaining as f64 / holders.max(1) as f64 + own as f64;
    let fair = (units * 1_000.0 / time_left.max(FILL) as f64).ceil() as u64;
    let wanted = demand.map_or(u64::MAX, |d| (d * 1.25).ceil() as u64 + 1);
    (wanted.min(fair).clamp(FLOOR, u64::from(u32::MAX)), wanted < fair)
}

/// The most a new piece of `secs` seconds may have as its rate (and depth), when `units`
/// are there to cover it: `rate x (1 + secs) <= units`.
pub fn affordable(units: u64, until: Millis, now: Millis) -> u64 {
    let life = until.saturating_sub(now);
    let mut rate = (units * 1_000) / (1_000 + life);
    // the bound rounds the refill up: one less where that tips it over
    while rate > 0 && rate + (rate * life).div_ceil(1_000) > units {
        rate -= 1;
    }
    rate
}

impl Limiter {
    /// The limit an Envoy RLQS bucket of `domain` shares (see [`crate::rlqs`]): its
    /// entries (a map: unordered) arranged to walk the rule tree (see
    /// `Domain::arrange`), then planned as a descriptor with those entries would be,
    /// overrides included. It must reach exactly one limit, a fixed window.
    pub fn quota_target(&self, domain: &str, entries: &[(&str, &str)]) -> Result<QuotaTarget, QuotaError> {
        if let Some(why) = &self.rules().pending {
            return Err(RequestError::NoRules(why.to_string()).into());
        }
        let d = (self.rules().domain(domain))
            .ok_or_else(|| QuotaError::UnknownDomain { domain: domain.chars().take(200).collect() })?;
        let order = d.arrange(entries).ok_or(QuotaError::NoRule)?;
        let req = Request::new(domain).descriptor(order.iter().map(|&i| entries[i]));
        let now = self.now();
        let Plan { groups, .. } = plan(self.rules(), &self.overrides().current(), &req, Mode::Peek, None, now)?;
        let mut ops = groups.iter().flat_map(|g| g.ops.iter().map(move |op| (g.tag, op)));
        let Some((tag, op)) = ops.next() else { return Err(QuotaError::Unlimited) };
        if ops.next().is_some() {
            return Err(QuotaError::NotOneFixedWindow("it has more than one limit".into()));
        }
        match op.limit {
            Limit::FixedWindow { window, .. } if window >= MIN_WINDOW => {}
            Limit::FixedWindow { .. } => {
                return Err(QuotaError::NotOneFixedWindow(format!(
                    "its window is shorter than {} s, too short to share by assignments",
                    MIN_WINDOW / 1000
                )));
            }
            other => return Err(QuotaError::NotOneFixedWindow(format!("its limit is a {}", other.algorithm()))),
        }
        let generation = self.overrides().generation();
        Ok(QuotaTarget { tag, key: op.key, limit: op.limit, shadow: op.shadow, generation })
    }
}

/// What a tick did.
#[derive(Debug, Default)]
pub struct Tick {
    /// What to send, if anything (nothing: the window ends before a whole second more
    /// fits; the next window's assignment is sent when it starts).
    pub assignment: Option<Assignment>,
    /// Units granted from the store.
    pub granted: u64,
    /// Units held for a window now over (or a state left) and not reported admitted:
    /// the under-admission shares cost.
    pub unspent: u64,
}

/// One Envoy's share of one bucket.
#[derive(Debug, Default, serde::Serialize)]
pub struct Share {
    /// The state shared: its tag and key, and the limit and generation it was last ticked under.
    #[serde(skip)]
    state: Option<(Tag, u64)>,
    #[serde(skip)]
    limit: Option<Limit>,
    #[serde(skip)]
    generation: u64,
    /// The store's window held in: its reset (0: none yet).
    pub window: Millis,
    /// Units granted in it.
    pub held: u64,
    /// Its pieces, the last one possibly in force.
    pub pieces: Vec<Piece>,
    /// Requests reported allowed in it.
    pub allowed: u64,
    /// The latest grant still open: its id and units.
    #[serde(skip)]
    grant: Option<(u64, u64)>,
    /// The store's remaining and open grants at the latest grant call.
    #[serde(skip)]
    remaining: u64,
    #[serde(skip)]
    holders: u64,
    /// Requests a second reported (allowed and denied), once a report covered time.
    pub demand: Option<f64>,
    /// The report interval measured.
    pub interval: Millis,
    /// The assignment last sent, and when.
    pub assignment: Option<Assignment>,
    pub sent: Millis,
    /// When to send the piece in force again so that it lasts to the window's end (0:
    /// no need).
    #[serde(skip)]
    top_up: Millis,
    /// Shares of the same bucket the caller serves that want more than their demand
    /// (this one included): a fair part is never more than this share of what is left,
    /// even before the others hold grants (at a window's start the store knows of none,
    /// and the first shares to tick took the window between them: 7 of 2,000 streams
    /// got it all).
    #[serde(skip)]
    peers: u64,
    /// Whether the last tick's rate was set by the demand reported, not a fair part:
    /// such a share leaves the fair parts to the others ([`Share::contends`]).
    #[serde(skip)]
    by_demand: bool,
}

impl Share {
    /// Takes in one usage report of the bucket.
    pub fn report(&mut self, allowed: u64, denied: u64, elapsed_secs: u64) {
        self.allowed = self.allowed.saturating_add(allowed);
        if elapsed_secs > 0 {
            self.demand = Some(allowed.saturating_add(denied) as f64 / elapsed_secs as f64);
            self.interval = elapsed_secs.saturating_mul(1_000).clamp(FILL, 60_000);
        }
    }

    /// Says how many shares of this bucket the caller serves that [contend](Self::contends),
    /// this one included (see the field).
    pub fn set_peers(&mut self, peers: u64) {
        self.peers = peers;
    }

    /// Whether the share wants a fair part: its last rate was not set by the demand
    /// reported (a new share, or one whose demand is more than a fair part).
    pub fn contends(&self) -> bool {
        !self.by_demand
    }

    /// The most the pieces of this window admit.
    pub fn committed(&self) -> u64 {
        self.pieces.iter().map(Piece::bound).sum()
    }

    /// The last piece, if the Envoy surely still holds it when what is sent `now` arrives.
    fn in_force(&self, now: Millis) -> Option<Piece> {
        self.pieces.last().copied().filter(|p| p.alive(now))
    }

    /// Ends the piece in force: replaced by what is sent `now`, it admits only until that
    /// arrives.
    fn truncate(&mut self, now: Millis) {
        if let Some(p) = self.pieces.last_mut().filter(|p| p.until > now) {
            *p = p.ending(now);
        }
    }

    /// Starts over in `window`: returns the units held in the old one and not reported
    /// admitted. A piece still in force (a window restarted early: a reset) counts in
    /// the new window for the rest of its life, full.
    fn restart(&mut self, window: Millis, now: Millis) -> u64 {
        let unspent = self.held.saturating_sub(self.allowed);
        let alive = self.pieces.last().filter(|p| p.until > now).map(|p| Piece { start: now, ..*p });
        self.pieces = alive.into_iter().collect();
        (self.window, self.held, self.allowed, self.grant) = (window, 0, 0, None);
        unspent
    }

    /// Everything this share holds lapses (its Envoy is gone, or the bucket is): the
    /// units held and not reported admitted. Nothing goes back, since the Envoy may still
    /// spend its last assignment until it lapses.
    pub fn close(&mut self) -> u64 {
        self.restart(0, 0)
    }

    /// How long an assignment should last: the report interval (as measured) and
    /// [`OUTLIVE`], in ms.
    fn ttl_wanted(&self) -> Millis {
        (if self.interval == 0 { REPORT_INTERVAL } else { self.interval }) + OUTLIVE
    }

    /// When the share should tick without a report (0: never): to send the window's last
    /// piece again, or when its window ends, for the next window's.
    ///
    /// A TTL is whole seconds, so a piece cut by the window's end lapses up to a second
    /// before the window does, and what the window has left for that second would not
    /// be admitted. Sent again when the window's end is a whole number of seconds (and
    /// [`SLOP`]) away, the same settings keep the Envoy's bucket and last to the end.
    pub fn due(&self) -> Millis {
        match self.top_up {
            0 => self.window,
            t => t.min(self.window),
        }
    }

    /// Sets when to send the piece in force again, near the window's end `cap`: from
    /// then, a whole number of seconds lasts to [`SLOP`] before it.
    fn schedule_top_up(&mut self, now: Millis, cap: Millis) {
        let to_end = cap.saturating_sub(now + SLOP);
        let in_force = self.in_force(now).map_or(0, |p| p.expires);
        if to_end >= 1_000 && cap - SLOP > in_force + SLOP {
            self.top_up = now + to_end % 1_000;
        }
    }

    /// Allows everything (an `unlimited` rule, a shadow-mode policy): no grant is held.
    pub fn allow_all(&mut self, now: Millis) -> Assignment {
        let a = Assignment::AllowAll { ttl: self.ttl_wanted() / 1_000 };
        (self.assignment, self.sent) = (Some(a), now);
        a
    }

    /// Brings the share up to date at `now`: takes what the next assignment needs from
    /// the store, and says what to send.
    pub async fn tick(&mut self, limiter: &Limiter, target: &QuotaTarget, now: Millis) -> Result<Tick, StoreError> {
        let mut tick = Tick::default();
        self.top_up = 0;
        if target.shadow {
            tick.assignment = Some(self.allow_all(now));
            return Ok(tick);
        }
        let ttl_wanted = self.ttl_wanted();
        if !matches!(target.limit, Limit::FixedWindow { .. }) {
            return Err(StoreError::protocol("RLQS shares fixed windows only"));
        }
        self.catch_up(limiter, target, now, &mut tick).await?;
        let cap = self.window.saturating_sub(MARGIN);
        let ttl = ((now + ttl_wanted).min(cap).saturating_sub(now)) / 1_000;
        let in_force = self.in_force(now).map_or(0, |p| p.expires);
        let near_end = now + ttl_wanted > cap;
        if ttl == 0 || in_force >= now + ttl * 1_000 {
            // the window's end leaves no piece longer than the one in force (for now)
            if near_end {
                self.schedule_top_up(now, cap);
            }
            return Ok(tick);
        }
        let by_demand = self.plan(now, ttl, cap);
        self.by_demand = by_demand;
        let need = self.committed().saturating_sub(self.held);
        if need > 0 {
            let mut g = self.grant(limiter, target, need, need, now).await?;
            if g.units == 0 {
                // less is left than needed: whatever the store lets go of
                g = self.grant(limiter, target, 1, need, now).await?;
            }
            if g.decision.reset_at != self.window {
                // the window restarted since (its end passed, or a reset): the units are
                // the new window's, and so is the piece just planned
                tick.unspent += self.restart(g.decision.reset_at, now);
            }
            self.held += g.units;
            tick.granted = g.units;
        }
        tick.assignment = Some(self.fit(now, ttl));
        (self.assignment, self.sent) = (tick.assignment, now);
        if near_end {
            self.schedule_top_up(now, cap);
        }
        if by_demand && self.grant.is_some() {
            // a share its demand sets is no holder of the window: closing its grant
            // leaves the fair parts to the shares that want more (and gives back what
            // the pieces cannot admit)
            self.give_back(limiter, now).await?;
        }
        Ok(tick)
    }

    /// Follows the state, its limit and its window to `now`: a new state starts afresh,
    /// a new limit of the same state (a reload, an override) or a reset gives back what
    /// is held past what the Envoy may still admit; then a grant of nothing reads the
    /// window as it stands (its end, what is left, and who holds grants in it now: a
    /// share that stopped wanting more closed its grant).
    async fn catch_up(
        &mut self,
        limiter: &Limiter,
        target: &QuotaTarget,
        now: Millis,
        tick: &mut Tick,
    ) -> Result<(), StoreError> {
        let state = (target.tag, target.key);
        if self.state != Some(state) {
            tick.unspent += self.restart(0, now);
            self.state = Some(state);
        } else if self.limit != Some(target.limit) || self.generation != target.generation {
            self.truncate(now);
            self.give_back(limiter, now).await?;
        }
        (self.limit, self.generation) = (Some(target.limit), target.generation);
        let g = self.grant(limiter, target, 0, 0, now).await?;
        if g.decision.reset_at != self.window {
            tick.unspent += self.restart(g.decision.reset_at, now);
        }
        Ok(())
    }

    /// Plans the next piece, of `ttl` seconds from `now`, its window's pieces ending by
    /// `cap`: the rate in force when the new one is within a fifth of it (the Envoy keeps
    /// its bucket; a new one would cost the margin, and come full), which extends the
    /// piece in force. Returns whether the demand, not a fair part, set the rate.
    fn plan(&mut self, now: Millis, ttl: u64, cap: Millis) -> bool {
        let (expires, until) = (now + ttl * 1_000, now + ttl * 1_000 + MARGIN);
        let last = self.in_force(now);
        // the units held and not committed, and what the piece in force commits past the
        // moment a new one would replace it
        let own = self.held.saturating_sub(self.committed()) + last.map_or(0, |p| p.bound() - p.ending(now).bound());
        let holders = (self.holders + u64::from(self.grant.is_none())).max(self.peers);
        let (mut rate, by_demand) = rate_for(self.demand, self.remaining, own, cap.saturating_sub(now), holders);
        if let Some(p) = last.filter(|p| p.rate.abs_diff(rate) * 5 <= p.rate) {
            rate = p.rate;
        }
        let depth = rate.max(1);
        match self.pieces.last_mut() {
            Some(p) if last.is_some_and(|l| (l.rate, l.depth) == (rate, depth)) => {
                (p.expires, p.until) = (expires, until)
            }
            _ => {
                self.truncate(now);
                if self.pieces.len() >= MAX_PIECES {
                    self.pieces.remove(0);
                }
                self.pieces.push(Piece { rate, depth, start: now, expires, until });
            }
        }
        by_demand
    }

    /// Makes the piece just planned fit what is held: a smaller rate, or DENY_ALL.
    fn fit(&mut self, now: Millis, ttl: u64) -> Assignment {
        let last = *self.pieces.last().expect("a piece was planned");
        if self.committed() <= self.held {
            return Assignment::TokenBucket { rate: last.rate, depth: last.depth, ttl };
        }
        self.pieces.pop();
        if last.start < now {
            // an extension that does not fit: the piece in force ends, replaced
            self.pieces.push(last);
            self.truncate(now);
        }
        let rate = affordable(self.held.saturating_sub(self.committed()), last.until, now).min(last.rate);
        if rate == 0 {
            return Assignment::DenyAll { ttl };
        }
        self.pieces.push(Piece { rate, depth: rate, start: now, ..last });
        Assignment::TokenBucket { rate, depth: rate, ttl }
    }

    /// One grant call: `need` to `want` units of the state (0: only reads the window),
    /// closing the grant held before; keeps what it says about the window.
    async fn grant(
        &mut self,
        limiter: &Limiter,
        target: &QuotaTarget,
        need: u64,
        want: u64,
        now: Millis,
    ) -> Result<Granted, StoreError> {
        let id = limiter.grants().new_id();
        let close = match want {
            0 => Vec::new(),
            _ => self.grant.take().map(|(id, _)| id).into_iter().collect(),
        };
        let ask = GrantAsk { key: target.key, limit: target.limit, need, want, id, close, pool: false };
        let g = limiter.store().grant(target.tag, ask, now).await?;
        if g.units > 0 {
            self.grant = Some((id, g.units));
        }
        (self.remaining, self.holders) = (g.decision.remaining, g.holders);
        Ok(g)
    }

    /// Gives back what is held past what the pieces may admit, through the open grant,
    /// and closes it.
    async fn give_back(&mut self, limiter: &Limiter, now: Millis) -> Result<(), StoreError> {
        let surplus = self.held.saturating_sub(self.committed());
        let (Some((tag, key)), Some(limit), Some((id, units))) = (self.state, self.limit, self.grant) else {
            return Ok(());
        };
        let back = GiveBack { key, limit, id, unspent: surplus.min(units), window: self.window, keep: 0 };
        let returned = limiter.store().give_back(tag, back, now).await?;
        self.held -= returned;
        self.grant = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_admits_its_depth_then_its_rate() {
        let p = Piece { rate: 10, depth: 10, start: 1_000, expires: 8_000, until: 8_250 };
        // 10 at once, then 10 a second for 7.25 s, rounded up
        assert_eq!(p.bound(), 10 + 73);
    }

    #[test]
    fn the_rate_follows_demand_within_a_fair_part_of_the_pace() {
        // 600 left over 60 s by 2 holders: 5 a second each
        assert_eq!(rate_for(None, 600, 0, 60_000, 2), (5, false));
        assert_eq!(rate_for(Some(100.0), 600, 0, 60_000, 2), (5, false));
        // and what a share holds for the time left is its own: 300 / 2 + 150 over 60 s
        assert_eq!(rate_for(None, 300, 150, 60_000, 2), (5, false));
        // a quiet Envoy gets its demand and a quarter, plus one
        assert_eq!(rate_for(Some(2.0), 600, 0, 60_000, 2), (4, true));
        // an idle one the floor, and so does one when nothing is left
        assert_eq!(rate_for(Some(0.0), 600, 0, 60_000, 1), (1, true));
        assert_eq!(rate_for(Some(50.0), 0, 0, 60_000, 1), (FLOOR, false));
    }

    #[test]
    fn what_is_affordable_covers_the_depth_and_the_life() {
        // 7 s and a margin: rate x 8.25 <= 100
        let r = affordable(100, 7_250, 0);
        assert_eq!(r, 12);
        let p = Piece { rate: r, depth: r, start: 0, expires: 7_000, until: 7_250 };
        assert!(p.bound() <= 100);
    }
}
