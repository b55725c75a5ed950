//! Credentials kept out of the config file: `server.admin_token_file`,
//! `server.api_tokens_file` and `limiter.key_secret_file` name files whose content is the
//! secret, as a Kubernetes Secret mounted as a volume gives them (one file per key), so
//! the config can live in a ConfigMap that anyone who reads the namespace may read.
//!
//! The files are read where the config is (at start, by `config check`, and at each
//! reload), and a secret that is still the examples' placeholder is refused wherever it
//! comes from: a deployment copied as written must not run with a credential everyone
//! can read in this repository.

use crate::config::checks::{CheckError, token_ok};
use crate::config::{Config, StoreConfig};
use std::path::Path;

/// How every placeholder the examples ship begins: a secret that begins so was never set.
pub const PLACEHOLDER: &str = "CHANGE-ME";

/// The largest secret file read: a token is tens of bytes; a file this large is the
/// wrong file.
const MAX_FILE_BYTES: u64 = 64 * 1024;

/// Reads the secrets `config` names by file into their keys (`admin_token`, `api_tokens`,
/// `key_secret`), and refuses any secret that is still a placeholder. Returns a warning
/// for each secret file other users can read or write.
pub fn read(config: &mut Config) -> Result<Vec<String>, CheckError> {
    let mut warnings = Vec::new();
    let server = &mut config.server;
    if let Some(path) = &server.admin_token_file {
        if server.admin_token.is_some() {
            return Err(both("server", "admin_token"));
        }
        let token = single(path, "server.admin_token_file")?;
        not_placeholder(&token, "server", "admin_token_file", path)?;
        token_ok(&token).map_err(|why| at_file("server", "admin_token_file", path, why))?;
        server.admin_token = Some(token);
        warnings.extend(exposed(path, "server.admin_token_file"));
    }
    if let Some(path) = &server.api_tokens_file {
        let text = file(path, "server", "api_tokens_file")?;
        let tokens: Vec<(usize, &str)> = lines(&text).collect();
        if tokens.is_empty() {
            let why = "holds no token (one a line; blank lines and # comments are skipped)".to_string();
            return Err(at_file("server", "api_tokens_file", path, why));
        }
        for (line, token) in tokens {
            not_placeholder(token, "server", "api_tokens_file", path)?;
            token_ok(token)
                .map_err(|why| at_file("server", "api_tokens_file", path, format!("line {line}: the token {why}")))?;
            server.api_tokens.push(token.to_string());
        }
        warnings.extend(exposed(path, "server.api_tokens_file"));
    }
    let limiter = &mut config.limiter;
    if let Some(path) = &limiter.key_secret_file {
        if limiter.key_secret != sluice::config::DEFAULT_KEY_SECRET {
            return Err(both("limiter", "key_secret"));
        }
        limiter.key_secret = single(path, "limiter.key_secret_file")?;
        not_placeholder(&limiter.key_secret, "limiter", "key_secret_file", path)?;
        warnings.extend(exposed(path, "limiter.key_secret_file"));
    }
    // a placeholder says more than its length does
    placeholders(config)?;
    strong_key_secret(config)?;
    Ok(warnings)
}

/// Refuses a secret read from the file `path` (named by `section.key`) that is still a
/// placeholder, pointing at the key that names the file.
fn not_placeholder(secret: &str, section: &str, key: &str, path: &Path) -> Result<(), CheckError> {
    if !is_placeholder(secret) {
        return Ok(());
    }
    let why = format!(
        "holds the placeholder {PLACEHOLDER}...: the examples' secrets are public; write your own there \
         (`openssl rand -hex 16`)"
    );
    Err(at_file(section, key, path, why))
}

/// A warning when the secret file at `path` (named by `key`) can be read by every user
/// of the host, or written by others than its owner, as ssh refuses such a private key.
/// Warned of, not refused: a group that may read it (a Kubernetes Secret's
/// `defaultMode: 0440` with `fsGroup`) is how a pod is meant to read it.
fn exposed(path: &Path, key: &str) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    let who = match mode {
        m if m & 0o004 != 0 => "readable by every user of the host",
        m if m & 0o022 != 0 => "writable by users other than its owner",
        _ => return None,
    };
    Some(format!(
        "{key}: the file {} is {who} (mode {mode:04o}): `chmod 600` it (a Kubernetes Secret: `defaultMode: 0440`, \
         as deploy/kubernetes sets)",
        path.display()
    ))
}

/// Refuses a key secret that cannot keep clients from predicting their tags: blank, or
/// shorter than a token (`checks::token_ok`: 16 bytes). The built-in default is let
/// through (warned of at start, and fine for the in-memory store).
fn strong_key_secret(config: &Config) -> Result<(), CheckError> {
    let (secret, from) = (&config.limiter.key_secret, &config.limiter.key_secret_file);
    if secret == sluice::config::DEFAULT_KEY_SECRET {
        return Ok(());
    }
    let why = match secret.trim().len() {
        0 => "is empty or only white space".to_string(),
        n if n < crate::config::checks::MIN_TOKEN_BYTES => {
            format!("is {n} bytes, too short to keep tags unpredictable")
        }
        _ => return Ok(()),
    };
    let fix = "use at least 16 random bytes, e.g. the output of `openssl rand -hex 16`";
    Err(match from {
        Some(path) => at_file("limiter", "key_secret_file", path, format!("holds a key secret that {why}; {fix}")),
        None => CheckError::at(&["limiter", "key_secret"], format!("limiter.key_secret {why}; {fix}")),
    })
}

/// Refuses a secret that is still one of the examples' placeholders.
fn placeholders(config: &Config) -> Result<(), CheckError> {
    let mut passwords = Vec::new();
    store_passwords(&config.store, "store", &mut passwords);
    if let Some(global) = &config.global_store {
        store_passwords(global, "global_store", &mut passwords);
    }
    if let Some((at, _)) = passwords.iter().find(|(_, p)| is_placeholder(p)) {
        let path: Vec<&str> = at.split('.').collect();
        let message = format!(
            "{at} holds the placeholder password {PLACEHOLDER}... (as `sluice config from-env` prints a credential): \
             write the store's password there, or run `sluice serve --ratelimit-env` to read it from REDIS_AUTH"
        );
        return Err(CheckError::at(&path, message));
    }
    let (server, limiter) = (&config.server, &config.limiter);
    let secrets = server
        .admin_token
        .iter()
        .map(|t| ("admin_token", "server", t))
        .chain(server.api_tokens.iter().map(|t| ("api_tokens", "server", t)))
        .chain(std::iter::once(("key_secret", "limiter", &limiter.key_secret)));
    for (key, section, secret) in secrets {
        if is_placeholder(secret) {
            let message = format!(
                "{section}.{key} is still the placeholder {PLACEHOLDER}...: the examples' secrets are public; put \
                 your own in a Secret (`openssl rand -hex 16`) and name its file with {section}.{key}_file \
                 (docs/operations.md, \"Secrets\")"
            );
            return Err(CheckError::at(&[section, key], message));
        }
    }
    Ok(())
}

/// The passwords the store config `store` (at the key `at`) holds, in its URLs' user info
/// or its own keys, each with the key that holds it.
fn store_passwords<'a>(store: &'a StoreConfig, at: &str, out: &mut Vec<(String, &'a str)>) {
    let mut urls = |key: &str, urls: &mut dyn Iterator<Item = &'a String>| {
        out.extend(urls.filter_map(|u| url_password(u)).map(|p| (format!("{at}.{key}"), p)));
    };
    match store {
        StoreConfig::Redis { url, replicas, .. } => urls("url", &mut std::iter::once(url).chain(replicas)),
        StoreConfig::RedisCluster { nodes, .. } => urls("nodes", &mut nodes.iter()),
        StoreConfig::RedisSharded { shards, .. } => {
            urls("shards", &mut shards.iter().flat_map(|s| std::iter::once(&s.primary).chain(&s.replicas)))
        }
        StoreConfig::RedisSentinel(c) => {
            let keys = [("password", &c.password), ("sentinel_password", &c.sentinel_password)];
            out.extend(keys.into_iter().filter_map(|(key, p)| Some((format!("{at}.{key}"), p.as_deref()?))));
        }
        StoreConfig::PerSecond { main, per_second } => {
            store_passwords(main, &format!("{at}.main"), out);
            store_passwords(per_second, &format!("{at}.per_second"), out);
        }
        StoreConfig::Migrating { from, to, .. } => {
            store_passwords(from, &format!("{at}.from"), out);
            store_passwords(to, &format!("{at}.to"), out);
        }
        StoreConfig::Memory { .. } | StoreConfig::Memcached { .. } => {}
    }
}

/// The password in a store URL, if any ([`sluice::store::redis::password_span`]).
fn url_password(url: &str) -> Option<&str> {
    sluice::store::redis::password_span(url).map(|span| &url[span])
}

/// Whether `secret` is a placeholder (`CHANGE-ME...`, in any case).
fn is_placeholder(secret: &str) -> bool {
    secret.trim().get(..PLACEHOLDER.len()).is_some_and(|head| head.eq_ignore_ascii_case(PLACEHOLDER))
}

/// A file's lines that hold a value, numbered from 1: blank lines and `#` comments are
/// skipped, and each value is trimmed (a file written by `echo` ends in a newline).
fn lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())).filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
}

/// A file that holds one secret, trimmed.
fn single(path: &Path, key: &str) -> Result<String, CheckError> {
    let (section, name) = key.split_once('.').expect("section.key");
    let text = file(path, section, name)?;
    let value = text.trim();
    if value.is_empty() {
        return Err(at_file(section, name, path, "is empty".into()));
    }
    Ok(value.to_string())
}

/// A secret file's text: present, readable, small, UTF-8.
fn file(path: &Path, section: &str, key: &str) -> Result<String, CheckError> {
    let err = |why: String| at_file(section, key, path, why);
    let meta = std::fs::metadata(path).map_err(|e| err(format!("cannot be read: {e}")))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(err(format!("is {} bytes, past the {MAX_FILE_BYTES} a secret file may hold", meta.len())));
    }
    let bytes = std::fs::read(path).map_err(|e| err(format!("cannot be read: {e}")))?;
    String::from_utf8(bytes).map_err(|_| err("is not UTF-8 text".into()))
}

fn at_file(section: &str, key: &str, path: &Path, why: String) -> CheckError {
    CheckError::at(&[section, key], format!("{section}.{key}: the file {} {why}", path.display()))
}

fn both(section: &str, key: &str) -> CheckError {
    CheckError::at(
        &[section, key],
        format!(
            "{section}.{key} and {section}.{key}_file are both set: keep one (the file, to keep the secret out of the config)"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(yaml: &str) -> Config {
        serde_norway::from_str(yaml).unwrap()
    }

    #[test]
    fn secrets_are_read_from_their_files() {
        let dir = sluice_testkit::TempDir::new("sluice-secrets");
        let (admin, api, key) = (dir.path().join("admin"), dir.path().join("api"), dir.path().join("key"));
        std::fs::write(&admin, "0123456789abcdef0123\n").unwrap();
        std::fs::write(&api, "# rotated on Mondays\nfedcba9876543210fedc\n\n  aaaaaaaaaaaaaaaaaaaa  \n").unwrap();
        std::fs::write(&key, "a-key-secret-of-our-own\n").unwrap();
        let yaml = format!(
            "server: {{admin_token_file: {}, api_tokens: [bbbbbbbbbbbbbbbbbbbb], api_tokens_file: {}}}\nlimiter: {{key_secret_file: {}}}\n",
            admin.display(),
            api.display(),
            key.display()
        );
        let mut c = config(&yaml);
        read(&mut c).unwrap();
        assert_eq!(c.server.admin_token.as_deref(), Some("0123456789abcdef0123"));
        assert_eq!(c.server.api_tokens, ["bbbbbbbbbbbbbbbbbbbb", "fedcba9876543210fedc", "aaaaaaaaaaaaaaaaaaaa"]);
        assert_eq!(c.limiter.key_secret, "a-key-secret-of-our-own");

        // each failure names the key, the file and the fix
        std::fs::write(&api, "fedcba9876543210fedc\nshort\n").unwrap();
        let e = read(&mut config(&yaml)).unwrap_err().message;
        assert!(e.contains("server.api_tokens_file") && e.contains("line 2") && e.contains("too short"), "{e}");
        std::fs::write(&api, "# nothing yet\n").unwrap();
        assert!(read(&mut config(&yaml)).unwrap_err().message.contains("holds no token"));
        std::fs::remove_file(&admin).unwrap();
        let e = read(&mut config(&yaml)).unwrap_err().message;
        assert!(e.contains("server.admin_token_file") && e.contains("cannot be read"), "{e}");
        let e = read(&mut config(&format!("server: {{admin_token: x, admin_token_file: {}}}", key.display())))
            .unwrap_err()
            .message;
        assert!(e.contains("are both set"), "{e}");
    }

    #[test]
    fn placeholders_are_refused_wherever_they_come_from() {
        let dir = sluice_testkit::TempDir::new("sluice-placeholders");
        let file = dir.path().join("key");
        std::fs::write(&file, "change-me-to-openssl-rand-hex-16\n").unwrap();
        for (yaml, key) in [
            ("server: {api_tokens: [CHANGE-ME-to-openssl-rand-hex-16]}".to_string(), "server.api_tokens"),
            ("server: {admin_token: CHANGE-ME-to-openssl-rand-hex-16}".to_string(), "server.admin_token"),
            ("limiter: {key_secret: CHANGE-ME-too}".to_string(), "limiter.key_secret"),
            (format!("limiter: {{key_secret_file: {}}}", file.display()), "limiter.key_secret_file: the file"),
            (format!("server: {{api_tokens_file: {}}}", file.display()), "server.api_tokens_file: the file"),
            (format!("server: {{admin_token_file: {}}}", file.display()), "server.admin_token_file: the file"),
        ] {
            let e = read(&mut config(&yaml)).unwrap_err();
            let m = &e.message;
            assert!(m.starts_with(key) && m.contains("placeholder") && m.contains("openssl rand"), "{yaml}: {m}");
            // a secret read from a file is placed at the key that names the file
            let named = key.split(':').next().unwrap().split('.').collect::<Vec<_>>();
            assert_eq!(e.anchors, named, "{yaml}: {m}");
        }
        read(&mut config("limiter: {key_secret: changed-and-mine}")).unwrap();
    }

    /// A secret file every user may read, or others than its owner may write, is warned
    /// of, naming it and its mode; one only its owner (and group) may read is not.
    #[test]
    fn exposed_secret_files_are_warned_of() {
        use std::os::unix::fs::PermissionsExt;
        let dir = sluice_testkit::TempDir::new("sluice-exposed");
        let file = dir.path().join("key_secret");
        std::fs::write(&file, "a-key-secret-of-our-own\n").unwrap();
        let yaml = format!("limiter: {{key_secret_file: {}}}", file.display());
        for (mode, warned) in [
            (0o644, Some("readable by every user of the host (mode 0644)")),
            (0o620, Some("writable by users other than its owner (mode 0620)")),
            (0o600, None),
            (0o440, None),
        ] {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
            let warnings = read(&mut config(&yaml)).unwrap();
            match warned {
                Some(says) => {
                    let [w] = &warnings[..] else { panic!("{mode:o}: {warnings:?}") };
                    assert!(w.starts_with("limiter.key_secret_file: the file") && w.contains(says), "{w}");
                }
                None => assert!(warnings.is_empty(), "{mode:o}: {warnings:?}"),
            }
        }
    }

    /// A key secret that cannot keep tags unpredictable is refused, naming its place: an
    /// empty, blank or short one in the config, or in the file that holds it.
    #[test]
    fn a_weak_key_secret_is_refused() {
        let dir = sluice_testkit::TempDir::new("sluice-weak-secret");
        let file = dir.path().join("key_secret");
        std::fs::write(&file, "x\n").unwrap();
        for (yaml, says) in [
            ("limiter: {key_secret: \"\"}".to_string(), "limiter.key_secret is empty"),
            ("limiter: {key_secret: \"   \"}".to_string(), "limiter.key_secret is empty"),
            ("limiter: {key_secret: x}".to_string(), "limiter.key_secret is 1 bytes"),
            (format!("limiter: {{key_secret_file: {}}}", file.display()), "key_secret_file: the file"),
        ] {
            let e = read(&mut config(&yaml)).unwrap_err().message;
            assert!(e.contains(says) && e.contains("openssl rand"), "{yaml}: {e}");
        }
    }
}
