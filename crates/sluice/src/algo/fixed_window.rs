//! GitHub's fixed window with a stored reset time.
//!
//! State is `{used, resets_at}`. The reset is decided once, when the window starts, and
//! stored; every answer in the window reports that stored value, so `X-RateLimit-Reset`
//! cannot wobble. A window whose stored reset has passed is treated as empty, whatever a
//! store (or a lagging replica) still holds: expiry is the application's decision.

use super::Decision;
use crate::time::Millis;

/// One client's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WindowState {
    /// What has been charged in this window.
    pub used: u64,
    /// When this window ends, in ms since the epoch. Stored, never recomputed.
    pub resets_at: Millis,
}

/// Where a window that starts at `now` ends: `now + window`, or with `aligned` the next
/// multiple of `window` (as envoyproxy/ratelimit counts).
pub fn window_end(window: Millis, aligned: bool, now: Millis) -> Millis {
    if aligned { (now / window + 1) * window } else { now + window }
}

/// An empty window starting at `now`.
pub fn fresh(window: Millis, aligned: bool, now: Millis) -> WindowState {
    WindowState { used: 0, resets_at: window_end(window, aligned, now) }
}

/// The state at `now`: unchanged while the window lasts, a fresh window once
/// `now >= resets_at`.
pub fn normalize(s: WindowState, window: Millis, aligned: bool, now: Millis) -> WindowState {
    if now >= s.resets_at { fresh(window, aligned, now) } else { s }
}

/// Charges `cost` if `used + cost <= limit`; otherwise refuses and charges nothing.
pub fn charge(s: WindowState, limit: u64, cost: u64, now: Millis) -> (Decision, Option<WindowState>) {
    let used = s.used.saturating_add(cost);
    if used <= limit {
        let d = Decision {
            holds: false,
            allowed: true,
            limit,
            used,
            remaining: limit - used,
            reset_at: s.resets_at,
            retry_after: None,
        };
        (d, (cost > 0).then_some(WindowState { used, ..s }))
    } else {
        let d = Decision {
            holds: false,
            allowed: false,
            limit,
            used: s.used,
            // GitHub's second bug was a 429 saying `Remaining: 5000`: a refusal says 0.
            remaining: 0,
            reset_at: s.resets_at,
            retry_after: (cost <= limit).then(|| s.resets_at.saturating_sub(now)),
        };
        (d, None)
    }
}

/// Gives back `cost` if the state is still the window (`resets_at`) that was charged.
pub fn refund(s: WindowState, cost: u64, charged_window: Millis) -> Option<WindowState> {
    (s.resets_at == charged_window && s.used > 0).then(|| WindowState { used: s.used.saturating_sub(cost), ..s })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_starts_at_first_hit_and_keeps_its_reset() {
        let s = normalize(WindowState::default(), 60_000, false, 1_000_500);
        assert_eq!(s, WindowState { used: 0, resets_at: 1_060_500 });
        let (d, s) = charge(s, 2, 1, 1_000_500);
        let s = s.unwrap();
        assert!(d.allowed);
        assert_eq!((d.used, d.remaining, d.reset_at), (1, 1, 1_060_500));
        // later in the window: the same reset
        let s = normalize(s, 60_000, false, 1_059_999);
        let (d, s) = charge(s, 2, 1, 1_059_999);
        assert_eq!((d.allowed, d.remaining, d.reset_at), (true, 0, 1_060_500));
        let (d, none) = charge(s.unwrap(), 2, 1, 1_059_999);
        assert_eq!((d.allowed, d.remaining, d.retry_after), (false, 0, Some(501)));
        assert!(none.is_none());
    }

    #[test]
    fn reset_passes_exactly_at_resets_at() {
        let s = WindowState { used: 5, resets_at: 2_000 };
        assert_eq!(normalize(s, 1_000, false, 1_999), s);
        assert_eq!(normalize(s, 1_000, false, 2_000), WindowState { used: 0, resets_at: 3_000 });
    }

    #[test]
    fn aligned_windows_end_on_clock_boundaries() {
        assert_eq!(window_end(60_000, true, 61_234), 120_000);
        assert_eq!(window_end(60_000, true, 120_000), 180_000);
        assert_eq!(window_end(60_000, false, 61_234), 121_234);
    }

    #[test]
    fn refund_only_reaches_the_window_it_was_charged_in() {
        let s = WindowState { used: 3, resets_at: 9_000 };
        assert_eq!(refund(s, 1, 9_000), Some(WindowState { used: 2, resets_at: 9_000 }));
        assert_eq!(refund(s, 1, 8_000), None);
        assert_eq!(refund(WindowState { used: 1, resets_at: 9_000 }, 5, 9_000).unwrap().used, 0);
    }
}
