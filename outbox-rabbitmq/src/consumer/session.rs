//! The connection and the consume loop: connect, consume, reconnect with
//! backoff, close on shutdown.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{Channel, Connection, ConnectionProperties};
use outbox_api::{Error, MessageId, Result};
use tokio::sync::watch;
use tokio::time::{Instant, timeout};

use super::RabbitConsumerBuilder;
use super::handle::{Shared, bump};
use super::inbox::Inbox;
use super::order::Held;
use crate::transport::{backoff, connect_error};

/// An open connection consuming the queue.
pub(super) struct Session {
    pub(super) connection: Connection,
    pub(super) channel: Channel,
    pub(super) consumer: lapin::Consumer,
}

/// Entries of the in-process attempt counter kept at most (oldest dropped).
pub(super) const MAX_TRACKED_ATTEMPTS: usize = 10_000;

pub(super) struct Worker {
    pub(super) settings: RabbitConsumerBuilder,
    pub(super) uri: AMQPUri,
    /// The inbox (and the application's handler on its connection).
    pub(super) inbox: Inbox,
    /// Handler failures so far, by message id, with when the last one happened.
    pub(super) attempts: HashMap<MessageId, (u32, Instant)>,
    pub(super) shared: Arc<Shared>,
    /// Deliveries held for a retry in place, and the later ones of their keys.
    pub(super) held: Held,
    /// Set when the consumer is to stop.
    pub(super) stop: watch::Receiver<bool>,
}

impl Worker {
    pub(super) async fn open_session(&self) -> Result<Session> {
        let config = &self.settings.config;
        let queue = &self.settings.queue;
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
            })
        };
        config.within_connect_timeout(attempt).await
    }

    pub(super) async fn run(mut self, first: Session, mut shutdown: watch::Receiver<bool>) {
        let mut session = Some(first);
        let mut failures = 0u32;
        loop {
            if *shutdown.borrow() {
                break;
            }
            let current = match session.take() {
                Some(s) => s,
                None => match self.open_session().await {
                    Ok(s) => {
                        failures = 0;
                        bump(&self.shared.counters.reconnects);
                        tracing::info!(queue = %self.shared.queue, "reconnected to RabbitMQ; consuming again");
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
        let mut check = tokio::time::interval(Duration::from_millis(500));
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.changed() => {
                    self.close(s).await;
                    return true;
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
                _ = check.tick() => {
                    if !s.connection.status().connected() || !s.channel.status().connected() {
                        tracing::warn!(queue = %self.shared.queue, "RabbitMQ connection lost; reconnecting");
                        return false;
                    }
                }
            }
        }
    }

    /// Graceful stop: cancel the consumer, close channel and connection.
    async fn close(&mut self, s: Session) {
        let limit = self.settings.config.connect_timeout;
        if s.channel.status().connected() {
            let _ = timeout(
                limit,
                s.channel
                    .basic_cancel(s.consumer.tag(), BasicCancelOptions::default()),
            )
            .await;
            let _ = timeout(limit, s.channel.close(200, "consumer stopped".into())).await;
        }
        if s.connection.status().connected() {
            let _ = timeout(limit, s.connection.close(200, "consumer stopped".into())).await;
        }
    }
}
