//! Envoy's rate limit service, `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`:
//! what an Envoy's `envoy.filters.http.ratelimit` filter calls, on `server.grpc`
//! (127.0.0.1:8081 by default), the port envoyproxy/ratelimit uses.
//!
//! The call is decided by the rate limit service (`service.rs`), which `/json` shares:
//! the same decisions, headers and errors. This module is the gRPC transport: one
//! message in, one out, every failure a gRPC status.

use crate::otel::Call;
use crate::state::AppState;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use std::sync::Arc;
use tonic::Status;

/// The gRPC service.
#[derive(Clone)]
pub struct Rls {
    pub state: Arc<AppState>,
}

/// The path of the one method served.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The largest request accepted, as tonic's own default for a decoded message.
const MAX_REQUEST: usize = 4 << 20;

type GrpcRequest = axum::http::Request<tonic::body::Body>;
type GrpcResponse = axum::http::Response<tonic::body::Body>;

impl tonic::server::NamedService for Rls {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

/// The service as tonic's transport calls it, written by hand rather than generated:
/// Envoy's calls are unary, and a generated server decodes through a streaming codec with
/// two 8 KiB buffers a call (a quarter of the server's CPU per decision in a profile),
/// decodes only the first of several messages, and answers a message that does not
/// decode with INTERNAL, which tells Envoy the server is broken rather than the request.
/// This one reads the whole request (bounded), accepts exactly one uncompressed message,
/// decodes it with prost, and answers one message and `grpc-status: 0`; every failure is
/// a gRPC status.
impl tower::Service<GrpcRequest> for Rls {
    type Response = GrpcResponse;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<GrpcResponse, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: GrpcRequest) -> Self::Future {
        let state = self.state.clone();
        let parent = crate::otel::Parent::from_headers(req.headers());
        Box::pin(async move {
            let work = async { unary(&state, req).await.unwrap_or_else(Status::into_http) };
            let tracer = state.tracer.as_deref();
            Ok(crate::otel::around(tracer, parent, Call::Grpc(SHOULD_RATE_LIMIT), work, grpc_ended).await)
        })
    }
}

/// The gRPC status of an answer (in its headers when it is an error, else OK).
fn grpc_ended(answer: &GrpcResponse) -> crate::otel::Ended {
    let code = answer.headers().get("grpc-status").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(0);
    crate::otel::Ended::grpc(code)
}

async fn unary(state: &AppState, req: GrpcRequest) -> Result<GrpcResponse, Status> {
    use http_body_util::BodyExt;
    use prost::Message;
    if req.uri().path() != SHOULD_RATE_LIMIT {
        return Err(Status::unimplemented(format!(
            "no method {}; this server answers {SHOULD_RATE_LIMIT}",
            req.uri().path()
        )));
    }
    let given = req.headers().get("authorization").map(|v| v.as_bytes());
    if !state.api_token_matches(given) {
        return Err(Status::unauthenticated("send metadata authorization: Bearer <one of server.api_tokens>"));
    }
    let body = match http_body_util::Limited::new(req.into_body(), MAX_REQUEST).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => return Err(Status::invalid_argument(format!("the request could not be read: {e}"))),
    };
    let message = one_message(&body).map_err(Status::invalid_argument)?;
    let request = RateLimitRequest::decode(message)
        .map_err(|e| Status::invalid_argument(format!("the message is not a RateLimitRequest: {e}")))?;
    let response = crate::service::should_rate_limit(state, request).await?;
    // one message, uncompressed: flag 0, its length, the message
    let len = response.encoded_len();
    let mut framed = bytes::BytesMut::with_capacity(5 + len);
    bytes::BufMut::put_u8(&mut framed, 0);
    bytes::BufMut::put_u32(&mut framed, len as u32);
    response.encode(&mut framed).expect("the buffer was sized for the message");
    let mut trailers = axum::http::HeaderMap::with_capacity(1);
    trailers.insert("grpc-status", axum::http::HeaderValue::from_static("0"));
    let frames = [
        Ok::<_, std::convert::Infallible>(http_body::Frame::data(framed.freeze())),
        Ok(http_body::Frame::trailers(trailers)),
    ];
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let mut answer = axum::http::Response::new(tonic::body::Body::new(body));
    answer.headers_mut().insert("content-type", axum::http::HeaderValue::from_static("application/grpc"));
    Ok(answer)
}

/// The one message of a unary call's body (1 byte flag, 4 bytes length, the message).
fn one_message(body: &[u8]) -> Result<&[u8], String> {
    let Some(header) = body.get(..5) else {
        return Err("a unary call carries exactly one message; this one carries none".into());
    };
    if header[0] != 0 {
        return Err("the message is compressed; this server accepts uncompressed messages only".into());
    }
    let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    match (body.len() - 5).cmp(&length) {
        std::cmp::Ordering::Equal => Ok(&body[5..]),
        std::cmp::Ordering::Less => Err(format!("the message is cut short: {} of {length} bytes", body.len() - 5)),
        std::cmp::Ordering::Greater => {
            Err("a unary call carries exactly one message; this one carries more than one".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::one_message;

    #[test]
    fn a_body_is_one_whole_uncompressed_message() {
        let framed = |flag: u8, len: u32, body: &[u8]| [&[flag][..], &len.to_be_bytes(), body].concat();
        assert_eq!(one_message(&framed(0, 3, b"abc")), Ok(&b"abc"[..]));
        assert_eq!(one_message(&framed(0, 0, b"")), Ok(&b""[..]));
        for (body, why) in [
            (vec![], "carries none"),
            (vec![0, 0, 0], "carries none"),
            (framed(1, 3, b"abc"), "compressed"),
            (framed(0, 4, b"abc"), "cut short: 3 of 4 bytes"),
            (framed(0, 2, b"abc"), "more than one"),
        ] {
            let e = one_message(&body).unwrap_err();
            assert!(e.contains(why), "{body:?}: {e}");
        }
    }
}
