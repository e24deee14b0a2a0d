//! Declaring exchanges, queues and bindings (all durable); queues are
//! quorum queues unless classic ones are asked for.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};
use outbox_api::{Error, Result};

use crate::Partitions;
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

/// The type of a queue (the queue argument `x-queue-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum QueueType {
    /// A replicated quorum queue (Raft): the default for new queues. It
    /// counts redeliveries (header `x-delivery-count`) and can dead-letter a
    /// message redelivered too often (`x-delivery-limit`).
    #[default]
    Quorum,
    /// A classic queue: for queues that exist already as classic (a queue's
    /// type cannot change), or brokers older than 3.8.
    Classic,
}

impl QueueType {
    fn name(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

/// How many times a quorum queue may deliver a message before it
/// dead-letters it, when nothing else is said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeliveryLimit {
    /// [`Topology::DEFAULT_DELIVERY_LIMIT`] on a quorum queue with a
    /// dead-letter exchange; none otherwise.
    Default,
    /// None at all.
    Unlimited,
    /// This many deliveries.
    Limit(u32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct QueueSpec {
    name: String,
    kind: QueueType,
    dead_letter_exchange: Option<String>,
    delivery_limit: DeliveryLimit,
    single_active_consumer: bool,
}

impl QueueSpec {
    /// The delivery limit declared with the queue, if any.
    fn delivery_limit(&self) -> Option<u32> {
        match self.delivery_limit {
            DeliveryLimit::Limit(n) => Some(n),
            DeliveryLimit::Unlimited => None,
            DeliveryLimit::Default => (self.kind == QueueType::Quorum
                && self.dead_letter_exchange.is_some())
            .then_some(Topology::DEFAULT_DELIVERY_LIMIT),
        }
    }

    /// The queue arguments, or why they cannot be declared.
    fn arguments(&self) -> Result<FieldTable> {
        let mut arguments = FieldTable::default();
        let long = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes()));
        arguments.insert(ShortString::from("x-queue-type"), long(self.kind.name()));
        if let Some(dlx) = &self.dead_letter_exchange {
            arguments.insert(ShortString::from("x-dead-letter-exchange"), long(dlx));
        }
        if let DeliveryLimit::Limit(n) = self.delivery_limit {
            if self.kind != QueueType::Quorum {
                return Err(Error::invalid_input(format!(
                    "queue `{}`: a delivery limit needs a quorum queue (it is declared classic)",
                    self.name
                )));
            }
            if n == 0 {
                return Err(Error::invalid_input(format!(
                    "queue `{}`: the delivery limit must be at least 1",
                    self.name
                )));
            }
        }
        if let Some(n) = self.delivery_limit() {
            arguments.insert(
                ShortString::from("x-delivery-limit"),
                AMQPValue::LongInt(i32::try_from(n).unwrap_or(i32::MAX)),
            );
        }
        if self.single_active_consumer {
            arguments.insert(
                ShortString::from("x-single-active-consumer"),
                AMQPValue::Boolean(true),
            );
        }
        Ok(arguments)
    }
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
/// Queues are **quorum queues** unless declared with
/// [`classic_queue`](Self::classic_queue): replicated, and counting
/// redeliveries. A quorum queue with a dead-letter exchange gets a delivery
/// limit of [`DEFAULT_DELIVERY_LIMIT`](Self::DEFAULT_DELIVERY_LIMIT)
/// (change it with [`delivery_limit`](Self::delivery_limit)): a message the
/// broker has delivered that often without an acknowledgement — its
/// consumer crashed on it again and again, which the consumer's own
/// in-process attempt count cannot see — is dead-lettered instead of
/// crashing consumers forever. Without a dead-letter exchange there is no
/// default limit (the broker would drop the message).
///
/// **Migration:** a queue's type cannot change. A queue that exists as a
/// classic queue (declared before quorum became the default here) fails to
/// declare as quorum with `PRECONDITION_FAILED` (`inequivalent arg
/// 'x-queue-type'`): keep declaring it with
/// [`classic_queue`](Self::classic_queue), or move to a quorum queue of a
/// new name (declare it, bind it beside the old one, let consumers drain the
/// old one, unbind and delete it).
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

    /// The delivery limit of a quorum queue with a dead-letter exchange
    /// when none is set: 20 deliveries (RabbitMQ 4's own default).
    pub const DEFAULT_DELIVERY_LIMIT: u32 = 20;

    /// A durable **quorum** queue (once per name: a later call for the same
    /// name changes nothing).
    pub fn queue(self, name: impl Into<String>) -> Self {
        self.queue_of_type(name, QueueType::Quorum)
    }

    /// A durable **classic** queue, e.g. one that exists as classic already.
    /// If `name` was added before, it becomes classic.
    pub fn classic_queue(self, name: impl Into<String>) -> Self {
        let name = name.into();
        let mut this = self.queue_of_type(name.clone(), QueueType::Classic);
        this.spec(&name).kind = QueueType::Classic;
        this
    }

    fn queue_of_type(mut self, name: impl Into<String>, kind: QueueType) -> Self {
        let name = name.into();
        if !self.queues.iter().any(|q| q.name == name) {
            self.queues.push(QueueSpec {
                name,
                kind,
                dead_letter_exchange: None,
                delivery_limit: DeliveryLimit::Default,
                single_active_consumer: false,
            });
        }
        self
    }

    /// The spec of a queue added before.
    fn spec(&mut self, name: &str) -> &mut QueueSpec {
        let at = self
            .queues
            .iter()
            .position(|q| q.name == name)
            .expect("the queue was added just before");
        &mut self.queues[at]
    }

    /// How many times the quorum queue `queue` may deliver a message before
    /// dead-lettering it (`x-delivery-limit`); `None`: no limit. Adds
    /// `queue` (quorum) if it was not added yet. Declaring fails, naming the
    /// queue, for a limit of 0 or on a classic queue.
    pub fn delivery_limit(mut self, queue: impl Into<String>, limit: Option<u32>) -> Self {
        let queue = queue.into();
        self = self.queue(queue.clone());
        self.spec(&queue).delivery_limit = match limit {
            Some(n) => DeliveryLimit::Limit(n),
            None => DeliveryLimit::Unlimited,
        };
        self
    }

    /// Gives `queue` a **single active consumer**
    /// (`x-single-active-consumer`): however many consumers subscribe, the
    /// broker delivers to one at a time, and to the next when it goes away.
    /// Adds `queue` (quorum) if it was not added yet.
    pub fn single_active_consumer(mut self, queue: impl Into<String>) -> Self {
        let queue = queue.into();
        self = self.queue(queue.clone());
        self.spec(&queue).single_active_consumer = true;
        self
    }

    /// The partition queues of `partitions` (`<prefix>.0` …), each a quorum
    /// queue with a [single active consumer](Self::single_active_consumer):
    /// a key's messages are consumed by one process at a time, in order.
    /// Bind them with [`bind_partitioned`](Self::bind_partitioned).
    pub fn partitioned(mut self, partitions: &Partitions) -> Self {
        for queue in partitions.queues() {
            self = self.single_active_consumer(queue);
        }
        self
    }

    /// Binds partition `i` of `partitions` to `exchange` with routing key
    /// `<routing_key>.<i>`, for every `i`: what the relay's transport
    /// publishes to an exchange configured with
    /// [`partitioned_exchange`](crate::RabbitConfig::partitioned_exchange)
    /// and the same count. Call once per routing key (e.g. message type).
    pub fn bind_partitioned(
        mut self,
        partitions: &Partitions,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Self {
        let (exchange, routing_key) = (exchange.into(), routing_key.into());
        for i in 0..partitions.count() {
            self = self.bind(
                partitions.queue(i),
                exchange.clone(),
                Partitions::routing_key(&routing_key, i),
            );
        }
        self
    }

    /// Dead-letters every partition queue of `partitions` to
    /// `dead_letter_exchange` (see [`dead_letter`](Self::dead_letter)).
    pub fn dead_letter_partitioned(
        mut self,
        partitions: &Partitions,
        dead_letter_exchange: impl Into<String>,
    ) -> Self {
        let dlx = dead_letter_exchange.into();
        for queue in partitions.queues() {
            self = self.dead_letter(queue, dlx.clone());
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
        self.spec(&queue).dead_letter_exchange = Some(dlx);
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
            let arguments = queue.arguments()?;
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
                .map_err(|e| {
                    declare_error(format!("{} queue `{}`", queue.kind.name(), queue.name), &e)
                })?;
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
        let hint = if e.to_string().contains("x-queue-type") {
            "; it exists with another queue type, which cannot change — declare it \
             as it is (`Topology::classic_queue` for a classic one) or move to a \
             new queue name"
        } else {
            ""
        };
        Error::backend(format!("the broker refused to declare {what}: {e}{hint}"))
    } else {
        Error::unavailable(format!("could not declare {what}: {e}"))
    }
}
