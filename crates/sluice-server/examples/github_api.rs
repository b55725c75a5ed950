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
use sluice::layer::{Extract, SluiceLayer};
use sluice::time::ceil_secs;
use sluice::{DomainBuilder, Limiter, Request, RulesBuilder, headers};
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
    let req = Request::new("github").descriptor([("client", client)]);
    let verdict = match limiter.status(&req).await {
        Ok(v) => v,
        Err(e) => return (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    };
    let core = verdict.descriptors[0].policies.iter().find(|p| &*p.name == "core").map(|p| p.decision);
    let Some(d) = core else { return StatusCode::INTERNAL_SERVER_ERROR.into_response() };
    let resource = json!({"limit": d.limit, "used": d.used, "remaining": d.remaining, "reset": ceil_secs(d.reset_at)});
    let mut resp = axum::Json(json!({"resources": {"core": resource}, "rate": resource})).into_response();
    for (name, value) in headers::render(&verdict, &Default::default()) {
        if let Ok(v) = HeaderValue::from_str(&value) {
            resp.headers_mut().insert(name, v);
        }
    }
    resp
}

/// GitHub's two limits on every client: `core` requests per window, and a secondary
/// limit on requests in flight.
fn limiter(args: &Args) -> Result<Limiter, String> {
    let window = sluice::config::Duration::parse(&args.window)?;
    let rules = RulesBuilder::new()
        .domain(DomainBuilder::new("github").rule([("client", None)], |r| {
            r.fixed_window("core", args.core_limit, std::time::Duration::from_millis(window.0)).concurrency(
                "secondary",
                args.concurrency,
                std::time::Duration::from_secs(60),
            )
        }))
        .build()
        .map_err(|e| e.to_string())?;
    Ok(Limiter::in_memory(rules))
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    let limiter = Arc::new(limiter(&args)?);
    let layer = SluiceLayer::builder(limiter.clone(), "github")
        .descriptor(vec![("client", Extract::Custom(Arc::new(identity_of)))])
        .build();
    let app = Router::new()
        .route("/repos/{owner}/{repo}", get(repo))
        .route_layer(layer)
        .route("/rate_limit", get(rate_limit))
        .with_state(limiter);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    // the address bound (port 0: the system's choice, read back by scripts/test)
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    eprintln!("github_api listening on http://{bound}");
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await.map_err(|e| e.to_string())
}
