//! Redis's answers to the registry's calls (`lua/registry.lua`, GET, HSCAN), read into a
//! [`RegistryReply`]. Each says what was wrong with an answer of another shape.

use crate::store::{Change, RegistryReply, StoreError};
use redis::{FromRedisValue, Value};

fn read<T: FromRedisValue>(v: Value) -> Result<T, StoreError> {
    redis::from_redis_value(v).map_err(|e| StoreError::protocol(format!("registry reply: {e}")).because(e))
}

fn items(v: Value) -> Result<std::vec::IntoIter<Value>, StoreError> {
    Ok(read::<Vec<Value>>(v)?.into_iter())
}

fn next(items: &mut impl Iterator<Item = Value>) -> Value {
    items.next().unwrap_or(Value::Nil)
}

/// An MGET of the version and the versions logged: none yet is 0.
pub(super) fn version(v: Value) -> Result<RegistryReply, StoreError> {
    let mut items = items(v)?;
    let version = read::<Option<u64>>(next(&mut items))?.unwrap_or(0);
    let logged = read::<Option<u64>>(next(&mut items))?.unwrap_or(0);
    Ok(RegistryReply { version, unlogged: version.saturating_sub(logged), ..RegistryReply::default() })
}

/// An HSCAN page: `[cursor, [id, value, ...]]`.
pub(super) fn page(v: Value) -> Result<RegistryReply, StoreError> {
    let mut items = items(v)?;
    let cursor: u64 = read(next(&mut items))?;
    let flat: Vec<String> = read(next(&mut items))?;
    if flat.len() % 2 != 0 {
        return Err(StoreError::protocol(format!("registry page of {} strings", flat.len())));
    }
    let mut flat = flat.into_iter();
    let mut entries = Vec::with_capacity(flat.len() / 2);
    while let (Some(id), Some(value)) = (flat.next(), flat.next()) {
        entries.push((id, value));
    }
    Ok(RegistryReply { cursor, entries, ..RegistryReply::default() })
}

/// A put, remove or touch: `{version, previous or false, [held when refused]}`.
pub(super) fn written(v: Value) -> Result<RegistryReply, StoreError> {
    let mut items = items(v)?;
    let version = read(next(&mut items))?;
    let previous = read(next(&mut items))?;
    let full = read(next(&mut items))?;
    Ok(RegistryReply { version, previous, full, ..RegistryReply::default() })
}

/// The changes after a version: `{version, floor, id, version, value or false, ...}`.
pub(super) fn changes(v: Value) -> Result<RegistryReply, StoreError> {
    let mut items = items(v)?;
    if items.len() < 2 || (items.len() - 2) % 3 != 0 {
        return Err(StoreError::protocol(format!("registry changes of {} items", items.len())));
    }
    let version = read(next(&mut items))?;
    let floor = read(next(&mut items))?;
    let mut changes = Vec::with_capacity(items.len() / 3);
    while let Some(id) = items.next() {
        let (id, version, value) = (read(id)?, read(next(&mut items))?, read(next(&mut items))?);
        changes.push(Change { id, version, value });
    }
    Ok(RegistryReply { version, floor, changes, ..RegistryReply::default() })
}
