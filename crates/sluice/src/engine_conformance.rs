//! The engine's part of the conformance suite (`sluice::conformance_suite!` runs it on
//! every store): what the rules make of a request, through the engine, must count the
//! same on every store.

use crate::store::Store;
use std::sync::Arc;

/// envoyproxy/ratelimit's rules that change what is counted, through the engine on this
/// store: `requests_per_unit: 0` refuses every request and charges nothing;
/// `share_threshold` makes the values its wildcard matches share one counter (and only
/// those); and when one descriptor of a request is refused, the others' charges are given
/// back and each reports what is true afterwards (the same remaining every time, never
/// a charge that did not happen).
pub async fn envoy_rules_are_exact(s: Arc<dyn Store>) {
    let limit = |n: u64| serde_json::json!({"unit": "hour", "requests_per_unit": n});
    let config = serde_json::json!({
        // a fresh secret: every client of this check is new to the store
        "limiter": {"key_secret": format!("{:x}", crate::store::conformance::fresh_tag().0)},
        "domains": [{"domain": "d", "descriptors": [
            {"key": "ip", "value": "50.0.0.5", "rate_limit": limit(0)},
            {"key": "ip", "rate_limit": limit(1)},
            {"key": "files", "value": "files/*", "share_threshold": true, "rate_limit": limit(3)},
            {"key": "own", "value": "own/*", "rate_limit": limit(2)},
            {"key": "user", "rate_limit": limit(10)}]}]});
    let rules: crate::config::RulesConfig = serde_json::from_value(config).expect("the check's rules");
    let clock = crate::time::ManualClock::new(crate::store::conformance::t0());
    let l = &crate::engine::Limiter::new(Arc::new(rules.compile().expect("they compile")), s, Arc::new(clock));
    let check = |entries: &[(&str, &str)]| {
        let req = entries.iter().fold(crate::request::Request::new("d"), |r, &e| r.descriptor([e]));
        async move { l.check(&req).await.expect("a decision") }
    };
    for _ in 0..3 {
        let v = check(&[("ip", "50.0.0.5")]).await;
        assert!(!v.allowed(), "a limit of 0 refuses");
        assert_eq!(v.descriptors[0].policies[0].decision.used, 0, "and charges nothing");
    }
    assert!(check(&[("ip", "50.0.0.1")]).await.allowed(), "other values keep their limit");
    let check = &check;
    let admitted = |values: &'static [&'static str]| async move {
        let mut n = 0;
        for v in values {
            n += usize::from(check(&[(v.split('/').next().unwrap(), v)]).await.allowed());
        }
        n
    };
    assert_eq!(admitted(&["files/a", "files/b", "files/c", "files/d", "files/a"]).await, 3, "one shared counter");
    assert_eq!(admitted(&["own/a", "own/b", "own/a", "own/b", "own/a"]).await, 4, "a counter per value");
    // user u allowed and charged once; the ip of the same request is now spent
    assert!(check(&[("user", "u"), ("ip", "1.2.3.4")]).await.allowed());
    for _ in 0..3 {
        let v = check(&[("user", "u"), ("ip", "1.2.3.4")]).await;
        assert!(!v.allowed());
        let user = v.descriptors[0].policies[0].decision;
        assert_eq!((user.allowed, user.used, user.remaining), (true, 1, 9), "given back, and reported so");
    }
    let status = l.status(&crate::request::Request::new("d").descriptor([("user", "u")])).await.expect("a status");
    assert_eq!(status.descriptors[0].policies[0].decision.used, 1);
}

/// envoyproxy/ratelimit's quota mode, through the engine on this store: a quota-mode
/// limit over its limit marks its descriptor OVER_LIMIT and is not charged, but the
/// request goes on while another quota-mode limit it met has room (charging that one and
/// the enforced limits); once every quota is spent the request is refused and charges
/// nothing. An enforced limit refuses as ever. `limiter.quota_mode` puts every rule in it.
pub async fn quota_mode_refuses_when_every_quota_is_spent(s: Arc<dyn Store>) {
    use crate::Code;
    let limit = |n: u64| serde_json::json!({"unit": "hour", "requests_per_unit": n});
    let secret = || format!("{:x}", crate::store::conformance::fresh_tag().0);
    let config = |global: bool| {
        let quota = !global;
        serde_json::json!({
            "limiter": {"key_secret": secret(), "quota_mode": global},
            "domains": [{"domain": "d", "descriptors": [
                {"key": "premium", "quota_mode": quota, "rate_limit": limit(1)},
                {"key": "standard", "quota_mode": quota, "rate_limit": limit(2)},
                {"key": "user", "rate_limit": limit(3)}]}]})
    };
    for global in [false, true] {
        let rules: crate::config::RulesConfig = serde_json::from_value(config(global)).expect("the check's rules");
        let clock = crate::time::ManualClock::new(crate::store::conformance::t0());
        let l =
            crate::engine::Limiter::new(Arc::new(rules.compile().expect("they compile")), s.clone(), Arc::new(clock));
        let req = crate::request::Request::new("d").descriptor([("premium", "m")]).descriptor([("standard", "m")]);
        let req = if global { req } else { req.descriptor([("user", "u")]) };
        let used = |v: &crate::Verdict| v.descriptors.iter().map(|d| d.policies[0].decision.used).collect::<Vec<_>>();
        let codes = |v: &crate::Verdict| v.descriptors.iter().map(|d| d.code).collect::<Vec<_>>();
        let v = l.check(&req).await.expect("a decision");
        assert!(v.allowed(), "every quota has room");
        // premium is spent: marked, not charged; standard and user go on, charged
        let v = l.check(&req).await.expect("a decision");
        assert!(v.allowed(), "standard has room left (global {global})");
        assert_eq!((codes(&v)[0], codes(&v)[1]), (Code::OverLimit, Code::Ok));
        assert_eq!(&used(&v)[..2], [1, 2]);
        // every quota spent: refused, and what it would have charged is not
        let v = l.check(&req).await.expect("a decision");
        assert!(!v.allowed(), "every quota is spent (global {global})");
        assert_eq!((codes(&v)[0], codes(&v)[1]), (Code::OverLimit, Code::OverLimit));
        if !global {
            assert_eq!(used(&v), [1, 2, 2], "user charged by the two requests that went on, not this one");
            // an enforced limit refuses alone, a quota left or not
            let other = crate::request::Request::new("d").descriptor([("standard", "x")]).descriptor([("user", "u")]);
            assert!(l.check(&other).await.expect("a decision").allowed(), "the user's last unit");
            let v = l.check(&other).await.expect("a decision");
            assert!(!v.allowed() && codes(&v) == [Code::Ok, Code::OverLimit], "the user's limit is enforced");
            assert_eq!(used(&v), [1, 3], "and the quota's charge given back");
        }
        let status = l.status(&req).await.expect("a status");
        assert_eq!(used(&status)[..2], [1, 2], "a status read counts nothing");
    }
}

/// Expands to one `#[tokio::test]` per conformance check. `$make` is an expression that
/// evaluates to a future of `(store, guard)`: the guard (a server process, say) lives
/// until the test ends. `conformance_suite!(fixed_window_only name, make)` runs the checks
/// that only use fixed windows, for stores that have nothing else (memcached).
#[macro_export]
macro_rules! conformance_suite {
    (fixed_window_only $name:ident, $make:expr) => {
        $crate::conformance_suite!(@tests $name, $make; fixed_window_counts_and_resets, aligned_window_ends_on_boundary,
            all_or_nothing, shadow_does_not_block, peek_never_charges, refunds, tags_and_keys_are_independent,
            reset_forgets_state, registry_is_versioned, grants_are_shares_given_back_once, pools_hold_what_the_region_holds,
            reservations_hold_and_settle,
            reservations_follow_the_model, reservations_count_billions, reservations_are_bounded,
            refusals_with_holds_say_when_the_first_lapses, lapsed_holds_come_back_when_touched_late);
    };
    ($name:ident, $make:expr) => {
        $crate::conformance_suite!(@tests $name, $make; fixed_window_counts_and_resets, aligned_window_ends_on_boundary,
            all_or_nothing, shadow_does_not_block, cost_zero_charges_nothing, peek_never_charges,
            token_bucket_burst_and_refill, sliding_window_weighs_previous, concurrency_leases, refunds,
            tags_and_keys_are_independent, sequence_matches_model, reset_forgets_state, reset_forgets_every_kind,
            registry_is_versioned, grants_are_shares_given_back_once, bucket_grants_hold_the_refill_back,
            pools_hold_what_the_region_holds,
            reservations_hold_and_settle, reservations_follow_the_model, reservations_and_grants_share_a_window,
            reservations_count_billions, reservations_are_bounded, refusals_with_holds_say_when_the_first_lapses,
            lapsed_holds_come_back_when_touched_late);
    };
    (@tests $name:ident, $make:expr; $($check:ident),*) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            use $crate::store::Store;
            use $crate::store::conformance as c;

            async fn conformance_store() -> (std::sync::Arc<dyn Store>, impl Sized) {
                let (store, guard) = $make.await;
                (std::sync::Arc::new(store) as std::sync::Arc<dyn Store>, guard)
            }

            $(
                #[tokio::test]
                async fn $check() {
                    let (s, _guard) = conformance_store().await;
                    c::$check(&*s).await
                }
            )*

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_calls_are_exact() {
                let (s, _guard) = conformance_store().await;
                c::concurrent_calls_are_exact(s).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_reservations_never_pass_the_limit() {
                let (s, _guard) = conformance_store().await;
                c::concurrent_reservations_never_pass_the_limit(s).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_grants_never_pass_the_limit() {
                let (s, _guard) = conformance_store().await;
                c::concurrent_grants_never_pass_the_limit(s).await
            }

            #[tokio::test]
            async fn envoy_rules_are_exact() {
                let (s, _guard) = conformance_store().await;
                $crate::engine_conformance::envoy_rules_are_exact(s).await
            }

            #[tokio::test]
            async fn quota_mode_refuses_when_every_quota_is_spent() {
                let (s, _guard) = conformance_store().await;
                $crate::engine_conformance::quota_mode_refuses_when_every_quota_is_spent(s).await
            }
        }
    };
}
