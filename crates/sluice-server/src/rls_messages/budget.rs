//! Budgets whose cost is known only when the work ends (an LLM response's tokens), as
//! every front-end offers them: reservations (hold an estimate, commit the actual; see
//! `sluice::algo::reservation`), checks that charge nothing, and reports that refuse
//! nothing. The HTTP API (`/v1/reservations`), Kuadrant's service (`grpc/kuadrant.rs`)
//! and Envoy's calls with `x-sluice-mode` (`grpc/rls.rs`) share them.
//!
//! A reservation id is a token that carries what a commit needs, resolved when it was
//! admitted (`sluice::Reserved`: the domain, each window held as a client tag, a state
//! and its limit, and the reservation's number), sealed with a keyed digest under
//! `limiter.key_secret`, so any instance of the fleet takes it back and none takes one it
//! did not issue or one altered. It names no descriptor value (tags and states are
//! keyed digests: an id in a proxy's log gives away no API key or user), and it is
//! bounded whatever was reserved (at most `MAX_RESERVED_WINDOWS` windows: about 60 bytes
//! each). The store keeps the holds; the token keeps nothing a client could use to
//! charge another client.

use crate::app::Engine;
use base64::Engine as _;
use sluice::{CheckError, Code, Outcome, Request, Reserved, Verdict};

/// The longest a reservation may be held: a response that takes longer is committed as
/// a report.
pub const MAX_TTL: sluice::config::Duration = sluice::config::Duration(3_600_000);

/// A reservation's TTL when the caller gives none.
pub const DEFAULT_TTL: sluice::config::Duration = sluice::config::Duration(30_000);

/// Each descriptor's actual, for `n` descriptors, from a commit's `actual` (for every
/// descriptor) or `actuals` (one each).
pub fn actuals(actual: Option<u64>, actuals: Option<Vec<u64>>, n: usize) -> Result<Vec<u64>, String> {
    match (actual, actuals) {
        (Some(a), None) => Ok(vec![a; n]),
        (None, Some(all)) if all.len() == n => Ok(all),
        (None, Some(all)) => Err(format!("`actuals` has {} numbers for {n} descriptors", all.len())),
        _ => Err("send `actual` (for every descriptor) or `actuals` (one a descriptor), not both".into()),
    }
}

/// Why a TTL is refused, if it is.
pub fn ttl_error(ttl: sluice::config::Duration) -> Option<String> {
    (ttl.0 == 0 || ttl.0 > MAX_TTL.0).then(|| format!("ttl {ttl} is not between 1ms and {MAX_TTL}"))
}

/// Reserves `req` for `ttl` ms: the verdict and, when admitted, the reservation's id.
pub async fn reserve(engine: &Engine, req: &Request, ttl: u64) -> Result<(Verdict, Option<String>), CheckError> {
    if engine.reservations_off {
        let off = "reservations are off here (limiter.reservations: false)";
        return Err(CheckError::Request(sluice::RequestError::NoReservations(off.into())));
    }
    let (mut v, reserved) = engine.limiter.reserve(req, random_id(), ttl).await?;
    if reserved.is_none() {
        // a refused estimate is told what is left (a decision's 0 says "not even one")
        for p in v.descriptors.iter_mut().flat_map(|d| d.policies.iter_mut()) {
            if !p.decision.allowed {
                p.decision.remaining = p.decision.limit.saturating_sub(p.decision.used);
            }
        }
    }
    Ok((v, reserved.map(|r| seal(&engine.limiter, &r))))
}

/// Whether a refused reservation was refused for the holds of a window (full until the
/// first lapses), not for its units.
pub fn too_many_holds(v: &Verdict, req: &Request) -> bool {
    v.descriptors.iter().zip(&req.descriptors).any(|(d, asked)| {
        let cost = asked.hits_addend.or(req.hits_addend).unwrap_or(1);
        d.policies.iter().any(|p| !p.shadow && sluice::algo::reservation::too_many_holds(&p.decision, cost))
    })
}

/// A status verdict (nothing charged) read as a check of `req`'s costs: a descriptor is
/// over its limit when an enforced policy has less left than the descriptor's cost (1
/// unless it or the request says otherwise), as Limitador's `CheckRateLimit` decides;
/// each such policy reads `allowed: false`, so that the answer agrees with itself.
pub fn as_check(mut v: Verdict, req: &Request) -> Verdict {
    let mut over = false;
    for (d, asked) in v.descriptors.iter_mut().zip(&req.descriptors) {
        let cost = asked.hits_addend.or(req.hits_addend).unwrap_or(1);
        for p in d.policies.iter_mut().filter(|p| p.decision.remaining < cost) {
            // each policy answers as the code does (a shadow one: what it would do)
            p.decision.allowed = false;
            if !p.shadow {
                d.code = Code::OverLimit;
                over = true;
            }
        }
    }
    if over && v.outcome == Outcome::Allowed {
        v.outcome = Outcome::OverLimit;
    }
    v
}

/// A fresh reservation number: never [`sluice::algo::reservation::REPORT`].
fn random_id() -> u64 {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    u64::from_le_bytes(b).max(1)
}

/// The token of reservation `r`: its bytes and their seal, in one URL-safe word.
fn seal(limiter: &sluice::Limiter, r: &Reserved) -> String {
    let mut bytes = r.to_bytes();
    bytes.extend(limiter.seal(&bytes).to_le_bytes());
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&bytes)
}

/// The reservation a token names, if it is one this fleet sealed.
pub fn open(limiter: &sluice::Limiter, token: &str) -> Option<Reserved> {
    // a token is at most a few KB: a longer one is not ours, and is not decoded
    if token.len() > MAX_TOKEN {
        return None;
    }
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(token).ok()?;
    let (payload, mac) = bytes.split_at_checked(bytes.len().checked_sub(16)?)?;
    let sealed = crate::app::same(mac, &limiter.seal(payload).to_le_bytes());
    sealed.then(|| Reserved::from_bytes(payload)).flatten()
}

/// The longest token [`seal`] writes (a reservation of `sluice::MAX_RESERVED_WINDOWS`
/// windows, each reached by a few descriptors, under a long domain name), with room.
pub const MAX_TOKEN: usize = 8_192;
