//! Unary gRPC calls served by hand (why: `rls.rs`): the request's one message read
//! whole and bounded, after its token, and one message answered with `grpc-status: 0`.
//! Envoy's service and Kuadrant's share it.

use crate::app::AppState;
use tonic::Status;

pub type GrpcRequest = axum::http::Request<tonic::body::Body>;
pub type GrpcResponse = axum::http::Response<tonic::body::Body>;

/// Implements `tower::Service` for a hand-written unary service `$service` (a struct
/// with `state: Arc<AppState>`): `$method` names the method a path calls (an error:
/// the status to answer, e.g. UNIMPLEMENTED), and `$call(&state, method, request)`
/// answers it; each call traced as `grpc <method>`, every failure a gRPC status.
macro_rules! unary_service {
    ($service:ty, $method:path, $call:path) => {
        impl tower::Service<$crate::grpc::unary::GrpcRequest> for $service {
            type Response = $crate::grpc::unary::GrpcResponse;
            type Error = std::convert::Infallible;
            type Future =
                std::pin::Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

            fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
                std::task::Poll::Ready(Ok(()))
            }

            fn call(&mut self, req: $crate::grpc::unary::GrpcRequest) -> Self::Future {
                let state = self.state.clone();
                let parent = $crate::otel::Parent::from_headers(req.headers());
                Box::pin(async move {
                    let method: &'static str = match $method(req.uri().path()) {
                        Ok(m) => m,
                        Err(status) => return Ok(tonic::Status::into_http(status)),
                    };
                    let work = async { $call(&state, method, req).await.unwrap_or_else(tonic::Status::into_http) };
                    let (tracer, call) = (state.tracer.as_deref(), $crate::otel::Call::Grpc(method));
                    Ok($crate::otel::around(tracer, parent, call, work, $crate::grpc::unary::ended).await)
                })
            }
        }
    };
}
pub(crate) use unary_service;

/// The largest request accepted, as tonic's own default for a decoded message.
const MAX_REQUEST: usize = 4 << 20;

/// The gRPC status of an answer (in its headers when it is an error, else OK).
pub fn ended(answer: &GrpcResponse) -> crate::otel::Ended {
    let code = answer.headers().get("grpc-status").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(0);
    crate::otel::Ended::grpc(code)
}

/// The request's message, decoded, when its caller holds a token (`server.api_tokens`).
pub async fn read<M: prost::Message + Default>(state: &AppState, req: GrpcRequest) -> Result<M, Status> {
    use http_body_util::BodyExt;
    let given = req.headers().get("authorization").map(|v| v.as_bytes());
    let peer = req.extensions().get::<crate::grpc::listen::Peer>().and_then(|p| p.addr);
    if !state.api_token_matches(given, "grpc", peer) {
        return Err(Status::unauthenticated("send metadata authorization: Bearer <one of server.api_tokens>"));
    }
    let body = match http_body_util::Limited::new(req.into_body(), MAX_REQUEST).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => return Err(Status::invalid_argument(format!("the request could not be read: {e}"))),
    };
    let message = one_message(&body).map_err(Status::invalid_argument)?;
    let name = std::any::type_name::<M>().rsplit("::").next().unwrap_or("message");
    M::decode(message).map_err(|e| Status::invalid_argument(format!("the message is not a {name}: {e}")))
}

/// One message, uncompressed, and `grpc-status: 0`.
pub fn answer(message: &impl prost::Message) -> GrpcResponse {
    // one message, uncompressed: flag 0, its length, the message
    let len = message.encoded_len();
    let mut framed = bytes::BytesMut::with_capacity(5 + len);
    bytes::BufMut::put_u8(&mut framed, 0);
    bytes::BufMut::put_u32(&mut framed, len as u32);
    message.encode(&mut framed).expect("the buffer was sized for the message");
    let mut trailers = axum::http::HeaderMap::with_capacity(1);
    trailers.insert("grpc-status", axum::http::HeaderValue::from_static("0"));
    let frames = [
        Ok::<_, std::convert::Infallible>(http_body::Frame::data(framed.freeze())),
        Ok(http_body::Frame::trailers(trailers)),
    ];
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let mut answer = axum::http::Response::new(tonic::body::Body::new(body));
    answer.headers_mut().insert("content-type", axum::http::HeaderValue::from_static("application/grpc"));
    answer
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
