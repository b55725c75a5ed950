//! Hot reload, end to end: a config edited in place, replaced by an atomic rename, and
//! swapped through a symlink (as Kubernetes swaps a ConfigMap) each take effect within
//! 2 s; a broken one is refused and counted while the last good one keeps serving; and
//! requests running through all of it are never dropped.

mod common;

use common::num;
use sluice_testkit::TempDir;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn config(limit: u64) -> String {
    format!(
        "{}domains:\n  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n",
        common::SERVER
    )
}

/// Waits until status reads report `limit`; returns how long that took.
async fn until_limit(client: &reqwest::Client, base: &str, limit: u64) -> Duration {
    let started = Instant::now();
    loop {
        let r = client.get(format!("{base}/v1/ratelimit?domain=d&user=probe")).send().await.unwrap();
        if num(&r, "x-ratelimit-limit") == limit {
            return started.elapsed();
        }
        assert!(started.elapsed() < Duration::from_secs(3), "limit {limit} not in force after 3 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_renames_and_symlink_swaps_take_effect_without_dropping_requests() {
    let dir = TempDir::new("sluice-reload");
    let (v1, v2, link) = (dir.path().join("v1.yaml"), dir.path().join("v2.yaml"), dir.path().join("sluice.yaml"));
    std::fs::write(&v1, config(3)).unwrap();
    std::os::unix::fs::symlink(&v1, &link).unwrap();
    let (_server, http, _) = common::spawn(&link, dir.path());
    let base = format!("http://{http}");
    let client = reqwest::Client::new();

    // load running through every reload: every request must get an answer, 200 or 429
    let stop = Arc::new(AtomicBool::new(false));
    let (answered, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (client, base, stop, answered, failed) =
            (client.clone(), base.clone(), stop.clone(), answered.clone(), failed.clone());
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let r = client
                    .post(format!("{base}/v1/ratelimit"))
                    .json(&common::body("d", &[("user", &format!("bg{}", i % 50))]))
                    .send()
                    .await;
                match r.map(|r| r.status().as_u16()) {
                    Ok(200 | 429) => answered.fetch_add(1, Ordering::Relaxed),
                    _ => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        })
    };

    assert!(until_limit(&client, &base, 3).await < Duration::from_millis(100));
    // 1. edited in place
    std::fs::write(&v1, config(5)).unwrap();
    let took = until_limit(&client, &base, 5).await;
    assert!(took <= Duration::from_secs(2), "in-place edit took {took:?}");
    // 2. replaced by an atomic rename
    write_atomically(&v1, &config(7));
    let took = until_limit(&client, &base, 7).await;
    assert!(took <= Duration::from_secs(2), "rename took {took:?}");
    // 3. a symlink swapped to another file, atomically
    std::fs::write(&v2, config(9)).unwrap();
    let next = dir.path().join("next-link");
    std::os::unix::fs::symlink(&v2, &next).unwrap();
    std::fs::rename(&next, &link).unwrap();
    let took = until_limit(&client, &base, 9).await;
    assert!(took <= Duration::from_secs(2), "symlink swap took {took:?}");
    // 4. a broken config is refused; the last good one keeps serving
    std::fs::write(&v2, config(9).replace("unit: hour", "unit: fortnight")).unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let r = client.get(format!("{base}/v1/ratelimit?domain=d&user=probe")).send().await.unwrap();
    assert_eq!(num(&r, "x-ratelimit-limit"), 9);
    let metrics = client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("sluice_config_reloads_total{result=\"failed\"} 1"), "{metrics}");
    assert!(metrics.contains("sluice_config_reloads_total{result=\"ok\"} 3"), "{metrics}");

    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    assert_eq!(failed.load(Ordering::Relaxed), 0, "requests were dropped during reloads");
    assert!(answered.load(Ordering::Relaxed) > 50);
}

/// A changed `store:` section builds and connects the new store; decisions move to it.
#[tokio::test]
async fn a_changed_store_is_connected() {
    let redis = sluice_testkit::RedisServer::start();
    let dir = TempDir::new("sluice-reload-store");
    let file = dir.path().join("sluice.yaml");
    std::fs::write(&file, config(100)).unwrap();
    let (_server, http, _) = common::spawn(&file, dir.path());
    let base = format!("http://{http}");
    let client = reqwest::Client::new();
    let r = common::hit(&client, &base, "d", &[("user", "mover")]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(redis.script_calls(), 0);
    let with_redis =
        config(100).replace("domains:", &format!("store:\n  kind: redis\n  url: {}\ndomains:", redis.url()));
    write_atomically(&file, &with_redis);
    let started = Instant::now();
    // The old store counts the client down from 98; the new one starts it afresh at 99.
    // (Script calls alone do not say a decision moved: the new store's overrides watcher
    // reads its registry by script before the store is put in force.)
    for remaining in (0..=98).rev() {
        let r = common::hit(&client, &base, "d", &[("user", "mover")]).await;
        assert_eq!((r.status().as_u16(), common::header(&r, "x-sluice-degraded")), (200, String::new()));
        if num(&r, "x-ratelimit-remaining") == 99 {
            assert!(redis.command("DBSIZE").unwrap().starts_with(":1"), "the client's count is in redis");
            return;
        }
        assert_eq!(num(&r, "x-ratelimit-remaining"), remaining, "still on the old store");
        assert!(started.elapsed() < Duration::from_secs(3), "decisions never moved to the new store");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("decisions never moved to the new store");
}

/// A migrating store's percentage moves through a config reload too, without rebuilding
/// the store (counts on both sides stay).
#[tokio::test]
async fn a_reload_moves_the_migration_percentage() {
    let dir = TempDir::new("sluice-reload-migration");
    let file = dir.path().join("sluice.yaml");
    let at = |percent: u8| {
        config(100).replace(
            "domains:",
            &format!("  admin_token: t-0123456789abcdef\nstore:\n  kind: migrating\n  percent: {percent}\n  from: {{kind: memory}}\n  to: {{kind: memory}}\ndomains:"),
        )
    };
    std::fs::write(&file, at(10)).unwrap();
    let (_server, http, _) = common::spawn(&file, dir.path());
    let base = format!("http://{http}");
    let client = reqwest::Client::new();
    let percent = || async {
        let r =
            client.get(format!("{base}/v1/admin/migration")).bearer_auth("t-0123456789abcdef").send().await.unwrap();
        r.json::<serde_json::Value>().await.unwrap()["percent"].as_u64().unwrap()
    };
    assert_eq!(percent().await, 10);
    // a client on `from` at 10%, so on `from` at 0% as well
    let tagger = sluice::tag::Tagger::new(sluice::config::DEFAULT_KEY_SECRET);
    let user = (0..)
        .map(|i| format!("stays-{i}"))
        .find(|u| !sluice::store::MigratingStore::on_new_store(tagger.tag("d", "user", u), 10))
        .unwrap();
    let before = common::hit(&client, &base, "d", &[("user", &user)]).await;
    assert_eq!(num(&before, "x-ratelimit-remaining"), 99);
    write_atomically(
        &file,
        &at(10).replace("percent: 10", "percent: 0").replace("requests_per_unit: 100", "requests_per_unit: 200"),
    );
    let started = Instant::now();
    while percent().await != 0 {
        assert!(started.elapsed() < Duration::from_secs(2), "the percentage did not move within 2 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // the store was kept, not rebuilt: the client's count is still there
    let r = common::hit(&client, &base, "d", &[("user", &user)]).await;
    assert_eq!(num(&r, "x-ratelimit-used"), 2);
    assert_eq!(num(&r, "x-ratelimit-limit"), 200, "and the new rules are in force");
}

/// A TCP listener that accepts connections and never answers: a store that hangs.
fn silent_server() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming().flatten() {
            held.push(c);
        }
    });
    addr
}

/// How long one decision takes (the store hangs, so: the deadline in force).
async fn decision_time(client: &reqwest::Client, base: &str) -> Duration {
    let started = Instant::now();
    let r = common::hit(client, base, "d", &[("user", "u")]).await;
    assert_eq!(common::header(&r, "x-sluice-degraded"), "fail-open");
    started.elapsed()
}

/// Editing `limiter:` alone (the store unchanged) takes effect: a new deadline bounds
/// the next decisions. (It used to be ignored while "config reloaded" was logged.)
#[tokio::test]
async fn a_changed_deadline_takes_effect_without_a_new_store() {
    let hang = silent_server();
    let dir = TempDir::new("sluice-reload-deadline");
    let file = dir.path().join("sluice.yaml");
    let at = |deadline: &str| {
        config(100).replace(
            "domains:",
            &format!(
                "store: {{kind: redis, url: \"redis://{hang}\", timeout: 10s}}\nlimiter: {{deadline: {deadline}, breaker_failures: 1000, near_cache: 0}}\ndomains:"
            ),
        )
    };
    std::fs::write(&file, at("100ms")).unwrap();
    let (server, http, _) = common::spawn(&file, dir.path());
    let base = format!("http://{http}");
    let client = reqwest::Client::new();
    let before = decision_time(&client, &base).await;
    assert!(before < Duration::from_millis(800), "the 100ms deadline took {before:?}");
    write_atomically(&file, &at("1500ms"));
    let started = Instant::now();
    loop {
        let took = decision_time(&client, &base).await;
        if took >= Duration::from_millis(1_400) {
            break;
        }
        let log = std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default();
        assert!(started.elapsed() < Duration::from_secs(4), "the new deadline never took effect: {took:?}\n{log}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = std::fs::read_to_string(dir.path().join("sluice.log")).unwrap();
    assert!(log.contains("applied") && log.contains("limiter"), "the reload says what it applied:\n{log}");
    drop(server);
}

/// A reload whose rules the store cannot run (a token bucket on Memcached) is refused
/// whole; the last good rules keep serving.
#[tokio::test]
async fn a_reload_the_store_cannot_run_is_refused() {
    let memcached = sluice_testkit::MemcachedServer::start();
    let dir = TempDir::new("sluice-reload-capability");
    let file = dir.path().join("sluice.yaml");
    let text = config(100)
        .replace("domains:", &format!("store: {{kind: memcached, servers: [\"{}\"]}}\ndomains:", memcached.addr()));
    std::fs::write(&file, &text).unwrap();
    let (_server, http, _) = common::spawn(&file, dir.path());
    let base = format!("http://{http}");
    let client = reqwest::Client::new();
    assert_eq!(num(&common::hit(&client, &base, "d", &[("user", "m")]).await, "x-ratelimit-limit"), 100);
    let bucket = text.replace(
        "rate_limit: {unit: hour, requests_per_unit: 100}",
        "policies: [{name: b, token_bucket: {rate: 5, per: 1s, burst: 5}}]",
    );
    assert_ne!(bucket, text);
    write_atomically(&file, &bucket);
    let started = Instant::now();
    while !common::metrics(&client, &base).await.contains("sluice_config_reloads_total{result=\"failed\"} 1") {
        assert!(started.elapsed() < Duration::from_secs(3), "the reload was not refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = common::hit(&client, &base, "d", &[("user", "m")]).await;
    assert_eq!((r.status().as_u16(), num(&r, "x-ratelimit-limit")), (200, 100), "the last good rules serve");
    let metrics = common::metrics(&client, &base).await;
    assert!(metrics.contains("sluice_config_reloads_total{result=\"ok\"} 0"), "{metrics}");
}

/// Waits until the scrape shows `n` failed reloads: at most 8 s, since a reload to a
/// store that does not answer is refused only after the watcher's poll (500 ms), its
/// settle time (250 ms) and the new store's 3 s to answer; 4 s left a loaded machine
/// 0.25 s, and a name that does not resolve took longer once.
async fn until_failed(client: &reqwest::Client, base: &str, n: u64, log: impl Fn() -> String) {
    let started = Instant::now();
    let want = format!("sluice_config_reloads_total{{result=\"failed\"}} {n}\n");
    while !common::metrics(client, base).await.contains(&want) {
        assert!(started.elapsed() < Duration::from_secs(8), "{n} failed reloads never counted:\n{}", log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A reload to a store that does not answer (a closed port, a name that does not
/// resolve) is refused, logged and counted; the last good store keeps deciding, and
/// readiness stays. (It was taken: every decision then failed open and /readyz said 503.)
#[tokio::test]
async fn a_reload_to_an_unreachable_store_is_refused() {
    let dir = TempDir::new("sluice-reload-unreachable");
    let file = dir.path().join("sluice.yaml");
    std::fs::write(&file, config(100)).unwrap();
    let (server, http, _) = common::spawn(&file, dir.path());
    let log = || std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default();
    let base = format!("http://{http}");
    let client = reqwest::Client::new();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    for (n, url) in [(1, format!("redis://{closed}")), (2, "redis://no-such-host.invalid:6379".to_string())] {
        let text = config(100).replace("domains:", &format!("store: {{kind: redis, url: \"{url}\"}}\ndomains:"));
        write_atomically(&file, &text);
        until_failed(&client, &base, n, log).await;
        let r = common::hit(&client, &base, "d", &[("user", "stays")]).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers().get("x-sluice-degraded"), None, "decided by the failure policy:\n{}", log());
        assert_eq!(num(&r, "x-ratelimit-used"), n, "the old store's count goes on");
        let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
        assert_eq!(ready.status(), 200);
    }
    let log = log();
    assert!(log.contains("did not answer within"), "{log}");
    assert!(common::metrics(&client, &base).await.contains("sluice_config_reloads_total{result=\"ok\"} 0"));
    drop(server);
}

/// A config file that cannot be read (deleted, a directory, a symlink loop) is logged
/// and counted as a failed reload, once each time, and on SIGHUP; the last good rules
/// keep serving, and a file put back is read again. (Each was ignored silently, so the
/// SluiceReloadFailed alert could never fire.)
#[tokio::test]
async fn a_config_file_that_cannot_be_read_is_logged_and_counted() {
    let dir = TempDir::new("sluice-reload-unreadable");
    let (real, link) = (dir.path().join("real.yaml"), dir.path().join("sluice.yaml"));
    std::fs::write(&real, config(7)).unwrap();
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let (server, http, _) = common::spawn(&link, dir.path());
    let log = || std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default();
    let base = format!("http://{http}");
    let client = reqwest::Client::new();
    let serves = || async {
        let r = client.get(format!("{base}/v1/ratelimit?domain=d&user=probe")).send().await.unwrap();
        assert_eq!(num(&r, "x-ratelimit-limit"), 7, "the last good rules serve");
    };
    // deleted: the symlink points at nothing
    std::fs::remove_file(&real).unwrap();
    until_failed(&client, &base, 1, log).await;
    serves().await;
    // and SIGHUP says so again
    server.signal("-HUP");
    until_failed(&client, &base, 2, log).await;
    // a directory where the file was
    std::fs::create_dir(&real).unwrap();
    until_failed(&client, &base, 3, log).await;
    std::fs::remove_dir(&real).unwrap();
    // a symlink loop
    std::os::unix::fs::symlink(&link, &real).unwrap();
    until_failed(&client, &base, 4, log).await;
    serves().await;
    // nothing more is counted while nothing changes
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    until_failed(&client, &base, 4, log).await;
    let text = log();
    assert!(text.contains("config file cannot be read"), "{text}");
    assert!(text.contains("No such file") && text.contains("directory"), "{text}");
    // put back with another limit: read again
    std::fs::remove_file(&real).unwrap();
    std::fs::write(&real, config(9)).unwrap();
    until_limit(&client, &base, 9).await;
}

/// A rewritten key secret file is noticed, and kept out of force until a restart: a new
/// secret re-keys every client, so a client that spent its limit would get it again. The
/// rest of a later reload is applied, and says so again.
#[tokio::test]
async fn a_rotated_key_secret_waits_for_a_restart() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("sluice-reload-key-secret");
    let (file, secret) = (dir.path().join("sluice.yaml"), dir.path().join("key_secret"));
    std::fs::write(&secret, "the-first-key-secret-of-ours\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let with_secret = |limit| {
        config(limit).replace("domains:", &format!("limiter:\n  key_secret_file: {}\ndomains:", secret.display()))
    };
    std::fs::write(&file, with_secret(5)).unwrap();
    let (_server, http, _) = common::spawn(&file, dir.path());
    let log = || std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default();
    let base = format!("http://{http}");
    let client = reqwest::Client::new();
    let codes = || async {
        let mut codes = Vec::new();
        for _ in 0..6 {
            codes.push(common::hit(&client, &base, "d", &[("user", "spent")]).await.status().as_u16());
        }
        codes
    };
    assert_eq!(codes().await, [200, 200, 200, 200, 200, 429]);
    let said = || log().matches("limiter.key_secret changed").count();

    let tmp = secret.with_extension("tmp");
    std::fs::write(&tmp, "a-second-key-secret-of-ours\n").unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::rename(&tmp, &secret).unwrap();
    let rotated = Instant::now();
    while said() == 0 {
        assert!(rotated.elapsed() < Duration::from_secs(5), "the rewritten secret went unnoticed:\n{}", log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(codes().await, [429; 6], "the client was re-keyed:\n{}", log());

    // an unrelated edit is applied; the secret stays the running one, said again
    write_atomically(&file, &with_secret(6));
    until_limit(&client, &base, 6).await;
    assert_eq!(said(), 2, "{}", log());
    let codes = codes().await;
    assert_eq!(codes, [200, 429, 429, 429, 429, 429], "5 of 6 spent, the raised limit's one more:\n{}", log());
    assert!(!log().contains("the-first-key-secret") && !log().contains("a-second-key-secret"), "{}", log());
}

/// The watcher looks at the files' metadata, not their bytes: a large config that does
/// not change costs next to no CPU. (Each poll read and parsed the whole file before:
/// at 1.1 MB, 13% of a core on a release build.)
#[tokio::test]
async fn an_unchanged_large_config_costs_no_cpu() {
    let dir = TempDir::new("sluice-reload-large");
    let file = dir.path().join("sluice.yaml");
    // 2,000 domains and 2 MB of comments: several MB a second of YAML to parse at 2 polls a second
    let mut text = format!("{}domains:\n", common::SERVER);
    for i in 0..2_000 {
        text.push_str(&format!(
            "  - domain: d{i}\n    descriptors:\n      - key: user\n        rate_limit: {{unit: hour, requests_per_unit: {i}}}\n"
        ));
        text.push_str(&format!("# {}\n", "x".repeat(1_000)));
    }
    std::fs::write(&file, &text).unwrap();
    let (server, _http, _) = common::spawn(&file, dir.path());
    let cpu = || common::cpu_ticks(server.pid());
    // past the first look (which reads the files once)
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let before = cpu();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let ticks = cpu() - before;
    // clock ticks are 1/100 s: 4 s of idle may cost 0.2 s (5% of a core)
    assert!(
        ticks <= 20,
        "an idle server with an unchanged {} MB config used {ticks}0 ms of CPU in 4 s",
        text.len() >> 20
    );
}

/// Turning a rule global by reload, with `region` and `global_store`, starts the region's
/// allocator: the rule admits at once (it used to log "config reloaded" and refuse every
/// request until a restart). A reload to a global store that does not answer is refused,
/// and the allocator in force keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turning_a_rule_global_by_reload_starts_the_allocator() {
    let (regional, global) = (sluice_testkit::RedisServer::start(), sluice_testkit::RedisServer::start());
    let dir = TempDir::new("sluice-reload-global");
    let file = dir.path().join("sluice.yaml");
    let store = format!("store: {{kind: redis, url: \"{}\"}}\n", regional.url());
    let plain = config(100).replace("domains:", &format!("{store}domains:"));
    std::fs::write(&file, &plain).unwrap();
    let (server, http, _) = common::spawn(&file, dir.path());
    let log = || std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default();
    let (base, client) = (format!("http://{http}"), reqwest::Client::new());
    assert_eq!(common::hit(&client, &base, "d", &[("user", "before")]).await.status(), 200);
    let global_at = |url: &str| {
        plain
            .replace("domains:", &format!("region: eu\nglobal_store: {{kind: redis, url: \"{url}\"}}\ndomains:"))
            .replace("requests_per_unit: 100}", "requests_per_unit: 100, global: true}")
    };
    write_atomically(&file, &global_at(&global.url()));
    let started = Instant::now();
    while !log().contains("a new allocator") {
        assert!(started.elapsed() < Duration::from_secs(5), "not reloaded:\n{}", log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in 0..20 {
        let r = common::hit(&client, &base, "d", &[("user", &format!("global-{i}"))]).await;
        assert_eq!(r.status(), 200, "a global rule turned on by reload refused a new client:\n{}", log());
        assert!(num(&r, "x-ratelimit-remaining") > 0);
    }
    let scrape = common::metrics(&client, &base).await;
    assert!(common::series(&scrape, "sluice_region_units_total{region=\"eu\",kind=\"taken\"}") > 0.0, "{scrape}");
    // a global store that does not answer: refused, the one in force goes on
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    write_atomically(&file, &global_at(&format!("redis://{closed}")));
    until_failed(&client, &base, 1, log).await;
    let r = common::hit(&client, &base, "d", &[("user", "after")]).await;
    assert_eq!(r.status(), 200, "{}", log());
    drop(server);
}
