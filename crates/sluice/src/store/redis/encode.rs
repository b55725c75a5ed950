//! What a script call sends and what its reply means: the arguments of coalesced
//! calls, decisions read back from integers, and errors classed by what failed.

use super::*;

pub(super) fn store_error(e: RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::unavailable(format!("redis timed out: {e}")).because(e)
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error() {
        StoreError::unavailable(format!("redis connection: {e}")).because(e)
    } else {
        StoreError::protocol(format!("redis: {e}")).because(e)
    }
}

/// Decodes a reply of 6 integers per op.
pub(super) fn decisions(v: Value, n: usize) -> Result<Vec<Decision>, StoreError> {
    let ints: Vec<i64> =
        redis::from_redis_value(v).map_err(|e| StoreError::protocol(format!("script reply: {e}")).because(e))?;
    if ints.len() != n * 6 {
        return Err(StoreError::protocol(format!("script answered {} numbers for {n} ops", ints.len())));
    }
    ints.chunks_exact(6).map(decision).collect()
}

/// One decision of a script's reply: its 6 integers (see `lua/apply.lua`; the first
/// holds flags: 1 allowed, 2 reservations open on the window; the last is -1 for no
/// wait). A negative count or time is refused, not read as a huge one.
pub(super) fn decision(d: &[i64]) -> Result<Decision, StoreError> {
    let n = |i: usize| natural(d[i], "a decision");
    Ok(Decision {
        allowed: d[0] & 1 == 1,
        holds: d[0] & 2 == 2,
        limit: n(1)?,
        used: n(2)?,
        remaining: n(3)?,
        reset_at: n(4)?,
        retry_after: (d[5] != -1).then(|| n(5)).transpose()?,
    })
}

/// A count or time a script answered: never negative.
pub(super) fn natural(n: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(n).map_err(|_| StoreError::protocol(format!("{what} held the negative number {n}")))
}

/// One client's apply call: its ops, where their states live, and `now`.
pub(crate) struct Call {
    pub(super) at: Vec<Location>,
    pub(super) ops: Vec<Op>,
    pub(super) now: Millis,
}

/// The apply script's arguments for `calls`, one after another (see `lua/apply.lua`).
pub(super) fn apply_args(cmd: &mut Cmd, calls: &[&Call]) {
    cmd.arg(GRACE_MS);
    for c in calls {
        cmd.arg(c.now).arg(c.ops.len());
        for (op, at) in c.ops.iter().zip(&c.at) {
            cmd.arg(policy(&op.limit, op.shadow)).arg(op.cost);
            if let Limit::Concurrency { .. } = op.limit {
                cmd.arg(op.lease.map(lease_hex).unwrap_or_default());
            } else {
                cmd.arg(&at.field);
            }
        }
    }
}

/// The apply script's reply: per call, its decisions or the error that stopped it.
pub(super) fn answers(reply: Result<Value, StoreError>, calls: &[&Call]) -> Vec<Result<Vec<Decision>, StoreError>> {
    let values = match reply {
        Ok(Value::Array(values)) => values,
        Ok(other) => return fail_all(StoreError::protocol(format!("apply answered {other:?}")), calls),
        Err(e) => return fail_all(e, calls),
    };
    let mut values = values.into_iter();
    let answers = calls.iter().map(|call| answer(&mut values, call.ops.len())).collect();
    match values.next() {
        None => answers,
        Some(_) => fail_all(StoreError::protocol(format!("apply answered too much for {} calls", calls.len())), calls),
    }
}

/// One call's part of the apply script's reply: 6 integers per op, or one error string.
pub(super) fn answer(values: &mut std::vec::IntoIter<Value>, ops: usize) -> Result<Vec<Decision>, StoreError> {
    if ops == 0 {
        return Ok(Vec::new());
    }
    match values.as_slice().first() {
        Some(Value::BulkString(why)) => {
            let why = String::from_utf8_lossy(why).into_owned();
            values.next();
            Err(StoreError::protocol(format!("redis script: {why}")))
        }
        _ => decisions(Value::Array(values.by_ref().take(ops * 6).collect()), ops),
    }
}

pub(super) fn fail_all(e: StoreError, calls: &[&Call]) -> Vec<Result<Vec<Decision>, StoreError>> {
    calls.iter().map(|_| Err(e.clone())).collect()
}
