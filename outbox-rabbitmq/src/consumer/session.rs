//! The connection and the consume loop: connect, consume, reconnect with
//! backoff, close on shutdown; for a standby partition, subscribe only
//! while no other consumer is on the queue and hand it back when one waits.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{Channel, Connection, ConnectionProperties};
use outbox_api::{Error, MessageId, Result};
use tokio::sync::watch;
use tokio::time::timeout;

use outbox_api::receive::{Attempts, Held, backoff, bump};

use super::RabbitConsumerBuilder;
use super::handle::Shared;
use crate::transport::connect_error;
use outbox_api::receive::BoundInbox;

/// An open connection consuming the queue.
pub(super) struct Session {
    pub(super) connection: Connection,
    pub(super) channel: Channel,
    pub(super) consumer: lapin::Consumer,
    /// The owner marker's subscription, kept for the session's life.
    pub(super) _marker: Option<lapin::Consumer>,
}

pub(super) struct Worker {
    pub(super) settings: RabbitConsumerBuilder,
    /// The queue this worker consumes (one partition, when partitioned).
    pub(super) queue: String,
    /// Partitioned: the partition's owner marker, an auto-deleted queue the
    /// owning replica consumes while it is there (see [`owner_marker`]).
    pub(super) marker: Option<String>,
    pub(super) uri: AMQPUri,
    /// The inbox (and the application's handler on its connection).
    pub(super) inbox: BoundInbox,
    /// Handler failures so far, by message id.
    pub(super) attempts: Attempts,
    pub(super) shared: Arc<Shared>,
    /// Deliveries held for a retry in place, and the later ones of their keys.
    pub(super) held: Held<lapin::message::Delivery>,
    /// Set when the consumer is to stop.
    pub(super) stop: watch::Receiver<bool>,
}

impl Worker {
    pub(super) async fn open_session(&self) -> Result<Session> {
        let config = &self.settings.config;
        let queue = &self.queue;
        let attempt = async {
            let properties = ConnectionProperties::default()
                .with_connection_name(LongString::from(config.connection_name.as_bytes()));
            let connection = Connection::connect_uri(self.uri.clone(), properties)
                .await
                .map_err(|e| connect_error(config, &self.uri, &e))?;
            let unavailable = |what: &str, e: lapin::Error| {
                Error::unavailable(format!(
                    "{what} on {}: {}",
                    config.redacted_url(),
                    config.scrub(&e.to_string())
                ))
            };
            let channel = connection
                .create_channel()
                .await
                .map_err(|e| unavailable("opening a channel", e))?;
            channel
                .basic_qos(self.settings.prefetch, BasicQosOptions::default())
                .await
                .map_err(|e| unavailable("setting the prefetch", e))?;
            let marker = match (&self.marker, self.shared.standby) {
                (Some(marker), false) => Some(
                    announce_owner(&channel, marker)
                        .await
                        .map_err(|e| unavailable("announcing the partition's owner", e))?,
                ),
                _ => None,
            };
            let tag = format!("{}-{}", self.settings.consumer_name, MessageId::new());
            let tag = ShortString::try_new(tag.chars().take(200).collect::<String>())
                .unwrap_or_else(|_| ShortString::from("outbox-rs"));
            let consumer = channel
                .basic_consume(
                    ShortString::from(queue.as_str()),
                    tag,
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    let not_found = matches!(
                        e.kind(),
                        lapin::ErrorKind::ProtocolError(a)
                            if *a.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
                    );
                    if not_found {
                        Error::new(
                            outbox_api::ErrorKind::NotFound,
                            format!(
                                "queue `{queue}` does not exist on {}",
                                config.redacted_url()
                            ),
                        )
                    } else {
                        Error::unavailable(format!(
                            "consuming queue `{queue}` on {}: {}",
                            config.redacted_url(),
                            config.scrub(&e.to_string())
                        ))
                    }
                })?;
            Ok(Session {
                connection,
                channel,
                consumer,
                _marker: marker,
            })
        };
        config.within_connect_timeout(attempt).await
    }

    pub(super) async fn run(mut self, first: Option<Session>, mut shutdown: watch::Receiver<bool>) {
        let mut session = first;
        let mut failures = 0u32;
        let mut opened_before = session.is_some();
        loop {
            if *shutdown.borrow() {
                break;
            }
            if session.is_none() && self.shared.standby && !self.await_no_owner(&mut shutdown).await
            {
                break;
            }
            let current = match session.take() {
                Some(s) => s,
                None => match self.open_session().await {
                    Ok(s) => {
                        failures = 0;
                        if self.shared.standby {
                            bump(&self.shared.counters.takeovers);
                            tracing::info!(queue = %self.shared.queue, "no other consumer on this partition; taking it over");
                        } else if opened_before {
                            bump(&self.shared.counters.reconnects);
                            tracing::info!(queue = %self.shared.queue, "reconnected to RabbitMQ; consuming again");
                        }
                        opened_before = true;
                        s
                    }
                    Err(e) => {
                        failures = failures.saturating_add(1);
                        let config = &self.settings.config;
                        let delay = backoff(config.reconnect_min, config.reconnect_max, failures);
                        tracing::warn!(
                            error = %e,
                            queue = %self.shared.queue,
                            failures,
                            retry_in_ms = delay.as_millis() as u64,
                            "consumer cannot reach RabbitMQ"
                        );
                        tokio::select! {
                            _ = tokio::time::sleep(delay) => {}
                            _ = shutdown.changed() => {}
                        }
                        continue;
                    }
                },
            };
            self.shared.connected.store(true, Ordering::SeqCst);
            let stopped = self.consume(current, &mut shutdown).await;
            self.shared.connected.store(false, Ordering::SeqCst);
            // Held deliveries belong to the closed channel: the broker
            // requeues every unacknowledged one, in order, and they come
            // back (redelivered) on the next session.
            let held = self.held.len();
            if held > 0 {
                tracing::info!(queue = %self.shared.queue, held, "returning held deliveries to the queue");
            }
            self.held.clear();
            if stopped {
                break;
            }
        }
        self.shared.running.store(false, Ordering::SeqCst);
        tracing::info!(queue = %self.shared.queue, "consumer stopped");
    }

    /// Consumes until shutdown (returns `true`, after closing gracefully)
    /// or until the connection fails (returns `false`).
    async fn consume(&mut self, mut s: Session, shutdown: &mut watch::Receiver<bool>) -> bool {
        let period = if self.shared.standby {
            self.settings.takeover_check.min(Duration::from_millis(500))
        } else {
            Duration::from_millis(500)
        };
        let mut check = tokio::time::interval(period);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.changed() => {
                    self.close(s).await;
                    return true;
                }
                // Before the deliveries: with a steady backlog a later
                // branch of this biased select would never be polled.
                _ = check.tick() => {
                    if !s.connection.status().connected() || !s.channel.status().connected() {
                        tracing::warn!(queue = %self.shared.queue, "RabbitMQ connection lost; reconnecting");
                        return false;
                    }
                    if self.shared.standby && self.owner_present(&s.connection).await == Some(true) {
                        // Closing the channel returns the deliveries not
                        // acknowledged yet to the queue's head, in order,
                        // and the single active consumer that waits gets
                        // them first.
                        bump(&self.shared.counters.handovers);
                        tracing::info!(queue = %self.shared.queue, "the partition's owner is back; handing it over");
                        self.close(s).await;
                        return false;
                    }
                }
                Some(lane) = self.held.due() => {
                    if !self.on_due(lane).await {
                        tracing::warn!(queue = %self.shared.queue, "acknowledging failed; reconnecting");
                        return false;
                    }
                }
                next = s.consumer.next() => match next {
                    Some(Ok(delivery)) => {
                        if !self.on_delivery(delivery).await {
                            tracing::warn!(queue = %self.shared.queue, "acknowledging failed; reconnecting");
                            return false;
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(
                            queue = %self.shared.queue,
                            error = %self.settings.config.scrub(&e.to_string()),
                            "RabbitMQ consumer failed; reconnecting"
                        );
                        return false;
                    }
                    None => {
                        tracing::warn!(queue = %self.shared.queue, "the broker cancelled the consumer; reconnecting");
                        return false;
                    }
                },
            }
        }
    }

    /// Whether the owner of this standby partition is there (its marker
    /// queue has a consumer), looked up on a channel of its own on
    /// `connection`; `None` when it cannot be told.
    async fn owner_present(&self, connection: &Connection) -> Option<bool> {
        let marker = self.marker.as_deref()?;
        let limit = self.settings.config.connect_timeout;
        let channel = timeout(limit, connection.create_channel())
            .await
            .ok()?
            .ok()?;
        let declared = timeout(limit, declare_marker(&channel, marker))
            .await
            .ok()?;
        let _ = timeout(limit, channel.close(200, "checked".into())).await;
        declared.ok().map(|q| q.consumer_count() > 0)
    }

    /// Waits, checking every `takeover_check`, until the owner of this
    /// standby partition is not there; `false` when the consumer stops
    /// first.
    async fn await_no_owner(&self, shutdown: &mut watch::Receiver<bool>) -> bool {
        let config = &self.settings.config;
        let mut probe: Option<Connection> = None;
        let mut failures = 0u32;
        loop {
            if *shutdown.borrow() {
                return false;
            }
            if probe.as_ref().is_none_or(|c| !c.status().connected()) {
                let properties = ConnectionProperties::default()
                    .with_connection_name(LongString::from(config.connection_name.as_bytes()));
                let opened = config
                    .within_connect_timeout(async {
                        Connection::connect_uri(self.uri.clone(), properties)
                            .await
                            .map_err(|e| connect_error(config, &self.uri, &e))
                    })
                    .await;
                probe = opened.ok();
            }
            let wait = match &probe {
                Some(connection) => match self.owner_present(connection).await {
                    Some(false) => {
                        if let Some(c) = probe.take() {
                            let _ = c.close(200, "taking the partition over".into()).await;
                        }
                        return true;
                    }
                    Some(true) => {
                        failures = 0;
                        // ±20 %: standbys of one partition do not all look at once.
                        backoff(
                            self.settings.takeover_check,
                            self.settings.takeover_check,
                            0,
                        )
                    }
                    None => {
                        // A fresh probe connection next time.
                        probe = None;
                        failures = failures.saturating_add(1);
                        backoff(config.reconnect_min, config.reconnect_max, failures)
                    }
                },
                None => {
                    failures = failures.saturating_add(1);
                    backoff(config.reconnect_min, config.reconnect_max, failures)
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    /// Graceful stop: close channel and connection. Closing the channel
    /// cancels the subscription and returns every delivery not acknowledged
    /// in one step; a `basic.cancel` first would let a waiting single
    /// active consumer start on later deliveries before these come back.
    async fn close(&mut self, s: Session) {
        let limit = self.settings.config.connect_timeout;
        if s.channel.status().connected() {
            let _ = timeout(limit, s.channel.close(200, "consumer stopped".into())).await;
        }
        if s.connection.status().connected() {
            let _ = timeout(limit, s.connection.close(200, "consumer stopped".into())).await;
        }
    }
}

/// The name of partition queue `queue`'s owner marker: `<queue>.owner`.
pub(super) fn owner_marker(queue: &str) -> String {
    format!("{queue}.owner")
}

/// How long an owner marker outlives its last use (no consumer, no
/// declare): replicas that still run declare it at every check.
const MARKER_EXPIRES_MS: i32 = 60_000;

/// Declares an owner marker: a classic, non-durable queue that expires
/// [`MARKER_EXPIRES_MS`] after its last use. Owners and standbys declare it
/// alike (a passive declare of a missing queue would close the channel,
/// which the broker logs as an error at every check).
async fn declare_marker(channel: &Channel, marker: &str) -> lapin::Result<lapin::Queue> {
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-queue-type"),
        lapin::types::AMQPValue::LongString(LongString::from("classic")),
    );
    arguments.insert(
        ShortString::from("x-expires"),
        lapin::types::AMQPValue::LongInt(MARKER_EXPIRES_MS),
    );
    channel
        .queue_declare(
            ShortString::from(marker),
            QueueDeclareOptions {
                durable: false,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await
}

/// Declares the owner marker and consumes it on `channel`: while this
/// channel lives, standby replicas see the partition's owner there. Nothing
/// is published to it; anything that is gets dropped (no acknowledgement).
async fn announce_owner(channel: &Channel, marker: &str) -> lapin::Result<lapin::Consumer> {
    declare_marker(channel, marker).await?;
    channel
        .basic_consume(
            ShortString::from(marker),
            ShortString::from("outbox-rs-owner"),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
}
