//! What a caller asks: a domain and descriptors, as Envoy's `RateLimitRequest` has them,
//! and the check of the bounds it must keep to (`limiter.request_bounds`, [`crate::config::RequestBounds`]).
//!
//! Every interface (the HTTP API, Envoy's gRPC, the tower layer) turns what it received
//! into a [`Request`]; the engine refuses one that breaks a bound with a
//! [`RequestError`] naming the problem, before any store is asked.

use crate::algo::MAX_EXACT;
use crate::config::{RequestBounds, Unit};

/// One `key=value` of a descriptor.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub key: String,
    pub value: String,
}

/// A request-supplied limit that replaces the configured one (Envoy's descriptor
/// `limit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitOverride {
    pub requests_per_unit: u64,
    pub unit: Unit,
}

/// One descriptor of a request: entries walked down the domain's rule tree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub entries: Vec<Entry>,
    /// This descriptor's cost; None takes the request's.
    pub hits_addend: Option<u64>,
    pub limit: Option<LimitOverride>,
}

impl Descriptor {
    /// A descriptor of `(key, value)` entries, in order.
    pub fn new<K: Into<String>, V: Into<String>>(entries: impl IntoIterator<Item = (K, V)>) -> Self {
        let entries = entries.into_iter().map(|(k, v)| Entry { key: k.into(), value: v.into() }).collect();
        Self { entries, ..Self::default() }
    }
}

/// A rate limit request, as Envoy's `RateLimitRequest` has it.
///
/// ```
/// use sluice::Request;
/// let req = Request::new("api").descriptor([("user", "alice")]).cost(2);
/// assert_eq!(req.descriptors[0].entries[0].value, "alice");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    pub domain: String,
    pub descriptors: Vec<Descriptor>,
    /// The cost of each descriptor that names none; None means 1.
    pub hits_addend: Option<u64>,
    /// Answer as envoyproxy/ratelimit does what Sluice's own API refuses as a mistake: a
    /// descriptor without entries (or an entry without a key) matches nothing and is
    /// allowed, and a cost above a limit's capacity is refused by that limit (OVER_LIMIT)
    /// rather than being an error. Envoy's gRPC path sets it.
    pub lenient: bool,
}

impl Request {
    /// A request in `domain` with no descriptors yet.
    pub fn new(domain: impl Into<String>) -> Self {
        Self { domain: domain.into(), ..Self::default() }
    }

    /// Adds a descriptor of `(key, value)` entries.
    pub fn descriptor<K: Into<String>, V: Into<String>>(mut self, entries: impl IntoIterator<Item = (K, V)>) -> Self {
        self.descriptors.push(Descriptor::new(entries));
        self
    }

    /// Sets the cost of every descriptor that names none.
    pub fn cost(mut self, cost: u64) -> Self {
        self.hits_addend = Some(cost);
        self
    }
}

/// A request the engine refuses to evaluate. Each says what is wrong and what to send.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// (The configured domains are not named to the data plane's callers: the admin
    /// API's answers and `config check` name them.)
    #[error("unknown domain '{domain}': no rules are configured for it")]
    UnknownDomain { domain: String },
    #[error("`descriptors` is empty; send at least one descriptor with at least one entry")]
    NoDescriptors,
    #[error("descriptors[{0}] has no entries; each descriptor needs at least one {{key, value}}")]
    EmptyDescriptor(usize),
    #[error("{sent} descriptors sent; at most {max} are accepted (limiter.request_bounds.descriptors)")]
    TooManyDescriptors { sent: usize, max: usize },
    #[error(
        "descriptors[{descriptor}] has {sent} entries; at most {max} are accepted (limiter.request_bounds.entries)"
    )]
    TooManyEntries { descriptor: usize, sent: usize, max: usize },
    #[error("descriptors[{descriptor}].entries[{entry}].{field} is {len} bytes; at most {max} are accepted")]
    TooLong { descriptor: usize, entry: usize, field: &'static str, len: usize, max: usize },
    #[error("descriptors[{descriptor}].entries[{entry}].key is empty")]
    EmptyKey { descriptor: usize, entry: usize },
    #[error(
        "descriptors[{descriptor}]: hits_addend {cost} exceeds the capacity {capacity} of policy '{policy}', \
         so it could never be admitted; send a cost of at most {capacity}"
    )]
    CostAboveCapacity { descriptor: usize, cost: u64, policy: String, capacity: u64 },
    #[error(
        "descriptors[{descriptor}]: hits_addend {cost} is above 9007199254740991 (2^53 - 1), the most any limit \
         counts exactly; send less"
    )]
    CostNotExact { descriptor: usize, cost: u64 },
    /// A reservation or a commit that cannot be taken as sent.
    #[error("{0}")]
    BadReservation(String),
    #[error(
        "descriptors[{0}] carries its own limit, which this server does not take (limiter.request_bounds.limits: false)"
    )]
    LimitRefused(usize),
    #[error("descriptors[{descriptor}].limit: {source}")]
    BadLimit {
        descriptor: usize,
        #[source]
        source: crate::algo::LimitError,
    },
    #[error("lease id '{0}' is not one this service issued")]
    BadLeaseId(String),
    #[error(
        "descriptors[{descriptor}] reaches policy '{policy}', a {algorithm}; reservations take fixed windows \
         (`rate_limit:` or `fixed_window:`)"
    )]
    NotReservable { descriptor: usize, policy: String, algorithm: &'static str },
    /// Reservations are not served here: the store keeps none, or they are turned off.
    #[error("{0}")]
    NoReservations(String),
    /// There are no rules yet: they are still to come (see [`crate::rules::Rules::pending`]).
    #[error("{0}")]
    NoRules(String),
}

impl RequestError {
    /// A stable machine-readable code for JSON errors.
    pub fn code(&self) -> &'static str {
        match self {
            RequestError::UnknownDomain { .. } => "unknown_domain",
            RequestError::NoDescriptors | RequestError::EmptyDescriptor(_) => "empty_descriptors",
            RequestError::TooManyDescriptors { .. } | RequestError::TooManyEntries { .. } => "too_many_descriptors",
            RequestError::TooLong { .. } | RequestError::EmptyKey { .. } => "bad_entry",
            RequestError::CostAboveCapacity { .. } | RequestError::CostNotExact { .. } => "cost_above_capacity",
            RequestError::BadReservation(_) => "bad_reservation",
            RequestError::BadLimit { .. } | RequestError::LimitRefused(_) => "bad_limit",
            RequestError::BadLeaseId(_) => "bad_lease_id",
            RequestError::NotReservable { .. } => "not_reservable",
            RequestError::NoReservations(_) => "no_reservations",
            RequestError::NoRules(_) => "no_rules_yet",
        }
    }
}

/// Checks a request against `bounds`, before any rule is matched.
pub(crate) fn validate(req: &Request, bounds: &RequestBounds) -> Result<(), RequestError> {
    if req.descriptors.is_empty() {
        return Err(RequestError::NoDescriptors);
    }
    if req.descriptors.len() > bounds.descriptors {
        return Err(RequestError::TooManyDescriptors { sent: req.descriptors.len(), max: bounds.descriptors });
    }
    for (di, d) in req.descriptors.iter().enumerate() {
        if d.entries.is_empty() && !req.lenient {
            return Err(RequestError::EmptyDescriptor(di));
        }
        if d.entries.len() > bounds.entries {
            return Err(RequestError::TooManyEntries { descriptor: di, sent: d.entries.len(), max: bounds.entries });
        }
        for (ei, e) in d.entries.iter().enumerate() {
            if e.key.is_empty() && !req.lenient {
                return Err(RequestError::EmptyKey { descriptor: di, entry: ei });
            }
            let fields = [("key", e.key.len(), bounds.key_bytes), ("value", e.value.len(), bounds.value_bytes)];
            for (field, len, max) in fields {
                if len > max {
                    return Err(RequestError::TooLong { descriptor: di, entry: ei, field, len, max });
                }
            }
        }
        if d.limit.is_some() && !bounds.limits {
            return Err(RequestError::LimitRefused(di));
        }
        let cost = d.hits_addend.or(req.hits_addend).unwrap_or(1);
        if cost > MAX_EXACT {
            return Err(RequestError::CostNotExact { descriptor: di, cost });
        }
    }
    Ok(())
}
