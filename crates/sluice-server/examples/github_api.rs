//! GitHub's REST API rate limiting, in miniature, on the Sluice tower layer.
//!
//! ```sh
//! cargo build --release --examples
//! target/release/examples/github_api --listen 127.0.0.1:8090 --core-limit 60 --window 1h --concurrency 100
//! curl -si -H 'Authorization: token abc' http://127.0.0.1:8090/repos/octo/hello
//! ```
//!
//! - Clients are identified by their `Authorization` token, or by IP when anonymous.
//! - The primary limit (`--core-limit` per `--window`, policy `core`) and a secondary
//!   concurrency limit (`--concurrency`) apply to every API route, in one store call.
//! - `GET /repos/{owner}/{repo}` has an `ETag`: a conditional GET answers 304, which is
//!   refunded (charged at the start, given back: GitHub's rule done right).
//! - `GET /rate_limit` answers GitHub's JSON from a peek: it never changes `remaining`.
//! - Over the limit: 429 with `x-ratelimit-remaining: 0` and the stored reset, which is
//!   what GitHub's client libraries (octokit's plugin-throttling) wait on.

use axum::Router;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use clap::Parser;
use serde_json::json;
use sluice::config::Config;
use sluice::engine::{Descriptor, Entry, Mode, Request};
use sluice::layer::{Extract, SluiceLayer};
use sluice::rules::Rules;
use sluice::store::MemoryStore;
use sluice::time::{SystemClock, ceil_secs};
use sluice::{Limiter, headers};
use std::net::SocketAddr;
use std::sync::Arc;

/// GitHub's REST rate limiting in miniature.
#[derive(Parser)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// Requests per window per client (the `core` resource).
    #[arg(long, default_value_t = 60)]
    core_limit: u64,
    /// The window, like 1h or 30s.
    #[arg(long, default_value = "1h")]
    window: String,
    /// Requests in flight at once per client (the secondary limit).
    #[arg(long, default_value_t = 100)]
    concurrency: u64,
}

const ETAG: &str = "\"v1\"";

/// A client: its token, or its address when anonymous.
fn identity(headers: &HeaderMap, addr: Option<SocketAddr>) -> String {
    let token = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        v.strip_prefix("token ").or_else(|| v.strip_prefix("Bearer ")).or_else(|| v.strip_prefix("bearer "))
    });
    match (token, addr) {
        (Some(t), _) => format!("token:{t}"),
        (None, Some(a)) => format!("ip:{}", a.ip()),
        (None, None) => "ip:unknown".into(),
    }
}

fn identity_of(parts: &Parts) -> Option<String> {
    let addr = parts.extensions.get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
    Some(identity(&parts.headers, addr))
}

async fn repo(Path((owner, name)): Path<(String, String)>, headers: HeaderMap) -> Response {
    if headers.get(header::IF_NONE_MATCH).is_some_and(|v| v == ETAG) {
        return (StatusCode::NOT_MODIFIED, [(header::ETAG, ETAG)]).into_response();
    }
    let body = json!({"name": name, "full_name": format!("{owner}/{name}"), "private": false});
    ([(header::ETAG, ETAG)], axum::Json(body)).into_response()
}

/// `GET /rate_limit`: the client's core limit, read without charging.
async fn rate_limit(
    State(limiter): State<Arc<Limiter>>,
    ConnectInfo(addr): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    let client = identity(&headers, Some(addr));
    let req = Request {
        domain: "github".into(),
        descriptors: vec![Descriptor {
            entries: vec![Entry { key: "client".into(), value: client }],
            ..Default::default()
        }],
        hits_addend: None,
    };
    let verdict = match limiter.run(&req, Mode::Peek).await {
        Ok(v) => v,
        Err(e) => return (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    };
    let core = verdict.descriptors[0].policies.iter().find(|p| &*p.name == "core").map(|p| p.decision);
    let Some(d) = core else { return StatusCode::INTERNAL_SERVER_ERROR.into_response() };
    let resource = json!({"limit": d.limit, "used": d.used, "remaining": d.remaining, "reset": ceil_secs(d.reset_at)});
    let mut resp = axum::Json(json!({"resources": {"core": resource}, "rate": resource})).into_response();
    for (name, value) in headers::render(&verdict, &limiter.rules().headers) {
        if let Ok(v) = HeaderValue::from_str(&value) {
            resp.headers_mut().insert(name, v);
        }
    }
    resp
}

fn limiter(args: &Args) -> Result<Limiter, String> {
    let yaml = format!(
        "domains:\n  - domain: github\n    descriptors:\n      - key: client\n        policies:\n          - {{name: core, fixed_window: {{limit: {}, window: {}}}}}\n          - {{name: secondary, concurrency: {{limit: {}, lease_ttl: 60s}}}}\n",
        args.core_limit, args.window, args.concurrency
    );
    let config: Config = serde_norway::from_str(&yaml).map_err(|e| e.to_string())?;
    let rules = Rules::compile(&config).map_err(|e| e.to_string())?;
    Ok(Limiter::new(Arc::new(rules), Arc::new(MemoryStore::new(1_000_000)), Arc::new(SystemClock)))
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    let limiter = Arc::new(limiter(&args)?);
    let layer = SluiceLayer::new(limiter.clone(), "github")
        .descriptor(vec![("client", Extract::Custom(Arc::new(identity_of)))]);
    let app = Router::new()
        .route("/repos/{owner}/{repo}", get(repo))
        .route_layer(layer)
        .route("/rate_limit", get(rate_limit))
        .with_state(limiter);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    eprintln!("github_api listening on http://{}", args.listen);
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await.map_err(|e| e.to_string())
}
