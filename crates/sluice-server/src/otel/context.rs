//! W3C trace context: a caller's `traceparent` read, and the ids and sampling of the
//! spans Sluice starts.

use super::*;

/// A W3C trace context, from a `traceparent` (and `tracestate`) header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
    pub state: String,
}

impl Parent {
    /// The context `headers` carry, if a valid one: an invalid `traceparent` is ignored,
    /// as W3C Trace Context asks (the request starts a trace of its own).
    pub fn from_headers(headers: &HeaderMap) -> Option<Self> {
        const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
        let (trace_id, span_id, flags) = traceparent(headers.get(TRACEPARENT)?.as_bytes())?;
        let state = headers.get("tracestate").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        Some(Self { trace_id, span_id, sampled: flags & 1 == 1, state })
    }
}

/// Parses `version-traceid-parentid-flags` (lowercase hex; version `ff` is invalid;
/// a version after 00 may add fields after the flags; all-zero ids are invalid).
pub(super) fn traceparent(v: &[u8]) -> Option<([u8; 16], [u8; 8], u8)> {
    let version = hex::<1>(v.get(0..2)?)?[0];
    let well_formed = match version {
        0 => v.len() == 55,
        0xff => false,
        _ => v.len() == 55 || (v.len() > 55 && v[55] == b'-'),
    };
    if !well_formed || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let trace_id = hex::<16>(&v[3..35])?;
    let span_id = hex::<8>(&v[36..52])?;
    let flags = hex::<1>(&v[53..55])?[0];
    (trace_id != [0; 16] && span_id != [0; 8]).then_some((trace_id, span_id, flags))
}

/// `N` bytes from `2N` lowercase hex digits.
pub(super) fn hex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0; N];
    for (i, pair) in s.chunks(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// Lowercase hex, for trace ids in log lines.
pub struct Hex<'a>(pub &'a [u8]);

impl std::fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// Random ids: a per-thread xorshift generator seeded from the system (ids must be
/// unique, not secret).
pub(super) fn random_u64() -> u64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            let mut seed = [0u8; 8];
            let _ = getrandom::fill(&mut seed);
            u64::from_le_bytes(seed) | 1
        });
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        x
    })
}

pub(super) fn span_id() -> [u8; 8] {
    random_u64().to_be_bytes()
}

pub(super) fn trace_id() -> [u8; 16] {
    let mut id = [0; 16];
    id[..8].copy_from_slice(&random_u64().to_be_bytes());
    id[8..].copy_from_slice(&random_u64().to_be_bytes());
    id
}

pub(super) fn unix_nanos() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Whether the trace `id` is recorded at `ratio`: its last 8 bytes against the ratio's
/// share of 2^63 (OpenTelemetry's `TraceIdRatioBased` rule).
pub(super) fn sampled_at(bound: u64, id: &[u8; 16]) -> bool {
    let low = u64::from_be_bytes(id[8..].try_into().expect("8 bytes"));
    (low >> 1) < bound
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_valid_and_not() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let (t, s, f) = traceparent(good.as_bytes()).expect("valid");
        assert_eq!(Hex(&t).to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(Hex(&s).to_string(), "00f067aa0ba902b7");
        assert_eq!(f, 1);
        // a later version may carry more after the flags
        assert!(traceparent(format!("01{}-extra", &good[2..]).as_bytes()).is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
        ] {
            assert_eq!(traceparent(bad.as_bytes()), None, "{bad:?}");
        }
    }

    /// The ratio sampler records about its share of random trace ids, none at 0 and
    /// every one at 1.
    #[test]
    fn sampling_follows_the_ratio() {
        let share = |ratio: f64| {
            let bound = (ratio * (1u64 << 63) as f64) as u64;
            (0..100_000).filter(|_| sampled_at(bound, &trace_id())).count()
        };
        assert_eq!(share(0.0), 0);
        assert_eq!(share(1.0), 100_000);
        let quarter = share(0.25);
        assert!((24_000..26_000).contains(&quarter), "{quarter} of 100,000 at 0.25");
    }
}
