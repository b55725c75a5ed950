//! The response's side of the layer: its body (yours, or a problem+json refusal) and the
//! guard it carries, which gives the leases, the adaptive stage's slot and a budget's
//! reservation back when the body ends or is dropped.

use super::{ACTUAL_HEADER, Shared, adaptive};
use crate::Limiter;
use crate::verdict::LeaseId;
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

/// What is given back when the response is done.
pub(super) struct Guard {
    pub(super) shared: Arc<Shared>,
    pub(super) leases: Vec<(Arc<Limiter>, LeaseId)>,
    /// The budget's open reservation, its estimate, and the actual once the response
    /// told it.
    pub(super) hold: Option<(crate::Reserved, u64, Option<u64>)>,
    /// The adaptive stage's slot, the response's status and whether its body ended.
    pub(super) slot: Option<adaptive::Slot>,
    pub(super) status: StatusCode,
    pub(super) finished: bool,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let (Some(slot), Some(stage)) = (self.slot.take(), &self.shared.adaptive) {
            stage.finish(slot, adaptive::outcome(self.status, self.finished));
        }
        if let Some((reserved, estimate, actual)) = self.hold.take() {
            // the response is done (or dropped): its actual, else the estimate, stands
            let limiter = self.shared.limiter.clone();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    if let Err(e) = limiter.commit(&reserved, &[actual.unwrap_or(estimate)]).await {
                        tracing::debug!(error = %e, "budget commit failed; the hold lapses at its TTL");
                    }
                });
            }
        }
        for (limiter, lease) in self.leases.drain(..) {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = limiter.release(&lease).await;
                });
            }
        }
    }
}

impl Guard {
    /// The response told what it cost.
    pub(super) fn told(&mut self, actual: u64) {
        if let Some(hold) = self.hold.as_mut() {
            hold.2 = Some(actual);
        }
    }
}

pin_project_lite::pin_project! {
    /// The response body: yours, or a problem+json refusal. Gives leases back when it
    /// ends or is dropped.
    pub struct SluiceBody<B> {
        #[pin]
        pub(super) inner: Option<B>,
        pub(super) refusal: Option<Bytes>,
        pub(super) guard: Option<Guard>,
    }
}

impl<B: Body<Data = Bytes>> Body for SluiceBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        if let Some(b) = this.refusal.take() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        let Some(mut inner) = this.inner.as_pin_mut() else { return Poll::Ready(None) };
        let polled = inner.as_mut().poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            // a streamed response tells its cost at the end, in a trailer
            let told = frame.trailers_ref().and_then(|t| t.get(ACTUAL_HEADER)?.to_str().ok()?.parse().ok());
            if let (Some(a), Some(g)) = (told, this.guard.as_mut()) {
                g.told(a);
            }
        }
        // the body is finished when it says so: hyper stops polling a body once
        // `is_end_stream` is true (a whole body is one frame, never followed by `None`)
        let ended = match &polled {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => inner.is_end_stream(),
            _ => false,
        };
        if ended {
            // give the leases back now, not when the body is dropped
            if let Some(g) = this.guard.as_mut() {
                g.finished = true;
            }
            this.guard.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.refusal.is_none() && self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.refusal, &self.inner) {
            (Some(b), _) => SizeHint::with_exact(b.len() as u64),
            (None, Some(i)) => i.size_hint(),
            (None, None) => SizeHint::with_exact(0),
        }
    }
}

/// A refusal: status, `application/problem+json` (RFC 9457) body, headers.
pub(super) fn refusal<B>(
    status: StatusCode,
    title: &str,
    detail: &str,
    extra: Vec<(&'static str, String)>,
) -> Response<SluiceBody<B>> {
    let kind = if status == StatusCode::TOO_MANY_REQUESTS { "rate-limited" } else { "overloaded" };
    let body = format!(
        "{{\"type\":\"https://sluice.dev/problems/{kind}\",\"title\":{},\"status\":{},\"detail\":{}}}",
        json_string(title),
        status.as_u16(),
        json_string(detail)
    );
    let mut r = Response::new(SluiceBody { inner: None, refusal: Some(Bytes::from(body)), guard: None });
    *r.status_mut() = status;
    r.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    for (k, v) in extra {
        if let Ok(v) = HeaderValue::from_str(&v) {
            r.headers_mut().insert(k, v);
        }
    }
    r
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
