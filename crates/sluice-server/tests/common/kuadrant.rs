//! A client of Kuadrant's rate limit service (`proto/kuadrantrls.proto`): its messages
//! declared from the proto, field for field (Envoy's come from envoy-types), and a unary
//! call. They repeat the server's (`grpc/kuadrant.rs`) on purpose: declared apart, a
//! wrong tag or type on either side fails the tests instead of agreeing with itself.

#![allow(dead_code)]

use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReserveRequest {
    #[prost(message, optional, tag = "1")]
    pub request: Option<RateLimitRequest>,
    #[prost(message, optional, tag = "2")]
    pub ttl: Option<PbDuration>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReserveResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<RateLimitResponse>,
    #[prost(string, tag = "2")]
    pub reservation_id: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CommitRequest {
    #[prost(string, tag = "1")]
    pub reservation_id: String,
    #[prost(uint64, optional, tag = "2")]
    pub actual: Option<u64>,
    #[prost(uint64, repeated, tag = "3")]
    pub actuals: Vec<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CommitResponse {
    #[prost(enumeration = "Settled", repeated, tag = "1")]
    pub settled: Vec<i32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
pub enum Settled {
    Committed = 0,
    Reported = 1,
    Again = 2,
}

/// A unary call of Kuadrant's `method` on a new connection to `grpc`.
pub async fn call<Q, A>(grpc: &str, method: &str, q: Q) -> Result<A, tonic::Status>
where
    Q: prost::Message + Send + Sync + 'static,
    A: prost::Message + Default + Send + Sync + 'static,
{
    call_on(channel(grpc).await, method, q).await
}

/// A unary call of Kuadrant's `method` on `channel`.
pub async fn call_on<Q, A>(channel: tonic::transport::Channel, method: &str, q: Q) -> Result<A, tonic::Status>
where
    Q: prost::Message + Send + Sync + 'static,
    A: prost::Message + Default + Send + Sync + 'static,
{
    let mut client = tonic::client::Grpc::new(channel);
    client.ready().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = format!("/kuadrant.service.ratelimit.v1.RateLimitService/{method}").parse().unwrap();
    let codec = tonic_prost::ProstCodec::<Q, A>::default();
    client.unary(tonic::Request::new(q), path, codec).await.map(|r| r.into_inner())
}

/// A connection to the gRPC listener at `grpc` (`127.0.0.1:PORT`).
pub async fn channel(grpc: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap()
}
