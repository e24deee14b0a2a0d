//! The connection and its confirm channel: (re)connecting with backoff,
//! reopening a channel the broker closed, checking exchanges.

use outbox_api::receive::backoff;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::{FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox_api::{Error, ErrorKind, Result};
use tokio::sync::watch;
use tokio::time::{Instant, timeout};

use super::Inner;
use super::confirms::Confirms;
use crate::config::RabbitConfig;

/// What the transport's lock guards.
#[derive(Default)]
pub(super) struct State {
    pub(super) link: Option<Link>,
    pub(super) failures: u32,
    retry_at: Option<Instant>,
    last_error: Option<String>,
    /// Connections made so far; numbers each [`Link`].
    connections: u64,
}

/// A live connection and its confirm channel.
pub(super) struct Link {
    pub(super) connection: Arc<Connection>,
    /// Which connection of this transport this is (see [`Publisher::link`]).
    pub(super) number: u64,
    /// `None` until first used; replaced when the broker closed it.
    channel: Option<ConfirmChannel>,
    /// Exchanges known to exist on this connection.
    pub(super) checked_exchanges: HashSet<String>,
    /// Dropped with the link: the confirm observers give up what is in flight.
    dropped: watch::Sender<()>,
}

/// A confirm-mode channel and the observer of its confirms.
struct ConfirmChannel {
    channel: Channel,
    confirms: Arc<Confirms>,
}

impl Drop for ConfirmChannel {
    fn drop(&mut self) {
        self.confirms.retire();
    }
}

/// What a send publishes with: the confirm channel and its observer, and
/// which connection they belong to.
#[derive(Clone)]
pub(super) struct Publisher {
    pub(super) channel: Channel,
    pub(super) confirms: Arc<Confirms>,
    pub(super) connection: Arc<Connection>,
    /// The [`Link::number`], so that a late failure report does not drop a
    /// newer connection.
    pub(super) link: u64,
}

impl Link {
    fn publisher(&self) -> Option<Publisher> {
        let c = self.channel.as_ref()?;
        Some(Publisher {
            channel: c.channel.clone(),
            confirms: Arc::clone(&c.confirms),
            connection: Arc::clone(&self.connection),
            link: self.number,
        })
    }
}

impl Inner {
    /// Makes sure a connection and a confirm channel are open. With
    /// `respect_backoff`, does not try to reconnect before the backoff delay
    /// after a failed attempt has passed.
    pub(super) async fn ensure(
        &self,
        state: &mut State,
        respect_backoff: bool,
    ) -> Result<Publisher> {
        let config = &self.config;
        if let Some(link) = state.link.as_mut() {
            if link.connection.status().connected() {
                if let Some(c) = &link.channel {
                    if c.channel.status().connected() {
                        if let Some(p) = link.publisher() {
                            return Ok(p);
                        }
                    }
                }
                match timeout(
                    config.connect_timeout,
                    open_confirm_channel(&link.connection),
                )
                .await
                {
                    Ok(Ok(channel)) => {
                        link.channel = Some(ConfirmChannel {
                            channel,
                            confirms: Confirms::start(link.dropped.subscribe()),
                        });
                        if let Some(p) = link.publisher() {
                            return Ok(p);
                        }
                    }
                    Ok(Err(e)) => tracing::warn!(
                        error = %self.scrub(&e),
                        "reopening the RabbitMQ confirm channel failed; reconnecting"
                    ),
                    Err(_) => tracing::warn!(
                        "reopening the RabbitMQ confirm channel timed out; reconnecting"
                    ),
                }
            }
            state.link = None;
        }
        if respect_backoff {
            if let Some(at) = state.retry_at {
                let now = Instant::now();
                if now < at {
                    return Err(Error::unavailable(format!(
                        "{}; next reconnect attempt in {} ms",
                        state
                            .last_error
                            .as_deref()
                            .unwrap_or("RabbitMQ is unavailable"),
                        (at - now).as_millis()
                    )));
                }
            }
        }
        state.connections += 1;
        match self.open_link(state.connections).await {
            Ok(link) => {
                let publisher = link.publisher();
                state.link = Some(link);
                state.failures = 0;
                state.retry_at = None;
                state.last_error = None;
                tracing::info!(url = %config.redacted_url(), "connected to RabbitMQ");
                publisher.ok_or_else(|| Error::unavailable("no channel"))
            }
            Err(e) => {
                state.failures = state.failures.saturating_add(1);
                let delay = backoff(config.reconnect_min, config.reconnect_max, state.failures);
                state.retry_at = Some(Instant::now() + delay);
                state.last_error = Some(e.message().to_owned());
                tracing::warn!(
                    error = %e,
                    failures = state.failures,
                    retry_in_ms = delay.as_millis() as u64,
                    "connecting to RabbitMQ failed"
                );
                Err(e)
            }
        }
    }

    /// Drops connection number `link` (if it is still the current one): the
    /// next send or probe reconnects. Everything still in flight on it is
    /// given up.
    pub(super) fn drop_link(&self, state: &mut State, link: u64, reason: &str) {
        if state.link.as_ref().is_some_and(|l| l.number == link) {
            tracing::warn!(%reason, "RabbitMQ connection failed; dropping it");
            state.link = None;
        }
    }

    async fn open_link(&self, number: u64) -> Result<Link> {
        let config = &self.config;
        let properties = ConnectionProperties::default()
            .with_connection_name(LongString::from(config.connection_name.as_bytes()));
        let attempt = async {
            let connection = Connection::connect_uri(self.uri.clone(), properties)
                .await
                .map_err(|e| connect_error(config, &self.uri, &e))?;
            let channel = open_confirm_channel(&connection).await.map_err(|e| {
                Error::unavailable(format!(
                    "opening a confirm channel on {}: {}",
                    config.redacted_url(),
                    self.scrub(&e)
                ))
            })?;
            let (dropped, watching) = watch::channel(());
            Ok(Link {
                connection: Arc::new(connection),
                number,
                channel: Some(ConfirmChannel {
                    channel,
                    confirms: Confirms::start(watching),
                }),
                checked_exchanges: HashSet::new(),
                dropped,
            })
        };
        config.within_connect_timeout(attempt).await
    }

    /// Checks (passively declares) each not yet verified exchange on a
    /// throw-away channel; returns the missing ones with the broker's
    /// words. `Err` when the connection itself failed.
    pub(super) async fn check_exchanges(
        &self,
        link: &mut Link,
        names: Vec<String>,
    ) -> std::result::Result<HashMap<String, String>, String> {
        let limit = self.config.connect_timeout;
        let mut missing = HashMap::new();
        let mut channel: Option<Channel> = None;
        for name in names {
            let ch = match &channel {
                Some(ch) => ch.clone(),
                None => {
                    let ch = timeout(limit, link.connection.create_channel())
                        .await
                        .map_err(|_| "opening a channel timed out".to_owned())?
                        .map_err(|e| format!("opening a channel: {}", self.scrub(&e)))?;
                    channel = Some(ch.clone());
                    ch
                }
            };
            let declared = timeout(
                limit,
                ch.exchange_declare(
                    ShortString::from(name.as_str()),
                    ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                ),
            )
            .await
            .map_err(|_| format!("checking exchange `{name}` timed out"))?;
            match declared {
                Ok(()) => {
                    link.checked_exchanges.insert(name);
                }
                Err(e) => {
                    // The broker closed this channel; use a new one next.
                    channel = None;
                    if matches!(e.kind(), lapin::ErrorKind::ProtocolError(a) if *a.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
                    {
                        missing.insert(name, self.scrub(&e));
                    } else if !e.is_amqp_soft_error() {
                        return Err(format!("checking exchange `{name}`: {}", self.scrub(&e)));
                    }
                    // Other channel-level refusals: let the publish decide.
                }
            }
        }
        if let Some(ch) = channel {
            if ch.status().connected() {
                let _ = timeout(limit, ch.close(200, "exchanges checked".into())).await;
            }
        }
        Ok(missing)
    }
}

/// Opens a channel in confirm mode.
pub(super) async fn open_confirm_channel(connection: &Connection) -> lapin::Result<Channel> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// The error for a failed connection attempt: `Config` for refused
/// credentials or vhost (naming the user, never the password), otherwise
/// `Unavailable` with the redacted URL.
pub(crate) fn connect_error(config: &RabbitConfig, uri: &AMQPUri, e: &lapin::Error) -> Error {
    let user = &uri.authority.userinfo.username;
    let host = format!("{}:{}", uri.authority.host, uri.authority.port);
    let text = config.scrub(&e.to_string());
    if let lapin::ErrorKind::ProtocolError(amqp) = e.kind() {
        match amqp.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
            | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
                if !text.contains("vhost") =>
            {
                return Error::new(
                    ErrorKind::Config,
                    format!(
                        "authentication failed for user `{user}` at {host} (vhost `{}`): {text}",
                        uri.vhost
                    ),
                );
            }
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
            | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED) => {
                return Error::new(
                    ErrorKind::Config,
                    format!(
                        "user `{user}` may not use vhost `{}` at {host}: {text}",
                        uri.vhost
                    ),
                );
            }
            _ => {}
        }
    }
    Error::unavailable(format!(
        "cannot connect to RabbitMQ at {}: {text}",
        config.redacted_url()
    ))
}
