//! Sluice: a distributed rate limiter and load shedder for HTTP APIs.
//!
//! Layers, data flowing down:
//! - [`engine`]: a request's descriptors become store calls and one [`engine::Verdict`];
//! - [`rules`]: which policies apply, compiled from a [`config::Config`];
//! - [`store`]: where state lives, behind the [`store::Store`] trait;
//! - [`algo`]: the pure algorithms, the reference every store is held to.
//!
//! [`headers`] renders a verdict as GitHub and IETF rate limit headers.

pub mod algo;
pub mod config;
pub mod engine;
pub mod headers;
#[cfg(feature = "tower")]
pub mod layer;
pub mod near_cache;
pub mod rules;
pub mod store;
pub mod tag;
pub mod telemetry;
pub mod time;

pub use engine::{Limiter, Request, Verdict};
