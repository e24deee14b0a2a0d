//! [`NatsConsumer`]: consumes a JetStream stream into any store's
//! [`Inbox`](outbox_api::Inbox), so that at-least-once delivery gives
//! exactly-once effects.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
#[cfg(doc)]
use outbox_api::receive::Received;
use outbox_api::receive::{
    ConsumerStats, Counters, InboxHandler, RetryRules, bind, purge_inbox_loop,
};
use outbox_api::{Error, Result};
use tokio::sync::watch;

use crate::config::NatsConfig;
use crate::transport::{connect_client, source_words};

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
            partitions: None,
            replica: (0, 1),
            takeover_check: Duration::from_secs(1),
            ownership_bucket: "outbox-owners".to_owned(),
        }
    }

    /// A consumer of the `partitions` partitions of the subjects `filter`
    /// matches (a transport configured with
    /// [`NatsConfig::partitioned`] appends the partition as the subject's
    /// last token; `filter` is the subjects without it, e.g. `shop.*` for
    /// `shop.OrderPlaced.3`): one durable pull consumer `{durable}-{i}` per
    /// partition `i`, filtered on `{filter}.{i}`, and **one process at a
    /// time consuming each partition**, so that a key's messages keep their
    /// order across processes.
    ///
    /// Run several processes with [`replica`](NatsConsumerBuilder::replica)
    /// `(index, replicas)`: a replica owns the partitions `i` with `i %
    /// replicas == index`, takes over the others while their owner is
    /// absent, and hands them back when it returns. Ownership is a lease in
    /// the JetStream key-value bucket
    /// [`ownership_bucket`](NatsConsumerBuilder::ownership_bucket), renewed
    /// every [`takeover_check`](NatsConsumerBuilder::takeover_check); see
    /// `docs/decisions.md`, "NATS: per-key order across consumer
    /// processes", for how a takeover keeps the order.
    pub fn partitioned(
        config: NatsConfig,
        stream: impl Into<String>,
        durable: impl Into<String>,
        filter: impl Into<String>,
        partitions: u16,
    ) -> NatsConsumerBuilder {
        let mut builder = Self::builder(config, stream, durable);
        builder.partitions = Some((filter.into(), partitions));
        builder
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
    /// The subjects' filter without the partition token, and the count.
    partitions: Option<(String, u16)>,
    /// This replica's index and how many there are.
    replica: (u16, u16),
    takeover_check: Duration,
    ownership_bucket: String,
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

    /// Partitioned consumers ([`NatsConsumer::partitioned`]): this process
    /// is replica `index` of `replicas` (default 0 of 1, which owns every
    /// partition) and owns the partitions `i` with `i % replicas == index`.
    pub fn replica(mut self, index: u16, replicas: u16) -> Self {
        self.replica = (index, replicas);
        self
    }

    /// Partitioned consumers: how often ownership leases are renewed and
    /// absent owners looked for (default 1 s, ±20 % jitter). A lease lasts
    /// three times as long: a dead owner's partitions are taken over after
    /// about that, plus `ack_wait` when it left messages unacknowledged.
    /// Every replica must use the same value.
    pub fn takeover_check(mut self, every: Duration) -> Self {
        self.takeover_check = every;
        self
    }

    /// Partitioned consumers: the key-value bucket that holds the
    /// ownership leases (default `outbox-owners`; created on first use,
    /// keys `owner.{stream}.{durable}.{partition}` and
    /// `member.{stream}.{durable}.{replica}`).
    pub fn ownership_bucket(mut self, bucket: impl Into<String>) -> Self {
        self.ownership_bucket = bucket.into();
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
        partitions::validate(self)
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
        // One durable consumer, or one per partition.
        let names: Vec<(String, String)> = match &self.partitions {
            Some((filter, count)) => (0..*count)
                .map(|i| (format!("{}-{i}", self.durable), format!("{filter}.{i}")))
                .collect(),
            None => vec![(
                self.durable.clone(),
                self.filter_subject.clone().unwrap_or_default(),
            )],
        };
        let mut consumers: Vec<jetstream::consumer::PullConsumer> = Vec::new();
        for (name, filter_subject) in names {
            let consumer = stream
                .get_or_create_consumer(
                    &name,
                    pull::Config {
                        durable_name: Some(name.clone()),
                        filter_subject,
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
                        "creating consumer `{name}` on stream `{}`: {}",
                        self.stream,
                        scrub(&e)
                    ))
                })?;
            consumers.push(consumer);
        }
        let ownership = match self.partitions {
            Some(_) => Some(partitions::Ownership::open(&js, &self).await?),
            None => None,
        };
        let counters = Arc::new(Counters::default());
        let running = Arc::new(AtomicBool::new(true));
        let connected = Arc::new(AtomicBool::new(true));
        let owned = Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
        let (stop, stopped) = watch::channel(false);
        let inbox = bind(inbox, Arc::new(handler));
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
            partitions = self.partitions.as_ref().map(|(_, n)| *n),
            "consuming from NATS JetStream"
        );
        let shared = Shared {
            settings: self,
            js,
            inbox,
            counters: counters.clone(),
            connected: connected.clone(),
        };
        let flag = running.clone();
        let owning = owned.clone();
        let task = tokio::spawn(async move {
            match ownership {
                Some(ownership) => {
                    partitions::run(shared, consumers, ownership, stopped, owning).await;
                }
                None => {
                    if let Some(consumer) = consumers.pop() {
                        let _ = shared.worker(stopped).run(consumer).await;
                    }
                }
            }
            flag.store(false, Ordering::SeqCst);
        });
        Ok(NatsConsumerHandle {
            stop,
            task: tokio::sync::Mutex::new(Some(task)),
            purger: tokio::sync::Mutex::new(purger),
            counters,
            running,
            connected,
            owned,
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
    owned: Arc<std::sync::Mutex<std::collections::BTreeSet<u16>>>,
}

impl NatsConsumerHandle {
    /// The partitions this process consumes right now, in order (empty
    /// for a consumer that is not [partitioned](NatsConsumer::partitioned)).
    pub fn partitions(&self) -> Vec<u16> {
        self.owned
            .lock()
            .map(|owned| owned.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Whether it is connected and pulling right now.
    pub fn is_connected(&self) -> bool {
        self.is_running() && self.connected.load(Ordering::SeqCst)
    }

    /// Stops consuming: the message in flight finishes (committed and
    /// acknowledged, or rolled back); messages fetched but not started, or
    /// held for a retry, are given back to the server (`nak`, in stream
    /// order), which delivers them again at once — to another process of
    /// the same durable consumer, say. Waits until that is done (at most
    /// about a second more than the message in flight).
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

mod decode;
mod partitions;
mod worker;

use worker::Shared;
