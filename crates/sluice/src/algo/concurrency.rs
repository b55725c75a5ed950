//! Stripe's concurrent requests limiter: leases with a time to live.
//!
//! A request takes a lease when it starts and gives it back when it ends. Requests that
//! get lost (a crashed worker, a dropped connection) would hold their place forever, so a
//! lease older than the TTL is reclaimed at the next acquire.

use super::Decision;
use crate::time::Millis;

/// A lease's identity: random, so one server cannot release another's lease by accident.
pub type Lease = u128;

/// The leases one client holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConcurrencyState {
    /// `(lease, acquired_at)`, oldest first.
    pub leases: Vec<(Lease, Millis)>,
}

impl ConcurrencyState {
    /// When the last lease held would be reclaimed.
    pub fn latest_expiry(&self, ttl: Millis) -> Millis {
        self.leases.iter().map(|&(_, at)| at + ttl).max().unwrap_or(0)
    }
    fn earliest_expiry(&self, ttl: Millis, now: Millis) -> Millis {
        self.leases.iter().map(|&(_, at)| at + ttl).min().unwrap_or(now)
    }
}

/// Leases past their TTL dropped.
pub fn normalize(mut s: ConcurrencyState, ttl: Millis, now: Millis) -> ConcurrencyState {
    s.leases.retain(|&(_, at)| at + ttl > now);
    s
}

/// How full the limiter is, without taking a lease.
pub fn status(s: &ConcurrencyState, limit: u64, ttl: Millis, now: Millis) -> Decision {
    let used = s.leases.len() as u64;
    Decision {
        holds: false,
        allowed: true,
        limit,
        used,
        remaining: limit.saturating_sub(used),
        reset_at: s.earliest_expiry(ttl, now),
        retry_after: None,
    }
}

/// Takes `lease` if fewer than `limit` are held. Taking a lease already held changes
/// nothing and succeeds (a retried acquire is not a second request).
pub fn acquire(
    s: &ConcurrencyState,
    limit: u64,
    ttl: Millis,
    lease: Lease,
    now: Millis,
) -> (Decision, Option<ConcurrencyState>) {
    if s.leases.iter().any(|&(id, _)| id == lease) {
        return (status(s, limit, ttl, now), None);
    }
    if (s.leases.len() as u64) < limit {
        let mut after = s.clone();
        after.leases.push((lease, now));
        (status(&after, limit, ttl, now), Some(after))
    } else {
        let reset_at = s.earliest_expiry(ttl, now);
        let d = Decision {
            holds: false,
            allowed: false,
            limit,
            used: s.leases.len() as u64,
            remaining: 0,
            reset_at,
            retry_after: Some(reset_at.saturating_sub(now)),
        };
        (d, None)
    }
}

/// Gives `lease` back. Releasing a lease not held (already released, reclaimed, or
/// unknown) does nothing: release is idempotent.
pub fn release(s: &mut ConcurrencyState, lease: Lease) -> bool {
    let before = s.leases.len();
    s.leases.retain(|&(id, _)| id != lease);
    s.leases.len() != before
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_release_and_reclaim() {
        let mut s = ConcurrencyState::default();
        for id in 1..=3 {
            let (d, n) = acquire(&normalize(s.clone(), 60_000, 0), 3, 60_000, id, id as u64);
            assert!(d.allowed);
            s = n.unwrap();
        }
        let (d, none) = acquire(&s, 3, 60_000, 4, 10);
        assert!(!d.allowed && none.is_none());
        assert_eq!(d.retry_after, Some(60_000 + 1 - 10));
        assert!(release(&mut s, 2));
        assert!(!release(&mut s, 2));
        assert!(acquire(&s, 3, 60_000, 4, 10).0.allowed);
        // past the TTL, lost leases come back
        assert!(normalize(s, 60_000, 60_004).leases.is_empty());
    }
}
