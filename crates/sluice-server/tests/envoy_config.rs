//! envoyproxy/ratelimit config files, loaded unchanged from a directory
//! (`domains_from`), behave as that service documents.

mod common;

use common::{bin, hit, num, start_with};

fn fixtures() -> String {
    format!("{}/tests/envoy-config", env!("CARGO_MANIFEST_DIR"))
}

#[tokio::test]
async fn a_directory_of_their_files_loads_and_behaves() {
    let s = start_with(&format!("domains_from: \"{}\"\n", fixtures()), "  []\n");
    let c = reqwest::Client::new();
    let admitted = |domain: &'static str, entries: Vec<(&'static str, &'static str)>, n: usize| {
        let (c, base) = (c.clone(), s.base.clone());
        async move {
            let mut ok = 0;
            for _ in 0..n {
                ok += (hit(&c, &base, domain, &entries).await.status() == 200) as usize;
            }
            ok
        }
    };
    assert_eq!(admitted("api", vec![("user", "ann")], 5).await, 2);
    assert_eq!(admitted("api", vec![("user", "vip")], 6).await, 4, "key=value beats key alone");
    assert_eq!(admitted("api", vec![("tenant", "t1"), ("path", "/a")], 3).await, 1);
    assert_eq!(admitted("api", vec![("tenant", "t1"), ("path", "/b")], 3).await, 1, "each path counted apart");
    assert_eq!(admitted("api", vec![("path", "/healthz")], 5).await, 5, "unlimited, by prefix");
    // both plans: promo's weekly limit replaces free's daily one
    let both = |c: reqwest::Client, base: String| async move {
        let body = serde_json::json!({"domain": "billing", "descriptors": [
            {"entries": [{"key": "plan", "value": "free"}]},
            {"entries": [{"key": "plan", "value": "promo"}]}]});
        c.post(format!("{base}/v1/ratelimit")).json(&body).send().await.unwrap()
    };
    for left in [2, 1, 0] {
        let r = both(c.clone(), s.base.clone()).await;
        assert_eq!(r.status(), 200);
        assert_eq!(num(&r, "x-ratelimit-remaining"), left);
        assert_eq!(num(&r, "x-ratelimit-limit"), 3, "the week limit, not the replaced day limit");
    }
    assert_eq!(both(c.clone(), s.base.clone()).await.status(), 429);
    // shadow mode: never refused
    assert_eq!(admitted("billing", vec![("trial", "x")], 3).await, 3);
}

#[test]
fn a_broken_domain_file_is_reported_in_its_own_file() {
    let dir = sluice_testkit::TempDir::new("sluice-envoy-config");
    let domains = dir.path().join("domains");
    std::fs::create_dir(&domains).unwrap();
    std::fs::write(
        domains.join("good.yaml"),
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    )
    .unwrap();
    std::fs::write(
        domains.join("bad.yaml"),
        "domain: b\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n",
    )
    .unwrap();
    let config = dir.path().join("sluice.yaml");
    std::fs::write(&config, "domains_from: domains\n").unwrap();
    let out = std::process::Command::new(bin()).args(["config", "check"]).arg(&config).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.yaml:5:"), "{err}");
    assert!(err.contains("unknown unit `fortnight`"), "{err}");
}

/// What envoyproxy/ratelimit refuses to load is refused here too, in its own file:
/// `unlimited: true` with a `unit`, and a limit whose `replaces` names itself.
#[test]
fn their_refusals_are_refusals_here() {
    for (file, text, says) in [
        (
            "unlimited_with_unit.yaml",
            "domain: a\ndescriptors:\n  - key: k\n    rate_limit:\n      unlimited: true\n      unit: second\n",
            "takes no `unit`",
        ),
        (
            "replaces_self.yaml",
            "domain: b\ndescriptors:\n  - key: k\n    rate_limit:\n      name: own\n      unit: second\n      requests_per_unit: 1\n      replaces:\n        - name: own\n",
            "rate_limit 'own' lists itself in `replaces`",
        ),
    ] {
        let dir = sluice_testkit::TempDir::new("sluice-envoy-config");
        let domains = dir.path().join("domains");
        std::fs::create_dir(&domains).unwrap();
        std::fs::write(domains.join(file), text).unwrap();
        let config = dir.path().join("sluice.yaml");
        std::fs::write(&config, "domains_from: domains\n").unwrap();
        let out = std::process::Command::new(bin()).args(["config", "check"]).arg(&config).output().unwrap();
        assert!(!out.status.success(), "{file} loaded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("{file}:3:")), "{err}");
        assert!(err.contains(says), "{err}");
    }
}

/// A domain in two files is refused naming both places; with `envoy.merge_domains`
/// (their `MERGE_DOMAIN_CONFIG`) the files are one domain, but a rule in both is still
/// refused, naming both.
#[test]
fn a_domain_in_two_files_is_refused_or_merged() {
    let dir = sluice_testkit::TempDir::new("sluice-envoy-config");
    let domains = dir.path().join("domains");
    std::fs::create_dir(&domains).unwrap();
    let rule = |key: &str| {
        format!("domain: a\ndescriptors:\n  - key: {key}\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n")
    };
    std::fs::write(domains.join("1.yaml"), rule("user")).unwrap();
    std::fs::write(domains.join("2.yaml"), rule("ip")).unwrap();
    let check = |sections: &str| {
        let config = dir.path().join("sluice.yaml");
        std::fs::write(&config, format!("domains_from: domains\n{sections}")).unwrap();
        let out = std::process::Command::new(bin()).args(["config", "check"]).arg(&config).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (ok, err) = check("");
    assert!(!ok);
    assert!(err.contains("2.yaml:1:9: domain 'a' is also defined at ") && err.contains("1.yaml:1:9"), "{err}");
    assert!(err.contains("envoy.merge_domains"), "{err}");
    assert_eq!(check("envoy: {merge_domains: true}\n"), (true, String::new()));
    std::fs::write(domains.join("3.yaml"), rule("user")).unwrap();
    let (ok, err) = check("envoy: {merge_domains: true}\n");
    assert!(!ok);
    assert!(
        err.contains("3.yaml:3:10: `key: user` of domain 'a' is also defined at ") && err.contains("1.yaml:3:10"),
        "{err}"
    );
}

/// Their integration test's reload step: a file added to the directory is served, a
/// file removed is unloaded, without a restart.
#[tokio::test]
async fn files_added_and_removed_are_loaded_and_unloaded() {
    let dir = sluice_testkit::TempDir::new("sluice-envoy-reload");
    let domains = dir.path().join("domains");
    std::fs::create_dir(&domains).unwrap();
    let file = |name: &str, domain: &str| {
        let text = format!(
            "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 0}}\n"
        );
        std::fs::write(domains.join(name), text).unwrap();
    };
    file("basic.yaml", "basic");
    let config = dir.path().join("sluice.yaml");
    std::fs::write(&config, format!("{}domains_from: domains\n", common::SERVER)).unwrap();
    let (_process, http, _) = common::spawn(&config, dir.path());
    let (c, base) = (reqwest::Client::new(), format!("http://{http}"));
    let status = |domain: &'static str| {
        let (c, base) = (c.clone(), base.clone());
        async move { hit(&c, &base, domain, &[("k", "v")]).await.status().as_u16() }
    };
    assert_eq!((status("basic").await, status("added").await), (429, 400));
    file("added.yaml", "added");
    let until = |domain: &'static str, want: u16| async move {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while status(domain).await != want {
            assert!(std::time::Instant::now() < deadline, "{domain} never answered {want}");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    };
    until("added", 429).await;
    std::fs::remove_file(domains.join("basic.yaml")).unwrap();
    until("basic", 400).await;
    assert_eq!(status("added").await, 429);
}

/// `sluice config from-env` prints the config their environment makes, and below it, as
/// comments, each variable it read with its value (a credential's hidden) and each
/// variable without effect here with why. No credential is printed: the Redis password
/// and the key secret are placeholders that `config check` refuses, naming each, and the
/// file loads once they are filled in (before, both were printed as they were).
#[test]
fn from_env_prints_the_config_and_what_each_variable_became() {
    const SECRET: &str = "a-key-secret-of-this-deployment";
    let dir = sluice_testkit::TempDir::new("sluice-from-env");
    let files = dir.path().join("runtime/ratelimit/config");
    std::fs::create_dir_all(&files).unwrap();
    std::fs::write(
        files.join("api.yaml"),
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
    )
    .unwrap();
    let runtime = dir.path().join("runtime").display().to_string();
    let vars = [
        ("RUNTIME_ROOT", runtime.as_str()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "127.0.0.1:6379"),
        ("REDIS_AUTH", "hunter2-secret"),
        ("REDIS_POOL_SIZE", "10"),
        ("LIMIT_RESET_HEADER", "X-Reset-In"),
        ("USE_STATSD", "false"),
        ("SLUICE_KEY_SECRET", SECRET),
    ];
    let out = std::process::Command::new(bin()).args(["config", "from-env"]).env_clear().envs(vars).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("reset: X-Reset-In") && text.contains("kind: redis"), "{text}");
    for line in ["#   LIMIT_RESET_HEADER=X-Reset-In", "#   REDIS_URL=127.0.0.1:6379", "#   REDIS_AUTH=(set)"] {
        assert!(text.contains(line), "{line} not in:\n{text}");
    }
    // no credential anywhere (a printed config becomes a ConfigMap): the Redis password
    // and the key secret are placeholders, which `config check` refuses, naming each
    assert!(!text.contains("hunter2") && !text.contains(SECRET), "a credential printed:\n{text}");
    assert!(text.contains("redis://:CHANGE-ME@127.0.0.1:6379") && text.contains("key_secret: CHANGE-ME"), "{text}");
    let without = text.lines().find(|l| l.starts_with("# these have no effect here")).unwrap_or_default();
    assert!(without.contains("REDIS_POOL_SIZE"), "{text}");
    let check = |text: &str| {
        let file = dir.path().join("from-env.yaml");
        std::fs::write(&file, text).unwrap();
        let check = std::process::Command::new(bin()).args(["config", "check"]).arg(&file).output().unwrap();
        (check.status.success(), String::from_utf8_lossy(&check.stderr).into_owned())
    };
    let (ok, err) = check(&text);
    assert!(!ok && err.contains("store.url holds the placeholder password"), "{err}");
    let (ok, err) = check(&text.replace(":CHANGE-ME@", ":hunter2-secret@"));
    assert!(!ok && err.contains("limiter.key_secret is still the placeholder"), "{err}");
    let (ok, err) = check(&text.replace(":CHANGE-ME@", ":hunter2-secret@").replace("CHANGE-ME-the-key-secret", SECRET));
    assert!(ok, "{err}");
}

/// Values theirs refuses to start on are refused here too, naming the variable (before,
/// `SHADOW_MODE=on` enforced, `REDIS_TLS=yes` connected in plaintext, a ratio that was no
/// number was ignored): by `config from-env` and by `serve --ratelimit-env`, which exits
/// at once. What Go's `ParseBool` and logrus take is honoured, in their spellings.
#[test]
fn values_theirs_refuses_stop_the_start_naming_the_variable() {
    let base = [("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "127.0.0.1:1"), ("USE_STATSD", "false")];
    let from_env = |var: (&str, &str)| {
        let mut command = std::process::Command::new(bin());
        let out = command.args(["config", "from-env"]).env_clear().envs(base).envs([var]).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for (var, value) in [
        ("SHADOW_MODE", "on"),
        ("REDIS_TLS", "yes"),
        ("QUOTA_MODE", "yes"),
        ("USE_PROMETHEUS", "enabled"),
        ("SHADOW_MODE", "tRuE"),
        ("NEAR_LIMIT_RATIO", "abc"),
        ("NEAR_LIMIT_RATIO", "5"),
        ("EXTRA_TAGS", "garbage"),
        ("LOG_LEVEL", "loud"),
        ("STATS_FLUSH_INTERVAL", "0s"),
    ] {
        let (ok, _, err) = from_env((var, value));
        assert!(
            !ok && (err.contains(&format!("{var}={value} is not")) || err.contains(&format!("{var}={value}:"))),
            "{var}={value}: {err}"
        );
    }
    for (var, value, says) in [
        ("SHADOW_MODE", "True", "shadow_mode: true"),
        ("SHADOW_MODE", "F", "shadow_mode: false"),
        ("LOG_LEVEL", "WARNING", "level: warn"),
        ("NEAR_LIMIT_RATIO", "0.9", "near_limit_ratio: 0.9"),
    ] {
        let (ok, text, err) = from_env((var, value));
        assert!(ok && text.contains(says), "{var}={value}: {says} not in\n{text}{err}");
    }
    // the server itself refuses to start, naming the variable
    let mut serve = std::process::Command::new(bin());
    let serve = serve.args(["serve", "--ratelimit-env"]).env_clear().envs(base).env("SHADOW_MODE", "on");
    let mut child = serve.stderr(std::process::Stdio::piped()).spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("serve --ratelimit-env started with SHADOW_MODE=on");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success() && err.contains("SHADOW_MODE=on is not a boolean"), "{err}");
}
