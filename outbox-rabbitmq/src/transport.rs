//! [`RabbitTransport`]: publishing with publisher confirms.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
    PublisherConfirm,
};
use outbox_api::{Error, ErrorKind, Message, Outcome, Result, Transport};
use tokio::sync::Mutex;
use tokio::time::{Instant, timeout, timeout_at};

use crate::config::{MAX_SHORT_STRING, RabbitConfig};
use crate::topology::Topology;

/// The AMQP header carrying the message's ordering key.
pub const KEY_HEADER: &str = "x-outbox-key";
/// The AMQP header carrying the W3C `traceparent` of the enqueuing span.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// AMQP `delivery_mode` of a persistent message.
const PERSISTENT: u8 = 2;

/// A [`Transport`] publishing to RabbitMQ over one connection and one
/// confirm-mode channel.
///
/// Every message is published persistent (`delivery_mode` 2) with
/// `mandatory = true`; a batch is published in full, then all confirms are
/// awaited (pipelined). Outcomes:
///
/// | broker says | outcome |
/// |---|---|
/// | ack | `Delivered` |
/// | ack with the message returned (no queue bound) | `Rejected("unroutable: …")` |
/// | nack | `Rejected` |
/// | the destination exchange does not exist | `Rejected` naming the exchange |
/// | headers or names that AMQP cannot encode, headers larger than a frame | `Rejected` (not published) |
/// | connection or channel lost, publish error, no confirm within the timeout | `Unavailable` |
///
/// After an `Unavailable` the connection is dropped and rebuilt on the next
/// `send` or `probe`, with exponential backoff (lapin's own auto-recovery is
/// not used). Batches are sent one at a time (a `send` waits for the
/// previous one's confirms); clones share the connection.
#[derive(Clone)]
pub struct RabbitTransport {
    inner: Arc<Inner>,
}

struct Inner {
    config: RabbitConfig,
    uri: AMQPUri,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    link: Option<Link>,
    failures: u32,
    retry_at: Option<Instant>,
    last_error: Option<String>,
}

/// A live connection and its confirm channel.
struct Link {
    connection: Arc<Connection>,
    /// `None` after the broker closed it; reopened on the next use.
    channel: Option<Channel>,
    /// Exchanges known to exist on this connection.
    checked_exchanges: HashSet<String>,
}

/// A message ready to publish.
struct Prepared {
    exchange: String,
    routing_key: String,
    properties: BasicProperties,
    header_bytes: usize,
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
            transport.ensure(&mut state, false).await?;
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
            self.ensure(&mut state, false).await?;
            match &state.link {
                Some(link) => Arc::clone(&link.connection),
                None => return Err(Error::unavailable("not connected to RabbitMQ")),
            }
        };
        let channel = connection.create_channel().await.map_err(|e| {
            Error::unavailable(format!(
                "opening a channel to declare the topology: {}",
                self.scrub(&e)
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

    fn scrub(&self, e: &impl fmt::Display) -> String {
        self.inner.config.scrub(&e.to_string())
    }

    /// Makes sure a connection and a confirm channel are open; returns the
    /// channel. With `respect_backoff`, does not try to reconnect before
    /// the backoff delay after a failed attempt has passed.
    async fn ensure(&self, state: &mut State, respect_backoff: bool) -> Result<Channel> {
        let config = &self.inner.config;
        if let Some(link) = state.link.as_mut() {
            if link.connection.status().connected() {
                if let Some(channel) = &link.channel {
                    if channel.status().connected() {
                        return Ok(channel.clone());
                    }
                }
                match timeout(
                    config.connect_timeout,
                    open_confirm_channel(&link.connection),
                )
                .await
                {
                    Ok(Ok(channel)) => {
                        link.channel = Some(channel.clone());
                        return Ok(channel);
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
        match self.open_link().await {
            Ok(link) => {
                let channel = link.channel.clone();
                state.link = Some(link);
                state.failures = 0;
                state.retry_at = None;
                state.last_error = None;
                tracing::info!(url = %config.redacted_url(), "connected to RabbitMQ");
                channel.ok_or_else(|| Error::unavailable("no channel"))
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

    async fn open_link(&self) -> Result<Link> {
        let config = &self.inner.config;
        let properties = ConnectionProperties::default()
            .with_connection_name(LongString::from(config.connection_name.as_bytes()));
        let attempt = async {
            let connection = Connection::connect_uri(self.inner.uri.clone(), properties)
                .await
                .map_err(|e| self.connect_error(&e))?;
            let channel = open_confirm_channel(&connection).await.map_err(|e| {
                Error::unavailable(format!(
                    "opening a confirm channel on {}: {}",
                    config.redacted_url(),
                    self.scrub(&e)
                ))
            })?;
            Ok(Link {
                connection: Arc::new(connection),
                channel: Some(channel),
                checked_exchanges: HashSet::new(),
            })
        };
        timeout(config.connect_timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(Error::unavailable(format!(
                    "connecting to RabbitMQ at {} timed out after {:?}",
                    config.redacted_url(),
                    config.connect_timeout
                )))
            })
    }

    fn connect_error(&self, e: &lapin::Error) -> Error {
        connect_error(&self.inner.config, &self.inner.uri, e)
    }

    /// Resolves the destination and encodes the properties; `Err` is the
    /// reason the message is rejected without being published.
    fn prepare(&self, m: &Message) -> std::result::Result<Prepared, String> {
        let config = &self.inner.config;
        let (exchange, routing_key) = match &m.destination {
            Some(d) => (d.exchange.clone(), d.routing_key.clone()),
            None => (
                config.default_exchange.clone(),
                config
                    .routing_key
                    .clone()
                    .unwrap_or_else(|| m.message_type.clone()),
            ),
        };
        check_short("exchange name", &exchange)?;
        check_short("routing key", &routing_key)?;
        let mut headers = FieldTable::default();
        let mut header_bytes = 4;
        let mut add = |name: &str, value: &str| -> std::result::Result<(), String> {
            let key = ShortString::try_new(name).map_err(|_| {
                format!(
                    "header name `{}…` is {} bytes long; AMQP allows at most {MAX_SHORT_STRING}",
                    name.chars().take(40).collect::<String>(),
                    name.len()
                )
            })?;
            header_bytes += 1 + name.len() + 1 + 4 + value.len();
            headers.insert(
                key,
                AMQPValue::LongString(LongString::from(value.as_bytes())),
            );
            Ok(())
        };
        for (name, value) in &m.headers {
            add(name, value)?;
        }
        if let Some(tp) = &m.trace_parent {
            add(TRACEPARENT_HEADER, tp)?;
        }
        if let Some(key) = &m.key {
            add(KEY_HEADER, key)?;
        }
        let message_type = short("message type", &m.message_type)?;
        let content_type = short("content type", &m.content_type)?;
        let timestamp = u64::try_from(m.created_at.as_millis().div_euclid(1000)).unwrap_or(0);
        let header_bytes = header_bytes
            + 14 // class, weight, body size, flags
            + 1 + m.content_type.len()
            + 1 + 36 // message id
            + 1 + m.message_type.len()
            + 8 + 1; // timestamp, delivery mode
        let properties = BasicProperties::default()
            .with_message_id(ShortString::from(m.id.to_string()))
            .with_type(message_type)
            .with_content_type(content_type)
            .with_timestamp(timestamp)
            .with_delivery_mode(PERSISTENT)
            .with_headers(headers);
        Ok(Prepared {
            exchange,
            routing_key,
            properties,
            header_bytes,
        })
    }

    /// Checks (passively declares) each not yet verified exchange on a
    /// throw-away channel; returns the missing ones with the broker's
    /// words. `Err` when the connection itself failed.
    async fn check_exchanges(
        &self,
        link: &mut Link,
        names: Vec<String>,
    ) -> std::result::Result<HashMap<String, String>, String> {
        let limit = self.inner.config.connect_timeout;
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
                    if is_soft(&e, AMQPSoftError::NOTFOUND) {
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

    async fn send_batch(&self, state: &mut State, batch: &[Message]) -> Vec<Outcome> {
        let config = &self.inner.config;
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        let mut prepared: Vec<Option<Prepared>> = Vec::with_capacity(batch.len());
        for (i, m) in batch.iter().enumerate() {
            match self.prepare(m) {
                Ok(p) => prepared.push(Some(p)),
                Err(reason) => {
                    outcomes[i] = Some(Outcome::Rejected(reason));
                    prepared.push(None);
                }
            }
        }
        let unavailable = |outcomes: Vec<Option<Outcome>>, reason: &str| -> Vec<Outcome> {
            outcomes
                .into_iter()
                .map(|o| o.unwrap_or_else(|| Outcome::Unavailable(reason.to_owned())))
                .collect()
        };

        let channel = match self.ensure(state, true).await {
            Ok(channel) => channel,
            Err(e) => {
                return unavailable(
                    outcomes,
                    &format!("RabbitMQ is unavailable: {}", e.message()),
                );
            }
        };
        let Some(link) = state.link.as_mut() else {
            return unavailable(outcomes, "RabbitMQ is unavailable: not connected");
        };

        // Headers that do not fit in one frame would make the broker close the connection.
        let frame_max = link.connection.configuration().frame_max() as usize;
        if frame_max > 0 {
            for (i, p) in prepared.iter_mut().enumerate() {
                if p.as_ref().is_some_and(|p| p.header_bytes + 8 > frame_max) {
                    let bytes = p.take().map_or(0, |p| p.header_bytes);
                    outcomes[i] = Some(Outcome::Rejected(format!(
                        "headers and properties take about {bytes} bytes; they must fit in one AMQP frame ({frame_max} bytes)"
                    )));
                }
            }
        }

        // Exchanges not yet known to exist: check them without disturbing the confirm channel.
        let mut to_check: Vec<String> = Vec::new();
        for p in prepared.iter().flatten() {
            if !p.exchange.is_empty()
                && !link.checked_exchanges.contains(&p.exchange)
                && !to_check.contains(&p.exchange)
            {
                to_check.push(p.exchange.clone());
            }
        }
        if !to_check.is_empty() {
            match self.check_exchanges(link, to_check).await {
                Ok(missing) => {
                    for (i, p) in prepared.iter_mut().enumerate() {
                        let hit = p.as_ref().and_then(|p| {
                            missing
                                .get(&p.exchange)
                                .map(|why| (p.exchange.clone(), why.clone()))
                        });
                        if let Some((exchange, why)) = hit {
                            *p = None;
                            outcomes[i] = Some(Outcome::Rejected(format!(
                                "exchange `{exchange}` does not exist: {why}"
                            )));
                        }
                    }
                }
                Err(reason) => {
                    tracing::warn!(%reason, "RabbitMQ connection failed; dropping it");
                    state.link = None;
                    return unavailable(outcomes, &format!("RabbitMQ is unavailable: {reason}"));
                }
            }
        }

        // Publish everything, then await the confirms.
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let mut pending: Vec<(usize, PublisherConfirm)> = Vec::with_capacity(batch.len());
        let mut errors: Vec<lapin::Error> = Vec::new();
        let mut failure: Option<String> = None;
        let mut drop_connection = false;
        for (i, slot) in prepared.iter_mut().enumerate() {
            let Some(p) = slot.as_mut() else { continue };
            let publish = channel.basic_publish(
                ShortString::from(p.exchange.as_str()),
                ShortString::from(p.routing_key.as_str()),
                options,
                &batch[i].payload,
                std::mem::take(&mut p.properties),
            );
            match timeout(config.confirm_timeout, publish).await {
                Ok(Ok(confirm)) => pending.push((i, confirm)),
                Ok(Err(e)) => {
                    failure = Some(format!("publishing failed: {}", self.scrub(&e)));
                    errors.push(e);
                    break;
                }
                Err(_) => {
                    failure = Some(format!(
                        "publishing did not complete within {:?}",
                        config.confirm_timeout
                    ));
                    drop_connection = true;
                    break;
                }
            }
        }

        let deadline = Instant::now() + config.confirm_timeout;
        let mut returned: Vec<(String, String, String, String)> = Vec::new();
        for (i, confirm) in pending {
            match timeout_at(deadline, confirm).await {
                Ok(Ok(Confirmation::Ack(ret))) => {
                    outcomes[i] = Some(Outcome::Delivered);
                    returned.extend(ret.map(describe_return));
                }
                Ok(Ok(Confirmation::Nack(ret))) => {
                    let p = prepared[i].as_ref();
                    outcomes[i] = Some(Outcome::Rejected(format!(
                        "the broker refused (nack) the message published to exchange `{}` with routing key `{}`",
                        p.map_or("", |p| p.exchange.as_str()),
                        p.map_or("", |p| p.routing_key.as_str()),
                    )));
                    returned.extend(ret.map(describe_return));
                }
                Ok(Ok(Confirmation::NotRequested)) => {
                    failure.get_or_insert_with(|| "the channel is not in confirm mode".to_owned());
                }
                Ok(Err(e)) => {
                    failure
                        .get_or_insert_with(|| format!("no publisher confirm: {}", self.scrub(&e)));
                    errors.push(e);
                }
                Err(_) => {
                    failure.get_or_insert_with(|| {
                        format!("no publisher confirm within {:?}", config.confirm_timeout)
                    });
                    drop_connection = true;
                }
            }
        }

        // Returned (unroutable) messages, matched by message id: lapin hands a
        // returned message to whichever confirm completes next.
        if !returned.is_empty() {
            let index: HashMap<String, usize> = batch
                .iter()
                .enumerate()
                .map(|(i, m)| (m.id.to_string(), i))
                .collect();
            for (id, exchange, routing_key, why) in returned {
                match index.get(&id) {
                    Some(&i) => {
                        outcomes[i] = Some(Outcome::Rejected(format!(
                            "unroutable: exchange `{exchange}` routing key `{routing_key}` ({why})"
                        )));
                    }
                    None => {
                        tracing::warn!(message_id = %id, "RabbitMQ returned a message of an earlier batch")
                    }
                }
            }
        }

        // The broker closed the channel because of one message's destination or size.
        let mut channel_closed = false;
        for e in &errors {
            let lapin::ErrorKind::ProtocolError(amqp) = e.kind() else {
                continue;
            };
            if let AMQPErrorKind::Soft(_) = amqp.kind() {
                channel_closed = true;
            }
            if let Some(exchange) = missing_exchange(amqp) {
                failure = Some(format!(
                    "not confirmed: RabbitMQ closed the channel because a message of the same batch was published to the missing exchange `{exchange}`"
                ));
                if let Some(link) = state.link.as_mut() {
                    link.checked_exchanges.remove(&exchange);
                }
                for (i, p) in prepared.iter().enumerate() {
                    if outcomes[i].is_none() && p.as_ref().is_some_and(|p| p.exchange == exchange) {
                        outcomes[i] = Some(Outcome::Rejected(format!(
                            "exchange `{exchange}` does not exist: {}",
                            self.scrub(e)
                        )));
                    }
                }
            }
            if let Some(max) = max_message_size(amqp) {
                for (i, m) in batch.iter().enumerate() {
                    if outcomes[i].is_none() && m.payload.len() > max {
                        outcomes[i] = Some(Outcome::Rejected(format!(
                            "payload of {} bytes is larger than the broker's max message size ({max} bytes)",
                            m.payload.len()
                        )));
                    }
                }
            }
        }

        let reason = failure.unwrap_or_else(|| "no publisher confirm".to_owned());
        if outcomes.iter().any(Option::is_none) {
            let connected = state
                .link
                .as_ref()
                .is_some_and(|l| l.connection.status().connected());
            if channel_closed && connected && !drop_connection {
                tracing::warn!(%reason, "RabbitMQ closed the confirm channel; reopening it");
                if let Some(link) = state.link.as_mut() {
                    link.channel = None;
                }
            } else {
                tracing::warn!(%reason, "RabbitMQ connection failed; dropping it");
                state.link = None;
            }
        } else if channel_closed {
            if let Some(link) = state.link.as_mut() {
                link.channel = None;
            }
        }
        unavailable(outcomes, &format!("RabbitMQ is unavailable: {reason}"))
    }
}

#[async_trait]
impl Transport for RabbitTransport {
    async fn send(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        let mut state = self.inner.state.lock().await;
        self.send_batch(&mut state, batch).await
    }

    async fn probe(&self) -> std::result::Result<(), String> {
        let mut state = self.inner.state.lock().await;
        self.ensure(&mut state, false)
            .await
            .map(|_| ())
            .map_err(|e| e.message().to_owned())
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

async fn open_confirm_channel(connection: &Connection) -> lapin::Result<Channel> {
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

/// `min * 2^(failures-1)`, at most `max`, ±20 % jitter.
pub(crate) fn backoff(min: Duration, max: Duration, failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(20);
    let base = min.saturating_mul(1 << exp).min(max);
    base.mul_f64(0.8 + 0.4 * fastrand::f64())
}

fn check_short(what: &str, value: &str) -> std::result::Result<(), String> {
    if value.len() > MAX_SHORT_STRING {
        Err(format!(
            "{what} `{}…` is {} bytes long; AMQP allows at most {MAX_SHORT_STRING}",
            value.chars().take(40).collect::<String>(),
            value.len()
        ))
    } else {
        Ok(())
    }
}

fn short(what: &str, value: &str) -> std::result::Result<ShortString, String> {
    check_short(what, value)?;
    ShortString::try_new(value).map_err(|e| format!("{what}: {e}"))
}

fn describe_return(r: lapin::message::BasicReturnMessage) -> (String, String, String, String) {
    let id = r
        .delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_owned())
        .unwrap_or_default();
    (
        id,
        r.delivery.exchange.as_str().to_owned(),
        r.delivery.routing_key.as_str().to_owned(),
        format!("{} {}", r.reply_code, r.reply_text),
    )
}

fn is_soft(e: &lapin::Error, soft: AMQPSoftError) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(a) if *a.kind() == AMQPErrorKind::Soft(soft))
}

/// `NOT_FOUND - no exchange 'X' in vhost '/'` → `X`.
fn missing_exchange(e: &AMQPError) -> Option<String> {
    if *e.kind() != AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) {
        return None;
    }
    let text = e.get_message().as_str();
    let rest = &text[text.find("no exchange '")? + "no exchange '".len()..];
    let end = rest.rfind("' in vhost")?;
    Some(rest[..end].to_owned())
}

/// `PRECONDITION_FAILED - message size N is larger than configured max size M` → `M`.
fn max_message_size(e: &AMQPError) -> Option<usize> {
    if *e.kind() != AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) {
        return None;
    }
    let text = e.get_message().as_str();
    let rest = &text[text.find("max size ")? + "max size ".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_broker_errors() {
        let e = AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND),
            "NOT_FOUND - no exchange 'it''s-x' in vhost '/'".into(),
        );
        assert_eq!(missing_exchange(&e).as_deref(), Some("it''s-x"));
        let e = AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED),
            "PRECONDITION_FAILED - message size 2000 is larger than configured max size 1000"
                .into(),
        );
        assert_eq!(max_message_size(&e), Some(1000));
    }

    #[test]
    fn backoff_grows_and_caps() {
        let min = Duration::from_millis(100);
        let max = Duration::from_secs(30);
        let first = backoff(min, max, 1);
        assert!(first >= Duration::from_millis(80) && first <= Duration::from_millis(120));
        let later = backoff(min, max, 4);
        assert!(later >= Duration::from_millis(640) && later <= Duration::from_millis(960));
        assert!(backoff(min, max, 1000) <= Duration::from_secs(36));
    }
}
