//! Sending one batch: encoding it, publishing it in order under the lock,
//! settling it outside, and — when the broker closes the channel — finding
//! the message that caused it.

use crate::Partitions;
use lapin::options::BasicPublishOptions;
use lapin::protocol::AMQPError;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};
use outbox_api::{Message, Outcome};
use tokio::time::{Instant, timeout, timeout_at};

use super::classify::{Culprit, Failure, Returned, refusal};
use super::confirms::{Publishing, Settled};
use super::link::open_confirm_channel;
use super::{Inner, KEY_HEADER, TRACEPARENT_HEADER};
use crate::config::MAX_SHORT_STRING;

/// AMQP `delivery_mode` of a persistent message.
const PERSISTENT: u8 = 2;

/// Every publish is mandatory: an unroutable message comes back.
const MANDATORY: BasicPublishOptions = BasicPublishOptions {
    mandatory: true,
    immediate: false,
};

/// How many times the messages left unconfirmed by a channel the broker
/// closed are published again together (the culprit named by the broker's
/// words taken out) before they are tried one at a time.
const PIPELINED_RETRIES: usize = 3;

/// A message ready to publish.
struct Prepared {
    exchange: String,
    routing_key: String,
    properties: BasicProperties,
    header_bytes: usize,
}

/// What one round of publishing left unsettled.
#[derive(Default)]
struct Round {
    /// Unconfirmed when the broker closed the channel, or not sent because
    /// it was closed: to send again.
    suspects: Vec<usize>,
    /// The broker's reasons for closing the channel.
    refusals: Vec<AMQPError>,
}

impl Inner {
    /// Sends a batch: one outcome per message, in order.
    pub(super) async fn send(&self, batch: &[Message]) -> Vec<Outcome> {
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
        let mut todo: Vec<usize> = (0..batch.len())
            .filter(|&i| prepared[i].is_some())
            .collect();
        let mut forget: Vec<String> = Vec::new();
        let mut retries = 0;
        while !todo.is_empty() {
            let round = self
                .publish_round(batch, &prepared, &todo, &forget, &mut outcomes)
                .await;
            if round.suspects.is_empty() {
                break;
            }
            // The broker's words may name the culprit: an exchange, a size.
            let culprits: Vec<Culprit> = round.refusals.iter().map(Culprit::of).collect();
            for culprit in &culprits {
                tracing::warn!(?culprit, "RabbitMQ closed the confirm channel");
                if let Culprit::Exchange {
                    name,
                    missing: true,
                    ..
                } = culprit
                {
                    forget.push(name.clone());
                }
            }
            for &i in &round.suspects {
                let Some(p) = &prepared[i] else { continue };
                let size = batch[i].payload.len();
                if let Some(why) = culprits.iter().find_map(|c| c.accuses(&p.exchange, size)) {
                    outcomes[i] = Some(Outcome::Rejected(self.config.scrub(&why)));
                }
            }
            let left: Vec<usize> = round
                .suspects
                .into_iter()
                .filter(|&i| outcomes[i].is_none())
                .collect();
            if left.is_empty() {
                break;
            }
            if culprits.contains(&Culprit::Unknown) || retries >= PIPELINED_RETRIES {
                self.one_at_a_time(batch, &prepared, &left, &mut outcomes)
                    .await;
                break;
            }
            retries += 1;
            todo = left;
        }
        outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    Outcome::Unavailable("RabbitMQ is unavailable: not confirmed".to_owned())
                })
            })
            .collect()
    }

    /// Publishes `todo` in order, holding the lock only to connect, check
    /// and publish, then awaits the confirms. Settles `outcomes` except for
    /// the suspects it returns.
    async fn publish_round(
        &self,
        batch: &[Message],
        prepared: &[Option<Prepared>],
        todo: &[usize],
        forget: &[String],
        outcomes: &mut [Option<Outcome>],
    ) -> Round {
        let mut round = Round::default();
        let unavailable = |outcomes: &mut [Option<Outcome>], which: &[usize], reason: &str| {
            for &i in which {
                outcomes[i].get_or_insert_with(|| {
                    Outcome::Unavailable(format!("RabbitMQ is unavailable: {reason}"))
                });
            }
        };

        let mut state = self.state.lock().await;
        let mut publisher = match self.ensure(&mut state, true).await {
            Ok(p) => p,
            Err(e) => {
                unavailable(outcomes, todo, e.message());
                return round;
            }
        };
        let Some(link) = state.link.as_mut() else {
            unavailable(outcomes, todo, "not connected");
            return round;
        };
        for name in forget {
            link.checked_exchanges.remove(name);
        }

        // Headers that do not fit in one frame would make the broker close the connection.
        let frame_max = link.connection.configuration().frame_max() as usize;
        let mut send: Vec<usize> = Vec::with_capacity(todo.len());
        for &i in todo {
            let Some(p) = &prepared[i] else { continue };
            if frame_max > 0 && p.header_bytes + 8 > frame_max {
                outcomes[i] = Some(Outcome::Rejected(format!(
                    "headers and properties take about {} bytes; they must fit in one AMQP frame ({frame_max} bytes)",
                    p.header_bytes
                )));
            } else {
                send.push(i);
            }
        }

        // Exchanges not yet known to exist: check them without disturbing the confirm channel.
        let mut to_check: Vec<String> = Vec::new();
        for &i in &send {
            let Some(p) = &prepared[i] else { continue };
            if !p.exchange.is_empty()
                && !link.checked_exchanges.contains(&p.exchange)
                && !to_check.contains(&p.exchange)
            {
                to_check.push(p.exchange.clone());
            }
        }
        if !to_check.is_empty() {
            match self.check_exchanges(link, to_check).await {
                Ok(missing) => send.retain(|&i| {
                    let Some(p) = &prepared[i] else { return false };
                    match missing.get(&p.exchange) {
                        Some(why) => {
                            outcomes[i] = Some(Outcome::Rejected(format!(
                                "exchange `{}` does not exist: {why}",
                                p.exchange
                            )));
                            false
                        }
                        None => true,
                    }
                }),
                Err(reason) => {
                    self.drop_link(&mut state, publisher.link, &reason);
                    unavailable(outcomes, &send, &reason);
                    return round;
                }
            }
        }

        // Publish in order. Once handed to the channel's observer, a publish
        // no longer depends on this call (a cancelled send leaves it be).
        let mut answers = Vec::with_capacity(send.len());
        let mut reopened = false;
        let mut k = 0;
        while k < send.len() {
            let i = send[k];
            let Some(p) = &prepared[i] else {
                k += 1;
                continue;
            };
            let publish = publishing(&publisher.channel, p, &batch[i].payload);
            let e = match publisher.confirms.publish(batch[i].id.to_string(), publish) {
                Ok(answer) => {
                    answers.push((i, answer));
                    k += 1;
                    continue;
                }
                Err(e) => e,
            };
            let channel_only = !matches!(Failure::of(&e), Failure::Connection)
                && publisher.connection.status().connected();
            if channel_only && k == 0 && !reopened {
                // The broker closed the channel before this round sent anything.
                reopened = true;
                match self.ensure(&mut state, true).await {
                    Ok(p) => publisher = p,
                    Err(e) => {
                        unavailable(outcomes, &send, e.message());
                        return round;
                    }
                }
            } else if channel_only {
                round.suspects.extend_from_slice(&send[k..]);
                break;
            } else {
                let reason = format!("publishing failed: {}", self.scrub(&e));
                self.drop_link(&mut state, publisher.link, &reason);
                unavailable(outcomes, &send[k..], &reason);
                break;
            }
        }
        drop(state);

        // Await the answers, outside the lock: other sends publish meanwhile.
        let limit = self.config.confirm_timeout;
        let deadline = Instant::now() + limit;
        let mut broken: Option<String> = None;
        for (i, answer) in answers {
            let settled = match timeout_at(deadline, answer).await {
                Ok(Ok(settled)) => settled,
                Ok(Err(_)) => Settled::Dropped,
                Err(_) => {
                    let reason = format!("no publisher confirm within {limit:?}");
                    unavailable(outcomes, &[i], &reason);
                    broken.get_or_insert(reason);
                    continue;
                }
            };
            outcomes[i] = match settled {
                Settled::Ack => Some(Outcome::Delivered),
                Settled::Returned(r) => Some(Outcome::Rejected(r.reason())),
                Settled::Nack => Some(nacked(prepared[i].as_ref())),
                Settled::Dropped => Some(Outcome::Unavailable(
                    "RabbitMQ is unavailable: the connection was given up before the confirm came"
                        .to_owned(),
                )),
                Settled::Failed(e) => match Failure::of(&e) {
                    Failure::Refused(amqp) => {
                        if !round.refusals.contains(&amqp) {
                            round.refusals.push(amqp);
                        }
                        round.suspects.push(i);
                        None
                    }
                    Failure::ChannelClosed if publisher.connection.status().connected() => {
                        round.suspects.push(i);
                        None
                    }
                    _ => {
                        let reason = format!("no publisher confirm: {}", self.scrub(&e));
                        let outcome =
                            Outcome::Unavailable(format!("RabbitMQ is unavailable: {reason}"));
                        broken.get_or_insert(reason);
                        Some(outcome)
                    }
                },
            };
        }
        if let Some(reason) = broken {
            let mut state = self.state.lock().await;
            self.drop_link(&mut state, publisher.link, &reason);
        }
        round
    }

    /// Sends `suspects` one at a time on a confirm channel of their own,
    /// each awaiting its confirm: a message the broker refuses is alone in
    /// flight, so it is the culprit (`Rejected` with the broker's words);
    /// the others are delivered.
    async fn one_at_a_time(
        &self,
        batch: &[Message],
        prepared: &[Option<Prepared>],
        suspects: &[usize],
        outcomes: &mut [Option<Outcome>],
    ) {
        tracing::info!(
            suspects = suspects.len(),
            "RabbitMQ closed the confirm channel; sending the unconfirmed messages one at a time"
        );
        let publisher = {
            let mut state = self.state.lock().await;
            match self.ensure(&mut state, true).await {
                Ok(p) => p,
                Err(e) => {
                    for &i in suspects {
                        outcomes[i] = Some(Outcome::Unavailable(format!(
                            "RabbitMQ is unavailable: {}",
                            e.message()
                        )));
                    }
                    return;
                }
            }
        };
        let config = &self.config;
        let mut channel: Option<Channel> = None;
        let mut broken: Option<String> = None;
        for &i in suspects {
            let Some(p) = &prepared[i] else { continue };
            if let Some(reason) = &broken {
                outcomes[i] = Some(Outcome::Unavailable(format!(
                    "RabbitMQ is unavailable: {reason}"
                )));
                continue;
            }
            let ch = match &channel {
                Some(ch) if ch.status().connected() => ch.clone(),
                _ => match timeout(
                    config.connect_timeout,
                    open_confirm_channel(&publisher.connection),
                )
                .await
                {
                    Ok(Ok(ch)) => {
                        channel = Some(ch.clone());
                        ch
                    }
                    Ok(Err(e)) => {
                        let reason = format!("opening a confirm channel: {}", self.scrub(&e));
                        outcomes[i] = Some(Outcome::Unavailable(format!(
                            "RabbitMQ is unavailable: {reason}"
                        )));
                        broken = Some(reason);
                        continue;
                    }
                    Err(_) => {
                        let reason = "opening a confirm channel timed out".to_owned();
                        outcomes[i] = Some(Outcome::Unavailable(format!(
                            "RabbitMQ is unavailable: {reason}"
                        )));
                        broken = Some(reason);
                        continue;
                    }
                },
            };
            let publish = publishing(&ch, p, &batch[i].payload);
            let confirmed = timeout(config.confirm_timeout, async { publish.await?.await }).await;
            outcomes[i] = Some(match confirmed {
                Ok(Ok(Confirmation::Ack(None))) => Outcome::Delivered,
                Ok(Ok(Confirmation::Ack(Some(r)) | Confirmation::Nack(Some(r)))) => {
                    Outcome::Rejected(Returned::from_lapin(&r).reason())
                }
                Ok(Ok(Confirmation::Nack(None))) => nacked(Some(p)),
                Ok(Ok(Confirmation::NotRequested)) => {
                    let reason = "the channel is not in confirm mode".to_owned();
                    broken = Some(reason.clone());
                    Outcome::Unavailable(format!("RabbitMQ is unavailable: {reason}"))
                }
                Ok(Err(e)) => match Failure::of(&e) {
                    Failure::Refused(amqp) => {
                        channel = None;
                        Outcome::Rejected(config.scrub(&refusal(
                            &amqp,
                            &p.exchange,
                            batch[i].payload.len(),
                        )))
                    }
                    _ => {
                        let reason = format!("publishing failed: {}", self.scrub(&e));
                        broken = Some(reason.clone());
                        Outcome::Unavailable(format!("RabbitMQ is unavailable: {reason}"))
                    }
                },
                Err(_) => {
                    let reason =
                        format!("no publisher confirm within {:?}", config.confirm_timeout);
                    broken = Some(reason.clone());
                    Outcome::Unavailable(format!("RabbitMQ is unavailable: {reason}"))
                }
            });
        }
        if let Some(reason) = broken {
            let mut state = self.state.lock().await;
            self.drop_link(&mut state, publisher.link, &reason);
        }
    }

    /// Resolves the destination and encodes the properties; `Err` is the
    /// reason the message is rejected without being published.
    fn prepare(&self, m: &Message) -> Result<Prepared, String> {
        let config = &self.config;
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
        let routing_key = match config.partitioned.get(&exchange) {
            Some(count) => {
                let partition = Partitions::of_message(m.key.as_deref(), m.id, *count);
                Partitions::routing_key(&routing_key, partition)
            }
            None => routing_key,
        };
        check_short("exchange name", &exchange)?;
        check_short("routing key", &routing_key)?;
        let mut headers = FieldTable::default();
        let mut header_bytes = 4;
        let mut add = |name: &str, value: &str| -> Result<(), String> {
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
}

/// A `basic.publish` of `p` on `channel`, owning what it publishes (so that
/// it can outlive the send that started it).
fn publishing(channel: &Channel, p: &Prepared, payload: &[u8]) -> Publishing {
    let channel = channel.clone();
    let exchange = ShortString::from(p.exchange.as_str());
    let routing_key = ShortString::from(p.routing_key.as_str());
    let properties = p.properties.clone();
    let payload = payload.to_vec();
    Box::pin(async move {
        channel
            .basic_publish(exchange, routing_key, MANDATORY, &payload, properties)
            .await
    })
}

fn nacked(p: Option<&Prepared>) -> Outcome {
    Outcome::Rejected(format!(
        "the broker refused (nack) the message published to exchange `{}` with routing key `{}`",
        p.map_or("", |p| p.exchange.as_str()),
        p.map_or("", |p| p.routing_key.as_str()),
    ))
}

fn check_short(what: &str, value: &str) -> Result<(), String> {
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

fn short(what: &str, value: &str) -> Result<ShortString, String> {
    check_short(what, value)?;
    ShortString::try_new(value).map_err(|e| format!("{what}: {e}"))
}
