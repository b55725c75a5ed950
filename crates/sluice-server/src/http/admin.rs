//! The admin API, behind `server.admin_token`: stored overrides, inspecting and resetting
//! a client, the clients each rule refuses most, the migration percentage. Every change writes one audit line and counts in
//! `sluice_admin_actions_total{action}` (docs/operations.md has the runbooks).

use super::api::client_query;
use super::error::{check_error, error, override_error};
use crate::app::AppState;
use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use sluice::time::ceil_secs;
use sluice::{CheckError, Override, PolicyDecision, RequestError};
use std::sync::Arc;

type Shared = State<Arc<AppState>>;

/// The admin routes, each answering 401 without the token.
pub fn routes(state: Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/admin/migration", get(migration).put(set_migration))
        .route("/v1/overrides", get(list_overrides))
        .route("/v1/overrides:import", axum::routing::post(super::admin_import::import))
        .route("/v1/overrides/{id}", get(get_override).put(put_override).delete(delete_override))
        .route("/v1/admin/clients", get(inspect).delete(reset))
        .route("/v1/admin/top", get(top))
        .route("/v1/admin/rlqs", get(rlqs))
        .merge(ui_routes(&state))
        .route_layer(axum::middleware::from_fn_with_state(state, require_token))
}

/// The live page and its overview, when `server.ui` is on (see `ui.rs`).
fn ui_routes(state: &AppState) -> Router<Arc<AppState>> {
    match state.ui {
        Some(_) => {
            Router::new().route("/ui", get(super::ui::page)).route("/v1/admin/overview", get(super::ui::overview))
        }
        None => Router::new(),
    }
}

/// Lets through requests carrying `Authorization: Bearer <server.admin_token>`, or HTTP
/// Basic with it as the password (a browser on the live page), compared in constant
/// time; 401 for the rest, inviting a browser to ask for Basic.
async fn require_token(
    State(state): Shared,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let given = request.headers().get(header::AUTHORIZATION).map(HeaderValue::as_bytes);
    let token = state.admin_token.as_deref();
    if token.is_some_and(|t| crate::app::bearer_is(given, t) || crate::app::basic_is(given, t)) {
        return next.run(request).await;
    }
    let mut refused = super::error::unauthorized_for("server.admin_token");
    refused.headers_mut().append(header::WWW_AUTHENTICATE, HeaderValue::from_static("Basic realm=\"sluice admin\""));
    refused
}

fn to_json(o: &Override) -> String {
    serde_json::to_string(o).unwrap_or_default()
}

fn no_override(id: &str) -> Response {
    error(StatusCode::NOT_FOUND, "unknown_override", format!("no override has the id '{id}'"))
}

fn bad_path(e: PathRejection) -> Response {
    error(StatusCode::BAD_REQUEST, "bad_path", format!("the path is not readable: {e}"))
}

/// The overrides as the store holds them now (read again, so an instance answers what
/// another has just set).
async fn fresh(state: &AppState) -> Result<Arc<sluice::Overrides>, Response> {
    let overrides = state.engine.load().limiter.overrides().clone();
    overrides.supported().map_err(override_error)?;
    overrides.refresh().await.map_err(|e| check_error(e.into()))?;
    Ok(overrides)
}

/// `GET /v1/overrides[?domain=D]`: every stored override, by id.
async fn list_overrides(State(state): Shared, query: Result<Query<Vec<(String, String)>>, QueryRejection>) -> Response {
    let domain = match query {
        Ok(Query(pairs)) => pairs.into_iter().find(|(k, _)| k == "domain").map(|(_, v)| v),
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_query", e.to_string()),
    };
    match fresh(&state).await {
        Ok(o) => axum::Json(json!({"overrides": o.list(domain.as_deref())})).into_response(),
        Err(resp) => resp,
    }
}

/// `GET /v1/overrides/{id}`.
async fn get_override(State(state): Shared, id: Result<Path<String>, PathRejection>) -> Response {
    let Path(id) = match id {
        Ok(id) => id,
        Err(e) => return bad_path(e),
    };
    match fresh(&state).await {
        Ok(o) => match o.get(&id) {
            Some(found) => axum::Json(&*found).into_response(),
            None => no_override(&id),
        },
        Err(resp) => resp,
    }
}

/// `PUT /v1/overrides/{id}` with an override as JSON: stores it (replacing one of the
/// same id) after checking it against the rules; 200 with the stored override.
async fn put_override(State(state): Shared, id: Result<Path<String>, PathRejection>, body: Body) -> Response {
    let Path(id) = match id {
        Ok(id) => id,
        Err(e) => return bad_path(e),
    };
    let Ok(bytes) = to_bytes(body, 64 * 1024).await else {
        return error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", "an override is at most 64 KiB".into());
    };
    let o: Override = match serde_json::from_slice(&bytes) {
        Ok(o) => o,
        Err(e) => {
            let message = format!(
                "the body is not an override: {e} (send {{\"domain\", \"entries\": [{{\"key\", \"value\"}}], \"limit\", optional \"policy\", \"window\", \"rate\", \"expires_at_ms\", \"reason\"}})"
            );
            return error(StatusCode::BAD_REQUEST, "invalid_json", message);
        }
    };
    if !o.id.is_empty() && o.id != id {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_override",
            format!("the body's id '{}' is not the path's '{id}'", o.id),
        );
    }
    let o = Override { id: id.clone(), set_by: state.actor(), ..o };
    let limiter = &state.engine.load().limiter;
    match limiter.set_override(o).await {
        Ok(previous) => {
            let stored = limiter.overrides().get(&id);
            let new = stored.as_deref().map(to_json);
            let reason = stored.as_ref().map_or("", |o| o.reason.as_str());
            state.audit("override_set", &id, previous.as_ref().map(to_json), new, reason);
            axum::Json(json!(stored)).into_response()
        }
        Err(e) => override_error(e),
    }
}

/// `DELETE /v1/overrides/{id}`: 200 with the override removed, 404 when there was none.
async fn delete_override(State(state): Shared, id: Result<Path<String>, PathRejection>) -> Response {
    let Path(id) = match id {
        Ok(id) => id,
        Err(e) => return bad_path(e),
    };
    match state.engine.load().limiter.remove_override(&id).await {
        Ok(Some(removed)) => {
            state.audit("override_removed", &id, Some(to_json(&removed)), None, &removed.reason);
            axum::Json(removed).into_response()
        }
        Ok(None) => no_override(&id),
        Err(e) => override_error(e),
    }
}

/// One policy's stored state, as inspect shows it.
fn policy_json(p: &PolicyDecision) -> Value {
    let d = &p.decision;
    let mut v = json!({
        "policy": &*p.name,
        "algorithm": p.limit.algorithm(),
        "limit": d.limit,
        "used": d.used,
        "remaining": d.remaining,
        "reset": ceil_secs(d.reset_at),
        "reset_at_ms": d.reset_at,
        "shadow": p.shadow,
        "override": p.overridden_by.as_deref(),
    });
    match p.limit {
        sluice::algo::Limit::TokenBucket { .. } => v["tokens"] = json!(d.remaining),
        sluice::algo::Limit::Concurrency { .. } => v["leases_held"] = json!(d.used),
        _ => {}
    }
    v
}

/// `GET /v1/admin/clients?domain=D&KEY=VALUE...`: every policy the client's descriptor
/// matches, its stored state and the override in force. Never charges.
async fn inspect(State(state): Shared, query: Result<Query<Vec<(String, String)>>, QueryRejection>) -> Response {
    let (req, _) = match client_query(query, None) {
        Ok(q) => q,
        Err(resp) => return *resp,
    };
    let limiter = &state.engine.load().limiter;
    let held = match limiter.leases(&req).await {
        Ok(h) => h,
        Err(e) => return admin_error(e, limiter),
    };
    let reserved = match limiter.holds(&req).await {
        Ok(h) => h,
        Err(e) => return admin_error(e, limiter),
    };
    let pools = match limiter.pools(&req).await {
        Ok(p) => p,
        Err(e) => return admin_error(e, limiter),
    };
    match limiter.status(&req).await {
        Ok(v) => {
            let mut policies = Vec::new();
            for (di, d) in v.descriptors.iter().enumerate() {
                for p in &d.policies {
                    let mut json = policy_json(p);
                    if let Some(h) = held.iter().find(|h| h.descriptor == di && h.policy == p.name) {
                        let leases: Vec<Value> = h
                            .leases
                            .iter()
                            .map(|(id, expires)| json!({"lease_id": id.to_string(), "expires_at_ms": expires}))
                            .collect();
                        json["leases"] = Value::Array(leases);
                    }
                    if let Some(r) = pools.iter().find(|r| r.descriptor == di && r.policy == p.name) {
                        json["region"] = region_json(r, limiter.now());
                    }
                    if let Some(r) = reserved.iter().find(|r| r.descriptor == di && r.policy == p.name) {
                        let holds: Vec<Value> = r
                            .holds
                            .iter()
                            .map(|h| json!({"reservation": h.id.to_string(), "units": h.units, "expires_at_ms": h.expires}))
                            .collect();
                        json["reservations"] = Value::Array(holds);
                    }
                    policies.push(json);
                }
            }
            let matched = v.descriptors.iter().any(|d| d.matched);
            let entries = &req.descriptors[0].entries;
            axum::Json(json!({"domain": req.domain, "entries": entries, "matched": matched, "policies": policies}))
                .into_response()
        }
        Err(e) => admin_error(e, limiter),
    }
}

/// A global limit's regional pool, as `inspect` shows it.
fn region_json(r: &sluice::RegionalPool, now: u64) -> Value {
    let (p, fleet) = (&r.fleet.pool, &r.fleet);
    let grants: Vec<Value> =
        fleet.grants_here.iter().map(|g| json!({"grant": g.id.to_string(), "units": g.units})).collect();
    let regions: Vec<Value> = fleet
        .regions
        .iter()
        .map(|r| json!({"region": r.region, "code": format!("{:04x}", r.code), "granted_open": r.units, "grants": r.grants}))
        .collect();
    json!({
        "held": p.cap,
        "taken_by_instances": p.used,
        "unspent": p.unspent(),
        "demand_per_s": (p.demand.per_s(1_000, now) * 10.0).round() / 10.0,
        "window_end_ms": p.resets_at,
        "grants_from_this_instance": grants,
        "global_granted": fleet.global.map(|(granted, _)| granted),
        "global_left": fleet.global.map(|(_, left)| left),
        "regions": regions,
    })
}

/// `GET /v1/admin/top?domain=D[&rule=R][&k=20][&outcome=refused|admitted]`: the `k`
/// clients each rule of the domain (or rule `R`) refused (or admitted) most over the last
/// one to two `limiter.top_clients.interval`s, from lists of bounded size (`sluice::topk`).
async fn top(State(state): Shared, query: Result<Query<Vec<(String, String)>>, QueryRejection>) -> Response {
    let bad = |message: String| error(StatusCode::BAD_REQUEST, "bad_query", message);
    let Ok(Query(pairs)) = query else { return bad("the query string is not KEY=VALUE pairs".into()) };
    let get = |key: &str| pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    if let Some((unknown, _)) = pairs.iter().find(|(k, _)| !["domain", "rule", "k", "outcome"].contains(&k.as_str())) {
        return bad(format!("unknown parameter '{unknown}': give domain, and rule, k, outcome if you like"));
    }
    let Some(domain) = get("domain") else { return bad("add ?domain=NAME".into()) };
    let k = match get("k").map(str::parse::<usize>) {
        None => 20,
        Some(Ok(k)) if (1..=1_000).contains(&k) => k,
        Some(_) => return bad("k is how many clients to list: 1 to 1000".into()),
    };
    let refused = match get("outcome") {
        None | Some("refused") => true,
        Some("admitted") => false,
        Some(other) => return bad(format!("outcome '{other}': refused or admitted")),
    };
    let engine = state.engine.load();
    let tops = match engine.limiter.top_clients(domain, get("rule"), refused, k) {
        Ok(tops) => tops,
        Err(e @ sluice::topk::TopError::Off) => return error(StatusCode::NOT_FOUND, "top_clients_off", e.to_string()),
        Err(e) => return error(StatusCode::NOT_FOUND, "unknown", e.to_string()),
    };
    let rules: Vec<Value> = tops
        .iter()
        .map(|t| {
            let clients: Vec<Value> =
                t.clients.iter().map(|c| json!({"client": c.client, "count": c.count, "error": c.error})).collect();
            let bound = t.decisions.div_ceil(t.capacity.max(1) as u64);
            json!({"rule": t.rule, "decisions": t.decisions, "error_bound": bound, "clients": clients})
        })
        .collect();
    let outcome = if refused { "refused" } else { "admitted" };
    axum::Json(json!({"domain": domain, "outcome": outcome, "rules": rules})).into_response()
}

/// `DELETE /v1/admin/clients?domain=D&KEY=VALUE...[&policy=NAME]`: forgets the client's
/// state for every policy (or the one named), atomically per client; answers once every
/// instance has dropped the client from its near-cache.
async fn reset(State(state): Shared, query: Result<Query<Vec<(String, String)>>, QueryRejection>) -> Response {
    let (req, policy) = match client_query(query, Some("policy")) {
        Ok(q) => q,
        Err(resp) => return *resp,
    };
    let limiter = &state.engine.load().limiter;
    match limiter.reset(&req, policy.as_deref()).await {
        Ok(names) if names.is_empty() => {
            let message = match &policy {
                Some(p) => format!("policy '{p}' does not apply to this client"),
                None => "no limit applies to this client".into(),
            };
            error(StatusCode::NOT_FOUND, "nothing_to_reset", message)
        }
        Ok(names) => {
            let entries: Vec<String> =
                req.descriptors[0].entries.iter().map(|e| format!("{}={}", e.key, e.value)).collect();
            let target = format!("{}:{}", req.domain, entries.join(","));
            let names: Vec<&str> = names.iter().map(|n| &**n).collect();
            state.audit("client_reset", &target, None, Some(json!({"reset": names}).to_string()), "");
            tokio::time::sleep(sluice::overrides::PROPAGATION).await;
            axum::Json(json!({"domain": req.domain, "reset": names})).into_response()
        }
        Err(e) => admin_error(e, limiter),
    }
}

/// `GET /v1/admin/migration`: the migrating store's percentage.
/// The Envoy RLQS streams open on this instance: each bucket's share, its pieces and
/// the assignment last sent.
async fn rlqs(State(state): Shared) -> Response {
    axum::Json(state.rlqs.view()).into_response()
}

async fn migration(State(state): Shared) -> Response {
    match &*state.migration.load() {
        Some(m) => axum::Json(json!({"percent": m.percent()})).into_response(),
        None => error(StatusCode::CONFLICT, "not_migrating", "store.kind is not migrating".into()),
    }
}

/// `PUT /v1/admin/migration` with `{"percent": N}`: moves the share of clients on the
/// migrating store's `to` backend, live. The next config reload that changes `percent`
/// sets it again.
async fn set_migration(State(state): Shared, body: Body) -> Response {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct PercentBody {
        percent: u8,
    }
    let Ok(bytes) = to_bytes(body, 1024).await else {
        return error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", "send {\"percent\": N}".into());
    };
    let percent = match serde_json::from_slice::<PercentBody>(&bytes) {
        Ok(b) if b.percent <= 100 => b.percent,
        Ok(b) => return error(StatusCode::BAD_REQUEST, "bad_percent", format!("percent {} is above 100", b.percent)),
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("send {{\"percent\": N}} with N from 0 to 100: {e}"),
            );
        }
    };
    match &*state.migration.load() {
        Some(m) => {
            let previous = m.percent();
            m.set_percent(percent);
            let (old, new) = (Some(previous.to_string()), Some(percent.to_string()));
            state.audit("migration_percent", "store.percent", old, new, "");
            axum::Json(json!({"percent": percent, "previous": previous})).into_response()
        }
        None => error(StatusCode::CONFLICT, "not_migrating", "store.kind is not migrating".into()),
    }
}

/// An error of the admin API, as the data plane's, but an unknown domain's names the
/// configured ones: an operator's question, which the data plane answers to no caller.
fn admin_error(e: CheckError, limiter: &sluice::Limiter) -> Response {
    match e {
        CheckError::Request(RequestError::UnknownDomain { domain }) => {
            let known = limiter.rules().domain_names().join(", ");
            let message = format!("unknown domain '{domain}'; configured domains: {known}");
            error(StatusCode::BAD_REQUEST, "unknown_domain", message)
        }
        e => check_error(e),
    }
}
