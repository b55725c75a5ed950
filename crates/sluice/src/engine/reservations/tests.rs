//! The unit tests of `reservations`.

use super::*;

/// Id 0 is the reports': a reservation under it is refused, saying so.
#[tokio::test]
async fn id_zero_is_not_a_reservation() {
    let rules = crate::RulesBuilder::new()
        .domain(
            crate::DomainBuilder::new("d")
                .rule([("user", None)], |r| r.fixed_window("w", 10, std::time::Duration::from_secs(60))),
        )
        .build()
        .unwrap();
    let limiter = Limiter::in_memory(rules);
    let req = Request::new("d").descriptor([("user", "a")]);
    let e = limiter.reserve(&req, REPORT, 1_000).await.unwrap_err();
    assert!(e.to_string().contains("reservation id 0"), "{e}");
    assert!(limiter.reserve(&req, 1, 1_000).await.unwrap().0.allowed());
}

/// A reservation names at most MAX_RESERVED_DESCRIPTORS descriptors, however many a
/// request may carry (an id counts each window's in a byte): one more is refused,
/// saying so; and a request of one window named 255 times holds it once.
#[tokio::test]
async fn a_reservation_names_at_most_255_descriptors() {
    let mut limiter = crate::config::LimiterConfig::default();
    limiter.request_bounds.descriptors = 1_000;
    let rule = serde_json::json!([{"domain": "d", "descriptors": [
        {"key": "user", "rate_limit": {"unit": "hour", "requests_per_unit": 1000}}]}]);
    let domains: Vec<crate::config::DomainConfig> = serde_json::from_value(rule).unwrap();
    let limiter = Limiter::in_memory(crate::rules::Rules::compile(&limiter, &domains).unwrap());
    let req = |n: usize| {
        let mut r = Request::new("d");
        for _ in 0..n {
            r = r.descriptor([("user", "a")]);
        }
        r
    };
    let e = limiter.reserve(&req(MAX_RESERVED_DESCRIPTORS + 1), 1, 1_000).await.unwrap_err();
    assert!(e.to_string().contains("at most 255"), "{e}");
    let (v, held) = limiter.reserve(&req(MAX_RESERVED_DESCRIPTORS), 2, 1_000).await.unwrap();
    assert!(v.allowed());
    let held = held.unwrap();
    assert_eq!(Reserved::from_bytes(&held.to_bytes()), Some(held.clone()), "its bytes read back");
    let settled = limiter.commit(&held, &[1; MAX_RESERVED_DESCRIPTORS]).await.unwrap();
    assert_eq!(settled, [Settled::Committed { held: MAX_RESERVED_DESCRIPTORS as u64 }], "one window");
}
