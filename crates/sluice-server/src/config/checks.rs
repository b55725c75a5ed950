//! The checks of a config that need no network, beyond what parsing and compiling the
//! rules already check: `sluice config check` and `sluice serve` both run them (through
//! `load::compile`), so a file the check passes is one `serve` takes.

use crate::config::{ServerConfig, StoreConfig, TlsConfig};
use sluice::rules::Rules;
use sluice::store::MemcachedStore;
use sluice::store::redis::{Tls, check_url};

/// The shortest credential accepted: 16 bytes, 128 bits when drawn at random (as
/// `openssl rand -hex 16` gives 32 characters). A shorter one can be guessed online, and
/// an empty one is no credential at all (it matched requests that sent none).
pub const MIN_TOKEN_BYTES: usize = 16;

/// A check that failed: what is wrong and how to mend it, and the words that lead to
/// where it is in the file.
#[derive(Debug)]
pub struct CheckError {
    pub anchors: Vec<String>,
    pub message: String,
}

impl CheckError {
    pub(crate) fn at(anchors: &[&str], message: String) -> Self {
        Self { anchors: anchors.iter().map(|a| a.to_string()).collect(), message }
    }
}

/// The `server` section's checks.
pub fn server(server: &ServerConfig) -> Result<(), CheckError> {
    if let Some(token) = &server.admin_token {
        token_ok(token)
            .map_err(|why| CheckError::at(&["server", "admin_token"], format!("server.admin_token {why}")))?;
    }
    for (i, token) in server.api_tokens.iter().enumerate() {
        token_ok(token)
            .map_err(|why| CheckError::at(&["server", "api_tokens"], format!("server.api_tokens[{i}] {why}")))?;
    }
    client_san(server)?;
    listeners(server)?;
    if server.ui && server.admin_token.is_none() {
        return Err(CheckError::at(
            &["server", "ui"],
            "server.ui is on but server.admin_token is not set: the page shows clients and overrides, so it is \
             served only behind the admin token; set server.admin_token (or ui: false)"
                .into(),
        ));
    }
    Ok(())
}

/// `server.tls.client_san`: a name, checked on certificates a CA verified; and TLS,
/// which a Unix socket (`server.grpc_uds`) does not speak.
fn client_san(server: &ServerConfig) -> Result<(), CheckError> {
    if let (Some(_), Some(path)) = (&server.tls, &server.grpc_uds) {
        let why = format!(
            "server.grpc_uds ({}) is served without TLS, but server.tls is set: drop one (a socket file is guarded by its permissions)",
            path.display()
        );
        return Err(CheckError::at(&["server", "grpc_uds"], why));
    }
    if let Some(tls) = &server.tls
        && let Some(san) = &tls.client_san
    {
        let why = if tls.client_ca_file.is_none() {
            Some("needs server.tls.client_ca_file: the name is checked on certificates that CA verified".to_string())
        } else {
            rustls::pki_types::ServerName::try_from(san.as_str())
                .err()
                .map(|e| format!("is not a DNS name or an IP address ({e})"))
        };
        if let Some(why) = why {
            return Err(CheckError::at(
                &["server", "tls", "client_san"],
                format!("server.tls.client_san `{san}` {why}"),
            ));
        }
    }
    Ok(())
}

/// The listeners: the metrics path one of its own, and no two on one port.
fn listeners(server: &ServerConfig) -> Result<(), CheckError> {
    let path = &server.metrics_path;
    let routable = path.starts_with('/')
        && path != "/healthz"
        && !path.contains(['?', '#', ' ', '{', '}', '*'])
        && !path.split('/').any(|segment| segment.starts_with(':'));
    if !routable {
        let why = format!(
            "server.metrics_path `{path}` is not a path of its own: write one that starts with /, e.g. /metrics \
             (not /healthz; no ?, #, spaces, braces, * or a segment that starts with :)"
        );
        return Err(CheckError::at(&["server", "metrics_path"], why));
    }
    let listeners = [
        ("http", Some(server.http)),
        ("grpc", Some(server.grpc)),
        ("metrics", server.metrics),
        ("debug", server.debug),
    ];
    for (i, (a, x)) in listeners.iter().enumerate() {
        for (b, y) in &listeners[i + 1..] {
            if let (Some(x), Some(y)) = (x, y)
                && clash(*x, *y)
            {
                return Err(CheckError::at(
                    &["server", b],
                    format!("server.{b} ({y}) and server.{a} ({x}) take the same port: give each listener its own"),
                ));
            }
        }
    }
    Ok(())
}

/// Whether two listeners would take the same port (port 0 is the system's choice, never
/// the same twice; an unspecified address takes the port on every address).
fn clash(a: std::net::SocketAddr, b: std::net::SocketAddr) -> bool {
    a.port() != 0 && a.port() == b.port() && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// The `store` section's checks, against the rules it must run: what building the store
/// would refuse, found without connecting to it (addresses that do not parse, TLS files
/// that cannot be read, rules the store cannot run, a percentage past 100). Whether the
/// store answers, and runs a Redis new enough, only `serve` can tell (`/readyz`).
pub fn store(store: &StoreConfig, rules: &Rules) -> Result<(), CheckError> {
    let at = |key: &str, e: &dyn std::fmt::Display| CheckError::at(&["store", key], e.to_string());
    supports(store, rules).map_err(|e| at("kind", &e))?;
    let urls = |key: &str, urls: &mut dyn Iterator<Item = &String>| {
        for u in urls {
            check_url(u).map_err(|_| {
                let fix = "write redis://HOST:PORT (rediss:// for TLS, redis+unix:///PATH for a socket)";
                CheckError::at(&["store", key, u], format!("store.{key}: not a Redis URL; {fix}"))
            })?;
        }
        Ok(())
    };
    match store {
        StoreConfig::Memory { .. } => {}
        StoreConfig::Redis { url, replicas, connection } => {
            urls("url", &mut std::iter::once(url))?;
            urls("replicas", &mut replicas.iter())?;
            tls(connection.tls.as_ref()).map_err(|e| at("tls", &e))?;
        }
        StoreConfig::RedisSentinel(c) => {
            tls(c.connection.tls.as_ref()).map_err(|e| at("tls", &e))?;
            if c.sentinels.is_empty() {
                return Err(at("sentinels", &"store.sentinels is empty: list at least one Sentinel host:port"));
            }
        }
        StoreConfig::RedisCluster { nodes, tls: files, .. } => {
            if nodes.is_empty() {
                return Err(at("nodes", &"store.nodes is empty: list at least one cluster node"));
            }
            urls("nodes", &mut nodes.iter())?;
            tls(files.as_ref()).map_err(|e| at("tls", &e))?;
        }
        StoreConfig::RedisSharded { shards, connection } => {
            if shards.is_empty() {
                return Err(at("shards", &UnfitStore::NoShards));
            }
            for shard in shards {
                urls("shards", &mut std::iter::once(&shard.primary).chain(&shard.replicas))?;
            }
            tls(connection.tls.as_ref()).map_err(|e| at("tls", &e))?;
        }
        StoreConfig::Memcached { servers, timeout, tls: files, srv, .. } => {
            memcached_servers(servers, srv.as_deref(), timeout.to_std()).map_err(|e| at("servers", &e))?;
            tls(files.as_ref()).map_err(|e| at("tls", &e))?;
        }
        StoreConfig::Migrating { from, to, percent } => {
            if *percent > 100 {
                return Err(at("percent", &UnfitStore::Percent(*percent)));
            }
            self::store(from, rules)?;
            self::store(to, rules)?;
        }
        StoreConfig::PerSecond { main, per_second } => {
            self::store(main, rules)?;
            self::store(per_second, rules)?;
        }
    }
    Ok(())
}

/// The `xds` section's checks: what the client would otherwise find only at run time,
/// in a loop of warnings (a URL where `host:port` goes, headers gRPC cannot send, TLS
/// files that do not load, a retry wait of nothing).
pub fn xds(xds: &crate::config::XdsConfig) -> Result<(), CheckError> {
    let at = |key: &str, message: String| CheckError::at(&["xds", key], message);
    if let Some((scheme, rest)) = xds.server.split_once("://") {
        let tls = if scheme.eq_ignore_ascii_case("https") { "; for TLS set xds.tls" } else { "" };
        return Err(at(
            "server",
            format!("xds.server is `{}`: write host:port, `{rest}`, without a scheme{tls}", xds.server),
        ));
    }
    let port = xds.server.rsplit_once(':').and_then(|(host, port)| (!host.is_empty()).then_some(port));
    if port.is_none_or(|p| p.parse::<u16>().is_err()) {
        return Err(at("server", format!("xds.server is `{}`: write host:port, e.g. envoy-gateway:18001", xds.server)));
    }
    xds.metadata().map_err(|e| at("headers", e))?;
    if xds.retry.0 == 0 {
        let why = "xds.retry is 0s: a lost stream would be opened again at once, in a loop; write at least 100ms (1s is the default)";
        return Err(at("retry", why.into()));
    }
    if xds.retry.0 > xds.max_retry.0 {
        return Err(at(
            "retry",
            format!(
                "xds.retry ({}) is above xds.max_retry ({}): the first wait is the shortest; lower it or raise max_retry",
                xds.retry, xds.max_retry
            ),
        ));
    }
    if xds.max_message_bytes == 0 {
        return Err(at("max_message_bytes", "xds.max_message_bytes is 0: no push could be read".into()));
    }
    if let Some(tls) = &xds.tls {
        let files = [("ca_file", &tls.ca_file), ("cert_file", &tls.cert_file), ("key_file", &tls.key_file)];
        for (key, path) in files.into_iter().filter_map(|(k, p)| Some((k, p.as_ref()?))) {
            let pem = std::fs::read(path).map_err(|e| at("tls", format!("xds.tls.{key} {}: {e}", path.display())))?;
            if !pem.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(at(
                    "tls",
                    format!("xds.tls.{key} {}: not a PEM file (no -----BEGIN line)", path.display()),
                ));
            }
        }
        if tls.cert_file.is_some() != tls.key_file.is_some() {
            return Err(at("tls", "xds.tls: give both cert_file and key_file, or neither".into()));
        }
    }
    Ok(())
}

/// The `telemetry` section's checks that parsing does not make: a StatsD flush interval
/// of 0 (a loop without a wait) and an address that is not `host:port`.
pub fn telemetry(telemetry: &crate::config::TelemetryConfig) -> Result<(), CheckError> {
    let Some(s) = &telemetry.statsd else { return Ok(()) };
    let at = |key: &str, why: String| CheckError::at(&["telemetry", "statsd", key], why);
    if s.flush_interval.0 == 0 {
        return Err(at(
            "flush_interval",
            "telemetry.statsd.flush_interval is 0s: write how often to send, e.g. 10s".into(),
        ));
    }
    for (i, m) in s.mogrifiers.iter().enumerate() {
        if let Err(e) = regex_lite::Regex::new(&m.pattern) {
            return Err(at(
                "mogrifiers",
                format!("telemetry.statsd.mogrifiers[{i}].pattern `{}` is not a regular expression: {e}", m.pattern),
            ));
        }
    }
    let port = s.address.rsplit_once(':').and_then(|(h, p)| (!h.is_empty()).then_some(p));
    if port.is_none_or(|p| p.parse::<u16>().is_err()) {
        return Err(at(
            "address",
            format!("telemetry.statsd.address `{}` is not host:port, e.g. localhost:8125", s.address),
        ));
    }
    Ok(())
}

/// A memcached store's servers: listed, or named by an SRV record, not both.
fn memcached_servers(servers: &[String], srv: Option<&str>, timeout: std::time::Duration) -> Result<(), String> {
    match srv {
        Some(_) if !servers.is_empty() => {
            Err("store.servers and store.srv are both set: name the servers, or the SRV record that names them".into())
        }
        Some(_) => Ok(()),
        None => MemcachedStore::new(servers, timeout).map(drop).map_err(|e| e.to_string()),
    }
}

/// One limit across regions: `global: true` needs `region` and `global_store` (each
/// without the other is a mistake too), and stores that keep grants and pools.
pub fn regions(config: &crate::config::Config, rules: &Rules) -> Result<(), CheckError> {
    let (region, global) = (config.region.as_deref(), config.global_store.as_ref());
    match (rules.use_global(), region, global) {
        (true, None, _) | (true, _, None) => {
            let why = "a limit has `global: true`, which needs `region` (this instance's region) and `global_store` \
                       (the store every region reaches): without them each region would count alone";
            return Err(CheckError::at(&["global"], why.into()));
        }
        (_, Some(_), None) => {
            let why = "`region` is set without `global_store`: name the store every region reaches, or remove `region`";
            return Err(CheckError::at(&["region"], why.into()));
        }
        (_, None, Some(_)) => {
            let why = "`global_store` is set without `region`: name this instance's region (each region's \
                       instances share what it holds)";
            return Err(CheckError::at(&["global_store"], why.into()));
        }
        _ => {}
    }
    if let Some(r) = region.filter(|r| r.is_empty() || r.len() > 64 || r.chars().any(|c| c.is_control())) {
        let why = format!("region {r:?}: write a name of 1 to 64 printable characters");
        return Err(CheckError::at(&["region"], why));
    }
    let memcached = |s: &StoreConfig| matches!(s, StoreConfig::Memcached { .. });
    if global.is_some_and(memcached) || (global.is_some() && memcached(&config.store)) {
        let why = "global limits need stores that keep quota grants and pools (memory or redis): the memcached \
                   store keeps neither, as `store` or as `global_store`";
        return Err(CheckError::at(&["global_store"], why.into()));
    }
    Ok(())
}

/// Global limits whose windows are shorter than regional pools serve well: a window
/// should last at least 25 cross-region round trips (2 s at 80 ms), or a region's share
/// runs out before the next arrives (docs/architecture.md, "One limit across regions").
/// At load the round trip is not known yet: 80 ms is assumed here, and each instance's
/// allocator checks again against the round trip it measures
/// (`sluice::regions::SERVED_ROUND_TRIPS`).
pub fn short_global_windows(rules: &Rules) -> Vec<String> {
    rules
        .global_windows()
        .into_iter()
        .filter(|(_, window)| *window < 2_000)
        .map(|(name, window)| {
            format!(
                "global limit '{name}' has a window of {window} ms: regional pools serve windows of at least 25 \
                 cross-region round trips (2 s at 80 ms); a shorter one leaves part of its limit unused"
            )
        })
        .collect()
}

/// `limiter.reservations: true` asks for a store that keeps them: memcached (on either
/// side of a migration too) is refused, saying so.
pub fn reservations(limiter: &sluice::config::LimiterConfig, store: &StoreConfig) -> Result<(), CheckError> {
    fn memcached(s: &StoreConfig) -> bool {
        match s {
            StoreConfig::Memcached { .. } => true,
            StoreConfig::Migrating { from, to, .. } => memcached(from) || memcached(to),
            StoreConfig::PerSecond { main, per_second } => memcached(main) || memcached(per_second),
            _ => false,
        }
    }
    if limiter.reservations == Some(true) && memcached(store) {
        let why = "limiter.reservations is true, but store memcached keeps no reservations (it has no atomic \
                   script to hold an estimate and settle it): use a redis store, or leave limiter.reservations unset";
        return Err(CheckError::at(&["limiter", "reservations"], why.into()));
    }
    Ok(())
}

/// A store config that cannot be built, whatever the network says.
#[derive(Debug, thiserror::Error)]
pub enum UnfitStore {
    #[error("store memcached runs fixed windows only, but the rules use {0}: use a redis store")]
    Unsupported(String),
    #[error("store.percent is {0}; write 0 to 100")]
    Percent(u8),
    #[error("store.shards is empty: list at least one {{primary, replicas}}")]
    NoShards,
    #[error("cannot read store tls.{what} {path}: {source}")]
    TlsFile {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("store tls: give both cert_file and key_file, or neither")]
    TlsPair,
    #[error("store tls: {0}")]
    Tls(String),
}

/// Refuses rules the store cannot run (Memcached has fixed windows only) when the
/// config is loaded, not when the first request fails.
fn supports(store: &StoreConfig, rules: &Rules) -> Result<(), UnfitStore> {
    match store {
        StoreConfig::Memcached { .. } => {
            let mut other: Vec<&str> = rules.algorithms().into_iter().filter(|a| *a != "fixed_window").collect();
            if rules.use_global() {
                other.push("grants and regional pools (`global: true` on a limit)");
            } else if rules.use_grants() {
                other.push("grants (`grants:` on a rule)");
            }
            match other.is_empty() {
                true => Ok(()),
                false => Err(UnfitStore::Unsupported(other.join(", "))),
            }
        }
        StoreConfig::Migrating { from, to, .. } => {
            supports(from, rules)?;
            supports(to, rules)
        }
        StoreConfig::PerSecond { main, per_second } => {
            supports(main, rules)?;
            supports(per_second, rules)
        }
        _ => Ok(()),
    }
}

/// Reads the TLS files a store names.
pub fn tls(files: Option<&TlsConfig>) -> Result<Option<Tls>, UnfitStore> {
    let Some(f) = files else { return Ok(None) };
    let read = |what: &'static str, p: &std::path::Path| {
        std::fs::read(p).map_err(|source| UnfitStore::TlsFile { what, path: p.display().to_string(), source })
    };
    let ca = f.ca_file.as_deref().map(|p| read("ca_file", p)).transpose()?;
    let client = match (&f.cert_file, &f.key_file) {
        (Some(c), Some(k)) => Some((read("cert_file", c)?, read("key_file", k)?)),
        (None, None) => None,
        _ => return Err(UnfitStore::TlsPair),
    };
    Ok(Some(Tls { ca, client }))
}

/// Why `token` cannot be a credential, in words that end the sentence "server.X ...".
pub fn token_ok(token: &str) -> Result<(), String> {
    let fix = format!("use at least {MIN_TOKEN_BYTES} random bytes, e.g. the output of `openssl rand -hex 16`");
    if token.trim().is_empty() {
        return Err(format!("is empty or only white space, which would let in requests that send no token; {fix}"));
    }
    if token.trim() != token {
        return Err(format!(
            "starts or ends with white space, which no `Authorization` header can carry; remove it ({fix})"
        ));
    }
    if token.len() < MIN_TOKEN_BYTES {
        return Err(format!("is {} bytes, too short to resist guessing; {fix}", token.len()));
    }
    if token.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
        return Err(format!("holds a character an HTTP header cannot carry (only visible ASCII, no spaces); {fix}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(admin: Option<&str>, api: &[&str], ui: bool) -> ServerConfig {
        ServerConfig {
            admin_token: admin.map(str::to_string),
            api_tokens: api.iter().map(|t| t.to_string()).collect(),
            ui,
            ..ServerConfig::default()
        }
    }

    #[test]
    fn empty_blank_and_short_tokens_are_refused_with_the_reason() {
        for (token, says) in [
            ("", "empty"),
            ("   ", "empty"),
            ("\t\n", "empty"),
            ("short", "5 bytes"),
            (" 0123456789abcdef", "white space"),
            ("0123456789abcdef\n", "white space"),
            ("0123456789 abcdef", "visible ASCII"),
        ] {
            let e = server(&with(Some(token), &[], false)).unwrap_err();
            assert!(e.message.starts_with("server.admin_token ") && e.message.contains(says), "{token:?}: {e:?}");
            assert!(e.message.contains("openssl rand"), "{e:?}");
            let e = server(&with(None, &["0123456789abcdef", token], false)).unwrap_err();
            assert!(e.message.starts_with("server.api_tokens[1] ") && e.message.contains(says), "{token:?}: {e:?}");
        }
        assert!(server(&with(Some("0123456789abcdef"), &["fedcba9876543210"], true)).is_ok());
    }

    #[test]
    fn the_live_page_needs_the_admin_token() {
        let e = server(&with(None, &[], true)).unwrap_err();
        assert!(e.message.contains("server.admin_token is not set"), "{e:?}");
    }

    /// Two listeners on one port were refused only at bind, "Address already in use".
    #[test]
    fn listeners_on_one_port_are_refused() {
        let on = |http: &str, grpc: &str, metrics: Option<&str>| ServerConfig {
            http: http.parse().unwrap(),
            grpc: grpc.parse().unwrap(),
            metrics: metrics.map(|m| m.parse().unwrap()),
            ..ServerConfig::default()
        };
        let e = server(&on("0.0.0.0:8080", "0.0.0.0:8081", Some("127.0.0.1:8080"))).unwrap_err();
        assert!(e.message.contains("server.metrics (127.0.0.1:8080) and server.http (0.0.0.0:8080)"), "{e:?}");
        assert!(server(&on("127.0.0.1:9000", "127.0.0.1:9000", None)).is_err());
        server(&on("127.0.0.1:0", "127.0.0.1:0", Some("127.0.0.1:0"))).unwrap();
        server(&on("127.0.0.1:8080", "127.0.0.2:8080", Some("127.0.0.1:9090"))).unwrap();
    }

    /// Each xDS setting that would fail at run time is refused at load, naming the fix.
    #[test]
    fn xds_settings_that_fail_at_run_time_are_refused() {
        let check = |yaml: &str| {
            let c: crate::config::XdsConfig = serde_norway::from_str(yaml).unwrap();
            xds(&c).err().map(|e| (e.anchors.join("."), e.message))
        };
        assert!(check("server: envoy-gateway:18001").is_none());
        for (yaml, key, says) in [
            ("server: http://envoy-gateway:18001", "xds.server", "write host:port, `envoy-gateway:18001`"),
            ("server: https://cp:18001", "xds.server", "for TLS set xds.tls"),
            ("server: envoy-gateway", "xds.server", "write host:port"),
            ("{server: 'cp:1', headers: {'bad key': v}}", "xds.headers", "not a valid gRPC metadata entry"),
            ("{server: 'cp:1', headers: {x-token: \"a\\nb\"}}", "xds.headers", "not a valid gRPC metadata entry"),
            ("{server: 'cp:1', retry: 0s}", "xds.retry", "in a loop"),
            ("{server: 'cp:1', retry: 1m, max_retry: 30s}", "xds.retry", "above xds.max_retry (30s)"),
            ("{server: 'cp:1', tls: {ca_file: /no/such/ca.pem}}", "xds.tls", "/no/such/ca.pem"),
            ("{server: 'cp:1', tls: {cert_file: /no/such.crt, key_file: /no/such.key}}", "xds.tls", "/no/such"),
        ] {
            let (anchors, message) = check(yaml).unwrap_or_else(|| panic!("{yaml} passed"));
            assert_eq!(anchors, key, "{yaml}: {message}");
            assert!(message.contains(says), "{yaml}: {message}");
        }
    }
}
