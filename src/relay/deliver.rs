//! One delivery: a domain message through the dispatcher (a guarded
//! handler run), or a group of integration messages through one transport
//! send. Each message gets its own span and its own outcome.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;
use outbox_api::{HandlerOutcome, Message, Outcome, panic_message, run_guarded};
use tracing::{Instrument, Span};

use super::Relay;

/// How one message's delivery ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum DeliveryOutcome {
    /// The handler returned `Ok` / the broker confirmed it.
    Delivered,
    /// The message's own fault (handler error, panic, timeout): counts as
    /// an attempt.
    Failed(String),
    /// The broker refused the message (nack, unroutable, too large): the
    /// message's fault too, counted like `Failed`.
    Rejected(String),
    /// The handler said it is temporarily unavailable: retried after a
    /// backoff, not counted.
    HandlerUnavailable {
        reason: String,
        retry_after: Option<Duration>,
    },
    /// The broker's fault: not counted; the transport is paused and probed.
    TransportUnavailable(String),
}

impl DeliveryOutcome {
    fn name(&self) -> &'static str {
        match self {
            DeliveryOutcome::Delivered => "delivered",
            DeliveryOutcome::Failed(_) => "failed",
            DeliveryOutcome::Rejected(_) => "rejected",
            DeliveryOutcome::HandlerUnavailable { .. } => "handler unavailable",
            DeliveryOutcome::TransportUnavailable(_) => "transport unavailable",
        }
    }
}

impl From<HandlerOutcome> for DeliveryOutcome {
    fn from(o: HandlerOutcome) -> Self {
        match o {
            HandlerOutcome::Succeeded => DeliveryOutcome::Delivered,
            HandlerOutcome::Failed(e) => DeliveryOutcome::Failed(e),
            HandlerOutcome::Unavailable {
                reason,
                retry_after,
            } => DeliveryOutcome::HandlerUnavailable {
                reason,
                retry_after,
            },
        }
    }
}

impl Relay {
    fn delivery_span(m: &Message) -> Span {
        let span = tracing::info_span!(
            "outbox.deliver",
            message.id = %m.id,
            message.type = %m.message_type,
            message.kind = m.kind.as_str(),
            message.key = m.key.as_deref(),
            message.attempt = m.attempts + 1,
            trace_parent = m.trace_parent.as_deref(),
            outcome = tracing::field::Empty,
        );
        outbox_api::trace::continue_trace(&span, m.trace_parent.as_deref());
        span
    }

    /// Runs the domain handlers of `m`, guarded: an error, panic or
    /// timeout is a counted failure of `m` alone.
    pub(super) async fn dispatch_one(&self, m: &Message) -> DeliveryOutcome {
        let span = Self::delivery_span(m);
        let outcome = match &self.inner.dispatcher {
            None => DeliveryOutcome::Failed("no dispatcher configured for domain messages".into()),
            Some(dispatcher) => {
                run_guarded(self.inner.config.handler_timeout, dispatcher.dispatch(m))
                    .instrument(span.clone())
                    .await
                    .into()
            }
        };
        if !span.is_disabled() {
            span.record("outcome", outcome.name());
        }
        outcome
    }

    /// Sends integration messages in one transport call; one outcome each,
    /// in order. A send that outlives `handler_timeout` is dropped and its
    /// messages count as unavailable (sent again later, uncounted).
    pub(super) async fn send(&self, msgs: &[Message]) -> Vec<DeliveryOutcome> {
        let spans: Vec<Span> = msgs.iter().map(Self::delivery_span).collect();
        let Some(transport) = &self.inner.transport else {
            return msgs
                .iter()
                .map(|_| DeliveryOutcome::TransportUnavailable("no transport configured".into()))
                .collect();
        };
        let timeout = self.inner.config.handler_timeout;
        let sent = tokio::time::timeout(
            timeout,
            AssertUnwindSafe(transport.send(msgs)).catch_unwind(),
        )
        .await;
        let mut outcomes = match sent {
            Ok(Ok(o)) => o,
            Ok(Err(panic)) => {
                let text = format!("transport panicked: {}", panic_message(&*panic));
                tracing::error!("{text}");
                vec![Outcome::Unavailable(text); msgs.len()]
            }
            // The broker may or may not have the messages: they are sent
            // again later (at least once), and the attempt does not count.
            Err(_) => {
                let text = format!("transport send timed out after {timeout:?}");
                vec![Outcome::Unavailable(text); msgs.len()]
            }
        };
        if outcomes.len() != msgs.len() {
            tracing::error!(
                expected = msgs.len(),
                got = outcomes.len(),
                "transport returned the wrong number of outcomes; the rest count as unavailable"
            );
            outcomes.resize(
                msgs.len(),
                Outcome::Unavailable("transport returned no outcome".into()),
            );
        }
        outcomes
            .into_iter()
            .zip(spans)
            .map(|(o, span)| {
                let r = match o {
                    Outcome::Delivered => DeliveryOutcome::Delivered,
                    Outcome::Rejected(e) => {
                        DeliveryOutcome::Rejected(format!("rejected by the broker: {e}"))
                    }
                    Outcome::Unavailable(e) => DeliveryOutcome::TransportUnavailable(e),
                };
                if !span.is_disabled() {
                    span.record("outcome", r.name());
                }
                r
            })
            .collect()
    }
}
