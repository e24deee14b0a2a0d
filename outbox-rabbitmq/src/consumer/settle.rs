//! Handling one delivery and settling it: ack after the inbox commit,
//! requeue after a failure, dead-letter at `max_attempts`.

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use outbox_api::MessageId;
use outbox_sqlite::InboxOutcome;
use tokio::time::Instant;
use tracing::Instrument;

use super::Received;
use super::handle::bump;
use super::session::{MAX_TRACKED_ATTEMPTS, Worker};

impl Worker {
    /// Handles one delivery; `false` when acknowledging failed (the channel
    /// is gone).
    pub(super) async fn process(&mut self, delivery: Delivery) -> bool {
        let mut received = match Received::decode(&delivery) {
            Ok(r) => r,
            Err(why) => {
                bump(&self.shared.counters.invalid);
                tracing::warn!(
                    queue = %self.shared.queue,
                    exchange = %delivery.exchange,
                    routing_key = %delivery.routing_key,
                    reason = %why,
                    "rejecting a delivery that cannot be handled (to the dead-letter exchange, if any)"
                );
                return settle(
                    delivery
                        .acker
                        .reject(BasicRejectOptions { requeue: false })
                        .await,
                );
            }
        };
        let id = received.id;
        received.attempt = self.attempts.get(&id).map_or(0, |a| a.0) + 1;
        let span = tracing::info_span!(
            "outbox.receive",
            message.id = %id,
            message.type = received.message_type.as_deref(),
            message.key = received.key.as_deref(),
            trace_parent = received.trace_parent.as_deref(),
            consumer = %self.shared.consumer_name,
            queue = %self.shared.queue,
            redelivered = received.redelivered,
            attempt = received.attempt,
            outcome = tracing::field::Empty,
        );
        outbox_api::trace::continue_trace(&span, received.trace_parent.as_deref());
        let outcome = self.handle(&received).instrument(span.clone()).await;
        self.settle_outcome(delivery, &received, outcome, &span)
            .instrument(span.clone())
            .await
    }

    /// Acknowledges, requeues or dead-letters the delivery after handling.
    async fn settle_outcome(
        &mut self,
        delivery: Delivery,
        received: &Received,
        outcome: InboxOutcome,
        span: &tracing::Span,
    ) -> bool {
        let id = received.id;
        let counters = &self.shared.counters;
        match outcome {
            InboxOutcome::Committed => {
                span.record("outcome", "handled");
                bump(&counters.handled);
                self.attempts.remove(&id);
                settle(delivery.acker.ack(BasicAckOptions::default()).await)
            }
            InboxOutcome::Duplicate => {
                span.record("outcome", "duplicate");
                bump(&counters.duplicates);
                self.attempts.remove(&id);
                tracing::debug!("already handled (inbox); acknowledging");
                settle(delivery.acker.ack(BasicAckOptions::default()).await)
            }
            InboxOutcome::HandlerFailed(error)
                if received.attempt >= self.settings.max_attempts =>
            {
                span.record("outcome", "dead-lettered");
                bump(&counters.dead_lettered);
                self.attempts.remove(&id);
                tracing::error!(
                    %error,
                    attempts = received.attempt,
                    "handler failed on its last attempt; rejecting to the dead-letter exchange"
                );
                settle(
                    delivery
                        .acker
                        .reject(BasicRejectOptions { requeue: false })
                        .await,
                )
            }
            InboxOutcome::HandlerFailed(error) => {
                span.record("outcome", "failed");
                bump(&counters.retried);
                self.remember_attempt(id, received.attempt);
                tracing::warn!(
                    %error,
                    attempts = received.attempt,
                    max_attempts = self.settings.max_attempts,
                    "handler failed; the delivery will be retried"
                );
                self.requeue(delivery).await
            }
            InboxOutcome::HandlerUnavailable { reason, .. } => {
                span.record("outcome", "unavailable");
                bump(&counters.deferred);
                tracing::warn!(%reason, "handler temporarily unavailable (not counted as an attempt); requeueing");
                self.requeue(delivery).await
            }
            InboxOutcome::StoreFailed(error) => {
                span.record("outcome", "store-failed");
                bump(&counters.store_errors);
                tracing::warn!(%error, "the inbox database failed (not counted as an attempt); requeueing");
                self.requeue(delivery).await
            }
        }
    }

    fn remember_attempt(&mut self, id: MessageId, attempt: u32) {
        if self.attempts.len() >= MAX_TRACKED_ATTEMPTS {
            let mut by_age: Vec<(Instant, MessageId)> = self
                .attempts
                .iter()
                .map(|(id, (_, at))| (*at, *id))
                .collect();
            by_age.sort();
            for (_, old) in by_age.into_iter().take(MAX_TRACKED_ATTEMPTS / 10) {
                self.attempts.remove(&old);
            }
        }
        self.attempts.insert(id, (attempt, Instant::now()));
    }

    /// Requeues the delivery after the retry delay, without holding up the
    /// deliveries behind it.
    async fn requeue(&mut self, delivery: Delivery) -> bool {
        let options = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        let delay = self.settings.retry_delay;
        if delay.is_zero() {
            return settle(delivery.acker.nack(options).await);
        }
        let acker = delivery.acker;
        self.delayed.spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = acker.nack(options).await;
        });
        true
    }

    /// The inbox transaction around the handler.
    async fn handle(&self, received: &Received) -> InboxOutcome {
        let handler = &self.handler;
        self.outbox
            .receive_once(
                &self.pool,
                &self.shared.consumer_name,
                received.id,
                self.settings.handler_timeout,
                async |tx| handler.handle(received, tx).await,
            )
            .await
    }
}

/// `true` when an ack/nack/reject went out.
fn settle(result: lapin::Result<bool>) -> bool {
    matches!(result, Ok(true))
}
