//! The live page (`server.ui`, issue #19): behind the admin token (Bearer, or Basic for a
//! browser), off unless asked, refused at start without a token; opened in a real
//! headless Chromium, it shows the figures its JSON endpoint returns.

mod common;

use common::{hit, start_with};
use serde_json::Value;
use sluice_testkit::{TempDir, require};
use std::process::Command;

const TOKEN: &str = "ui-7d1e-secret-0123";
const DOMAINS: &str = "  - domain: api\n    descriptors:\n      - key: user\n        rate_limit: {name: hourly, unit: hour, requests_per_unit: 5}\n";

/// Runs headless Chromium on `url` with `args` (its JavaScript given 4 s of virtual time).
fn chromium(args: &[&str], url: &str) -> String {
    let program = require("chromium", "chromium");
    let profile = TempDir::new("sluice-chromium");
    let out = Command::new(program)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=4000"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .output()
        .unwrap();
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn the_live_page_shows_what_its_endpoint_returns() {
    let s = start_with(&format!("  admin_token: {TOKEN}\n  ui: true\n"), DOMAINS);
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
    let out = Command::new(common::bin()).args(["serve", "--config"]).arg(&config).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("server.ui is on but server.admin_token is not set"), "{said}");
}
