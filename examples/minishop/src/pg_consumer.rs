//! Consuming a RabbitMQ queue into a module's **PostgreSQL** inbox
//! (`--postgres` with `--amqp`).
//!
//! The library's `RabbitConsumer` runs its inbox transaction on SQLite
//! only, so MiniShop brings this small consumer for PostgreSQL. It keeps
//! the consumer's promises that matter here: each delivery is handled
//! through [`receive`] (inbox row, effects and reply in one PostgreSQL
//! transaction) and acknowledged only after that commit; a duplicate is
//! acknowledged without running the handler; a handler that fails
//! [`MAX_ATTEMPTS`] times is rejected to the dead-letter exchange; a
//! database outage or a handler that is temporarily unavailable is retried
//! in place with backoff, uncounted; a lost connection is rebuilt with
//! backoff, and the broker redelivers what was not acknowledged (the inbox
//! turns that into no effect).
//!
//! Deliveries are handled one at a time, in queue order, so a retry holds
//! up the queue behind it — simple, and it keeps each key's order.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use outbox::MessageId;
use outbox::rabbitmq::lapin::message::Delivery;
use outbox::rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions,
};
use outbox::rabbitmq::lapin::types::{FieldTable, LongString, ShortString};
use outbox::rabbitmq::lapin::{Channel, Connection, ConnectionProperties, Consumer};
use outbox::sqlite::InboxOutcome;
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

use crate::fail::Fail;
use crate::inbox::{InboxModule, receive};

/// Counted handler failures after which a delivery is dead-lettered.
pub const MAX_ATTEMPTS: u32 = 5;
/// Deliveries the broker sends ahead.
const PREFETCH: u16 = 200;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const RETRY_MIN: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What a consumer has done since it started.
#[derive(Debug, Default)]
pub struct Counters {
    /// Committed.
    pub handled: AtomicU64,
    /// Found in the inbox: acknowledged without running the handler.
    pub duplicates: AtomicU64,
    /// Tries that did not commit and were tried again.
    pub retried: AtomicU64,
    /// Rejected to the dead-letter exchange.
    pub dead_lettered: AtomicU64,
    /// Database failures (counted among the retries too).
    pub store_errors: AtomicU64,
}

struct Shared {
    queue: String,
    running: AtomicBool,
    connected: AtomicBool,
    counters: Counters,
}

/// A running consumer of one queue into one module's PostgreSQL inbox.
pub struct PgConsumer {
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for PgConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgConsumer")
            .field("queue", &self.shared.queue)
            .finish_non_exhaustive()
    }
}

struct Session {
    connection: Connection,
    channel: Channel,
    consumer: Consumer,
}

/// Where and what to consume; everything a session needs.
struct Settings {
    url: String,
    redacted: String,
    queue: String,
    module: Arc<dyn InboxModule>,
}

impl Settings {
    /// The text of a broker error, the password scrubbed.
    fn scrub(&self, text: String) -> String {
        text.replace(&self.url, &self.redacted)
    }

    async fn open_session(&self) -> Result<Session, String> {
        let name = self.module.db().name;
        let attempt = async {
            let properties = ConnectionProperties::default().with_connection_name(
                LongString::from(format!("minishop {name} consumer").as_bytes()),
            );
            let connection = Connection::connect(&self.url, properties)
                .await
                .map_err(|e| format!("connecting to RabbitMQ at {}: {e}", self.redacted))?;
            let channel = connection
                .create_channel()
                .await
                .map_err(|e| format!("opening a channel: {e}"))?;
            channel
                .basic_qos(PREFETCH, BasicQosOptions::default())
                .await
                .map_err(|e| format!("setting the prefetch: {e}"))?;
            let tag = format!("minishop-{name}-{}", MessageId::new());
            let consumer = channel
                .basic_consume(
                    ShortString::from(self.queue.as_str()),
                    ShortString::from(tag.as_str()),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| format!("consuming queue `{}`: {e}", self.queue))?;
            Ok(Session {
                connection,
                channel,
                consumer,
            })
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
            Ok(result) => result.map_err(|e| self.scrub(e)),
            Err(_) => Err(format!(
                "connecting to RabbitMQ at {} timed out after {CONNECT_TIMEOUT:?}",
                self.redacted
            )),
        }
    }
}

impl PgConsumer {
    /// Connects (failing at once if it cannot) and consumes `queue` into
    /// `module`'s inbox until [`shutdown`](Self::shutdown).
    pub async fn spawn(
        url: &str,
        redacted: &str,
        queue: &str,
        module: Arc<dyn InboxModule>,
    ) -> Result<PgConsumer, Fail> {
        let settings = Settings {
            url: url.to_owned(),
            redacted: redacted.to_owned(),
            queue: queue.to_owned(),
            module,
        };
        let first = settings
            .open_session()
            .await
            .map_err(|e| Fail(format!("consuming RabbitMQ queue `{queue}`: {e}")))?;
        let shared = Arc::new(Shared {
            queue: queue.to_owned(),
            running: AtomicBool::new(true),
            connected: AtomicBool::new(true),
            counters: Counters::default(),
        });
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(settings, Arc::clone(&shared), first, stopped));
        Ok(PgConsumer {
            shared,
            stop,
            task: Mutex::new(Some(task)),
        })
    }

    /// The queue it consumes.
    pub fn queue(&self) -> &str {
        &self.shared.queue
    }

    /// Whether it still runs (it stops only at shutdown).
    pub fn is_running(&self) -> bool {
        self.shared.running.load(Ordering::SeqCst)
    }

    /// Whether it is connected to the broker now.
    pub fn is_connected(&self) -> bool {
        self.shared.connected.load(Ordering::SeqCst)
    }

    /// What it has done.
    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// Stops consuming; a delivery being handled finishes (or, mid-retry,
    /// goes back to the queue unacknowledged).
    pub async fn shutdown(&self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.lock().await.take() {
            let _ = task.await;
        }
    }
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The consume loop, reconnecting with backoff until stopped.
async fn run(
    settings: Settings,
    shared: Arc<Shared>,
    first: Session,
    mut stop: watch::Receiver<bool>,
) {
    let mut session = Some(first);
    let mut delay = RETRY_MIN;
    while !*stop.borrow() {
        let current = match session.take() {
            Some(s) => s,
            None => match settings.open_session().await {
                Ok(s) => {
                    delay = RETRY_MIN;
                    tracing::info!(queue = %shared.queue, "reconnected to RabbitMQ; consuming again");
                    s
                }
                Err(e) => {
                    tracing::warn!(queue = %shared.queue, error = %e, "consumer cannot reach RabbitMQ");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = stop.changed() => {}
                    }
                    delay = (delay * 2).min(RETRY_MAX);
                    continue;
                }
            },
        };
        shared.connected.store(true, Ordering::SeqCst);
        let stopped = consume(&settings, &shared, current, &mut stop).await;
        shared.connected.store(false, Ordering::SeqCst);
        if stopped {
            break;
        }
    }
    shared.running.store(false, Ordering::SeqCst);
}

/// Handles deliveries until stopped (`true`) or the session breaks (`false`).
async fn consume(
    settings: &Settings,
    shared: &Shared,
    mut s: Session,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    loop {
        tokio::select! {
            biased;
            _ = stop.changed() => break,
            next = s.consumer.next() => match next {
                Some(Ok(delivery)) => match settle(settings, shared, delivery, stop).await {
                    Settled::Done => {}
                    Settled::Stopped => break,
                    Settled::Lost(e) => {
                        tracing::warn!(queue = %shared.queue, error = %settings.scrub(e), "acknowledging failed; reconnecting");
                        return false;
                    }
                },
                Some(Err(e)) => {
                    tracing::warn!(queue = %shared.queue, error = %settings.scrub(e.to_string()), "RabbitMQ consumer failed; reconnecting");
                    return false;
                }
                None => {
                    tracing::warn!(queue = %shared.queue, "the broker cancelled the consumer; reconnecting");
                    return false;
                }
            },
        }
    }
    // Unacknowledged deliveries go back to the queue when the channel closes.
    let _ = s.channel.close(200, "minishop stopping".into()).await;
    let _ = s.connection.close(200, "minishop stopping".into()).await;
    true
}

enum Settled {
    /// Acknowledged or dead-lettered.
    Done,
    /// Stopped while retrying: left unacknowledged, so it is redelivered.
    Stopped,
    /// The acknowledgement failed: the channel is gone.
    Lost(String),
}

/// Runs the inbox transaction until it commits (ack), finds a duplicate
/// (ack) or the handler failed [`MAX_ATTEMPTS`] times (reject: dead letter).
async fn settle(
    settings: &Settings,
    shared: &Shared,
    delivery: Delivery,
    stop: &mut watch::Receiver<bool>,
) -> Settled {
    let c = &shared.counters;
    let p = &delivery.properties;
    let id = p
        .message_id()
        .as_ref()
        .and_then(|raw| raw.as_str().parse::<MessageId>().ok());
    let Some(id) = id else {
        tracing::warn!(queue = %shared.queue, "a delivery without a valid message_id; dead-lettering it");
        bump(&c.dead_lettered);
        return acked(
            delivery
                .acker
                .reject(BasicRejectOptions { requeue: false })
                .await,
        );
    };
    let message_type = p
        .kind()
        .as_ref()
        .map(|t| t.as_str().to_owned())
        .unwrap_or_default();
    let mut failures = 0;
    let mut delay = RETRY_MIN;
    loop {
        let wait = match receive(&*settings.module, id, &message_type, &delivery.data).await {
            InboxOutcome::Committed => {
                bump(&c.handled);
                return acked(delivery.acker.ack(BasicAckOptions::default()).await);
            }
            InboxOutcome::Duplicate => {
                bump(&c.duplicates);
                return acked(delivery.acker.ack(BasicAckOptions::default()).await);
            }
            InboxOutcome::HandlerFailed(error) => {
                failures += 1;
                if failures >= MAX_ATTEMPTS {
                    tracing::warn!(queue = %shared.queue, message = %id, %error, "handler failed {MAX_ATTEMPTS} times; dead-lettering the message");
                    bump(&c.dead_lettered);
                    return acked(
                        delivery
                            .acker
                            .reject(BasicRejectOptions { requeue: false })
                            .await,
                    );
                }
                tracing::debug!(queue = %shared.queue, message = %id, %error, "handler failed; trying again");
                delay
            }
            InboxOutcome::HandlerUnavailable {
                reason,
                retry_after,
            } => {
                tracing::debug!(queue = %shared.queue, message = %id, %reason, "handler unavailable; trying again");
                retry_after.unwrap_or(delay)
            }
            InboxOutcome::StoreFailed(error) => {
                bump(&c.store_errors);
                tracing::warn!(queue = %shared.queue, message = %id, %error, "the inbox transaction failed; trying again");
                delay
            }
        };
        bump(&c.retried);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return Settled::Stopped,
        }
        delay = (delay * 2).min(RETRY_MAX);
    }
}

/// An acknowledgement's result: `Ok(false)` means the channel that
/// delivered it is gone (poisoned acker) — as lost as an error.
fn acked(result: outbox::rabbitmq::lapin::Result<bool>) -> Settled {
    match result {
        Ok(true) => Settled::Done,
        Ok(false) => Settled::Lost("the delivery's channel is closed".to_owned()),
        Err(e) => Settled::Lost(e.to_string()),
    }
}
