//! Budgets whose cost is known only when the work ends (an LLM response's tokens), as
//! every front-end offers them: reservations (hold an estimate, commit the actual; see
//! `sluice::algo::reservation`), checks that charge nothing, and reports that refuse
//! nothing. The HTTP API (`/v1/reservations`), Kuadrant's service (`grpc/kuadrant.rs`)
//! and Envoy's calls with `x-sluice-mode` (`grpc/rls.rs`) share them.
//!
//! A reservation id is a token that carries what a commit needs (the domain, each
//! descriptor's entries, the reservation's number), sealed with a keyed digest under
//! `limiter.key_secret`, so any instance of the fleet takes it back and none takes one it
//! did not issue or one altered. The store keeps the holds; the token keeps nothing a
//! client could use to charge another client.

use crate::state::Engine;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sluice::{CheckError, Code, Descriptor, Entry, Outcome, Request, Verdict};

/// The longest a reservation may be held: a response that takes longer is committed as
/// a report.
pub const MAX_TTL: sluice::config::Duration = sluice::config::Duration(3_600_000);

/// A reservation's TTL when the caller gives none.
pub const DEFAULT_TTL: sluice::config::Duration = sluice::config::Duration(30_000);

/// What a reservation id carries.
#[derive(Serialize, Deserialize)]
pub struct Token {
    /// The domain.
    d: String,
    /// Each descriptor's entries.
    e: Vec<Vec<(String, String)>>,
    /// The reservation's number.
    i: u64,
}

impl Token {
    /// How many descriptors the reservation named (one actual each).
    pub fn descriptors(&self) -> usize {
        self.e.len()
    }

    /// The request that commits it, each descriptor's actual as its cost; and its number.
    pub fn commit(self, actuals: Vec<u64>) -> (Request, u64) {
        let descriptors = self
            .e
            .into_iter()
            .zip(actuals)
            .map(|(entries, actual)| Descriptor {
                entries: entries.into_iter().map(|(key, value)| Entry { key, value }).collect(),
                hits_addend: Some(actual),
                limit: None,
            })
            .collect();
        (Request { domain: self.d, descriptors, hits_addend: None, lenient: false }, self.i)
    }
}

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
    let id = random_id();
    let v = engine.limiter.reserve(req, id, ttl).await?;
    let token = (v.outcome == Outcome::Allowed).then(|| seal(&engine.limiter, req, id));
    Ok((v, token))
}

/// A status verdict (nothing charged) read as a check of `req`'s costs: a descriptor is
/// over its limit when an enforced policy has less left than the descriptor's cost (1
/// unless it or the request says otherwise), as Limitador's `CheckRateLimit` decides.
pub fn as_check(mut v: Verdict, req: &Request) -> Verdict {
    let mut over = false;
    for (d, asked) in v.descriptors.iter_mut().zip(&req.descriptors) {
        let cost = asked.hits_addend.or(req.hits_addend).unwrap_or(1);
        if d.policies.iter().any(|p| !p.shadow && p.decision.remaining < cost) {
            d.code = Code::OverLimit;
            over = true;
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

/// The token of reservation `id` of `req`.
fn seal(limiter: &sluice::Limiter, req: &Request, id: u64) -> String {
    let e =
        req.descriptors.iter().map(|d| d.entries.iter().map(|e| (e.key.clone(), e.value.clone())).collect()).collect();
    let token = Token { d: req.domain.clone(), e, i: id };
    let payload = serde_json::to_vec(&token).expect("strings and numbers serialize");
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    format!("{}.{:032x}", b64.encode(&payload), limiter.seal(&payload))
}

/// What a token carries, if it is one this fleet sealed (its seal written exactly as
/// [`seal`] writes it: one spelling a token).
pub fn open(limiter: &sluice::Limiter, token: &str) -> Option<Token> {
    let (payload, mac) = token.split_once('.')?;
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload).ok()?;
    let sealed = crate::state::same(mac.as_bytes(), format!("{:032x}", limiter.seal(&payload)).as_bytes());
    sealed.then(|| serde_json::from_slice(&payload).ok()).flatten()
}
