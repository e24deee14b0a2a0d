//! [`NatsConsumer`]: consumes a JetStream stream into any store's
//! [`Inbox`](outbox_api::Inbox), so that at-least-once delivery gives
//! exactly-once effects.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::message::{Acker, PublishMessage};
use async_nats::jetstream::{self, AckKind};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use futures_util::StreamExt;
use outbox_api::receive::{
    Attempts, ConsumerStats, Counters, Held, InboxHandler, Lane, Pending, Received, RetryRules,
    Settle, backoff, bump, purge_inbox_loop,
};
use outbox_api::{Error, InboxOutcome, InboxWork, MessageId, Result, Timestamp};
use tokio::sync::watch;
use tracing::Instrument;

use crate::config::NatsConfig;
use crate::transport::{
    CONTENT_TYPE_HEADER, CREATED_AT_HEADER, KEY_HEADER, MSG_ID_HEADER, TRACEPARENT_HEADER,
    TYPE_HEADER, connect_client, source_words,
};

/// Header of a dead letter: why it was dead-lettered.
pub const DEAD_REASON_HEADER: &str = "Outbox-Dead-Reason";
/// Header of a dead letter: the subject it was received on.
pub const DEAD_SUBJECT_HEADER: &str = "Outbox-Dead-Subject";
/// Header of a dead letter: the consumer that gave up on it.
pub const DEAD_CONSUMER_HEADER: &str = "Outbox-Dead-Consumer";
/// Header of a dead letter: the handler failures it took.
pub const DEAD_ATTEMPTS_HEADER: &str = "Outbox-Dead-Attempts";

/// Consumes a JetStream stream into an inbox.
///
/// A durable pull consumer with explicit acknowledgement. Each message is
/// decoded ([`Received`]: `Nats-Msg-Id` is the inbox key), run through the
/// inbox with the handler, and acknowledged only after the inbox commit.
/// What happens after a try is decided by [`RetryRules::settle`], as for
/// every consumer of this project: a failed handler is tried again **in
/// place** after `retry_delay`, later messages of its key held behind it in
/// this process (other keys go on); at `max_attempts` it is published to
/// the dead-letter subject (through JetStream, acknowledged) and terminated;
/// an outage of the handler's downstream or of the database is retried
/// uncounted with a growing backoff. Held messages are kept from being
/// redelivered by the server with "in progress" acknowledgements every half
/// `ack_wait`.
///
/// Per-key order holds within one consumer process: JetStream hands a
/// durable consumer's messages to its subscribers in stream order, so run
/// one process per durable consumer (or one durable per partition of the
/// subjects) when order matters.
pub struct NatsConsumer;

impl NatsConsumer {
    /// A durable consumer `durable` of `stream` on the server `config`
    /// describes; `durable` is also the consumer name recorded in the
    /// inbox.
    pub fn builder(
        config: NatsConfig,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> NatsConsumerBuilder {
        let durable = durable.into();
        NatsConsumerBuilder {
            config,
            stream: stream.into(),
            dead_letter_subject: format!("outbox-dead.{durable}"),
            durable,
            filter_subject: None,
            max_ack_pending: 256,
            ack_wait: Duration::from_secs(60),
            rules: RetryRules {
                max_attempts: 5,
                retry_delay: Duration::from_secs(1),
                unavailable_backoff: (Duration::from_millis(100), Duration::from_secs(30)),
            },
            handler_timeout: Duration::from_secs(30),
            inbox_retention: Some(Duration::from_secs(7 * 24 * 3600)),
            inbox_purge_interval: Duration::from_secs(60),
        }
    }
}

/// Settings of a [`NatsConsumer`]; finish with [`spawn`](Self::spawn).
#[derive(Debug, Clone)]
pub struct NatsConsumerBuilder {
    config: NatsConfig,
    stream: String,
    durable: String,
    filter_subject: Option<String>,
    max_ack_pending: usize,
    ack_wait: Duration,
    rules: RetryRules,
    handler_timeout: Duration,
    dead_letter_subject: String,
    inbox_retention: Option<Duration>,
    inbox_purge_interval: Duration,
}

impl NatsConsumerBuilder {
    /// Consumes only the stream's messages on `subject` (wildcards allowed).
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// Messages delivered and not yet acknowledged at most (default 256):
    /// the prefetch. Messages held behind a key waiting for its retry keep
    /// their slots.
    pub fn max_ack_pending(mut self, n: usize) -> Self {
        self.max_ack_pending = n;
        self
    }

    /// How long the server waits for an acknowledgement before it delivers
    /// a message again (default 60 s); longer than `handler_timeout`.
    /// Messages that were on their way to this consumer when its
    /// connection broke come again after it.
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait;
        self
    }

    /// Handler failures before the message is dead-lettered (default 5).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.rules.max_attempts = attempts;
        self
    }

    /// The delay before trying a failed message again (default 1 s).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.rules.retry_delay = delay;
        self
    }

    /// First and longest delay of the uncounted retries (default 100 ms
    /// to 30 s).
    pub fn unavailable_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.rules.unavailable_backoff = (first, max);
        self
    }

    /// How long the handler may run (default 30 s); past it, the inbox
    /// transaction rolls back and the try counts as failed.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// Where dead letters are published (default `outbox-dead.{durable}`):
    /// a subject some stream captures, e.g. `StreamSpec::new("OUTBOX_DEAD",
    /// ["outbox-dead.>"])`. A dead letter carries the message's headers and
    /// payload, and [`DEAD_REASON_HEADER`] and its siblings.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = subject.into();
        self
    }

    /// How long inbox entries are kept (default 7 days; `None` keeps them
    /// forever). An entry must outlive every redelivery of its message —
    /// the sender's lease and retries, an operator's retry of a poisoned
    /// message — or a late duplicate runs the handler again. Older entries
    /// are purged every [`inbox_purge_interval`](Self::inbox_purge_interval)
    /// in small batches, beside the deliveries.
    pub fn inbox_retention(mut self, retention: Option<Duration>) -> Self {
        self.inbox_retention = retention;
        self
    }

    /// How often the inbox purge runs (default 1 min).
    pub fn inbox_purge_interval(mut self, interval: Duration) -> Self {
        self.inbox_purge_interval = interval;
        self
    }

    /// Checks the settings; a `Config` error names the one that is wrong.
    pub fn validate(&self) -> Result<()> {
        self.config.validate()?;
        if self.durable.is_empty()
            || self
                .durable
                .chars()
                .any(|c| c == '.' || c == '*' || c == '>' || c.is_whitespace())
        {
            return Err(Error::config(
                "durable",
                format!(
                    "`{}` is not a consumer name: not empty, no `.`, `*`, `>` or whitespace",
                    self.durable
                ),
            ));
        }
        if self.max_ack_pending == 0 {
            return Err(Error::config("max_ack_pending", "must be at least 1"));
        }
        if self.rules.max_attempts == 0 {
            return Err(Error::config("max_attempts", "must be at least 1"));
        }
        if self.handler_timeout.is_zero() {
            return Err(Error::config("handler_timeout", "must be longer than zero"));
        }
        if self.ack_wait <= self.handler_timeout {
            return Err(Error::config(
                "ack_wait",
                format!(
                    "{:?} must be longer than handler_timeout {:?}, or the server delivers a message again while its handler runs",
                    self.ack_wait, self.handler_timeout
                ),
            ));
        }
        crate::subject::check(&self.dead_letter_subject)
            .map_err(|why| Error::config("dead_letter_subject", why))?;
        Ok(())
    }

    /// Connects, creates the durable consumer if it does not exist (binds
    /// to it if it does), checks that a stream captures the dead-letter
    /// subject, and starts consuming on the current tokio runtime.
    ///
    /// Fails with a `Config` error for bad settings or a dead-letter
    /// subject no stream captures, `NotFound` when the stream does not
    /// exist, `Unavailable` when the server cannot be reached.
    pub async fn spawn<I: outbox_api::Inbox>(
        self,
        inbox: I,
        handler: impl InboxHandler<I::Conn>,
    ) -> Result<NatsConsumerHandle> {
        self.validate()?;
        let client = connect_client(&self.config).await?;
        let js = jetstream::new(client);
        let scrub =
            |e: &dyn std::error::Error| self.config.scrub(&format!("{e}{}", source_words(e)));
        let stream = js.get_stream(&self.stream).await.map_err(|e| {
            if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(api) if api.code() == 404)
            {
                Error::new(
                    outbox_api::ErrorKind::NotFound,
                    format!("stream `{}` does not exist", self.stream),
                )
            } else {
                Error::unavailable(format!("looking up stream `{}`: {}", self.stream, scrub(&e)))
            }
        })?;
        match js
            .stream_by_subject(self.dead_letter_subject.as_str())
            .await
        {
            Ok(_) => {}
            Err(e) if e.kind() == jetstream::context::GetStreamByNameErrorKind::NotFound => {
                return Err(Error::config(
                    "dead_letter_subject",
                    format!(
                        "no stream captures `{}`: declare one (e.g. StreamSpec::new(\"OUTBOX_DEAD\", [\"outbox-dead.>\"])) so that dead letters are kept for a human",
                        self.dead_letter_subject
                    ),
                ));
            }
            Err(e) => {
                return Err(Error::unavailable(format!(
                    "looking up the stream of `{}`: {}",
                    self.dead_letter_subject,
                    scrub(&e)
                )));
            }
        }
        let consumer: jetstream::consumer::PullConsumer = stream
            .get_or_create_consumer(
                &self.durable,
                pull::Config {
                    durable_name: Some(self.durable.clone()),
                    filter_subject: self.filter_subject.clone().unwrap_or_default(),
                    ack_policy: AckPolicy::Explicit,
                    deliver_policy: DeliverPolicy::All,
                    ack_wait: self.ack_wait,
                    max_ack_pending: self.max_ack_pending as i64,
                    max_deliver: -1,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| {
                Error::unavailable(format!(
                    "creating consumer `{}` on stream `{}`: {}",
                    self.durable,
                    self.stream,
                    scrub(&e)
                ))
            })?;
        let counters = Arc::new(Counters::default());
        let running = Arc::new(AtomicBool::new(true));
        let connected = Arc::new(AtomicBool::new(true));
        let (stop, stopped) = watch::channel(false);
        let inbox: Arc<dyn Receiver> = Arc::new(Bound {
            inbox,
            handler: Arc::new(handler),
        });
        let purger = self.inbox_retention.map(|retention| {
            let purging = inbox.clone();
            tokio::spawn(purge_inbox_loop(
                purging.table(),
                move |before, limit| {
                    let inbox = purging.clone();
                    async move { inbox.purge(before, limit).await }
                },
                retention,
                self.inbox_purge_interval,
                stopped.clone(),
            ))
        });
        tracing::info!(
            stream = %self.stream,
            consumer = %self.durable,
            inbox = %inbox.table(),
            "consuming from NATS JetStream"
        );
        let worker = Worker {
            settings: self,
            js,
            inbox,
            held: Held::default(),
            attempts: Attempts::default(),
            counters: counters.clone(),
            connected: connected.clone(),
            stop: stopped,
        };
        let flag = running.clone();
        let task = tokio::spawn(async move {
            worker.run(consumer).await;
            flag.store(false, Ordering::SeqCst);
        });
        Ok(NatsConsumerHandle {
            stop,
            task: tokio::sync::Mutex::new(Some(task)),
            purger: tokio::sync::Mutex::new(purger),
            counters,
            running,
            connected,
        })
    }
}

/// A running [`NatsConsumer`]. Dropping it stops the consumer (without
/// waiting); [`shutdown`](Self::shutdown) stops it gracefully.
#[derive(Debug)]
pub struct NatsConsumerHandle {
    stop: watch::Sender<bool>,
    task: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    purger: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    counters: Arc<Counters>,
    running: Arc<AtomicBool>,
    connected: Arc<AtomicBool>,
}

impl NatsConsumerHandle {
    /// Whether it is connected and pulling right now.
    pub fn is_connected(&self) -> bool {
        self.is_running() && self.connected.load(Ordering::SeqCst)
    }

    /// Stops consuming: the message in flight finishes (committed and
    /// acknowledged, or rolled back); messages fetched but not started, or
    /// held for a retry, are left unacknowledged for the server to deliver
    /// again. Waits until that is done.
    pub async fn shutdown(&self) {
        self.stop.send_replace(true);
        for task in [
            self.task.lock().await.take(),
            self.purger.lock().await.take(),
        ]
        .into_iter()
        .flatten()
        {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "NATS consumer task ended abnormally");
            }
        }
    }

    /// Whether it still runs.
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::SeqCst)
    }

    /// Counts since start.
    pub fn stats(&self) -> ConsumerStats {
        self.counters.stats()
    }
}

impl Drop for NatsConsumerHandle {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// The inbox with the handler bound, one type whatever the store.
#[async_trait::async_trait]
trait Receiver: Send + Sync {
    fn table(&self) -> String;
    async fn receive_once(
        &self,
        consumer: &str,
        received: &Received,
        timeout: Duration,
    ) -> InboxOutcome;
    async fn purge(&self, before: Timestamp, limit: usize) -> Result<u64>;
}

struct Bound<I: outbox_api::Inbox, H> {
    inbox: I,
    handler: Arc<H>,
}

struct Work<'a, H> {
    handler: &'a H,
    received: &'a Received,
}

#[async_trait::async_trait]
impl<C: ?Sized + Send + 'static, H: InboxHandler<C>> InboxWork<C> for Work<'_, H> {
    async fn run(&self, conn: &mut C) -> std::result::Result<(), outbox_api::HandlerError> {
        self.handler.handle(self.received, conn).await
    }
}

#[async_trait::async_trait]
impl<I: outbox_api::Inbox, H: InboxHandler<I::Conn>> Receiver for Bound<I, H> {
    fn table(&self) -> String {
        self.inbox.name()
    }

    async fn purge(&self, before: Timestamp, limit: usize) -> Result<u64> {
        self.inbox.purge(before, limit).await
    }

    async fn receive_once(
        &self,
        consumer: &str,
        received: &Received,
        timeout: Duration,
    ) -> InboxOutcome {
        let work = Work {
            handler: &*self.handler,
            received,
        };
        self.inbox
            .receive_once(consumer, received.id, timeout, &work)
            .await
    }
}

struct Worker {
    settings: NatsConsumerBuilder,
    js: jetstream::Context,
    inbox: Arc<dyn Receiver>,
    held: Held<Acker>,
    attempts: Attempts,
    counters: Arc<Counters>,
    /// Pulling over a live connection right now.
    connected: Arc<AtomicBool>,
    stop: watch::Receiver<bool>,
}

impl Worker {
    async fn run(mut self, consumer: jetstream::consumer::PullConsumer) {
        let mut failures = 0u32;
        let mut opened_before = false;
        let mut progress = tokio::time::interval(self.settings.ack_wait / 2);
        progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut connection_check = tokio::time::interval(Duration::from_millis(100));
        connection_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        'outer: while !*self.stop.borrow() {
            let mut messages = match consumer
                .stream()
                .max_messages_per_batch(self.settings.max_ack_pending.min(1000))
                .heartbeat(Duration::from_secs(5))
                .messages()
                .await
            {
                Ok(m) => {
                    self.connected.store(true, Ordering::SeqCst);
                    if opened_before {
                        bump(&self.counters.reconnects);
                    }
                    opened_before = true;
                    failures = 0;
                    m
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
            };
            let client = self.js.client();
            let mut lost = false;
            loop {
                tokio::select! {
                    biased;
                    _ = self.stop.changed() => break 'outer,
                    _ = progress.tick() => self.keep_held_in_progress().await,
                    // After a reconnect, pull afresh: pull requests made on
                    // the lost connection are not answered any more.
                    _ = connection_check.tick() => {
                        let connected = client.connection_state() == async_nats::connection::State::Connected;
                        self.connected.store(connected, Ordering::SeqCst);
                        if !connected {
                            lost = true;
                        } else if lost {
                            tracing::info!(consumer = %self.settings.durable, "NATS connection restored; pulling again");
                            break;
                        }
                    }
                    Some(lane) = self.held.due() => {
                        if let Some(head) = self.held.take_head(&lane) {
                            self.run_lane(lane, head).await;
                        }
                    }
                    next = messages.next() => match next {
                        Some(Ok(message)) => self.on_message(message).await,
                        Some(Err(e)) => {
                            // Heartbeats missed, a reconnect: the stream of
                            // messages recovers by itself or ends.
                            tracing::debug!(
                                error = %self.settings.config.scrub(&e.to_string()),
                                consumer = %self.settings.durable,
                                "JetStream pull reported an error"
                            );
                        }
                        None => {
                            tracing::warn!(consumer = %self.settings.durable, "JetStream pull ended; pulling again");
                            break;
                        }
                    },
                }
            }
        }
        // Whatever is held goes back to the server, unacknowledged.
        self.held.clear();
        self.connected.store(false, Ordering::SeqCst);
        tracing::info!(consumer = %self.settings.durable, "NATS consumer stopped");
    }

    /// Tells the server the held messages are being worked on, so that it
    /// does not deliver them again meanwhile.
    async fn keep_held_in_progress(&self) {
        for pending in self.held.deliveries() {
            let _ = pending.delivery.ack_with(AckKind::Progress).await;
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
    async fn run_lane(&mut self, lane: Lane, first: Pending<Acker>) {
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
        mut pending: Pending<Acker>,
    ) -> Option<(Pending<Acker>, Duration)> {
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
                if let Err(e) = pending.delivery.ack().await {
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
    async fn dead_letter(&self, acker: &Acker, received: &Received, why: &str) -> bool {
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
        if let Err(e) = acker.ack_with(AckKind::Term).await {
            tracing::warn!(error = %e, "terminating the dead-lettered message failed; it may come again (and be dead-lettered again)");
        }
        true
    }
}

/// The headers as text (a header's first value).
fn text_headers(h: &HeaderMap) -> std::collections::BTreeMap<String, String> {
    h.iter()
        .filter_map(|(name, values)| {
            values
                .first()
                .map(|v| (name.to_string(), v.as_str().to_owned()))
        })
        .collect()
}

/// Decodes a JetStream message; `Err` says why it cannot be handled.
fn decode(
    m: &jetstream::Message,
    stream: &str,
    redelivered: bool,
) -> std::result::Result<Received, String> {
    let headers = m.headers.as_ref().map(text_headers).unwrap_or_default();
    let raw = headers
        .get(MSG_ID_HEADER)
        .ok_or_else(|| format!("the message has no {MSG_ID_HEADER} header"))?;
    let id: MessageId = raw.parse().map_err(|_| {
        format!(
            "{MSG_ID_HEADER} `{}` is not a message id (UUID)",
            raw.chars().take(80).collect::<String>()
        )
    })?;
    let mut r = Received::new(id, m.payload.to_vec());
    r.message_type = headers.get(TYPE_HEADER).cloned();
    r.key = headers.get(KEY_HEADER).cloned();
    r.trace_parent = headers.get(TRACEPARENT_HEADER).cloned();
    r.content_type = headers.get(CONTENT_TYPE_HEADER).cloned();
    r.timestamp = headers
        .get(CREATED_AT_HEADER)
        .and_then(|t| t.parse::<i64>().ok())
        .map(Timestamp::from_millis);
    r.headers = headers;
    r.exchange = stream.to_owned();
    r.routing_key = m.subject.to_string();
    r.redelivered = redelivered;
    Ok(r)
}
