//! The consume loop: pull, run each message through the inbox in its
//! key's lane, settle it (acknowledge, retry in place, dead-letter), keep
//! held messages in progress, pull afresh after a reconnect or when a pull
//! request goes unanswered past its expiry.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::pull::Batch;
use async_nats::jetstream::message::{Acker, PublishMessage};
use async_nats::jetstream::{self, AckKind};
use async_nats::{HeaderName, HeaderValue};
use futures_util::StreamExt;
use outbox_api::MessageId;
use outbox_api::receive::{
    Attempts, BoundInbox, Counters, Held, Lane, Pending, Received, Settle, backoff, bump,
};
use tokio::sync::watch;
use tracing::Instrument;

use super::decode::{decode, text_headers};
use super::{
    DEAD_ATTEMPTS_HEADER, DEAD_CONSUMER_HEADER, DEAD_REASON_HEADER, DEAD_SUBJECT_HEADER,
    NatsConsumerBuilder,
};

/// What every worker of one consumer shares.
pub(super) struct Shared {
    pub(super) settings: NatsConsumerBuilder,
    pub(super) js: jetstream::Context,
    pub(super) inbox: BoundInbox,
    pub(super) counters: Arc<Counters>,
    pub(super) connected: Arc<AtomicBool>,
}

impl Shared {
    /// A worker that runs until `stop` turns true.
    pub(super) fn worker(&self, stop: watch::Receiver<bool>) -> Worker {
        Worker {
            settings: self.settings.clone(),
            js: self.js.clone(),
            inbox: self.inbox.clone(),
            held: Held::default(),
            attempts: Attempts::default(),
            counters: self.counters.clone(),
            connected: self.connected.clone(),
            stop,
        }
    }
}

pub(super) struct Worker {
    pub(super) settings: NatsConsumerBuilder,
    pub(super) js: jetstream::Context,
    pub(super) inbox: BoundInbox,
    pub(super) held: Held<Delivery>,
    pub(super) attempts: Attempts,
    pub(super) counters: Arc<Counters>,
    /// Pulling over a live connection right now.
    pub(super) connected: Arc<AtomicBool>,
    pub(super) stop: watch::Receiver<bool>,
}

/// How long one pull request waits for messages. Short, so that a process
/// that stops (or dies) has no pull request left at the server soon after:
/// a partition's next owner relies on it.
pub(super) const PULL_EXPIRY: Duration = Duration::from_secs(1);

/// How long past its expiry a pull request may stay unanswered before the
/// worker asks for the next one. The server ends an expired request with a
/// `408` status; when that status does not come (seen under load: one
/// request in a few runs of MiniShop), async-nats ends the batch only 5 s
/// after the expiry, and this worker's partition would wait that long.
const PULL_GRACE: Duration = Duration::from_millis(150);

/// How reading a pull request ended.
enum Ended {
    /// Fulfilled, expired, or given up after a reconnect: the next.
    Done,
    /// Unanswered past its expiry: read on as the lingering one.
    Overdue,
}

/// How many overdue pull requests a worker reads on at once; past that it
/// waits for the current one as long as async-nats does. Each ends by
/// itself within 5 s of its expiry.
const MAX_LINGERING: usize = 4;

/// The next item of the lingering pull requests, the oldest first; those
/// that ended are dropped. `None` once none is left.
async fn next_of(
    lingering: &mut Vec<Batch>,
) -> Option<Result<jetstream::Message, async_nats::Error>> {
    std::future::poll_fn(|cx| {
        let mut i = 0;
        while i < lingering.len() {
            match lingering[i].poll_next_unpin(cx) {
                std::task::Poll::Ready(Some(item)) => return std::task::Poll::Ready(Some(item)),
                std::task::Poll::Ready(None) => {
                    lingering.remove(i);
                }
                std::task::Poll::Pending => i += 1,
            }
        }
        if lingering.is_empty() {
            std::task::Poll::Ready(None)
        } else {
            std::task::Poll::Pending
        }
    })
    .await
}

/// A message delivered to this consumer: its stream sequence (the order
/// it is given back in) and what acknowledges it.
pub(super) struct Delivery {
    seq: u64,
    acker: Acker,
}

impl Worker {
    /// Consumes until told to stop. Then gives back to the server (`nak`,
    /// in stream order, so that it delivers them again at once and in that
    /// order) everything fetched but not settled: the held messages and the
    /// rest of the pull request in flight. `true` when all of it was given
    /// back, so that the server holds no message of this consumer waiting
    /// for `ack_wait`.
    pub(super) async fn run(mut self, consumer: jetstream::consumer::PullConsumer) -> bool {
        let mut failures = 0u32;
        let mut pulled_before = false;
        let mut progress = tokio::time::interval(self.settings.ack_wait / 2);
        progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut connection_check = tokio::time::interval(Duration::from_millis(100));
        connection_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let client = self.js.client();
        let mut lost = false;
        let size = self.settings.max_ack_pending.min(1000);
        // The pull request being read (with when it was asked for), and the
        // next one, asked for as soon as the current one has brought all it
        // asked for: the server delivers into it while this worker handles
        // the last ones, so the flow does not stop for a round trip every
        // `size` messages.
        let mut current: Option<(Batch, usize, Instant)> = None;
        let mut queued: Option<(Batch, Instant)> = None;
        // Requests left unanswered past their expiry (`PULL_GRACE`), oldest
        // first: still read, before the current one, until each ends. The
        // server serves requests in the order they came, so whatever it
        // sent into an older one was sent before anything of the later ones;
        // reading the older first keeps the stream's order.
        let mut lingering: Vec<Batch> = Vec::new();
        'outer: while !*self.stop.borrow() {
            if current.is_none() {
                let pulled = match queued.take() {
                    Some(asked) => Ok(asked),
                    None => {
                        let asked = Instant::now();
                        self.pull(&consumer, size).await.map(|b| (b, asked))
                    }
                };
                match pulled {
                    Ok((batch, asked)) => {
                        if failures > 0 || (lost && pulled_before) {
                            bump(&self.counters.reconnects);
                        }
                        pulled_before = true;
                        failures = 0;
                        lost = false;
                        self.connected.store(true, Ordering::SeqCst);
                        current = Some((batch, 0, asked));
                    }
                    Err(e) => {
                        self.connected.store(false, Ordering::SeqCst);
                        failures = failures.saturating_add(1);
                        let delay =
                            backoff(Duration::from_millis(50), Duration::from_secs(5), failures);
                        tracing::warn!(
                            error = %self.settings.config.scrub(&e.to_string()),
                            consumer = %self.settings.durable,
                            retry_in_ms = delay.as_millis() as u64,
                            "cannot pull from JetStream; retrying"
                        );
                        tokio::select! {
                            _ = tokio::time::sleep(delay) => {}
                            _ = self.stop.changed() => {}
                        }
                        continue;
                    }
                }
            }
            let Some((batch, got, asked)) = current.as_mut() else {
                continue;
            };
            let overdue = tokio::time::Instant::from_std(*asked + PULL_EXPIRY + PULL_GRACE);
            let ended = loop {
                tokio::select! {
                    biased;
                    _ = self.stop.changed() => break 'outer,
                    _ = progress.tick() => self.keep_held_in_progress().await,
                    // After a reconnect, pull afresh: a pull request made
                    // on the lost connection is not answered any more.
                    _ = connection_check.tick() => {
                        let connected = client.connection_state() == async_nats::connection::State::Connected;
                        self.connected.store(connected, Ordering::SeqCst);
                        if !connected {
                            lost = true;
                        } else if lost {
                            tracing::info!(consumer = %self.settings.durable, "NATS connection restored; pulling again");
                            queued = None;
                            lingering.clear();
                            break Ended::Done;
                        }
                    }
                    Some(lane) = self.held.due() => {
                        if let Some(head) = self.held.take_head(&lane) {
                            self.run_lane(lane, head).await;
                        }
                    }
                    Some(next) = next_of(&mut lingering), if !lingering.is_empty() => match next {
                        Ok(message) => self.on_message(message).await,
                        Err(e) => self.pull_error(&e),
                    },
                    next = batch.next() => match next {
                        Some(Ok(message)) => {
                            *got += 1;
                            if *got == size && queued.is_none() {
                                let asked = Instant::now();
                                queued = self.pull(&consumer, size).await.ok().map(|b| (b, asked));
                            }
                            self.on_message(message).await;
                        }
                        Some(Err(e)) => self.pull_error(&e),
                        // The pull request is fulfilled or expired: the next.
                        None => break Ended::Done,
                    },
                    _ = tokio::time::sleep_until(overdue), if lingering.len() < MAX_LINGERING => {
                        tracing::debug!(consumer = %self.settings.durable, "a pull request went unanswered past its expiry; asking for the next");
                        break Ended::Overdue;
                    }
                }
            };
            match ended {
                Ended::Done => current = None,
                Ended::Overdue => lingering.extend(current.take().map(|(batch, ..)| batch)),
            }
        }
        let in_flight = lingering
            .into_iter()
            .chain(current.map(|(batch, ..)| batch))
            .chain(queued.map(|(batch, _)| batch));
        let clean = self.give_back(in_flight.collect(), &client).await;
        self.connected.store(false, Ordering::SeqCst);
        tracing::info!(consumer = %self.settings.durable, "NATS consumer stopped");
        clean
    }

    /// Gives back (`nak`) the held messages and what the pull request in
    /// flight still brings, in stream order. `true` when all of it reached
    /// the server.
    async fn give_back(&mut self, in_flight: Vec<Batch>, client: &async_nats::Client) -> bool {
        let mut back: Vec<Delivery> = self
            .held
            .take_all()
            .into_iter()
            .map(|p| p.delivery)
            .collect();
        let mut clean = true;
        // The server answers an expired pull request with a status that
        // ends the batch; a lost connection does not.
        let deadline = tokio::time::sleep(PULL_EXPIRY + Duration::from_millis(500));
        tokio::pin!(deadline);
        for mut batch in in_flight {
            loop {
                tokio::select! {
                    next = batch.next() => match next {
                        Some(Ok(message)) => {
                            let seq = message.info().map(|i| i.stream_sequence).unwrap_or(0);
                            back.push(Delivery { seq, acker: message.split().1 });
                        }
                        Some(Err(_)) => {}
                        None => break,
                    },
                    _ = &mut deadline => {
                        clean = false;
                        break;
                    }
                }
            }
        }
        back.sort_by_key(|d| d.seq);
        for delivery in &back {
            if delivery.acker.ack_with(AckKind::Nak(None)).await.is_err() {
                clean = false;
            }
        }
        // Always: the acknowledgements of the last messages handled, and
        // the `nak`s above, are still in the client's buffer, and the
        // connection may close right after. A server that does not answer
        // cannot have them.
        let flushed = tokio::time::timeout(Duration::from_secs(1), client.flush()).await;
        if !matches!(flushed, Ok(Ok(()))) {
            clean = false;
        }
        if !back.is_empty() {
            tracing::debug!(consumer = %self.settings.durable, given_back = back.len(), clean, "gave unsettled messages back to the server");
        }
        clean
    }

    /// Logs an error status a pull request ended with (the loop goes on).
    fn pull_error(&self, e: &async_nats::Error) {
        tracing::debug!(
            error = %self.settings.config.scrub(&e.to_string()),
            consumer = %self.settings.durable,
            "JetStream pull reported an error"
        );
    }

    /// Asks the server for up to `size` messages within [`PULL_EXPIRY`].
    async fn pull(
        &self,
        consumer: &jetstream::consumer::PullConsumer,
        size: usize,
    ) -> Result<Batch, jetstream::consumer::pull::BatchError> {
        consumer
            .batch()
            .max_messages(size)
            .expires(PULL_EXPIRY)
            .messages()
            .await
    }

    /// Tells the server the held messages are being worked on, so that it
    /// does not deliver them again meanwhile.
    async fn keep_held_in_progress(&self) {
        for pending in self.held.deliveries() {
            let _ = pending.delivery.acker.ack_with(AckKind::Progress).await;
        }
    }

    async fn on_message(&mut self, message: jetstream::Message) {
        let (tag, decoded) = match message.info() {
            Ok(info) => (
                info.stream_sequence,
                decode(&message, info.stream, info.delivered > 1),
            ),
            Err(e) => (0, Err(format!("no JetStream metadata: {e}"))),
        };
        let (message, acker) = message.split();
        let acker = Delivery { seq: tag, acker };
        let received = match decoded {
            Ok(r) => r,
            Err(why) => {
                bump(&self.counters.invalid);
                tracing::warn!(
                    subject = %message.subject,
                    reason = %why,
                    consumer = %self.settings.durable,
                    "a message that cannot be handled; dead-lettering it"
                );
                let mut received = Received::new(MessageId::new(), message.payload.to_vec());
                received.routing_key = message.subject.to_string();
                if let Some(h) = &message.headers {
                    received.headers = text_headers(h);
                }
                self.dead_letter(&acker, &received, &why).await;
                return;
            }
        };
        let pending = Pending::new(acker, received);
        let lane = Lane::of(&pending.received, tag);
        if self.held.holds(&lane) {
            bump(&self.counters.held_back);
            self.held.queue_behind(lane, pending);
            return;
        }
        self.run_lane(lane, pending).await;
    }

    /// Runs `first`, then the messages held behind it in arrival order,
    /// until the lane is empty or one must wait for a retry.
    async fn run_lane(&mut self, lane: Lane, first: Pending<Delivery>) {
        let mut next = Some(first);
        while let Some(pending) = next {
            if let Some((pending, delay)) = self.try_once(pending).await {
                self.held.hold(lane, pending, delay);
                return;
            }
            next = self.held.next_behind(&lane);
            if *self.stop.borrow() {
                if let Some(pending) = next {
                    self.held.hold(lane, pending, Duration::ZERO);
                }
                return;
            }
        }
    }

    /// One try: the inbox transaction, then settling. `Some` when the
    /// message waits for a retry in place.
    async fn try_once(
        &mut self,
        mut pending: Pending<Delivery>,
    ) -> Option<(Pending<Delivery>, Duration)> {
        let id = pending.received.id;
        pending.received.attempt = self.attempts.next_try(id);
        let received = &pending.received;
        let span = tracing::info_span!(
            "outbox.receive",
            message.id = %id,
            message.type = received.message_type.as_deref(),
            message.key = received.key.as_deref(),
            consumer = %self.settings.durable,
            subject = %received.routing_key,
            redelivered = received.redelivered,
            attempt = received.attempt,
            outcome = tracing::field::Empty,
        );
        outbox_api::trace::continue_trace(&span, received.trace_parent.as_deref());
        let outcome = self
            .inbox
            .receive_once(
                &self.settings.durable,
                received,
                self.settings.handler_timeout,
            )
            .instrument(span.clone())
            .await;
        let settle = self.settings.rules.settle(&mut pending, outcome);
        let _enter = span.enter();
        match &settle {
            Settle::Ack | Settle::AckDuplicate => {
                span.record(
                    "outcome",
                    if settle == Settle::Ack {
                        "handled"
                    } else {
                        "duplicate"
                    },
                );
                self.attempts.settled(id);
                if let Err(e) = pending.delivery.acker.ack().await {
                    // The server delivers it again; the inbox makes that a no-op.
                    tracing::warn!(error = %e, "acknowledging failed; the message will come again");
                }
            }
            Settle::DeadLetter { error } => {
                span.record("outcome", "dead-lettered");
                tracing::error!(%error, attempts = pending.received.attempt, "handler failed on its last attempt; dead-lettering");
                if !self
                    .dead_letter(&pending.delivery, &pending.received, error)
                    .await
                {
                    // Not published: keep it and try the dead letter again.
                    let delay = self.settings.rules.unavailable_backoff.0;
                    return Some((pending, delay));
                }
                self.attempts.settled(id);
            }
            Settle::Retry { error, delay } => {
                span.record("outcome", "failed");
                self.attempts.failed(id, pending.received.attempt);
                tracing::warn!(%error, attempts = pending.received.attempt, retry_in_ms = delay.as_millis() as u64,
                    "handler failed; retrying in place (later messages of its key wait)");
                let delay = *delay;
                self.counters.count(&settle);
                return Some((pending, delay));
            }
            Settle::Defer {
                reason,
                delay,
                store,
            } => {
                span.record(
                    "outcome",
                    if *store {
                        "store-failed"
                    } else {
                        "unavailable"
                    },
                );
                tracing::warn!(%reason, deferrals = pending.deferrals, retry_in_ms = delay.as_millis() as u64,
                    "not the message's fault (not counted as an attempt); will retry");
                let delay = *delay;
                self.counters.count(&settle);
                return Some((pending, delay));
            }
        }
        self.counters.count(&settle);
        None
    }

    /// Publishes `received` to the dead-letter subject (acknowledged by
    /// JetStream), then terminates the original. `false` when the publish
    /// failed (the original is left as it is).
    async fn dead_letter(&self, delivery: &Delivery, received: &Received, why: &str) -> bool {
        let mut headers = HeaderMap::new();
        let mut add = |name: &str, value: &str| {
            if let (Ok(n), Ok(v)) = (name.parse::<HeaderName>(), value.parse::<HeaderValue>()) {
                headers.insert(n, v);
            }
        };
        for (name, value) in &received.headers {
            add(name, value);
        }
        let reason: String = why.replace(['\r', '\n'], " ").chars().take(1000).collect();
        add(DEAD_REASON_HEADER, &reason);
        add(DEAD_SUBJECT_HEADER, &received.routing_key);
        add(DEAD_CONSUMER_HEADER, &self.settings.durable);
        add(DEAD_ATTEMPTS_HEADER, &received.attempt.to_string());
        let publish = PublishMessage::build()
            .payload(received.payload.clone().into())
            .headers(headers);
        let acked = match self
            .js
            .send_publish(self.settings.dead_letter_subject.clone(), publish)
            .await
        {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = acked {
            tracing::warn!(error = %self.settings.config.scrub(&e), subject = %self.settings.dead_letter_subject,
                "publishing the dead letter failed; will try again");
            return false;
        }
        if let Err(e) = delivery.acker.ack_with(AckKind::Term).await {
            tracing::warn!(error = %e, "terminating the dead-lettered message failed; it may come again (and be dead-lettered again)");
        }
        true
    }
}
