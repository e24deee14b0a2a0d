//! The consume loop: receive, run each record through the inbox in its
//! key's lane, settle it (commit its offset once it is safe, retry in
//! place, dead-letter), let go of what it holds when a rebalance takes its
//! partitions, pause fetching while too much is in flight.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use outbox_api::MessageId;
use outbox_api::Timestamp;
use outbox_api::receive::{Attempts, BoundInbox, Held, Lane, Pending, Received, Settle, bump};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use tokio::sync::watch;
use tracing::Instrument;

use super::context::{Context, Shared, commit_list};
use super::offsets::Partition;
use super::{
    DEAD_ATTEMPTS_HEADER, DEAD_GROUP_HEADER, DEAD_OFFSET_HEADER, DEAD_REASON_HEADER,
    DEAD_TOPIC_HEADER, KafkaConsumerBuilder, LANE_SLICE,
};
use crate::transport::{
    CONTENT_TYPE_HEADER, CREATED_AT_HEADER, ID_HEADER, KEY_HEADER, TRACEPARENT_HEADER, TYPE_HEADER,
};

/// A record received: where it is in its partition, and, for one that
/// cannot be handled (no valid message id), why — it is dead-lettered
/// without a try.
pub(super) struct Delivery {
    partition: Partition,
    offset: i64,
    invalid: Option<String>,
}

pub(super) struct Worker {
    settings: KafkaConsumerBuilder,
    consumer: Arc<StreamConsumer<Context>>,
    dead: FutureProducer,
    inbox: BoundInbox,
    shared: Arc<Shared>,
    held: Held<Delivery>,
    attempts: Attempts,
    stop: watch::Receiver<bool>,
    /// The rebalances seen (`Shared::epoch`).
    epoch: u64,
    /// Tells keyless records' lanes apart.
    alone: u64,
    /// Fetching is paused (too much in flight).
    paused: bool,
}

impl Worker {
    pub(super) fn new(
        settings: KafkaConsumerBuilder,
        consumer: Arc<StreamConsumer<Context>>,
        dead: FutureProducer,
        inbox: BoundInbox,
        shared: Arc<Shared>,
        stop: watch::Receiver<bool>,
    ) -> Worker {
        Worker {
            settings,
            consumer,
            dead,
            inbox,
            shared,
            held: Held::default(),
            attempts: Attempts::default(),
            stop,
            epoch: 0,
            alone: 0,
            paused: false,
        }
    }

    /// Consumes until told to stop; then commits what is safe, lets go of
    /// what it holds and leaves the group.
    pub(super) async fn run(mut self) {
        let consumer = self.consumer.clone();
        let mut commit = tokio::time::interval(self.settings.commit_interval);
        commit.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // Rebalance callbacks run inside `recv`'s poll only: every
            // branch first drops what a rebalance took (`resync`), before
            // it runs or settles anything.
            tokio::select! {
                biased;
                _ = self.stop.changed() => break,
                _ = commit.tick() => {
                    self.resync();
                    self.commit();
                }
                Some(lane) = self.held.due() => {
                    if !self.resync()
                        && let Some(head) = self.held.take_head(&lane)
                    {
                        self.run_lane(lane, head).await;
                    }
                }
                next = consumer.recv() => {
                    self.resync();
                    match next {
                        Ok(record) => {
                            let (lane, pending) = self.decode(&record);
                            drop(record);
                            self.on_record(lane, pending).await;
                        }
                        Err(e) => {
                            tracing::warn!(group = %self.settings.group,
                                error = %self.settings.config.scrub(&e.to_string()),
                                "receiving from Kafka failed; going on");
                            tokio::select! {
                                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                                _ = self.stop.changed() => {}
                            }
                        }
                    }
                }
            }
            if *self.stop.borrow() {
                break;
            }
            self.flow();
        }
        self.resync();
        self.held.clear();
        let group = self.settings.group.clone();
        let stopped = group.clone();
        let shared = self.shared.clone();
        drop(self);
        // Commits and closing block (the close serves the last rebalance).
        let closed = tokio::task::spawn_blocking(move || {
            let partitions: Vec<Partition> = shared
                .assigned
                .lock()
                .map(|a| a.iter().cloned().collect())
                .unwrap_or_default();
            let commits = shared.offsets().revoke(&partitions);
            if !commits.is_empty()
                && let Err(e) = consumer.commit(&commit_list(&commits), CommitMode::Sync)
            {
                tracing::warn!(%group, error = %e, "committing the last offsets failed; those records come again");
            }
            consumer.unsubscribe();
            drop(consumer);
        })
        .await;
        if let Err(e) = closed {
            tracing::error!(error = %e, "closing the Kafka consumer failed");
        }
        tracing::info!(group = %stopped, "Kafka consumer stopped");
    }

    /// Drops what it holds when a rebalance happened since the last look:
    /// an eager assignor revokes every partition, and their next owner
    /// reads them again from the committed offset. `true` if it did.
    fn resync(&mut self) -> bool {
        let now = self.shared.epoch.load(Ordering::SeqCst);
        if now == self.epoch {
            return false;
        }
        self.epoch = now;
        self.paused = false;
        if !self.held.is_empty() {
            tracing::info!(group = %self.settings.group, let_go = self.held.len(),
                "a rebalance took the partitions; letting go of the records held for a retry");
        }
        self.held.clear();
        self.attempts = Attempts::default();
        true
    }

    /// Commits (asynchronously) the offsets that moved.
    fn commit(&self) {
        let commits = self.shared.offsets().take_moved();
        if !commits.is_empty()
            && let Err(e) = self
                .consumer
                .commit(&commit_list(&commits), CommitMode::Async)
        {
            tracing::debug!(group = %self.settings.group, error = %e, "committing offsets failed; a later commit carries them");
        }
    }

    /// Pauses fetching while `max_in_flight` records are unsettled, and
    /// resumes it below.
    fn flow(&mut self) {
        let full = self.shared.offsets().unsettled() >= self.settings.max_in_flight;
        if full == self.paused {
            return;
        }
        let assignment = match self.consumer.assignment() {
            Ok(a) => a,
            Err(_) => return,
        };
        let done = if full {
            self.consumer.pause(&assignment)
        } else {
            self.consumer.resume(&assignment)
        };
        match done {
            Ok(()) => self.paused = full,
            Err(e) => {
                tracing::debug!(group = %self.settings.group, error = %e, "pausing or resuming fetching failed")
            }
        }
    }

    /// Decodes `record` and counts it received; its lane is its ordering
    /// key (or itself alone).
    fn decode(&mut self, record: &BorrowedMessage<'_>) -> (Lane, Pending<Delivery>) {
        let partition = (record.topic().to_owned(), record.partition());
        let offset = record.offset();
        self.shared.offsets().received(&partition, offset);
        let mut headers = std::collections::BTreeMap::new();
        if let Some(h) = record.headers() {
            for header in h.iter() {
                headers.insert(
                    header.key.to_owned(),
                    String::from_utf8_lossy(header.value.unwrap_or_default()).into_owned(),
                );
            }
        }
        let payload = record.payload().unwrap_or_default().to_vec();
        let parsed = match headers.get(ID_HEADER) {
            None => Err(format!("the record has no {ID_HEADER} header")),
            Some(raw) => raw.parse::<MessageId>().map_err(|_| {
                format!(
                    "{ID_HEADER} `{}` is not a message id (UUID)",
                    raw.chars().take(80).collect::<String>()
                )
            }),
        };
        let (id, invalid) = match parsed {
            Ok(id) => (id, None),
            Err(why) => (MessageId::new(), Some(why)),
        };
        let mut r = Received::new(id, payload);
        r.message_type = headers.get(TYPE_HEADER).cloned();
        r.key = headers.get(KEY_HEADER).cloned().or_else(|| {
            record
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned())
        });
        r.trace_parent = headers.get(TRACEPARENT_HEADER).cloned();
        r.content_type = headers.get(CONTENT_TYPE_HEADER).cloned();
        r.timestamp = headers
            .get(CREATED_AT_HEADER)
            .and_then(|t| t.parse::<i64>().ok())
            .or_else(|| record.timestamp().to_millis())
            .map(Timestamp::from_millis);
        r.headers = headers;
        r.exchange = partition.0.clone();
        r.routing_key = format!("{}/{}", partition.0, partition.1);
        self.alone += 1;
        let lane = Lane::of(&r, self.alone);
        if let Some(why) = &invalid {
            bump(&self.shared.counters.invalid);
            tracing::warn!(topic = %partition.0, partition = partition.1, offset, reason = %why,
                group = %self.settings.group, "a record that cannot be handled; dead-lettering it");
        }
        let delivery = Delivery {
            partition,
            offset,
            invalid,
        };
        (lane, Pending::new(delivery, r))
    }

    async fn on_record(&mut self, lane: Lane, pending: Pending<Delivery>) {
        if self.held.holds(&lane) {
            bump(&self.shared.counters.held_back);
            self.held.queue_behind(lane, pending);
            return;
        }
        self.run_lane(lane, pending).await;
    }

    /// Runs `first`, then the records held behind it in arrival order,
    /// until the lane is empty, one must wait for a retry, or the lane has
    /// run for [`LANE_SLICE`] (the rest goes on after a poll).
    async fn run_lane(&mut self, lane: Lane, first: Pending<Delivery>) {
        let started = Instant::now();
        let mut next = Some(first);
        while let Some(pending) = next {
            if let Some((pending, delay)) = self.try_once(pending).await {
                self.held.hold(lane, pending, delay);
                return;
            }
            next = self.held.next_behind(&lane);
            if *self.stop.borrow() || started.elapsed() > LANE_SLICE {
                if let Some(pending) = next {
                    self.held.hold(lane, pending, Duration::ZERO);
                }
                return;
            }
        }
    }

    /// Marks `delivery` settled: its offset may be committed.
    fn settled(&self, delivery: &Delivery) {
        self.shared
            .offsets()
            .settled(&delivery.partition, delivery.offset);
    }

    /// One try: the inbox transaction (or, for a record that cannot be
    /// handled, the dead letter), then settling. `Some` when the record
    /// waits for a retry in place.
    async fn try_once(
        &mut self,
        mut pending: Pending<Delivery>,
    ) -> Option<(Pending<Delivery>, Duration)> {
        if let Some(why) = pending.delivery.invalid.clone() {
            if self.dead_letter(&pending, &why).await {
                self.settled(&pending.delivery);
                return None;
            }
            let delay = self.settings.rules.unavailable_backoff.0;
            return Some((pending, delay));
        }
        let id = pending.received.id;
        pending.received.attempt = self.attempts.next_try(id);
        let received = &pending.received;
        let span = tracing::info_span!(
            "outbox.receive",
            message.id = %id,
            message.type = received.message_type.as_deref(),
            message.key = received.key.as_deref(),
            consumer = %self.settings.group,
            topic = %pending.delivery.partition.0,
            partition = pending.delivery.partition.1,
            offset = pending.delivery.offset,
            attempt = received.attempt,
            outcome = tracing::field::Empty,
        );
        outbox_api::trace::continue_trace(&span, received.trace_parent.as_deref());
        let outcome = self
            .inbox
            .receive_once(
                &self.settings.group,
                received,
                self.settings.handler_timeout,
            )
            .instrument(span.clone())
            .await;
        let settle = self.settings.rules.settle(&mut pending, outcome);
        let _enter = span.enter();
        let wait = match &settle {
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
                self.settled(&pending.delivery);
                None
            }
            Settle::DeadLetter { error } => {
                span.record("outcome", "dead-lettered");
                tracing::error!(%error, attempts = pending.received.attempt, "handler failed on its last attempt; dead-lettering");
                if !self.dead_letter(&pending, error).await {
                    // Not produced: keep it and try the dead letter again
                    // (the attempt is counted again, still the last).
                    return Some((pending, self.settings.rules.unavailable_backoff.0));
                }
                self.attempts.settled(id);
                self.settled(&pending.delivery);
                None
            }
            Settle::Retry { error, delay } => {
                span.record("outcome", "failed");
                self.attempts.failed(id, pending.received.attempt);
                tracing::warn!(%error, attempts = pending.received.attempt, retry_in_ms = delay.as_millis() as u64,
                    "handler failed; retrying in place (later records of its key wait)");
                Some(*delay)
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
                    "not the record's fault (not counted as an attempt); will retry");
                Some(*delay)
            }
        };
        self.shared.counters.count(&settle);
        wait.map(|delay| (pending, delay))
    }

    /// Produces `pending`'s record to the dead-letter topic (waiting for
    /// the brokers' acknowledgement, up to the delivery timeout). `false`
    /// when it was not acknowledged (it may still arrive: a dead letter
    /// can then be there twice).
    async fn dead_letter(&self, pending: &Pending<Delivery>, why: &str) -> bool {
        let received = &pending.received;
        let delivery = &pending.delivery;
        let reason: String = why.replace(['\r', '\n'], " ").chars().take(1000).collect();
        let position = format!("{}/{}", delivery.partition.1, delivery.offset);
        let attempts = received.attempt.to_string();
        let own = [
            (DEAD_REASON_HEADER, reason.as_str()),
            (DEAD_TOPIC_HEADER, delivery.partition.0.as_str()),
            (DEAD_OFFSET_HEADER, position.as_str()),
            (DEAD_GROUP_HEADER, self.settings.group.as_str()),
            (DEAD_ATTEMPTS_HEADER, attempts.as_str()),
        ];
        let mut headers = OwnedHeaders::new_with_capacity(received.headers.len() + own.len());
        for (key, value) in received
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .filter(|(k, _)| !own.iter().any(|(o, _)| o == k))
            .chain(own)
        {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let mut record = FutureRecord::to(&self.settings.dead_letter_topic)
            .payload(received.payload.as_slice())
            .headers(headers);
        if let Some(key) = &received.key {
            record = record.key(key.as_bytes());
        }
        let limit = self.settings.config.delivery_timeout;
        let sent = tokio::time::timeout(limit, self.dead.send(record, Timeout::After(limit))).await;
        let failure = match sent {
            Ok(Ok(_)) => return true,
            Ok(Err((e, _))) => e.to_string(),
            Err(_) => format!("no answer within {limit:?}"),
        };
        tracing::warn!(error = %self.settings.config.scrub(&failure), topic = %self.settings.dead_letter_topic,
            "producing the dead letter failed; will try again");
        false
    }
}
