//! The docs are run, not trusted: every config example in README.md and docs/ loads
//! with `sluice config check`, and the README's curl examples answer as shown. A doc
//! that drifts from the binary fails here.
//!
//! Which YAML blocks are configs: a block whose top-level keys include `domains`,
//! `domains_from` or `xds` is a whole config; one with other sections of a config only (a
//! `store:` example) is checked with a domain added; one whose top level is `domain:`
//! is a domain file (envoyproxy/ratelimit's format), checked inside a config. Envoy's
//! and Kubernetes' own files are theirs, not Sluice's, and are run elsewhere
//! (tests/envoy.rs, tests/deploy_docs.rs).

mod common;

use sluice_testkit::TempDir;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// README.md and every page of docs/.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![repo().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The fenced blocks of `text` whose info string is `lang`, with their first line's
/// number.
fn blocks(text: &str, lang: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut open: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let fence = line.trim_start();
        match &mut open {
            None if fence.strip_prefix("```").is_some_and(|info| info.trim() == lang) => {
                open = Some((i + 2, String::new()))
            }
            Some(_) if fence.starts_with("```") => {
                // a block inside a list item is indented with it
                let (line, body) = open.take().unwrap();
                let indent =
                    body.lines().filter(|l| !l.trim().is_empty()).map(|l| l.len() - l.trim_start().len()).min();
                let body = body.lines().map(|l| l.get(indent.unwrap_or(0)..).unwrap_or("")).collect::<Vec<_>>();
                out.push((line, body.join("\n") + "\n"));
            }
            Some((_, body)) => {
                body.push_str(line);
                body.push('\n');
            }
            None => {}
        }
    }
    out
}

/// A YAML block as a config to check, if it is one (see the module's doc).
fn as_config(block: &str) -> Option<String> {
    let value: serde_norway::Value = serde_norway::from_str(block).ok()?;
    let map = value.as_mapping()?;
    let has = |k: &str| map.contains_key(serde_norway::Value::String(k.into()));
    if has("domain") && has("descriptors") {
        let indented: String = block.lines().map(|l| format!("    {l}\n")).collect();
        return Some(format!("domains:\n  -\n{indented}"));
    }
    let sections = ["server", "store", "limiter", "headers", "domains", "domains_from", "log", "telemetry", "envoy"];
    // with `xds` the rules are pushed: a whole config without domains
    if has("domains") || has("domains_from") || has("xds") {
        Some(block.to_string())
    } else if sections.iter().any(|k| has(k)) {
        // some sections of a config: checked with a domain added
        let domain = "  - domain: part\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 5}\n";
        Some(format!("{block}domains:\n{domain}"))
    } else {
        None
    }
}

/// `config` with its `domains_from` (if any) pointed at a directory of `dir` holding
/// one domain file: the directory an example names is the reader's.
fn with_domain_files(config: &str, dir: &Path) -> String {
    let Some(line) = config.lines().find(|l| l.starts_with("domains_from:")) else { return config.to_string() };
    let files = dir.join("domains");
    std::fs::create_dir_all(&files).unwrap();
    let domain = "domain: files\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
    std::fs::write(files.join("files.yaml"), domain).unwrap();
    config.replace(line, &format!("domains_from: {}", files.display()))
}

/// `config` with each file it names by a `*_file` key that does not exist here (a
/// certificate, a secret) made in `dir`, and named there: the files an example names
/// are the reader's, and `config check` reads them.
fn with_named_files(config: &str, dir: &Path) -> String {
    let mut out = config.to_string();
    for piece in config.split("_file: ").skip(1) {
        let path = piece.split([',', '}', '\n', ' ']).next().unwrap_or_default().trim_matches('"');
        if path.is_empty() || Path::new(path).exists() {
            continue;
        }
        let made = dir.join(Path::new(path).file_name().unwrap_or_default());
        // a secret file holds a token; a certificate or key file, PEM
        let secret = ["token", "secret"].iter().any(|w| path.contains(w));
        let content = if secret { "0123456789abcdef0123456789abcdef\n" } else { "-----BEGIN CERTIFICATE-----\n" };
        std::fs::write(&made, content).unwrap();
        out = out.replace(path, &made.display().to_string());
    }
    out
}

#[test]
fn every_config_in_the_docs_loads() {
    let dir = TempDir::new("sluice-docs");
    let (mut checked, mut failed) = (0, Vec::new());
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.strip_prefix(repo()).unwrap().display().to_string();
        for (line, block) in blocks(&text, "yaml") {
            let Some(config) = as_config(&block) else { continue };
            let file = dir.path().join("sluice.yaml");
            std::fs::write(&file, with_named_files(&with_domain_files(&config, dir.path()), dir.path())).unwrap();
            let out = Command::new(common::bin()).args(["config", "check"]).arg(&file).output().unwrap();
            checked += 1;
            if !out.status.success() {
                failed.push(format!("{name}:{line}: {}", String::from_utf8_lossy(&out.stderr).trim()));
            }
        }
    }
    assert!(failed.is_empty(), "configs in the docs that do not load:\n{}", failed.join("\n"));
    assert!(checked >= 10, "only {checked} configs found in the docs");
}

/// The commands of a `sh` block (`$ ` lines, continued by a trailing `\`), each with the
/// output shown after it.
fn commands(block: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    let mut continued = false;
    for line in block.lines() {
        if let Some(command) = line.strip_prefix("$ ") {
            out.push((command.to_string(), Vec::new()));
            continued = command.ends_with('\\');
        } else if continued {
            let (command, _) = out.last_mut().unwrap();
            command.push('\n');
            command.push_str(line);
            continued = line.ends_with('\\');
        } else if let Some((_, shown)) = out.last_mut() {
            shown.push(line.to_string());
        }
    }
    out
}

/// Whether `actual` holds every field `shown` does, with the same values.
fn holds(actual: &serde_json::Value, shown: &serde_json::Value) -> bool {
    match (actual, shown) {
        (serde_json::Value::Object(a), serde_json::Value::Object(s)) => {
            s.iter().all(|(k, v)| a.get(k).is_some_and(|av| holds(av, v)))
        }
        (serde_json::Value::Array(a), serde_json::Value::Array(s)) => s.iter().zip(a).all(|(sv, av)| holds(av, sv)),
        _ => actual == shown,
    }
}

/// The README's `$ curl` examples, run as written (the address aside) against `sluice
/// serve` on its built-in config: the status line as shown, every header shown (values
/// that name a moment, such as the reset, by name only), and the body's fields shown.
#[test]
fn the_readme_curl_examples_answer_as_shown() {
    let curl = sluice_testkit::require("curl", "curl");
    let dir = TempDir::new("sluice-readme");
    let mut cmd = Command::new(common::bin());
    cmd.args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"]);
    let (_server, http, _) = common::spawn_command(cmd, dir.path());
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let mut ran = 0;
    for (line, block) in blocks(&readme, "sh") {
        for (command, shown) in commands(&block) {
            if !command.contains("curl") {
                continue;
            }
            let command = command.replace("localhost:8080", &http).replace("curl ", &format!("{} ", curl.display()));
            let out = Command::new("sh").arg("-c").arg(&command).output().unwrap();
            assert!(out.status.success(), "README.md:{line}: {command}: {}", String::from_utf8_lossy(&out.stderr));
            ran += 1;
            let Some(status) = shown.first() else { continue };
            let answer = String::from_utf8_lossy(&out.stdout).replace("\r\n", "\n");
            let (head, body) = answer.split_once("\n\n").unwrap_or((&answer, ""));
            assert_eq!(head.lines().next(), Some(status.as_str()), "README.md:{line}: {command}\n{answer}");
            let headers: Vec<(String, String)> = head
                .lines()
                .skip(1)
                .filter_map(|l| l.split_once(": ").map(|(k, v)| (k.to_ascii_lowercase(), v.to_string())))
                .collect();
            for shown_line in shown.iter().skip(1).take_while(|l| !l.is_empty()) {
                let (name, value) = shown_line.split_once(": ").unwrap_or((shown_line, ""));
                let got = headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
                let moment = ["x-ratelimit-reset", "retry-after"].contains(&name) || name == "ratelimit";
                match moment {
                    true => assert!(got.is_some(), "README.md:{line}: no {name} in\n{answer}"),
                    false => assert_eq!(got, Some(value), "README.md:{line}: {name}\n{answer}"),
                }
            }
            if let Some(json) = shown.iter().find(|l| l.starts_with('{')) {
                let shown_json: serde_json::Value = serde_json::from_str(&json.replace(",...", "")).unwrap();
                let actual: serde_json::Value = serde_json::from_str(body.trim()).unwrap();
                assert!(holds(&actual, &shown_json), "README.md:{line}: the body shown {json} is not\n{body}");
            }
        }
    }
    assert!(ran >= 3, "only {ran} curl examples found in README.md");
}
