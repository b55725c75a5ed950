//! The live page (`server.ui`, issue #19): behind the admin token (Bearer, or Basic for a
//! browser), off unless asked, refused at start without a token; opened in a real
//! headless Chromium, it shows the figures its JSON endpoint returns.

mod common;

use common::{chromium, hit, start_with};
use serde_json::Value;
use sluice_testkit::TempDir;

const TOKEN: &str = "ui-7d1e-secret-0123";
const DOMAINS: &str = "  - domain: api\n    descriptors:\n      - key: user\n        rate_limit: {name: hourly, unit: hour, requests_per_unit: 5}\n";

#[tokio::test]
async fn the_live_page_shows_what_its_endpoint_returns() {
    let s = start_with(&format!("  admin_token: {TOKEN}\n  ui: true\n  adaptive_concurrency: true\n"), DOMAINS);
    let c = reqwest::Client::new();
    for _ in 0..25 {
        hit(&c, &s.base, "api", &[("user", "heavy")]).await;
    }
    for i in 0..30 {
        assert_eq!(hit(&c, &s.base, "api", &[("user", &format!("u{i}"))]).await.status(), 200);
    }
    let o = serde_json::json!({"domain": "api", "entries": [{"key": "user", "value": "vip"}], "limit": 100, "reason": "ticket 9"});
    let r = c.put(format!("{}/v1/overrides/vip", s.base)).bearer_auth(TOKEN).json(&o).send().await.unwrap();
    assert_eq!(r.status(), 200);
    tokio::time::sleep(std::time::Duration::from_millis(2_500)).await; // two samples
    // the endpoint: behind the token, with the rule's totals, the top client, the override
    let r = c.get(format!("{}/v1/admin/overview", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = c.get(format!("{}/ui", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.headers().get_all("www-authenticate").iter().any(|v| v.to_str().unwrap().starts_with("Basic")));
    let j: Value =
        c.get(format!("{}/v1/admin/overview", s.base)).bearer_auth(TOKEN).send().await.unwrap().json().await.unwrap();
    let rule = &j["rules"][0];
    assert_eq!(
        (rule["rule"].as_str(), rule["allowed"].as_u64(), rule["refused"].as_u64()),
        (Some("hourly"), Some(35), Some(20)),
        "{j}"
    );
    let top = &j["top_refused"][0]["clients"][0];
    assert_eq!((top["client"].as_str(), top["count"].as_u64()), (Some("user=heavy"), Some(20)), "{j}");
    assert_eq!((j["store"]["kind"].as_str(), j["overrides"][0]["id"].as_str()), (Some("memory"), Some("vip")));
    // server.adaptive_concurrency: the data plane's adaptive stage, at rest (one request
    // at a time: its initial limit, nothing waiting)
    let adaptive = (j["store"]["adaptive_limit"].as_f64(), j["store"]["adaptive_in_flight"].as_f64());
    assert_eq!(adaptive, (Some(20.0), Some(0.0)), "{j}");
    // the page, in a browser logging in with Basic: the same figures in its DOM
    let url = format!("{}/ui", s.base.replace("http://", &format!("http://admin:{TOKEN}@")));
    let dom = chromium(&["--dump-dom"], &url);
    for shown in [
        "id=\"store-kind\">memory<".to_string(),
        format!("data-rule=\"api/hourly\"><b>api / hourly</b><br><span class=\"figure allowed\">{}<", rule["allowed"]),
        format!("<span class=\"figure refused\">{}<", rule["refused"]),
        format!("<td class=\"client\">user=heavy</td><td class=\"count\">{}<", top["count"]),
        "data-override=\"vip\">vip: api user=vip limit 100 (ticket 9)<".to_string(),
        "id=\"status\">updated".to_string(),
        "id=\"adaptive-limit\">20<".to_string(),
    ] {
        assert!(dom.contains(&shown), "the page does not show {shown}:\n{dom}");
    }
    // and a screenshot of it (docs/operations.md has one made the same way)
    let shot = TempDir::new("sluice-ui-shot");
    let png = shot.path().join("ui.png");
    chromium(&["--window-size=1000,620", &format!("--screenshot={}", png.display())], &url);
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000, "a screenshot of {} bytes", bytes.len());
}

#[tokio::test]
async fn the_page_is_off_unless_asked_and_needs_a_token() {
    let s = start_with(&format!("  admin_token: {TOKEN}\n"), DOMAINS);
    let c = reqwest::Client::new();
    let r = c.get(format!("{}/ui", s.base)).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), 404, "server.ui is off by default");
    let dir = TempDir::new("sluice-ui-no-token");
    let config = dir.path().join("sluice.yaml");
    std::fs::write(&config, format!("{}  ui: true\ndomains:\n{DOMAINS}", common::SERVER)).unwrap();
    let out = std::process::Command::new(common::bin()).args(["serve", "--config"]).arg(&config).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("server.ui is on but server.admin_token is not set"), "{said}");
}

/// With 10,000 domains, the page's sampling keeps memory flat and takes a small share of
/// a core, and the overview answers at once with at most the rules it shows. (Five
/// minutes of whole parsed readings were kept: an idle server grew about 10 MB a
/// second, used 40% of a core, and the overview took 17.6 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_is_bounded_whatever_the_rules() {
    let _heavy = common::heavy().await;
    let domains = common::many_domains(10_000, 3);
    let s = start_with(&format!("  admin_token: {TOKEN}\n  ui: true\n"), &domains);
    let c = reqwest::Client::new();
    let overview = || async {
        let r = c.get(format!("{}/v1/admin/overview", s.base)).bearer_auth(TOKEN).send().await.unwrap();
        r.json::<Value>().await.unwrap()
    };
    // waits for a sample after `after` seconds covered (readings are spaced 20 times
    // their duration, which a debug build's 10,000 rules make seconds)
    let next_sample = |after: f64| async move {
        let started = std::time::Instant::now();
        loop {
            let j = overview().await;
            if j["seconds"].as_f64().unwrap() > after {
                return j;
            }
            assert!(started.elapsed() < std::time::Duration::from_secs(90), "no new sample in 90 s");
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    };
    let first = next_sample(0.0).await["seconds"].as_f64().unwrap();
    // traffic on 100 rules, some refused: 240 allowed, 60 refused (3 an hour each)
    for i in 0..100 {
        for _ in 0..(1 + i % 5) {
            hit(&c, &s.base, &format!("d{i}"), &[("user", "u")]).await;
        }
    }
    next_sample(first).await;
    let pid = s.process.pid();
    let cpu = || common::cpu_ticks(pid);
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    // the least resident memory over 3 s, at the start and at the end of 12 s: a reading
    // in flight holds a render of every rule for a moment (one sample taken then read
    // 21 MB of growth once), and what is kept shows in the least
    let least = || async {
        let mut least = u64::MAX;
        for _ in 0..12 {
            least = least.min(common::rss_of(pid));
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
        least
    };
    let cpu_before = cpu();
    let rss_before = least().await;
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    let (grown, ticks) = (least().await.saturating_sub(rss_before), cpu() - cpu_before);
    assert!(grown < 16 << 20, "RSS grew {} MB in 12 s idle", grown >> 20);
    // 12 s of a core is 1,200 ticks: the page may take a tenth of that (a twentieth, plus the rest of the server)
    assert!(ticks < 120, "{ticks}0 ms of CPU in 12 s idle");
    let started = std::time::Instant::now();
    let j = overview().await;
    let took = started.elapsed();
    assert!(took < std::time::Duration::from_secs(1), "the overview took {took:?}");
    let rules = j["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 50, "the 50 most decided of the 100 rules with traffic: {j}");
    assert!(rules.iter().all(|r| r["allowed"].as_u64().unwrap() + r["refused"].as_u64().unwrap() >= 3), "{j}");
    // every rule counts in the totals
    assert_eq!((j["allowed"].as_u64(), j["refused"].as_u64()), (Some(240), Some(60)), "{j}");
    assert!(j["top_refused"].as_array().unwrap().len() <= 50, "{j}");
}

/// Decisions made on local counts (`failure: local`, the store gone) are shown beside
/// 503s and fail-open, in the endpoint and on the page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_shows_decisions_on_local_counts() {
    let mut redis = sluice_testkit::RedisServer::start();
    let sections = format!("  admin_token: {TOKEN}\n  ui: true\nstore:\n  kind: redis\n  url: {}\n", redis.url());
    let rules = "  - domain: api\n    descriptors:\n      - key: user\n        failure: local\n        rate_limit: {name: hourly, unit: hour, requests_per_unit: 5}\n";
    let s = start_with(&sections, rules);
    redis.kill();
    let c = reqwest::Client::new();
    let r = hit(&c, &s.base, "api", &[("user", "first")]).await;
    assert_eq!(common::header(&r, "x-sluice-degraded"), "local", "{}", s.log());
    // requests go on while the page is read: its figure is the last second's
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (c, base, stop) = (c.clone(), s.base.clone(), stop.clone());
        tokio::spawn(async move {
            for i in 0.. {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    return i;
                }
                hit(&c, &base, "api", &[("user", &format!("u{}", i % 50))]).await;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            unreachable!()
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(2_500)).await; // two samples
    let j: Value =
        c.get(format!("{}/v1/admin/overview", s.base)).bearer_auth(TOKEN).send().await.unwrap().json().await.unwrap();
    let last = |key: &str| j[key].as_array().and_then(|a| a.last()).and_then(Value::as_f64);
    assert!(last("local_per_s").is_some_and(|r| r > 5.0), "{j}");
    assert_eq!((last("fail_open_per_s"), last("unavailable_per_s")), (Some(0.0), Some(0.0)), "{j}");
    let url = format!("{}/ui", s.base.replace("http://", &format!("http://admin:{TOKEN}@")));
    let dom = tokio::task::spawn_blocking(move || chromium(&["--dump-dom"], &url)).await.unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(load.await.unwrap() > 50);
    let shown = dom.split("id=\"local\">").nth(1).and_then(|rest| rest.split('<').next()).unwrap_or_default();
    assert!(shown.parse::<f64>().is_ok_and(|r| r > 0.0), "the page shows local {shown:?}:\n{dom}");
    assert!(dom.contains("id=\"fail-open\">0<"), "{dom}");
}
