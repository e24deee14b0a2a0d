//! Handling deliveries and settling them: run the inbox transaction, then
//! acknowledge, hold for a retry in place (keeping the key's order), or
//! dead-letter at `max_attempts`.

use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicRejectOptions};
use outbox_api::InboxOutcome;
use outbox_api::receive::{Lane, Pending, Received, Settle, bump};
use tokio::time::Instant;
use tracing::Instrument;

use super::received::decode;
use super::session::Worker;

/// What became of one try of a delivery.
enum Step {
    /// Acknowledged or rejected; `false` when that failed (the channel is
    /// gone).
    Settled(bool),
    /// Not settled: try it again in place after the delay.
    RetryAfter(Box<Pending<Delivery>>, Duration),
}

impl Worker {
    /// A delivery arrived: decode it, then run it — or, when an earlier
    /// delivery of its key is held for a retry, queue it behind that one.
    /// `false` when settling failed (the channel is gone).
    pub(super) async fn on_delivery(&mut self, delivery: Delivery) -> bool {
        self.shared.meter.received.increment(1);
        let received = match decode(&delivery) {
            Ok(r) => r,
            Err(why) => {
                bump(&self.shared.counters.invalid);
                self.shared.meter.invalid.increment(1);
                tracing::warn!(
                    queue = %self.shared.queue,
                    exchange = %delivery.exchange,
                    routing_key = %delivery.routing_key,
                    reason = %why,
                    "rejecting a delivery that cannot be handled (to the dead-letter exchange, if any)"
                );
                return settled(
                    delivery
                        .acker
                        .reject(BasicRejectOptions { requeue: false })
                        .await,
                );
            }
        };
        let tag = delivery.delivery_tag;
        let pending = Pending::new(delivery, received);
        let lane = Lane::of(&pending.received, tag);
        if self.held.holds(&lane) {
            bump(&self.shared.counters.held_back);
            tracing::debug!(
                queue = %self.shared.queue,
                message.id = %pending.received.id,
                message.key = pending.received.key.as_deref(),
                "an earlier delivery of this key waits for its retry; holding this one behind it"
            );
            self.held.queue_behind(lane, pending);
            return true;
        }
        self.run_lane(lane, pending).await
    }

    /// A held delivery's retry is due: run it, then the ones behind it.
    pub(super) async fn on_due(&mut self, lane: Lane) -> bool {
        match self.held.take_head(&lane) {
            Some(head) => self.run_lane(lane, head).await,
            None => true,
        }
    }

    /// Runs `first`, then the deliveries held behind it in arrival order,
    /// until the lane is empty or one must wait for a retry (it becomes the
    /// lane's held head, the rest stay behind it).
    async fn run_lane(&mut self, lane: Lane, first: Pending<Delivery>) -> bool {
        let mut next = Some(first);
        while let Some(pending) = next {
            match self.try_once(pending).await {
                Step::Settled(true) => {}
                Step::Settled(false) => return false,
                Step::RetryAfter(pending, delay) => {
                    self.held.hold(lane, *pending, delay);
                    return true;
                }
            }
            next = self.held.next_behind(&lane);
            if *self.stop.borrow() {
                // Stopping: leave the rest held; closing the channel
                // returns them to the queue in order.
                if let Some(pending) = next {
                    self.held.hold(lane, pending, Duration::ZERO);
                }
                return true;
            }
        }
        true
    }

    /// One try of a delivery: the inbox transaction, then settling.
    async fn try_once(&mut self, mut pending: Pending<Delivery>) -> Step {
        let received = &mut pending.received;
        let id = received.id;
        received.attempt = self.attempts.next_try(id);
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
            deferrals = pending.deferrals,
            outcome = tracing::field::Empty,
        );
        outbox_api::trace::continue_trace(&span, received.trace_parent.as_deref());
        let started = Instant::now();
        let outcome = self
            .handle(&pending.received)
            .instrument(span.clone())
            .await;
        self.shared
            .meter
            .process
            .record(started.elapsed().as_secs_f64());
        self.settle(pending, outcome, &span)
            .instrument(span.clone())
            .await
    }

    /// Acknowledges, dead-letters, or keeps the delivery for a retry in
    /// place, after one try, as [`RetryRules::settle`](outbox_api::receive::RetryRules::settle)
    /// decides.
    async fn settle(
        &mut self,
        mut pending: Pending<Delivery>,
        outcome: InboxOutcome,
        span: &tracing::Span,
    ) -> Step {
        let id = pending.received.id;
        let attempt = pending.received.attempt;
        let settle = self.settings.rules().settle(&mut pending, outcome);
        self.shared.counters.count(&settle);
        let meter = &self.shared.meter;
        match settle {
            Settle::Ack | Settle::AckDuplicate => {
                if settle == Settle::Ack {
                    span.record("outcome", "handled");
                    meter.handled.increment(1);
                } else {
                    span.record("outcome", "duplicate");
                    meter.duplicates.increment(1);
                    tracing::debug!("already handled (inbox); acknowledging");
                }
                self.attempts.settled(id);
                Step::Settled(settled(
                    pending.delivery.acker.ack(BasicAckOptions::default()).await,
                ))
            }
            Settle::DeadLetter { error } => {
                span.record("outcome", "dead-lettered");
                meter.dead_lettered.increment(1);
                self.attempts.settled(id);
                tracing::error!(
                    %error,
                    attempts = attempt,
                    "handler failed on its last attempt; rejecting to the dead-letter exchange"
                );
                let rejected = pending
                    .delivery
                    .acker
                    .reject(BasicRejectOptions { requeue: false })
                    .await;
                Step::Settled(settled(rejected))
            }
            Settle::Retry { error, delay } => {
                span.record("outcome", "failed");
                self.attempts.failed(id, attempt);
                tracing::warn!(
                    %error,
                    attempts = attempt,
                    max_attempts = self.settings.max_attempts,
                    retry_in_ms = delay.as_millis() as u64,
                    "handler failed; the delivery will be retried (later ones of its key wait)"
                );
                Step::RetryAfter(Box::new(pending), delay)
            }
            Settle::Defer {
                reason,
                delay,
                store,
            } => {
                if store {
                    span.record("outcome", "store-failed");
                    tracing::warn!(
                        error = %reason,
                        deferrals = pending.deferrals,
                        retry_in_ms = delay.as_millis() as u64,
                        "the inbox database failed (not counted as an attempt); will retry"
                    );
                } else {
                    span.record("outcome", "unavailable");
                    tracing::warn!(
                        %reason,
                        deferrals = pending.deferrals,
                        retry_in_ms = delay.as_millis() as u64,
                        "handler temporarily unavailable (not counted as an attempt); will retry"
                    );
                }
                Step::RetryAfter(Box::new(pending), delay)
            }
        }
    }

    /// The inbox transaction around the handler.
    async fn handle(&self, received: &Received) -> InboxOutcome {
        self.inbox
            .receive_once(
                &self.shared.consumer_name,
                received,
                self.settings.handler_timeout,
            )
            .await
    }
}

/// `true` when an ack or reject went out.
fn settled(result: lapin::Result<bool>) -> bool {
    matches!(result, Ok(true))
}
