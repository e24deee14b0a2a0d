//! Declaring exchanges, queues and bindings (all durable).

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};
use outbox_api::{Error, Result};

use crate::config::MAX_SHORT_STRING;

/// The type of an exchange.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExchangeType {
    /// Routes to queues whose binding key equals the routing key.
    Direct,
    /// Routes to every bound queue.
    Fanout,
    /// Routes by routing-key pattern (`*` one word, `#` any words).
    Topic,
    /// Routes by header values.
    Headers,
    /// A plugin's exchange type, e.g. `x-delayed-message`.
    Custom(String),
}

impl ExchangeType {
    fn to_lapin(&self) -> ExchangeKind {
        match self {
            ExchangeType::Direct => ExchangeKind::Direct,
            ExchangeType::Fanout => ExchangeKind::Fanout,
            ExchangeType::Topic => ExchangeKind::Topic,
            ExchangeType::Headers => ExchangeKind::Headers,
            ExchangeType::Custom(name) => ExchangeKind::Custom(name.clone()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct QueueSpec {
    name: String,
    dead_letter_exchange: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Binding {
    queue: String,
    exchange: String,
    routing_key: String,
}

/// Exchanges, queues, bindings and dead-letter settings to declare, all
/// durable. Declaring is idempotent: declaring what already exists with the
/// same settings does nothing; different settings fail with the broker's
/// `PRECONDITION_FAILED` named in the error.
///
/// ```
/// use outbox_rabbitmq::{ExchangeType, Topology};
/// let topology = Topology::new()
///     .exchange("orders", ExchangeType::Topic)
///     .exchange("orders.dlx", ExchangeType::Fanout)
///     .queue("warehouse")
///     .queue("warehouse.dead")
///     .bind("warehouse", "orders", "order.*")
///     .bind("warehouse.dead", "orders.dlx", "")
///     .dead_letter("warehouse", "orders.dlx");
/// # let _ = topology;
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    exchanges: Vec<(String, ExchangeType)>,
    queues: Vec<QueueSpec>,
    bindings: Vec<Binding>,
}

impl Topology {
    /// Nothing to declare yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A durable exchange of `kind`.
    pub fn exchange(mut self, name: impl Into<String>, kind: ExchangeType) -> Self {
        self.exchanges.push((name.into(), kind));
        self
    }

    /// A durable queue.
    pub fn queue(mut self, name: impl Into<String>) -> Self {
        let name = name.into();
        if !self.queues.iter().any(|q| q.name == name) {
            self.queues.push(QueueSpec {
                name,
                dead_letter_exchange: None,
            });
        }
        self
    }

    /// Binds `queue` to `exchange` with `routing_key`.
    pub fn bind(
        mut self,
        queue: impl Into<String>,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Self {
        self.bindings.push(Binding {
            queue: queue.into(),
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        });
        self
    }

    /// Messages rejected or expired in `queue` go to the exchange
    /// `dead_letter_exchange` (the queue argument `x-dead-letter-exchange`).
    /// Adds `queue` if it was not added yet.
    pub fn dead_letter(
        mut self,
        queue: impl Into<String>,
        dead_letter_exchange: impl Into<String>,
    ) -> Self {
        let queue = queue.into();
        let dlx = dead_letter_exchange.into();
        self = self.queue(queue.clone());
        if let Some(spec) = self.queues.iter_mut().find(|q| q.name == queue) {
            spec.dead_letter_exchange = Some(dlx);
        }
        self
    }

    /// Declares everything on `channel`: exchanges, then queues, then
    /// bindings. The error names what could not be declared.
    pub async fn declare_on(&self, channel: &Channel) -> Result<()> {
        for (name, kind) in &self.exchanges {
            let exchange = short("exchange name", name)?;
            channel
                .exchange_declare(
                    exchange,
                    kind.to_lapin(),
                    ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| declare_error(format!("exchange `{name}` ({kind:?})"), &e))?;
        }
        for queue in &self.queues {
            let mut arguments = FieldTable::default();
            if let Some(dlx) = &queue.dead_letter_exchange {
                arguments.insert(
                    ShortString::from("x-dead-letter-exchange"),
                    AMQPValue::LongString(LongString::from(dlx.as_bytes())),
                );
            }
            channel
                .queue_declare(
                    short("queue name", &queue.name)?,
                    QueueDeclareOptions {
                        durable: true,
                        ..QueueDeclareOptions::default()
                    },
                    arguments,
                )
                .await
                .map_err(|e| declare_error(format!("queue `{}`", queue.name), &e))?;
        }
        for b in &self.bindings {
            channel
                .queue_bind(
                    short("queue name", &b.queue)?,
                    short("exchange name", &b.exchange)?,
                    short("routing key", &b.routing_key)?,
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    declare_error(
                        format!(
                            "binding of queue `{}` to exchange `{}` with routing key `{}`",
                            b.queue, b.exchange, b.routing_key
                        ),
                        &e,
                    )
                })?;
        }
        Ok(())
    }
}

fn short(what: &str, value: &str) -> Result<ShortString> {
    if value.len() > MAX_SHORT_STRING {
        return Err(Error::invalid_input(format!(
            "{what} `{}…` is {} bytes long; AMQP allows at most {MAX_SHORT_STRING}",
            value.chars().take(40).collect::<String>(),
            value.len()
        )));
    }
    ShortString::try_new(value).map_err(|e| Error::invalid_input(format!("{what}: {e}")))
}

fn declare_error(what: String, e: &lapin::Error) -> Error {
    if e.is_amqp_error() {
        Error::backend(format!("the broker refused to declare {what}: {e}"))
    } else {
        Error::unavailable(format!("could not declare {what}: {e}"))
    }
}
