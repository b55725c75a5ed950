//! The metrics' help texts (Prometheus's `# HELP` lines).

use super::names;

/// Gives every metric of [`names`] its help text (Prometheus's `# HELP` line), once the
/// application has installed its recorder. The words are docs/operations.md's, shorter.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    use names::*;
    describe_counter!(DECISIONS, "Policy decisions, by domain, policy and outcome (allowed, over_limit).");
    for (name, what) in [
        (
            RATELIMIT_TOTAL_HITS,
            "Hits of a rate_limit rule (envoyproxy/ratelimit's name, with limiter.ratelimit_metrics).",
        ),
        (RATELIMIT_OVER_LIMIT, "Hits a rate_limit rule refused (envoyproxy/ratelimit's name)."),
        (
            RATELIMIT_NEAR_LIMIT,
            "Hits a rate_limit rule allowed past the near-limit share (envoyproxy/ratelimit's name).",
        ),
        (RATELIMIT_WITHIN_LIMIT, "Hits a rate_limit rule allowed (envoyproxy/ratelimit's name)."),
        (RATELIMIT_SHADOW_MODE, "Hits a shadow-mode rate_limit rule would have refused (envoyproxy/ratelimit's name)."),
    ] {
        describe_counter!(name, what);
    }
    describe_counter!(NEAR_LIMIT, "Allowed decisions that used at least limiter.near_limit_ratio of the quota.");
    describe_counter!(SHADOW_OVER_LIMIT, "Shadow-mode decisions that would have refused (the request was allowed).");
    describe_counter!(NEAR_CACHE_HITS, "Refusals answered from the near-cache, without a store call.");
    describe_counter!(
        DEGRADED,
        "Requests decided by the failure policy (open or closed) because the store did not answer."
    );
    describe_counter!(LEASES_ACQUIRED, "Concurrency leases taken.");
    describe_counter!(LEASES_RELEASED, "Concurrency leases given back.");
    describe_histogram!(STORE_CALL_SECONDS, metrics::Unit::Seconds, "Store call latency, by store and op.");
    describe_counter!(STORE_ERRORS, "Failed store calls, by store and cause.");
    describe_gauge!(BREAKER_STATE, "The store's circuit breaker: 0 closed, 1 open, 2 half-open.");
    describe_gauge!(MEMORY_KEYS, "States held by the memory store.");
    describe_counter!(MEMORY_EVICTIONS, "States the memory store dropped because their time had passed.");
    describe_counter!(MEMORY_FULL, "Calls that found the memory store full with a new client's state to hold.");
    describe_counter!(CONFIG_RELOADS, "Config reloads applied (ok) and refused (failed: the last good config stayed).");
    describe_counter!(DECISIONS_DETAILED, "Decisions by descriptor value, for rules with detailed_metric: true.");
    describe_counter!(HTTP_OVER_LIMIT, "HTTP connections accepted past server.max_connections (one request each).");
    describe_gauge!(GRPC_CONNECTIONS, "gRPC connections open.");
    describe_counter!(GRPC_OVER_LIMIT, "gRPC connections closed at their accept, past server.max_connections.");
    describe_counter!(
        GRPC_CLOSED,
        "gRPC connections closed by a deadline: no first call (first_call) or none open (idle)."
    );
    describe_counter!(ADMIN_ACTIONS, "Admin actions, each also an audit log line.");
    describe_gauge!(OVERRIDES, "Stored overrides this instance holds.");
    describe_gauge!(
        OVERRIDES_REFRESHED,
        metrics::Unit::Seconds,
        "When this instance last read the stored overrides' version (seconds since the epoch)."
    );
    describe_counter!(GRANTS_TAKEN, "Quota grants taken, per granted policy.");
    describe_counter!(GRANT_UNITS, "Grant units granted to this instance, given back, and lapsed unspent.");
    describe_gauge!(GRANT_UNITS_HELD, "Grant units this instance holds unspent.");
    describe_counter!(GRANT_LOCAL, "Decisions answered from a grant, without a store call.");
    describe_counter!(GRANT_STORE_CALLS, "Store calls made for grants (taking and giving back).");
    describe_gauge!(MIGRATION_PERCENT, "A migrating store's share of clients on its `to` store.");
    describe_regions();
    describe_reservations();
    describe_shedders();
}

/// The load shedders' help texts.
fn describe_shedders() {
    use metrics::{describe_counter, describe_gauge};
    use names::*;
    describe_counter!(SHED, "Requests dropped by the load shedders, by shedder and priority class.");
    describe_gauge!(SHED_AMOUNT, "The worker utilization shedder's controller amount (below 0: at rest).");
    describe_gauge!(ADAPTIVE_LIMIT, "The adaptive concurrency limit: how many requests may run at once.");
    describe_gauge!(ADAPTIVE_IN_FLIGHT, "Requests running through the adaptive stage now.");
    describe_gauge!(ADAPTIVE_WAITING, "Requests waiting for a slot of the adaptive stage now.");
    describe_gauge!(ADAPTIVE_BASE_SECONDS, metrics::Unit::Seconds, "The no-load latency the adaptive stage learned.");
}

/// The regional allocator's help texts (one limit across regions).
fn describe_regions() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    use names::*;
    describe_counter!(REGION_UNITS, "Units of global limits this instance took from the global store, and gave back.");
    describe_counter!(
        REGION_HURRIED,
        "Decisions on global limits that found their region's pool short and asked the global store at once."
    );
    describe_counter!(
        REGION_REFUSALS,
        "Refusals on global limits after asking the global store: fleet_spent (the limit is spent), waiting (its \
         answer came too late: refused under the limit)."
    );
    describe_counter!(
        REGION_GLOBAL_CALLS,
        "Calls to the global store (ok, error): the allocator's, and those of decisions that found their pool short."
    );
    describe_histogram!(REGION_GLOBAL_SECONDS, metrics::Unit::Seconds, "Time of each call to the global store.");
    describe_counter!(
        REGION_DECIDED_GLOBALLY,
        "Decisions on global limits charged on the global store itself, while the region's own store failed \
         (failure: local)."
    );
    describe_counter!(
        REGION_LOST_UNITS,
        "Units of global windows this instance held that the global store no longer counted: it lost its data."
    );
    describe_gauge!(
        REGION_DISAGREEMENTS,
        "Global rules whose limit or window the regions configure differently (units are asked for under the \
         smallest limit)."
    );
    describe_gauge!(
        REGION_HORIZON,
        metrics::Unit::Seconds,
        "How far ahead a region holds units of a global window: twice the global calls' latency and a tick."
    );
}

/// The reservation metrics' help texts.
fn describe_reservations() {
    use metrics::{describe_counter, describe_gauge};
    use names::*;
    describe_counter!(RESERVATIONS, "Reservations asked for, by domain, policy and result (admitted, refused).");
    describe_counter!(RESERVATION_UNITS, "Reservation units held at admission, and committed (the actuals).");
    describe_counter!(
        RESERVATION_SETTLEMENTS,
        "Commits, by what they found: committed, expired (the hold was released at its TTL), again, reported."
    );
    describe_gauge!(
        RESERVATIONS_OPEN,
        "Reservations this instance admitted that are neither committed nor past their TTL."
    );
    describe_gauge!(RESERVATION_HELD_UNITS, "Units those reservations hold.");
}
