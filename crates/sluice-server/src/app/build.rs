//! From config to engine: the clock, the store (remote stores behind the deadline and
//! circuit breaker), the near-cache and the rules. `serve`, `reload` and `bench` all
//! build here.

use crate::app::Engine;
use crate::config::checks::{UnfitStore, tls};
use crate::config::{Config, RedisConnectionConfig, SentinelConfig, StoreConfig};
use sluice::Limiter;
use sluice::config::{ClockKind, LimiterConfig};
use sluice::rules::Rules;
use sluice::store::redis::{Auth, RedisOptions, RedisStore, SentinelOptions, ShardedRedisStore};
use sluice::store::{MemcachedStore, MemoryStore, MigratingStore, Resilience, Resilient, Store, StoreError, Tuning};
use sluice::time::{Clock, CoarseClock, SystemClock};
use std::sync::Arc;
use std::time::Duration;

/// Why an engine cannot be built from a config.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Unfit(#[from] UnfitStore),
}

/// An engine and the handles the server keeps to it.
pub struct Built {
    pub engine: Engine,
    /// The migrating store, when the store is one.
    pub migration: Option<Arc<MigratingStore>>,
    /// The deadline and breaker every remote store of this engine obeys.
    pub tuning: Arc<Tuning>,
}

/// The engine a config describes, with a new store. The config is one `config::load`
/// made, so its checks (`config/checks.rs`: rules the store can run, addresses, files)
/// have passed.
pub fn build(config: &Config, rules: Rules) -> Result<Built, BuildError> {
    let tuning = Arc::new(Tuning::new(resilience(&config.limiter)));
    let mut migration = None;
    let clock = clock(&config.limiter);
    let mut store = store(&config.store, &tuning, clock.clone(), &mut migration)?;
    if config.telemetry.otlp.is_some() {
        store = Arc::new(crate::otel::TracedStore(store));
    }
    let regions = match &config.global_store {
        Some(global) => {
            Some(regions((config.region.as_deref(), global), &config.limiter, store.clone(), clock.clone())?)
        }
        None => None,
    };
    let mut engine = engine(config, rules, store, clock.clone(), None);
    if let Some(regions) = regions {
        engine.limiter = engine.limiter.with_overrides(fleet_overrides(&regions, clock));
        engine.limiter = engine.limiter.with_regions(regions);
    }

    Ok(Built { engine, migration, tuning })
}

/// The allocator of `region` between its store `local` and the `global_store`, started (it
/// ticks in the background, when there is a runtime to tick in). The global store's
/// calls have a deadline of a second at least: no decision waits on them, and a cross-
/// region round trip can take most of `limiter.deadline`.
pub fn regions(
    (region, global): (Option<&str>, &StoreConfig),
    limiter: &LimiterConfig,
    local: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
) -> Result<Arc<sluice::regions::Regions>, BuildError> {
    let mut resilience = resilience(limiter);
    resilience.deadline = resilience.deadline.max(Duration::from_secs(1));
    // its calls' series are labelled store="global", apart from the region's own store's
    let global = store(global, &Arc::new(Tuning::new(resilience).labelled("global")), clock.clone(), &mut None)?;
    let regions = sluice::regions::Regions::named(region.unwrap_or_default(), global, local, clock);
    if tokio::runtime::Handle::try_current().is_ok() {
        regions.spawn();
    }
    Ok(regions)
}

/// A config's `store` and its `global_store`, if any.
pub type Stores = (Arc<dyn Store>, Option<Arc<dyn Store>>);

/// The stores `config` names, its `store` and its `global_store`, for `config check
/// --online` to contact: behind the deadline (a second at least), no allocator started
/// (a check is no region).
pub fn stores(config: &Config) -> Result<Stores, BuildError> {
    let mut resilience = resilience(&config.limiter);
    resilience.deadline = resilience.deadline.max(Duration::from_secs(1));
    let tuning = Arc::new(Tuning::new(resilience));
    let clock = clock(&config.limiter);
    let local = store(&config.store, &tuning, clock.clone(), &mut None)?;
    let global = match &config.global_store {
        Some(global) => Some(store(global, &tuning, clock, &mut None)?),
        None => None,
    };
    Ok((local, global))
}

/// The overrides of a fleet across regions: in the global store's registry, one set for
/// every region (an override set in one is in force in all within
/// [`sluice::overrides::PROPAGATION`] and the round trip), kept current.
pub fn fleet_overrides(regions: &sluice::regions::Regions, clock: Arc<dyn Clock>) -> Arc<sluice::overrides::Overrides> {
    let overrides = sluice::overrides::Overrides::new(regions.global().clone(), clock);
    overrides.watch(sluice::overrides::REFRESH);
    overrides
}

/// An engine over an existing store, with the clock, near-cache and headers `config`
/// asks for. It applies the overrides and quota grants of `previous` (the engine it
/// follows, on the same store), or reads the store's overrides and keeps them current
/// (every [`sluice::overrides::REFRESH`]).
pub fn engine(
    config: &Config,
    rules: Rules,
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    previous: Option<&Limiter>,
) -> Engine {
    let remote = !matches!(config.store, StoreConfig::Memory { .. });
    let limiter = Limiter::new(Arc::new(rules), store, clock);
    let limiter = match previous {
        Some(p) => {
            let limiter = limiter
                .with_overrides(p.overrides().clone())
                .with_grants(p.grants().clone())
                .with_issued(p.issued().clone())
                .with_fallback(p.fallback().clone());
            match p.regions() {
                Some(r) => limiter.with_regions(r.clone()),
                None => limiter,
            }
        }
        None => {
            limiter.overrides().watch(sluice::overrides::REFRESH);
            limiter
        }
    };
    let limiter = match config.limiter.near_cache {
        n if remote && n > 0 => limiter.with_near_cache(n),
        _ => limiter,
    };
    if limiter.rules().use_local_failure() && tokio::runtime::Handle::try_current().is_ok() {
        // `failure: local` needs to know its fleet (once: a reload keeps the heartbeat)
        limiter.spawn_heartbeat();
    }
    let reservations_off = config.limiter.reservations == Some(false);
    Engine { limiter, headers: config.headers, envoy: config.envoy, reservations_off }
}

/// The clock `limiter.clock` names.
pub fn clock(limiter: &LimiterConfig) -> Arc<dyn Clock> {
    match limiter.clock {
        ClockKind::System => Arc::new(SystemClock),
        ClockKind::Coarse => Arc::new(CoarseClock),
    }
}

/// The deadline and breaker of `limiter`.
pub fn resilience(limiter: &LimiterConfig) -> Resilience {
    Resilience {
        deadline: limiter.deadline.to_std(),
        failures: limiter.breaker_failures.max(1),
        cooldown: limiter.breaker_cooldown.to_std(),
    }
}

/// The `redis_cluster` store.
fn cluster(config: &StoreConfig) -> Result<RedisStore, BuildError> {
    let StoreConfig::RedisCluster {
        nodes,
        read_from_replicas,
        timeout,
        retries,
        tls: files,
        buckets,
        grant_acks,
        replica_acks,
    } = config
    else {
        unreachable!("called with a redis_cluster config")
    };
    let options = RedisOptions {
        timeout: timeout.to_std(),
        grant_acks: Some(*grant_acks),
        replica_acks: *replica_acks,
        cluster_retries: *retries,
        tls: tls(files.as_ref())?,
        buckets: buckets.0,
    };
    Ok(RedisStore::cluster(nodes, *read_from_replicas, options)?)
}

fn store(
    config: &StoreConfig,
    tuning: &Arc<Tuning>,
    clock: Arc<dyn Clock>,
    migration: &mut Option<Arc<MigratingStore>>,
) -> Result<Arc<dyn Store>, BuildError> {
    Ok(match config {
        &StoreConfig::Memory { max_keys } => {
            let store = Arc::new(MemoryStore::new(max_keys));
            // collect expired state in the background so memory follows active clients
            store.collect_in_background(clock, Duration::from_secs(5));
            store
        }
        StoreConfig::Redis { url, replicas, connection } => {
            resilient(RedisStore::new(url, replicas, options(connection)?)?, tuning)
        }
        StoreConfig::RedisSentinel(c) => resilient(sentinel(c)?, tuning),
        c @ StoreConfig::RedisCluster { .. } => resilient(cluster(c)?, tuning),
        StoreConfig::Memcached { servers, timeout, tls, srv, srv_refresh, srv_nameserver } => {
            let refresh = srv_refresh.to_std();
            let store = memcached(servers, timeout.to_std(), srv.as_deref(), refresh, *srv_nameserver)?;
            let store = match tls {
                Some(files) => store.with_connector(crate::tls::memcached_connector(files).map_err(UnfitStore::Tls)?),
                None => store,
            };
            resilient(store, tuning)
        }
        StoreConfig::Migrating { from, to, percent } => {
            if *percent > 100 {
                return Err(UnfitStore::Percent(*percent).into());
            }
            let from = store(from, tuning, clock.clone(), &mut None)?;
            let to = store(to, tuning, clock, &mut None)?;
            let store = Arc::new(MigratingStore::new(from, to, *percent));
            *migration = Some(store.clone());
            store
        }
        StoreConfig::PerSecond { main, per_second } => {
            let main = store(main, tuning, clock.clone(), migration)?;
            let second = store(per_second, tuning, clock, &mut None)?;
            Arc::new(sluice::store::PerSecondStore::new(main, second))
        }
        StoreConfig::RedisSharded { shards, connection } => {
            if shards.is_empty() {
                return Err(UnfitStore::NoShards.into());
            }
            let shards = shards
                .iter()
                .map(|s| Ok(RedisStore::new(&s.primary, &s.replicas, options(connection)?)?))
                .collect::<Result<Vec<_>, BuildError>>()?;
            resilient(ShardedRedisStore::new(shards), tuning)
        }
    })
}

/// The Redis store a `redis_sentinel` config names.
fn sentinel(c: &SentinelConfig) -> Result<RedisStore, BuildError> {
    let sentinel = SentinelOptions {
        sentinels: c.sentinels.clone(),
        master_name: c.master_name.clone(),
        read_from_replicas: c.read_from_replicas,
        sentinel_auth: Auth { username: c.sentinel_username.clone(), password: c.sentinel_password.clone() },
        redis_auth: Auth { username: c.username.clone(), password: c.password.clone() },
    };
    Ok(RedisStore::sentinel(&sentinel, options(&c.connection)?)?)
}

/// A remote store behind the deadline and breaker of `tuning`.
/// How long a name server has to answer an SRV query.
const SRV_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The memcached store of `servers`, or of the servers the SRV record `srv` names (read
/// again every `refresh`, when not 0).
fn memcached(
    servers: &[String],
    timeout: std::time::Duration,
    srv: Option<&str>,
    refresh: std::time::Duration,
    nameserver: Option<std::net::SocketAddr>,
) -> Result<MemcachedStore, StoreError> {
    let Some(name) = srv else { return MemcachedStore::new(servers, timeout) };
    let found = crate::app::srv::lookup(name, nameserver, SRV_TIMEOUT)
        .map_err(|why| StoreError::unavailable(format!("store.srv {name}: {why}")))?;
    let store = MemcachedStore::new(&found, timeout)?;
    refresh_srv(store.server_list(), name.to_string(), nameserver, refresh);
    Ok(store)
}

/// Reads the SRV record `name` again every `every` (none for 0) and puts the servers it
/// names in force; a lookup that fails keeps those in force, said at most every 10 s.
fn refresh_srv(
    servers: sluice::store::MemcachedServers,
    name: String,
    nameserver: Option<std::net::SocketAddr>,
    every: std::time::Duration,
) {
    if every.is_zero() || tokio::runtime::Handle::try_current().is_err() {
        return;
    }
    tokio::spawn(async move {
        let failing = crate::logs::Sometimes::default();
        loop {
            tokio::time::sleep(every).await;
            let (n, ns) = (name.clone(), nameserver);
            match tokio::task::spawn_blocking(move || crate::app::srv::lookup(&n, ns, SRV_TIMEOUT)).await {
                Ok(Ok(found)) => servers.set(&found),
                Ok(Err(why)) if failing.due() => {
                    tracing::warn!(srv = %name, error = %why, "the memcached SRV record cannot be read; the servers in force stay")
                }
                _ => {}
            }
        }
    });
}

fn resilient<S: Store>(store: S, tuning: &Arc<Tuning>) -> Arc<dyn Store> {
    Arc::new(Resilient::tuned(store, tuning.clone()))
}

fn options(c: &RedisConnectionConfig) -> Result<RedisOptions, BuildError> {
    Ok(RedisOptions {
        timeout: c.timeout.to_std(),
        replica_acks: c.replica_acks,
        grant_acks: c.grant_acks,
        tls: tls(c.tls.as_ref())?,
        buckets: c.buckets.0,
        ..RedisOptions::default()
    })
}
