//! Data-plane calls refused for their credentials (`server.api_tokens`), made visible.
//!
//! Envoy's rate limit filters fail open by default: a call Sluice refuses as
//! UNAUTHENTICATED lets the request through, so a filter whose `grpc_service` sends no
//! token (or an old one) limits nothing and says nothing. Each refusal is counted
//! (`sluice_unauthenticated_total{listener}`) and logged, at most every 10 s, with the
//! last peer's address and how many were refused since the last line; the
//! `SluiceUnauthenticatedCalls` alert (deploy/prometheus) fires on the count.

use crate::logs::Sometimes;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

/// The counter's name.
pub const UNAUTHENTICATED: &str = "sluice_unauthenticated_total";

/// Describes the counter to the recorder.
pub fn describe() {
    metrics::describe_counter!(
        UNAUTHENTICATED,
        "Data-plane calls refused for their credentials (no token, or not one of server.api_tokens), by listener."
    );
}

/// The refusals since the last log line, and when it may be written again.
#[derive(Default)]
pub struct Refusals {
    since: AtomicU64,
    log: Sometimes,
}

impl Refusals {
    /// Counts a call on `listener` (`http`, `grpc`) refused for its credentials, from
    /// `peer`; `sent` says whether it carried an `authorization` at all.
    pub fn refused(&self, listener: &'static str, peer: Option<SocketAddr>, sent: bool) {
        metrics::counter!(UNAUTHENTICATED, "listener" => listener).increment(1);
        let count = self.since.fetch_add(1, Ordering::Relaxed) + 1;
        if self.log.due() {
            self.since.fetch_sub(count, Ordering::Relaxed);
            let peer = peer.map_or_else(|| "unknown".to_string(), |p| p.to_string());
            let why = if sent { "a token that is not one of server.api_tokens" } else { "no authorization" };
            tracing::warn!(
                listener,
                peer = %peer,
                refused = count,
                "data-plane calls refused for their credentials ({why}, the last from {peer}; {count} since the last such line, logged at most every 10 s): an Envoy filter that sends no token fails open and limits nothing; give its grpc_service the metadata authorization: Bearer <one of server.api_tokens> (docs/envoy.md, \"When Sluice requires credentials\")"
            );
        }
    }
}
