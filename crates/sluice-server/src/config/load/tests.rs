//! The unit tests of `load`.

use super::*;

#[test]
fn the_default_config_loads() {
    let l = load_str(DEFAULT_CONFIG, "default.yaml").unwrap();
    assert!(l.rules.domain_names().contains(&"demo"));
}

#[test]
fn a_config_without_domains_is_refused() {
    for text in ["", "# nothing yet\n", "server:\n  http: 127.0.0.1:8080\n", "domains: []\n"] {
        let e = load_str(text, "c.yaml").err().unwrap_or_else(|| panic!("{text:?} was accepted"));
        assert!(e.to_string().starts_with("c.yaml: no domain"), "{text:?}: {e}");
    }
}

/// With `xds` the rules are the management server's: no domain is needed, and
/// domains beside it are refused, never mixed in.
#[test]
fn xds_and_domains_never_mix() {
    let xds = "xds: {server: 127.0.0.1:18000}\n";
    assert!(load_str(xds, "c.yaml").unwrap().rules.domain_names().is_empty());
    let both = format!("{xds}domains:\n  - domain: d\n");
    let e = load_str(&both, "c.yaml").err().unwrap();
    assert!(e.to_string().starts_with("c.yaml:1:1: `xds` and `domains`"), "{e}");
    let e = load_str(&format!("{xds}domains_from: rules\n"), "c.yaml").err().unwrap();
    assert!(e.message.contains("never mixes"), "{e}");
}

#[test]
fn rule_errors_point_at_the_rule() {
    let text = "domains:\n  - domain: d\n    descriptors:\n      - key: a\n        policies:\n          - name: p\n            sliding_window: {limit: 0, window: 1s}\n";
    let e = load_str(text, "c.yaml").err().unwrap();
    assert_eq!(e.at, Some((6, 19)), "{e}");
    assert!(e.to_string().starts_with("c.yaml:6:19: "), "{e}");
    assert!(e.message.contains("at least 1"), "{e}");
}

#[test]
fn parse_errors_point_at_the_value() {
    let text = "domains:\n  - domain: d\n    descriptors:\n      - key: a\n        rate_limit:\n          requests_per_unit: 5\n          unit: fortnight\n";
    let e = load_str(text, "c.yaml").err().unwrap();
    assert_eq!(e.at.map(|a| a.0), Some(7), "{e}");
    assert!(e.message.contains("unknown unit `fortnight`"), "{e}");
}

/// A file cut short mid-key (found by the fuzzer): the position is inside the file
/// (the YAML library names line 4 of 3), and not repeated in the message.
#[test]
fn a_truncated_file_is_placed_on_its_last_line() {
    let e = load_str("server:\n  http: 127.0.0.1:0\nd", "c.yaml").err().unwrap();
    assert_eq!(e.at, Some((3, 2)), "{e}");
    assert!(!e.message.contains("line 4"), "{e}");
}

/// A garbage domain file of megabytes on one line: the error quotes an excerpt of it,
/// not all of it (a 50 MB file was one 52 MB log line).
#[test]
fn a_huge_bad_file_is_quoted_in_part() {
    let dir = sluice_testkit::TempDir::new("sluice-garbage");
    std::fs::write(dir.path().join("junk.yaml"), "x".repeat(2_000_000)).unwrap();
    let config = dir.path().join("sluice.yaml");
    std::fs::write(&config, "domains_from: .\n").unwrap();
    let said = load_file(&config).err().unwrap().to_string();
    assert!(said.len() < 2 * MAX_MESSAGE && said.contains("bytes cut"), "{} bytes: {}", said.len(), &said[..200]);
    assert!(said.contains("junk.yaml"), "{said}");
}

/// Names of domain files that lead to no file (a dangling symlink, one that loops, a
/// directory) are skipped with a word each, not in silence; the others load.
#[test]
fn domain_files_that_lead_nowhere_are_named() {
    let dir = sluice_testkit::TempDir::new("sluice-links");
    let d = dir.path();
    std::fs::write(
        d.join("a.yaml"),
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    )
    .unwrap();
    std::os::unix::fs::symlink(d.join("gone.yaml"), d.join("dangling.yaml")).unwrap();
    std::os::unix::fs::symlink(d.join("loop.yaml"), d.join("loop.yaml")).unwrap();
    std::fs::create_dir(d.join("dir.yaml")).unwrap();
    std::fs::write(d.join("sluice.yaml"), "domains_from: .\n").unwrap();
    // the config file itself is one of the *.yaml files: it is no domain file
    std::fs::rename(d.join("sluice.yaml"), d.join("sluice.conf")).unwrap();
    let loaded = load_file(&d.join("sluice.conf")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(loaded.config.domains.len(), 1);
    let said = loaded.warnings.join("\n");
    assert_eq!(loaded.warnings.len(), 3, "{said}");
    for name in ["dangling.yaml: a symlink that leads to no file", "loop.yaml: a symlink", "dir.yaml: not a file"] {
        assert!(said.contains(name), "{name}: {said}");
    }
}

/// A domain in two pushed resources is named as resources, not files.
#[test]
fn pushed_domains_are_resources() {
    let domain = |text: &str| domain_file(text, "r").unwrap();
    let d = domain("domain: eg\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n");
    let pushed = vec![("RateLimitConfig 'a'".to_string(), d.clone()), ("RateLimitConfig 'b'".to_string(), d)];
    let e = with_domains(&Config::default(), pushed).err().unwrap().to_string();
    assert!(e.contains("keep one domain to a resource") && e.contains("read the resources as one domain"), "{e}");
}
