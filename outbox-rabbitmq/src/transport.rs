//! [`RabbitTransport`]: publishing with publisher confirms.

mod classify;
mod confirms;
mod link;
mod publish;

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use lapin::uri::AMQPUri;
use outbox_api::{Error, Message, Outcome, Result, Transport};
use tokio::sync::Mutex;
use tokio::time::timeout;

use crate::config::RabbitConfig;
use crate::topology::Topology;
use link::State;
pub(crate) use link::connect_error;

/// The AMQP header carrying the message's ordering key.
pub const KEY_HEADER: &str = "x-outbox-key";
/// The AMQP header carrying the W3C `traceparent` of the enqueuing span.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// A [`Transport`] publishing to RabbitMQ over one connection and one
/// confirm-mode channel.
///
/// Every message is published persistent (`delivery_mode` 2) with
/// `mandatory = true`. Outcomes:
///
/// | broker says | outcome |
/// |---|---|
/// | ack | `Delivered` |
/// | ack with the message returned (no queue bound) | `Rejected("unroutable: …")` |
/// | nack | `Rejected` |
/// | the destination exchange does not exist | `Rejected` naming the exchange |
/// | closes the channel because of the message (access refused, e.g. an `internal` exchange; too large; any channel-level error) | `Rejected` with the broker's words; the other messages in flight are sent again |
/// | headers or names that AMQP cannot encode, headers larger than a frame | `Rejected` (not published) |
/// | connection lost, connection-level error, no confirm within the timeout | `Unavailable` |
///
/// `send` may be called concurrently (clones share the connection): the
/// lock is held only to (re)connect, check exchanges and publish one call's
/// messages, in order; confirms are awaited outside it, so one call
/// publishes while others await their confirms. A returned message is
/// matched to its call by message id, whichever confirm lapin hands it to.
///
/// When the broker closes the channel, every message unconfirmed on it is a
/// suspect. Those the broker's words name (the exchange, the size) are
/// `Rejected`; the others are published again on a new channel. When the
/// words name none, the suspects are sent one at a time on a channel of
/// their own, each awaiting its confirm, so the culprit is found.
///
/// After an `Unavailable` the connection is dropped and rebuilt on the next
/// `send` or `probe`, with exponential backoff (lapin's own auto-recovery is
/// not used).
#[derive(Clone)]
pub struct RabbitTransport {
    inner: Arc<Inner>,
}

struct Inner {
    config: RabbitConfig,
    uri: AMQPUri,
    state: Mutex<State>,
}

impl Inner {
    fn scrub(&self, e: &impl fmt::Display) -> String {
        self.config.scrub(&e.to_string())
    }
}

impl RabbitTransport {
    /// A configuration for the broker at `url`, to adjust with the
    /// `with_*` methods and finish with [`build`](RabbitConfig::build).
    pub fn builder(url: impl Into<String>) -> RabbitConfig {
        RabbitConfig::new(url)
    }

    /// Checks `config`, connects and opens a confirm channel. Fails with a
    /// clear error (password redacted) if the URL is malformed
    /// (`ErrorKind::Config`), the credentials are refused
    /// (`ErrorKind::Config`, "authentication failed for user …") or the
    /// broker cannot be reached (`ErrorKind::Unavailable`).
    pub async fn connect(config: RabbitConfig) -> Result<Self> {
        let transport = Self::lazy(config)?;
        {
            let mut state = transport.inner.state.lock().await;
            transport.inner.ensure(&mut state, false).await?;
        }
        Ok(transport)
    }

    pub(crate) fn lazy(config: RabbitConfig) -> Result<Self> {
        config.validate()?;
        let uri = config.parse_url()?;
        Ok(RabbitTransport {
            inner: Arc::new(Inner {
                config,
                uri,
                state: Mutex::new(State::default()),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RabbitConfig {
        &self.inner.config
    }

    /// Declares `topology` (durable exchanges, queues, bindings) on a
    /// channel of its own, connecting first if needed.
    pub async fn declare(&self, topology: &Topology) -> Result<()> {
        let connection = {
            let mut state = self.inner.state.lock().await;
            self.inner.ensure(&mut state, false).await?.connection
        };
        let channel = connection.create_channel().await.map_err(|e| {
            Error::unavailable(format!(
                "opening a channel to declare the topology: {}",
                self.inner.scrub(&e)
            ))
        })?;
        let result = topology.declare_on(&channel).await;
        if channel.status().connected() {
            let _ = channel.close(200, "topology declared".into()).await;
        }
        result
    }

    /// Closes the connection gracefully. The next `send` or `probe`
    /// reconnects.
    pub async fn close(&self) {
        let link = self.inner.state.lock().await.link.take();
        if let Some(link) = link {
            if link.connection.status().connected() {
                let _ = timeout(
                    self.inner.config.connect_timeout,
                    link.connection.close(200, "closed by outbox-rs".into()),
                )
                .await;
            }
        }
    }
}

#[async_trait]
impl Transport for RabbitTransport {
    async fn send(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        self.inner.send(batch).await
    }

    async fn probe(&self) -> Result<()> {
        let mut state = self.inner.state.lock().await;
        self.inner.ensure(&mut state, false).await.map(|_| ())
    }
}

impl fmt::Debug for RabbitTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("RabbitTransport");
        d.field("config", &self.inner.config);
        if let Ok(state) = self.inner.state.try_lock() {
            d.field(
                "connected",
                &state
                    .link
                    .as_ref()
                    .is_some_and(|l| l.connection.status().connected()),
            )
            .field("failures", &state.failures);
        }
        d.finish_non_exhaustive()
    }
}
