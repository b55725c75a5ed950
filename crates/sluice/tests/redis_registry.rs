//! The registry's Lua (`store/redis/lua/registry.lua`) against the memory store's, on a
//! real redis-server: the same changes give the same versions, change log and floor,
//! past the tombstones the log keeps too.

use sluice::store::redis::{RedisOptions, RedisStore};
use sluice::store::{MemoryStore, RegistryOp, Store, TOMBSTONES};
use sluice_testkit::RedisServer;

async fn both(stores: &[&dyn Store], op: RegistryOp) -> sluice::store::RegistryReply {
    let a = stores[0].registry(op.clone()).await.unwrap();
    let b = stores[1].registry(op.clone()).await.unwrap();
    assert_eq!(a, b, "after {op:?}");
    a
}

#[tokio::test]
async fn redis_keeps_the_registry_as_the_model_does() {
    let redis = RedisServer::start();
    let options = RedisOptions { timeout: std::time::Duration::from_secs(2), ..RedisOptions::default() };
    let node = RedisStore::new(&redis.url(), &[], options).unwrap();
    let model = MemoryStore::new(1_000);
    let stores: [&dyn Store; 2] = [&node, &model];
    let put = |ids: &[String], max| RegistryOp::Put {
        entries: ids.iter().map(|i| (i.clone(), format!("v{i}"))).collect(),
        max,
    };
    let ids: Vec<String> = (0..TOMBSTONES + 100).map(|i| format!("id{i}")).collect();
    both(&stores, put(&ids[..3], 3)).await;
    assert!(both(&stores, put(&ids[3..4], 3)).await.full == Some(3), "the fourth is one too many");
    both(&stores, put(&ids[..1], 3)).await;
    for chunk in ids[3..].chunks(500) {
        both(&stores, put(chunk, u64::MAX)).await;
    }
    both(&stores, RegistryOp::Touch).await;
    for (i, id) in ids.iter().enumerate().skip(1) {
        let only_if = (i % 997 == 0).then(|| "not its value".to_string());
        both(&stores, RegistryOp::Remove { id: id.clone(), only_if }).await;
        if i % 1_000 == 0 {
            both(&stores, put(&ids[i - 5..i - 3], u64::MAX)).await;
        }
    }
    for after in [0, 5, 10_000, 11_000] {
        let changes = both(&stores, RegistryOp::Changes { after, count: 300 }).await;
        assert!(changes.floor > 0, "removals were forgotten");
    }
}

/// A Sluice older than the change log, writing to the same Redis during a rollout (a
/// plain HSET and INCR of the version, as its script did): an instance of this one sees
/// the change, by reading the whole set again, also when a logged change came after it.
#[tokio::test]
async fn a_change_by_an_older_sluice_is_seen() {
    let redis = RedisServer::start();
    let options = RedisOptions { timeout: std::time::Duration::from_secs(2), ..RedisOptions::default() };
    let store: std::sync::Arc<dyn Store> = std::sync::Arc::new(RedisStore::new(&redis.url(), &[], options).unwrap());
    let clock = std::sync::Arc::new(sluice::time::ManualClock::new(1));
    let me = sluice::Overrides::new(store.clone(), clock);
    let value = |user: &str| format!(r#"{{"domain":"api","entries":[{{"key":"user","value":"{user}"}}],"limit":5}}"#);
    store.registry(RegistryOp::Put { entries: vec![("new-1".into(), value("a"))], max: 10 }).await.unwrap();
    assert!(me.refresh().await.unwrap() && me.len() == 1);
    let old_write = |id: &str, user: &str| {
        let hset = format!("HSET sluice:{{registry}}:overrides {id} '{}'", value(user));
        assert_eq!(redis.command(&hset).unwrap().trim(), ":1");
        redis.command("INCR sluice:{registry}:version").unwrap();
    };
    old_write("old-1", "b");
    assert!(me.refresh().await.unwrap() && me.get("old-1").is_some(), "{:?}", me.list(None));
    old_write("old-2", "c");
    store.registry(RegistryOp::Put { entries: vec![("new-2".into(), value("d"))], max: 10 }).await.unwrap();
    assert!(me.refresh().await.unwrap());
    assert!(me.get("old-2").is_some() && me.get("new-2").is_some() && me.len() == 4, "{:?}", me.list(None));
    assert!(!me.refresh().await.unwrap(), "then nothing moved");
}
