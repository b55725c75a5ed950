//! Sluice: a distributed rate limiter and load shedder for HTTP APIs.
//!
//! GitHub's and Stripe's rate limiters as one library: fixed windows with a stored reset,
//! token buckets, sliding windows and concurrency limits, several per client evaluated
//! all or nothing, in process memory or in Redis (a node, replicas, client-side shards,
//! Redis Cluster), with the same answers everywhere.
//!
//! Ten lines to a limiter in process:
//!
//! ```
//! use sluice::{DomainBuilder, Limiter, Request, RulesBuilder};
//! use std::time::Duration;
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let rules = RulesBuilder::new()
//!     .domain(DomainBuilder::new("api").rule([("user", None)], |r| {
//!         r.fixed_window("per_minute", 100, Duration::from_secs(60))
//!     }))
//!     .build()?;
//! let limiter = Limiter::in_memory(rules);
//! let verdict = limiter.check(&Request::new("api").descriptor([("user", "alice")])).await?;
//! assert!(verdict.allowed());
//! assert_eq!(verdict.binding().unwrap().decision.remaining, 99);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! The parts, top down (docs/architecture.md has the rules they keep):
//! - [`layer`] (feature `tower`): all of it in front of a service, with Stripe's load
//!   shedders;
//! - [`Limiter`]: a [`Request`] becomes store calls and one [`Verdict`];
//!   [`headers::render`] turns a verdict into GitHub and IETF headers;
//! - [`RulesBuilder`] (or a config file's [`config`] model) compiles into [`rules::Rules`];
//! - [`store`]: where state lives, behind the [`store::Store`] trait;
//! - [`algo`]: the pure algorithms, the reference every store is held to.

pub mod algo;
mod builder;
pub mod config;
mod engine;
#[cfg(feature = "conformance")]
#[doc(hidden)]
pub mod engine_conformance;
pub mod fallback;
pub mod grants;
mod hash;
pub mod headers;
#[cfg(feature = "tower")]
pub mod layer;
mod near_cache;
pub mod overrides;
mod plan;
pub mod regions;
mod request;
pub mod rlqs;
pub mod rules;
pub mod store;
pub mod tag;
mod telemetry;
pub mod time;
pub mod topk;
mod verdict;

pub use builder::{DomainBuilder, RuleBuilder, RulesBuilder};
pub use engine::{
    CheckError, HeldLeases, HeldReservations, Issued, Limiter, MAX_RESERVED_DESCRIPTORS, MAX_RESERVED_WINDOWS,
    RegionalPool, Reserved,
};
pub use overrides::{Misfit, Override, OverrideError, Overrides, Rejected};
pub use request::{Descriptor, Entry, LimitOverride, Request, RequestError};
pub use telemetry::names as metric_names;
pub use telemetry::{Audit, audit, describe as describe_metrics};
pub use verdict::{Code, DescriptorVerdict, LeaseId, Outcome, PolicyDecision, Source, Verdict};
