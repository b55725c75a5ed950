//! `store` from `BACKEND_TYPE` and the `REDIS_*` or `MEMCACHE_*` variables (URLs, sockets,
//! TLS, credentials kept out of the printed config), and the listener's TLS.

use super::*;

/// `store`, from `BACKEND_TYPE` and the `REDIS_*` or `MEMCACHE_*` variables.
pub(super) fn store(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Result<Value, String> {
    if get("BACKEND_TYPE").is_some_and(|b| b.eq_ignore_ascii_case("memcache")) {
        return memcached(get, on);
    }
    let main = redis(get, on, "REDIS", "ratelimit")?;
    if !on("REDIS_PERSECOND") {
        return Ok(main);
    }
    // their per-second Redis: the windows of one second on a store of their own
    let second = redis(get, on, "REDIS_PERSECOND", "ratelimitpersecond")?;
    Ok(json!({"kind": "per_second", "main": main, "per_second": second}))
}

/// A Redis store from the variables `{prefix}_URL`, `_TYPE`, `_SOCKET_TYPE`, `_AUTH`,
/// `_TLS`, `_SENTINEL_AUTH` and `_TIMEOUT` (`REDIS` or `REDIS_PERSECOND`), with the TLS
/// files of `REDIS_TLS_*`; `socket` names their default Unix socket.
pub(super) fn redis(
    get: &dyn Fn(&str) -> Option<String>,
    on: &dyn Fn(&str) -> bool,
    prefix: &str,
    socket: &str,
) -> Result<Value, String> {
    let var = |name: &str| format!("{prefix}_{name}");
    let v = |name: &str| get(&var(name));
    let lower = |name: &str, default: &str| v(name).unwrap_or_else(|| default.into()).to_ascii_lowercase();
    let given = v("URL").unwrap_or_else(|| format!("/var/run/nutcracker/{socket}.sock"));
    // theirs is host:port, but a URL is what users write too: its scheme is taken
    let (url, by_scheme) = without_scheme(&given, &var("URL"))?;
    let (user, password) = credentials(v("AUTH"));
    let tls = on(&var("TLS")) || by_scheme == Some(true);
    let files = json!({"ca_file": get("REDIS_TLS_CACERT"), "cert_file": get("REDIS_TLS_CLIENT_CERT"),
        "key_file": get("REDIS_TLS_CLIENT_KEY")});
    let tls_files = if tls { files } else { Value::Null };
    let with_auth = |address: &str| {
        let scheme = if tls { "rediss" } else { "redis" };
        let auth = match (&user, &password) {
            (_, None) => String::new(),
            (u, Some(p)) => format!("{}:{}@", percent_encode(u.as_deref().unwrap_or("")), percent_encode(p)),
        };
        format!("{scheme}://{auth}{address}")
    };
    let (url_var, socket_var) = (var("URL"), var("SOCKET_TYPE"));
    let mut store = match lower("TYPE", "single").as_str() {
        "cluster" => {
            let nodes: Vec<String> = url.split(',').map(|n| with_auth(n.trim())).collect();
            json!({"kind": "redis_cluster", "nodes": nodes, "tls": tls_files})
        }
        "sentinel" => {
            // theirs: the primary's name, then the Sentinels
            let mut parts = url.split(',').map(str::trim);
            let master = parts.next().unwrap_or_default();
            let (sentinel_username, sentinel_password) = credentials(v("SENTINEL_AUTH"));
            json!({"kind": "redis_sentinel", "master_name": master, "sentinels": parts.collect::<Vec<_>>(),
                "username": user, "password": password, "sentinel_username": sentinel_username,
                "sentinel_password": sentinel_password, "tls": tls_files})
        }
        _ if by_scheme.is_some() && lower("SOCKET_TYPE", "tcp") == "unix" => {
            return Err(format!("{url_var}={given} is a TCP URL, but {socket_var} is unix: set it to tcp"));
        }
        _ if by_scheme.is_none() && lower("SOCKET_TYPE", "unix") == "unix" => {
            unix_socket(&url, password.as_deref(), &url_var, &socket_var, v("SOCKET_TYPE"))?
        }
        _ => {
            let built = with_auth(&url);
            sluice::store::redis::check_url(&built).map_err(|_| {
                format!("{url_var}={given} is not host:port (or redis://host:port, rediss:// for TLS), e.g. redis:6379")
            })?;
            json!({"kind": "redis", "url": built, "tls": tls_files})
        }
    };
    // their _TIMEOUT bounds connecting and each reply, as `timeout` does here
    if let Some(t) = v("TIMEOUT").filter(|t| sluice::config::Duration::parse(t).is_ok()) {
        store["timeout"] = json!(t);
    }
    Ok(store)
}

/// A Redis store on the Unix socket `url` (their default socket type): refused, naming
/// `url_var` and `socket_var`, when `url` is no path.
pub(super) fn unix_socket(
    url: &str,
    password: Option<&str>,
    url_var: &str,
    socket_var: &str,
    socket_type: Option<String>,
) -> Result<Value, String> {
    if !url.starts_with('/') {
        return Err(format!(
            "{url_var}={url} is not a socket path, and {socket_var} is {}: the default socket type is unix, as \
             envoyproxy/ratelimit's is; for a host:port set {socket_var}=tcp",
            socket_type.unwrap_or_else(|| "unset".into())
        ));
    }
    let auth = password.map(|p| format!("?pass={}", percent_encode(p))).unwrap_or_default();
    Ok(json!({"kind": "redis", "url": format!("redis+unix://{url}{auth}")}))
}

/// REDIS_URL without a `redis://` or `rediss://` scheme (and whether that scheme asks for
/// TLS), as each node of a list; another scheme is refused.
pub(super) fn without_scheme(given: &str, var: &str) -> Result<(String, Option<bool>), String> {
    let mut tls = None;
    let mut nodes = Vec::new();
    for node in given.split(',') {
        let node = node.trim();
        match node.split_once("://") {
            None => nodes.push(node.to_string()),
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("redis") || scheme.eq_ignore_ascii_case("rediss") => {
                tls = Some(scheme.eq_ignore_ascii_case("rediss"));
                nodes.push(rest.trim_end_matches('/').to_string());
            }
            Some((scheme, _)) => {
                return Err(format!(
                    "{var}={given}: {scheme}:// is not a Redis scheme; write host:port (or redis://host:port)"
                ));
            }
        }
    }
    Ok((nodes.join(","), tls))
}

/// A memcached store, from `MEMCACHE_HOST_PORT` and `MEMCACHE_TLS` with its files.
pub(super) fn memcached(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Result<Value, String> {
    let tls = on("MEMCACHE_TLS").then(|| {
        json!({"ca_file": get("MEMCACHE_TLS_CACERT"), "cert_file": get("MEMCACHE_TLS_CLIENT_CERT"),
            "key_file": get("MEMCACHE_TLS_CLIENT_KEY")})
    });
    // their MEMCACHE_SRV, when set, names the servers instead of MEMCACHE_HOST_PORT
    if let Some(srv) = get("MEMCACHE_SRV") {
        let refresh = get("MEMCACHE_SRV_REFRESH").unwrap_or_else(|| "0s".into());
        return Ok(json!({"kind": "memcached", "srv": srv, "srv_refresh": refresh, "tls": tls}));
    }
    let servers =
        get("MEMCACHE_HOST_PORT").ok_or("BACKEND_TYPE=memcache needs MEMCACHE_HOST_PORT (or MEMCACHE_SRV)")?;
    let servers: Vec<&str> = servers.split(',').map(str::trim).collect();
    Ok(json!({"kind": "memcached", "servers": servers, "tls": tls}))
}

/// Their `password` or `username:password`.
pub(super) fn credentials(auth: Option<String>) -> (Option<String>, Option<String>) {
    match auth {
        Some(auth) => match auth.split_once(':') {
            Some((u, p)) => (Some(u.to_string()), Some(p.to_string())),
            None => (None, Some(auth)),
        },
        None => (None, None),
    }
}

/// `server.tls`, from `GRPC_SERVER_USE_TLS` and its files.
pub(super) fn listener_tls(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Option<Value> {
    on("GRPC_SERVER_USE_TLS").then(|| {
        // theirs is gRPC's alone: the HTTP port (probes, /json) stays plain
        json!({"cert_file": get("GRPC_SERVER_TLS_CERT"), "key_file": get("GRPC_SERVER_TLS_KEY"),
            "client_ca_file": get("GRPC_CLIENT_TLS_CACERT"), "client_san": get("GRPC_CLIENT_TLS_SAN"), "http": false})
    })
}
