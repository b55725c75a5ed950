//! `POST /v1/overrides:import`: many overrides in one request (a migration, a restore,
//! a customer list), checked all or nothing and stored a page at a time, so loading
//! 200,000 takes seconds instead of one `PUT` each.

use super::error::error;
use super::error::override_error;
use crate::app::AppState;
use axum::body::{Body, to_bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use sluice::Override;
use std::sync::Arc;

/// The largest import body: 250,000 overrides (the default `limiter.max_overrides`) of
/// about 200 bytes each, with room.
pub const MAX_IMPORT_BYTES: usize = 128 * 1024 * 1024;

/// How long an import body may take to arrive (a 50 MB body at 10 Mbit/s, with room).
pub const IMPORT_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// `POST /v1/overrides:import`. The body is JSON: an array of overrides, the object
/// `GET /v1/overrides` answers (`{"overrides": [...]}`, so an export is an import), or
/// one override a line; each override has its `id`. 200 `{"imported": N}`; 400 listing
/// each refused one (none stored); 409 past `limiter.max_overrides` (none stored).
pub async fn import(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let Ok(read) = tokio::time::timeout(IMPORT_BODY_TIMEOUT, to_bytes(body, MAX_IMPORT_BYTES)).await else {
        let message = format!("the import did not arrive within {IMPORT_BODY_TIMEOUT:?}; split it in several");
        return error(StatusCode::REQUEST_TIMEOUT, "body_timeout", message);
    };
    let Ok(bytes) = read else {
        let message = format!("an import is at most {} MiB; split it in several", MAX_IMPORT_BYTES >> 20);
        return error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", message);
    };
    let by = state.actor();
    let all = match parse(&bytes) {
        Ok(all) => all.into_iter().map(|o| Override { set_by: by.clone(), ..o }).collect(),
        Err(message) => return error(StatusCode::BAD_REQUEST, "invalid_json", message),
    };
    match state.engine.load().limiter.import_overrides(all).await {
        Ok(n) => {
            // one line for the import: 200,000 lines would bury the trail
            state.audit("overrides_imported", &format!("{n} overrides"), None, None, "");
            axum::Json(json!({"imported": n})).into_response()
        }
        Err(e) => override_error(e),
    }
}

/// The overrides of an import body, in order; what is wrong with the first bad one.
fn parse(bytes: &[u8]) -> Result<Vec<Override>, String> {
    let mut all = Vec::new();
    for (n, value) in serde_json::Deserializer::from_slice(bytes).into_iter::<Value>().enumerate() {
        let value = value.map_err(|e| format!("the body is not JSON: {e} (JSON value {})", n + 1))?;
        let items = match value {
            Value::Array(items) => items,
            Value::Object(mut o) if o.contains_key("overrides") => match o.remove("overrides") {
                Some(Value::Array(items)) => items,
                _ => return Err("`overrides` must be an array of overrides".into()),
            },
            one => vec![one],
        };
        for item in items {
            let index = all.len();
            let o: Override = serde_json::from_value(item).map_err(|e| {
                format!(
                    "overrides[{index}] is not an override: {e} (each has \"id\", \"domain\", \"entries\", \"limit\")"
                )
            })?;
            if o.id.is_empty() {
                return Err(format!("overrides[{index}] has no \"id\": an import names each override"));
            }
            all.push(o);
        }
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = r#"{"id":"a","domain":"api","entries":[{"key":"user","value":"a"}],"limit":5}"#;

    #[test]
    fn an_array_an_export_and_lines_are_read_alike() {
        let lines = format!("{ONE}\n{}\n", ONE.replace("\"a\"", "\"b\""));
        for body in [format!("[{ONE}]"), format!("{{\"overrides\": [{ONE}]}}"), lines] {
            let all = parse(body.as_bytes()).unwrap();
            assert_eq!(all[0].id, "a", "{body}");
        }
        assert_eq!(parse(format!("{ONE}\n{ONE}").as_bytes()).unwrap().len(), 2);
    }

    #[test]
    fn a_bad_item_is_named_by_its_place() {
        let e = parse(format!("[{ONE}, {{\"id\": \"x\"}}]").as_bytes()).unwrap_err();
        assert!(e.starts_with("overrides[1]"), "{e}");
        let e = parse(ONE.replace("\"id\":\"a\",", "").as_bytes()).unwrap_err();
        assert!(e.contains("no \"id\""), "{e}");
        assert!(parse(b"[{").unwrap_err().contains("not JSON"));
    }
}
