//! `sluice admin ...`: the admin API from the command line, against a running server
//! (`--server URL`, the token from `SLUICE_ADMIN_TOKEN` or `--token-file`). Prints for
//! people by default, the server's JSON with `--json`; exits 1 with the server's message
//! when it refuses.

use clap::{Args as ClapArgs, Subcommand};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{Value, json};
use sluice::Entry;
use sluice::store::percent_encode;
use std::path::PathBuf;

#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The server's HTTP address.
    #[arg(long, global = true, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// A file holding the admin token (else the SLUICE_ADMIN_TOKEN environment variable).
    #[arg(long, global = true)]
    pub token_file: Option<PathBuf>,
    /// Print the server's JSON answer instead of text for people.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: AdminCommand,
}

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// Stored overrides: other limits for some clients, in force fleet-wide within 1 s.
    #[command(subcommand)]
    Override(OverrideCommand),
    /// Show a client's stored state for every policy its descriptor matches (charges
    /// nothing).
    Inspect(Client),
    /// Forget a client's state (every policy, or `--policy NAME`): its next request sees
    /// the full limit on every instance.
    Reset {
        #[command(flatten)]
        client: Client,
        /// Only this policy.
        #[arg(long)]
        policy: Option<String>,
    },
    /// The clients each rule of a domain refused (or admitted) most over the last one to
    /// two `limiter.top_clients.interval`s.
    Top {
        /// The domain.
        #[arg(long)]
        domain: String,
        /// Only this rule.
        #[arg(long)]
        rule: Option<String>,
        /// How many clients a rule.
        #[arg(long, default_value_t = 20)]
        k: usize,
        /// `refused` or `admitted`.
        #[arg(long, default_value = "refused")]
        outcome: String,
    },
}

/// A client: a domain and its descriptor's entries, in order.
#[derive(Debug, ClapArgs)]
pub struct Client {
    /// The domain.
    #[arg(long)]
    pub domain: String,
    /// The descriptor's entries, KEY=VALUE, in order.
    #[arg(required = true, value_parser = entry)]
    pub entries: Vec<(String, String)>,
}

#[derive(Debug, Subcommand)]
pub enum OverrideCommand {
    /// Set (or replace) the override ID.
    Set {
        /// The override's id: letters, digits and _ . - : @.
        id: String,
        #[arg(long)]
        domain: String,
        /// The descriptor's entries, KEY=VALUE, in order; a VALUE ending in * is a prefix.
        #[arg(long = "entry", required = true, value_parser = entry)]
        entries: Vec<(String, String)>,
        /// The new limit (a window's requests, a bucket's burst, concurrent leases).
        #[arg(long)]
        limit: u64,
        /// Only this policy (default: every policy the entries match).
        #[arg(long)]
        policy: Option<String>,
        /// A fixed window's new length, like 1h.
        #[arg(long, value_parser = sluice::config::Duration::parse)]
        window: Option<sluice::config::Duration>,
        /// A token bucket's new rate.
        #[arg(long)]
        rate: Option<u64>,
        /// Lapse after this long, like 2h.
        #[arg(long, value_parser = sluice::config::Duration::parse, conflicts_with = "expires_at_ms")]
        expires_in: Option<sluice::config::Duration>,
        /// Lapse at this time, in ms since the epoch.
        #[arg(long)]
        expires_at_ms: Option<u64>,
        /// Why, for the audit log and the next operator.
        #[arg(long, default_value = "")]
        reason: String,
        /// Meant: an entry's value is exactly `*`, every client of that key.
        #[arg(long)]
        all_clients: bool,
    },
    /// Store every override of FILE at once, all or none (a JSON array, the output of
    /// `sluice admin --json override list`, or one override a line; each with its "id").
    Import { file: PathBuf },
    /// Show the override ID.
    Get { id: String },
    /// List the overrides (of one domain with --domain).
    List {
        #[arg(long)]
        domain: Option<String>,
    },
    /// Remove the override ID.
    Rm { id: String },
}

fn entry(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("`{s}` is not KEY=VALUE"))
}

/// Why an admin command failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("no admin token: set SLUICE_ADMIN_TOKEN or pass --token-file (an empty one is no token)")]
    NoToken,
    #[error("cannot read --token-file {path}: {source}")]
    TokenFile { path: String, source: std::io::Error },
    #[error("cannot read the import file {path}: {source}")]
    ImportFile { path: String, source: std::io::Error },
    #[error("--server {0} is not http://HOST:PORT")]
    Server(String),
    #[error("cannot reach {server}: {reason}")]
    Unreachable { server: String, reason: String },
    #[error("the server answered {status}: {message}")]
    Refused { status: u16, message: String },
}

/// Whether the server at `authority` sends an HTTP/2 settings frame before it is asked
/// anything, as a gRPC server does (an HTTP/1 server waits for the request).
async fn speaks_http2(authority: &str) -> bool {
    let first = async {
        let mut stream = tokio::net::TcpStream::connect(authority).await.ok()?;
        let mut head = [0u8; 9];
        tokio::io::AsyncReadExt::read_exact(&mut stream, &mut head).await.ok()?;
        Some(head[3] == 0x04)
    };
    tokio::time::timeout(std::time::Duration::from_millis(500), first).await.ok().flatten().unwrap_or(false)
}

/// Runs one admin command.
pub async fn run(args: Args) -> Result<(), AdminError> {
    let token = match &args.token_file {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|source| AdminError::TokenFile { path: p.display().to_string(), source })?
            .trim()
            .to_string(),
        None => std::env::var("SLUICE_ADMIN_TOKEN").map_err(|_| AdminError::NoToken)?,
    };
    if token.trim().is_empty() {
        return Err(AdminError::NoToken);
    }
    let client = Http { server: args.server.trim_end_matches('/').to_string(), token };
    let (method, path, body) = request(&args.command)?;
    let answer = client.call(method, &path, body).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&answer).unwrap_or_default());
    } else {
        print!("{}", human(&args.command, &answer));
    }
    Ok(())
}

/// The method, path and body of a command.
fn request(c: &AdminCommand) -> Result<(&'static str, String, Option<String>), AdminError> {
    Ok(match c {
        AdminCommand::Override(o) => overriding(o)?,
        AdminCommand::Inspect(client) => ("GET", format!("/v1/admin/clients?{}", client_query(client, None)), None),
        AdminCommand::Reset { client, policy } => {
            ("DELETE", format!("/v1/admin/clients?{}", client_query(client, policy.as_deref())), None)
        }
        AdminCommand::Top { domain, rule, k, outcome } => {
            let mut q = format!("domain={}&k={k}&outcome={}", percent_encode(domain), percent_encode(outcome));
            if let Some(r) = rule {
                q.push_str(&format!("&rule={}", percent_encode(r)));
            }
            ("GET", format!("/v1/admin/top?{q}"), None)
        }
    })
}

/// The method, path and body of an override command.
fn overriding(o: &OverrideCommand) -> Result<(&'static str, String, Option<String>), AdminError> {
    Ok(match o {
        OverrideCommand::Set {
            id,
            domain,
            entries,
            limit,
            policy,
            window,
            rate,
            expires_in,
            expires_at_ms,
            reason,
            all_clients,
        } => {
            let now = sluice::time::Clock::now(&sluice::time::SystemClock);
            // the server sets `set_at_ms` and `set_by`
            let body = sluice::Override {
                id: id.clone(),
                domain: domain.clone(),
                entries: entries.iter().map(|(key, value)| Entry { key: key.clone(), value: value.clone() }).collect(),
                limit: *limit,
                policy: policy.clone(),
                window: *window,
                rate: *rate,
                expires_at_ms: expires_at_ms.or(expires_in.map(|d| now + d.0)),
                reason: reason.clone(),
                set_at_ms: 0,
                set_by: String::new(),
                all_clients: *all_clients,
            };
            ("PUT", format!("/v1/overrides/{}", percent_encode(id)), Some(json!(body).to_string()))
        }
        OverrideCommand::Get { id } => ("GET", format!("/v1/overrides/{}", percent_encode(id)), None),
        OverrideCommand::List { domain } => {
            let query = domain.as_ref().map(|d| format!("?domain={}", percent_encode(d))).unwrap_or_default();
            ("GET", format!("/v1/overrides{query}"), None)
        }
        OverrideCommand::Rm { id } => ("DELETE", format!("/v1/overrides/{}", percent_encode(id)), None),
        OverrideCommand::Import { file } => {
            let body = std::fs::read_to_string(file)
                .map_err(|source| AdminError::ImportFile { path: file.display().to_string(), source })?;
            ("POST", "/v1/overrides:import".into(), Some(body))
        }
    })
}

fn client_query(c: &Client, policy: Option<&str>) -> String {
    let mut q = format!("domain={}", percent_encode(&c.domain));
    for (k, v) in &c.entries {
        q.push_str(&format!("&{}={}", percent_encode(k), percent_encode(v)));
    }
    if let Some(p) = policy {
        q.push_str(&format!("&policy={}", percent_encode(p)));
    }
    q
}

/// An answer for people.
fn human(c: &AdminCommand, v: &Value) -> String {
    let line = |o: &Value| {
        let entries: Vec<String> = o["entries"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| format!("{}={}", e["key"].as_str().unwrap_or(""), e["value"].as_str().unwrap_or("")))
            .collect();
        let mut s = format!(
            "{}  domain={} {}  limit={}",
            o["id"].as_str().unwrap_or(""),
            o["domain"].as_str().unwrap_or(""),
            entries.join(","),
            o["limit"]
        );
        for key in ["policy", "window", "rate", "expires_at_ms", "reason"] {
            match &o[key] {
                Value::Null => {}
                Value::Number(ms) if key == "expires_at_ms" => {
                    s.push_str(&format!("  expires={}", date(ms.as_u64().unwrap_or(0))));
                }
                Value::String(t) if t.is_empty() => {}
                Value::String(t) => s.push_str(&format!("  {key}={t}")),
                other => s.push_str(&format!("  {key}={other}")),
            }
        }
        s + "\n"
    };
    match c {
        AdminCommand::Override(OverrideCommand::List { .. }) => {
            let all = v["overrides"].as_array().cloned().unwrap_or_default();
            match all.is_empty() {
                true => "no overrides\n".into(),
                false => all.iter().map(line).collect(),
            }
        }
        AdminCommand::Override(OverrideCommand::Rm { .. }) => format!("removed {}", line(v)),
        AdminCommand::Override(OverrideCommand::Import { .. }) => format!("imported {} overrides\n", v["imported"]),
        AdminCommand::Override(_) => line(v),
        AdminCommand::Inspect(_) => inspected(v),
        AdminCommand::Reset { .. } => {
            let names: Vec<&str> = v["reset"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
            format!("reset {} on every instance\n", names.join(", "))
        }
        AdminCommand::Top { .. } => tops(v),
    }
}

/// Top lists, for people: a table a rule.
fn tops(v: &Value) -> String {
    let mut out = String::new();
    for rule in v["rules"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{} {}: {} decisions lately (a count may overstate by up to {})\n",
            rule["rule"].as_str().unwrap_or(""),
            v["outcome"].as_str().unwrap_or(""),
            rule["decisions"],
            rule["error_bound"]
        ));
        for c in rule["clients"].as_array().into_iter().flatten() {
            out.push_str(&format!("{:>10}  {}\n", c["count"], c["client"].as_str().unwrap_or("")));
        }
    }
    out
}

/// A client's state, for people.
fn inspected(v: &Value) -> String {
    let mut out = String::new();
    if v["matched"] == json!(false) {
        out.push_str("no rule matches this descriptor: it is not limited\n");
    }
    for p in v["policies"].as_array().into_iter().flatten() {
        let by = match &p["override"] {
            Value::Null => String::new(),
            o => format!("  (override {})", o["id"].as_str().unwrap_or("")),
        };
        out.push_str(&format!(
            "{:<20} {:<15} used {}/{}  remaining {}  reset {}{by}\n",
            p["policy"].as_str().unwrap_or(""),
            p["algorithm"].as_str().unwrap_or(""),
            p["used"],
            p["limit"],
            p["remaining"],
            p["reset"].as_u64().map_or_else(|| p["reset"].to_string(), |secs| date(secs * 1000)),
        ));
        if let Some(r) = p.get("region").filter(|r| r.is_object()) {
            out.push_str(&region_lines(r));
        }
        for r in p["reservations"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "    reservation {}  holds {}  lapses at {}\n",
                r["reservation"].as_str().unwrap_or(""),
                r["units"],
                date(r["expires_at_ms"].as_u64().unwrap_or(0))
            ));
        }
        for l in p["leases"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "    lease {}  lapses at {}\n",
                l["lease_id"].as_str().unwrap_or(""),
                date(l["expires_at_ms"].as_u64().unwrap_or(0))
            ));
        }
    }
    out
}

/// A global limit's window as `inspect` shows it (a policy's `region`), for people: the
/// region's pool, the global store's count, and every region's grants there.
fn region_lines(r: &Value) -> String {
    let here = r["grants_from_this_instance"].as_array().map_or(0, Vec::len);
    let mut out = format!(
        "    region holds {} of this window ({} taken by its instances, {} unspent), asked {}/s; this instance's \
         grants in the global store: {here}\n    the global store: {} granted to the regions, {} left\n",
        r["held"], r["taken_by_instances"], r["unspent"], r["demand_per_s"], r["global_granted"], r["global_left"]
    );
    let by_region: Vec<String> = r["regions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|g| {
            let code = || format!("region {}", g["code"].as_str().unwrap_or(""));
            let name = g["region"].as_str().map_or_else(code, String::from);
            let n = g["grants"].as_u64().unwrap_or(0);
            format!("{name} {} ({n} grant{})", g["granted_open"], if n == 1 { "" } else { "s" })
        })
        .collect();
    if !by_region.is_empty() {
        out.push_str(&format!("    grants open there, by region: {}\n", by_region.join(", ")));
    }
    out
}

/// `ms` since the Unix epoch as a UTC date, to the millisecond (`--json` keeps the
/// number): `2026-11-28T14:05:03.120Z`.
fn date(ms: u64) -> String {
    let (days, rest) = (ms / 86_400_000, ms % 86_400_000);
    // the civil date of a day count (proleptic Gregorian, eras of 400 years)
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, sec, milli) = (rest / 3_600_000, rest / 60_000 % 60, rest / 1_000 % 60, rest % 1_000);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{sec:02}.{milli:03}Z")
}

struct Http {
    server: String,
    token: String,
}

impl Http {
    /// One request over a fresh connection; the answer's JSON, or the server's error.
    async fn call(&self, method: &str, path: &str, body: Option<String>) -> Result<Value, AdminError> {
        let authority = self.server.strip_prefix("http://").ok_or_else(|| AdminError::Server(self.server.clone()))?;
        match self.exchange(authority, method, path, body).await {
            Err(AdminError::Unreachable { server, reason }) if speaks_http2(authority).await => {
                let reason = format!(
                    "{reason}: it speaks HTTP/2 unasked, which looks like the gRPC port; the admin API is on the HTTP port (server.http, 8080 by default)"
                );
                Err(AdminError::Unreachable { server, reason })
            }
            other => other,
        }
    }

    /// [`Http::call`] on `authority`.
    async fn exchange(
        &self,
        authority: &str,
        method: &str,
        path: &str,
        body: Option<String>,
    ) -> Result<Value, AdminError> {
        let unreachable = |reason: String| AdminError::Unreachable { server: self.server.clone(), reason };
        let stream = tokio::net::TcpStream::connect(authority).await.map_err(|e| unreachable(e.to_string()))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        tokio::spawn(conn);
        let bytes = body.unwrap_or_default();
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", authority)
            .header("authorization", format!("Bearer {}", self.token))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(bytes)))
            .map_err(|e| unreachable(e.to_string()))?;
        let response = sender.send_request(request).await.map_err(|e| unreachable(e.to_string()))?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.map_err(|e| unreachable(e.to_string()))?.to_bytes();
        let value: Value = serde_json::from_slice(&body).unwrap_or_else(|_| json!(String::from_utf8_lossy(&body)));
        if status >= 300 {
            let message = value["error"]["message"].as_str().map(str::to_string).unwrap_or_else(|| value.to_string());
            return Err(AdminError::Refused { status, message });
        }
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::{date, inspected};
    use serde_json::json;

    /// A global limit's window, for people: the region's pool, the global store's count
    /// and every region's grants there, the others by their code.
    #[test]
    fn a_global_limit_shows_every_region_s_grants() {
        let region = json!({"held": 30, "taken_by_instances": 12, "unspent": 18, "demand_per_s": 4.5,
            "grants_from_this_instance": [{"grant": "1", "units": 12}], "global_granted": 70, "global_left": 130,
            "regions": [{"region": "eu", "code": "3fa2", "granted_open": 30, "grants": 2},
                {"region": null, "code": "91c0", "granted_open": 25, "grants": 1}]});
        let v = json!({"matched": true, "policies": [{"policy": "api", "algorithm": "fixed_window", "used": 70,
            "limit": 200, "remaining": 130, "reset": 0, "region": region}]});
        let text = inspected(&v);
        assert!(text.contains("region holds 30 of this window (12 taken by its instances, 18 unspent)"), "{text}");
        assert!(text.contains("the global store: 70 granted to the regions, 130 left"), "{text}");
        assert!(text.contains("grants open there, by region: eu 30 (2 grants), region 91c0 25 (1 grant)"), "{text}");
    }

    #[test]
    fn times_are_dates() {
        assert_eq!(date(0), "1970-01-01T00:00:00.000Z");
        // 2026-11-28T14:05:03.120Z, and a leap day
        assert_eq!(date(1_795_874_703_120), "2026-11-28T14:05:03.120Z");
        assert_eq!(date(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }
}
