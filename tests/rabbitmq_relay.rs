//! The whole path against a real RabbitMQ at `OUTBOX_AMQP_URL`: a SQLite
//! outbox, the relay, the RabbitMQ transport (through a TCP proxy that cuts
//! the connection), and the inbox-aware `RabbitConsumer` on another SQLite
//! database. Fails (never skips) when `OUTBOX_AMQP_URL` is unset.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox::{
    ErrorKind, HandlerError, ListQuery, MessageId, MessageKind, MessageState, NewMessage,
    OperatorStore, Relay, RelayHandle, RetryPolicy, Store, TransportHealth,
};
use outbox_api::testing::wait_until;
use outbox_rabbitmq::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ExchangeDeclareOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use outbox_rabbitmq::lapin::types::{FieldTable, ShortString};
use outbox_rabbitmq::lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind,
};
use outbox_rabbitmq::testing::{
    TcpProxy, amqp_url, broker_addr, unique_name, url_via, url_with_password,
};
use outbox_rabbitmq::{
    ConsumerHandle, ExchangeType, InboxHandler, RabbitConsumer, RabbitTransport, Received, Topology,
};
use outbox_sqlite::sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions, SqliteSynchronous};
use outbox_sqlite::sqlx::{self, SqliteConnection, SqlitePool};
use outbox_sqlite::testing::SqlxUnderTest;

const DEADLINE: Duration = Duration::from_secs(30);
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

// ---------------------------------------------------------------- fixtures

/// Unique exchange, queue, dead-letter exchange and dead-letter queue, and
/// the test's own connection to the broker; `cleanup` deletes them.
struct Broker {
    _connection: Connection,
    channel: Channel,
    exchange: String,
    queue: String,
    dlx: String,
    dead: String,
}

impl Broker {
    async fn new() -> Broker {
        let url = amqp_url();
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .expect("test connection to OUTBOX_AMQP_URL");
        let channel = connection.create_channel().await.expect("test channel");
        let (exchange, queue, dlx, dead) = (
            unique_name("x"),
            unique_name("q"),
            unique_name("dlx"),
            unique_name("dead"),
        );
        Topology::new()
            .exchange(exchange.as_str(), ExchangeType::Direct)
            .exchange(dlx.as_str(), ExchangeType::Fanout)
            .queue(queue.as_str())
            .queue(dead.as_str())
            .bind(queue.as_str(), exchange.as_str(), "deliver")
            .bind(dead.as_str(), dlx.as_str(), "")
            .dead_letter(queue.as_str(), dlx.as_str())
            .declare_on(&channel)
            .await
            .expect("declare the test topology");
        Broker {
            _connection: connection,
            channel,
            exchange,
            queue,
            dlx,
            dead,
        }
    }

    /// An integration message routed to the test queue.
    fn message(&self, n: usize) -> NewMessage {
        NewMessage::new(
            MessageKind::Integration,
            "OrderPlaced",
            format!("order {n}"),
        )
        .content_type("text/plain")
        .destination(self.exchange.as_str(), "deliver")
    }

    /// Ready messages in `queue` (not counting unacknowledged ones).
    async fn ready(&self, queue: &str) -> u32 {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("passive declare")
            .message_count()
    }

    /// Publishes a raw message to the test queue (not through the outbox).
    async fn publish_raw(&self, message_id: Option<&str>, body: &[u8]) {
        let mut props = BasicProperties::default()
            .with_type(ShortString::from("OrderPlaced"))
            .with_delivery_mode(2);
        if let Some(id) = message_id {
            props = props.with_message_id(ShortString::from(id));
        }
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                "deliver".into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("publish confirm");
    }

    async fn cleanup(self) {
        for q in [&self.queue, &self.dead] {
            let _ = self
                .channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        for x in [&self.exchange, &self.dlx] {
            let _ = self
                .channel
                .exchange_delete(x.as_str().into(), Default::default())
                .await;
        }
    }
}

/// The producer: a SQLite outbox with a sqlx pool for the application.
async fn producer() -> SqlxUnderTest {
    SqlxUnderTest::fresh(None).await
}

async fn enqueue(db: &SqlxUnderTest, messages: Vec<NewMessage>) -> Vec<MessageId> {
    let outbox = db.sqlite().outbox();
    let mut tx = db
        .pool()
        .begin_with("BEGIN IMMEDIATE")
        .await
        .expect("begin");
    let mut ids = Vec::with_capacity(messages.len());
    for m in messages {
        ids.push(outbox.enqueue(&mut *tx, m).await.expect("enqueue"));
    }
    tx.commit().await.expect("commit");
    ids
}

/// Messages of the producer's outbox with `attempts > 0`.
async fn counted_attempts(db: &SqlxUnderTest) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM test_outbox WHERE attempts > 0")
        .fetch_one(db.pool())
        .await
        .expect("count attempts")
}

/// The receiving side: its own SQLite database (inbox + an `effects` table
/// the handler writes to + its own outbox for replies).
struct Receiver {
    db: SqlxUnderTest,
    pool: SqlitePool,
}

impl Receiver {
    async fn new() -> Receiver {
        let db = SqlxUnderTest::fresh(None).await;
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(db.sqlite().path())
                    .synchronous(SqliteSynchronous::Normal)
                    .busy_timeout(Duration::from_secs(10)),
            )
            .await
            .expect("receiver pool");
        sqlx::query(
            "CREATE TABLE effects (message_id TEXT NOT NULL, message_type TEXT, payload BLOB)",
        )
        .execute(&pool)
        .await
        .expect("create effects");
        Receiver { db, pool }
    }

    async fn effects(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT message_id FROM effects")
            .fetch_all(&self.pool)
            .await
            .expect("read effects")
    }

    async fn effect_count(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM effects")
            .fetch_one(&self.pool)
            .await
            .expect("count effects")
    }

    async fn inbox_count(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM test_inbox")
            .fetch_one(&self.pool)
            .await
            .expect("count inbox")
    }

    async fn consume(
        &self,
        broker: &Broker,
        handler: impl InboxHandler<SqliteConnection>,
    ) -> ConsumerHandle {
        RabbitConsumer::builder(amqp_url(), broker.queue.as_str())
            .consumer_name("warehouse")
            .retry_delay(Duration::from_millis(20))
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(500))
            .spawn(
                outbox_sqlite::SqliteInbox::new(self.db.sqlite().outbox(), self.pool.clone()),
                handler,
            )
            .await
            .expect("start the consumer")
    }
}

/// Writes an effect row per message (in the inbox transaction), enqueues a
/// reply into the receiver's outbox (how a saga answers), remembers what it
/// saw, and fails when told to.
#[derive(Clone, Default)]
struct Recorder {
    outbox: Option<outbox_sqlite::SqliteOutbox>,
    calls: Arc<AtomicU64>,
    seen: Arc<Mutex<Vec<Received>>>,
    fail: bool,
}

#[async_trait]
impl InboxHandler<SqliteConnection> for Recorder {
    async fn handle(&self, msg: &Received, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.seen.lock().unwrap().push(msg.clone());
        sqlx::query("INSERT INTO effects (message_id, message_type, payload) VALUES (?, ?, ?)")
            .bind(msg.id.to_string())
            .bind(msg.message_type.clone())
            .bind(msg.payload.clone())
            .execute(&mut *tx)
            .await?;
        if let Some(outbox) = &self.outbox {
            outbox
                .enqueue(
                    &mut *tx,
                    NewMessage::new(
                        MessageKind::Integration,
                        "OrderAccepted",
                        msg.id.to_string(),
                    ),
                )
                .await?;
        }
        if self.fail {
            return Err("the warehouse is on fire".into());
        }
        Ok(())
    }
}

async fn transport(url: String) -> RabbitTransport {
    RabbitTransport::builder(url)
        .confirm_timeout(Duration::from_secs(3))
        .connect_timeout(Duration::from_secs(2))
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(300))
        .build()
        .await
        .expect("connect the transport")
}

fn relay(db: &SqlxUnderTest, transport: RabbitTransport) -> RelayHandle {
    Relay::builder(db.sqlite().clone())
        .transport(transport)
        .batch_size(200)
        .poll_interval(Duration::from_millis(100))
        .probe_initial(Duration::from_millis(20))
        .probe_max(Duration::from_millis(300))
        .retry_policy(RetryPolicy::Fixed(Duration::from_millis(50)))
        .spawn()
        .expect("relay")
}

async fn wait_for_effects(receiver: &Receiver, expected: &HashSet<String>, deadline: Duration) {
    let start = Instant::now();
    loop {
        let got: HashSet<String> = receiver.effects().await.into_iter().collect();
        if expected.is_subset(&got) {
            return;
        }
        assert!(
            start.elapsed() < deadline,
            "after {deadline:?} only {} of {} messages were handled",
            expected.intersection(&got).count(),
            expected.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn trace_parent(n: usize) -> String {
    format!("00-{TRACE_ID}-{:016x}-01", n + 1)
}

// ---------------------------------------------------------------- tests

/// (a) relay → RabbitMQ → RabbitConsumer → handler effect, every property
/// checked at the consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_every_property_reaches_the_handler() {
    let broker = Broker::new().await;
    let producer = producer().await;
    let receiver = Receiver::new().await;
    let recorder = Recorder {
        outbox: Some(receiver.db.sqlite().outbox()),
        ..Recorder::default()
    };
    let consumer = receiver.consume(&broker, recorder.clone()).await;
    let relay = relay(&producer, transport(amqp_url()).await);

    let messages: Vec<NewMessage> = (0..5)
        .map(|n| {
            broker
                .message(n)
                .key(format!("order-{}", n % 2))
                .trace_parent(trace_parent(n))
                .header("tenant", "acme")
        })
        .collect();
    let ids = enqueue(&producer, messages).await;
    let expected: HashSet<String> = ids.iter().map(ToString::to_string).collect();
    wait_for_effects(&receiver, &expected, DEADLINE).await;
    relay.until_idle().await.unwrap();

    let seen = recorder.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 5, "{seen:?}");
    for (n, id) in ids.iter().enumerate() {
        let r = seen.iter().find(|r| r.id == *id).expect("seen");
        assert_eq!(r.message_type.as_deref(), Some("OrderPlaced"));
        assert_eq!(r.payload, format!("order {n}").into_bytes());
        assert_eq!(r.content_type.as_deref(), Some("text/plain"));
        let key = format!("order-{}", n % 2);
        assert_eq!(r.key.as_deref(), Some(key.as_str()));
        assert_eq!(r.header("x-outbox-key"), Some(key.as_str()));
        assert_eq!(r.header("tenant"), Some("acme"));
        let tp = r.trace_parent.as_deref().expect("traceparent");
        assert_eq!(tp, trace_parent(n));
        assert_eq!(tp.split('-').nth(1), Some(TRACE_ID), "trace id preserved");
        assert_eq!(r.header("traceparent"), Some(tp));
        assert_eq!(r.exchange, broker.exchange);
        assert_eq!(r.routing_key, "deliver");
        assert!(r.timestamp.is_some());
        assert!(!r.redelivered);
        assert_eq!(r.attempt, 1);
    }
    // Per-key order held end to end.
    for key in ["order-0", "order-1"] {
        let got: Vec<MessageId> = seen
            .iter()
            .filter(|r| r.key.as_deref() == Some(key))
            .map(|r| r.id)
            .collect();
        let want: Vec<MessageId> = ids
            .iter()
            .enumerate()
            .filter(|(n, _)| format!("order-{}", n % 2) == key)
            .map(|(_, id)| *id)
            .collect();
        assert_eq!(got, want, "order of key {key}");
    }
    // The inbox rows and the saga's replies committed with the effects.
    assert_eq!(receiver.inbox_count().await, 5);
    let replies = receiver
        .db
        .sqlite()
        .list(
            &ListQuery::new()
                .state(MessageState::Pending)
                .message_type("OrderAccepted")
                .limit(100),
        )
        .await
        .unwrap();
    assert_eq!(replies.len(), 5);
    // Everything acknowledged: the queue is empty once the consumer is gone.
    let stats = consumer.stats();
    assert_eq!((stats.handled, stats.duplicates), (5, 0), "{stats:?}");
    consumer.shutdown().await;
    assert!(!consumer.is_running());
    assert_eq!(broker.ready(&broker.queue).await, 0);
    let health = relay.health().await;
    assert_eq!(health.pending, 0, "{health:?}");
    relay.shutdown().await;
    broker.cleanup().await;
}

/// (b) an unroutable message is Rejected, its attempts count up, it is
/// poisoned at max_attempts; the other messages keep flowing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_is_rejected_counted_and_poisoned_while_others_flow() {
    let broker = Broker::new().await;
    let producer = producer().await;
    let receiver = Receiver::new().await;
    let consumer = receiver.consume(&broker, Recorder::default()).await;
    let relay = Relay::builder(producer.sqlite().clone())
        .transport(transport(amqp_url()).await)
        .max_attempts(3)
        .poll_interval(Duration::from_millis(50))
        .retry_policy(RetryPolicy::Fixed(Duration::from_millis(30)))
        .spawn()
        .unwrap();

    let bad = enqueue(
        &producer,
        vec![
            NewMessage::new(MessageKind::Integration, "OrderPlaced", "lost?")
                .destination(broker.exchange.as_str(), "nowhere"),
        ],
    )
    .await[0];
    let mut good = Vec::new();
    for round in 0..5 {
        good.extend(enqueue(&producer, vec![broker.message(round)]).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let store = producer.sqlite().clone();
    wait_until("the unroutable message is poisoned", DEADLINE, || {
        let store = store.clone();
        async move {
            store.get(bad).await.unwrap().map(|m| m.state) == Some(MessageState::Poisoned)
        }
    })
    .await;
    let m = store.get(bad).await.unwrap().unwrap();
    assert_eq!(m.attempts, 3, "{m:?}");
    let error = m.last_error.unwrap_or_default();
    assert!(error.contains("unroutable"), "{error}");
    assert!(error.contains("nowhere"), "{error}");

    let expected: HashSet<String> = good.iter().map(ToString::to_string).collect();
    wait_for_effects(&receiver, &expected, DEADLINE).await;
    for id in &good {
        let m = store.get(*id).await.unwrap().unwrap();
        assert_eq!((m.state, m.attempts), (MessageState::Processed, 0), "{m:?}");
    }
    let health = relay.health().await;
    assert_eq!(health.poisoned, 1, "{health:?}");
    assert!(
        health.reasons.iter().any(|r| r.contains("poisoned")),
        "{health:?}"
    );
    consumer.shutdown().await;
    relay.shutdown().await;
    broker.cleanup().await;
}

/// One refused destination stalls nothing: a message to an exchange
/// declared `internal` (the broker answers ACCESS_REFUSED and closes the
/// channel) among 200 good ones. The 200 arrive, the refused one is
/// counted and poisoned, and the transport is never reported down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_destination_is_that_messages_failure_and_stalls_nothing() {
    let broker = Broker::new().await;
    let internal = unique_name("internal");
    broker
        .channel
        .exchange_declare(
            internal.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                internal: true,
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare an internal exchange");
    let producer = producer().await;
    let receiver = Receiver::new().await;
    let consumer = receiver.consume(&broker, Recorder::default()).await;
    let relay = Relay::builder(producer.sqlite().clone())
        // Patient timeouts: a confirm or a channel slower than the helper's
        // (3 s, 2 s) on a loaded machine is an outage by those limits, and
        // this test is about a refusal only.
        .transport(
            RabbitTransport::builder(amqp_url())
                .confirm_timeout(Duration::from_secs(30))
                .connect_timeout(Duration::from_secs(30))
                .build()
                .await
                .expect("connect the transport"),
        )
        .max_attempts(3)
        .batch_size(50)
        .poll_interval(Duration::from_millis(50))
        .retry_policy(RetryPolicy::Fixed(Duration::from_millis(30)))
        .spawn()
        .unwrap();
    let mut messages: Vec<NewMessage> = (0..200).map(|n| broker.message(n)).collect();
    messages.insert(
        37,
        NewMessage::new(MessageKind::Integration, "OrderPlaced", "refused")
            .destination(internal.as_str(), "deliver"),
    );
    let ids = enqueue(&producer, messages).await;
    let bad = ids[37];
    let good: HashSet<String> = ids
        .iter()
        .filter(|id| **id != bad)
        .map(ToString::to_string)
        .collect();
    let store = producer.sqlite().clone();
    // The first outage seen, if any: its reason is the failure's message.
    let down_seen: Arc<Mutex<Option<String>>> = Arc::default();
    wait_until("the refused message is poisoned", DEADLINE, || {
        let (store, relay, down_seen) = (store.clone(), &relay, down_seen.clone());
        async move {
            if let TransportHealth::Down(reason) = relay.health().await.transport {
                down_seen.lock().unwrap().get_or_insert(reason);
            }
            store.get(bad).await.unwrap().map(|m| m.state) == Some(MessageState::Poisoned)
        }
    })
    .await;
    wait_for_effects(&receiver, &good, DEADLINE).await;
    let m = store.get(bad).await.unwrap().unwrap();
    assert_eq!(m.attempts, 3, "{m:?}");
    let error = m.last_error.unwrap_or_default();
    assert!(error.contains(internal.as_str()), "{error}");
    if let Some(reason) = down_seen.lock().unwrap().take() {
        panic!(
            "a refusal caused by one message is not an outage, but the transport went down: {reason}"
        );
    }
    assert_eq!(relay.health().await.transport, TransportHealth::Up);
    consumer.shutdown().await;
    relay.shutdown().await;
    broker.cleanup().await;
}

/// (c) the relay's broker connection is cut mid-run: no attempt is
/// counted, health shows the transport down while cut, and everything
/// arrives after heal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_cut_mid_run_loses_nothing_and_counts_no_attempt() {
    let broker = Broker::new().await;
    let producer = producer().await;
    let receiver = Receiver::new().await;
    let consumer = receiver.consume(&broker, Recorder::default()).await;
    let url = amqp_url();
    let proxy = TcpProxy::start(broker_addr(&url).await).await;
    let relay = relay(&producer, transport(url_via(&url, proxy.addr())).await);

    let mut ids: Vec<MessageId> = Vec::new();
    for round in 0..10 {
        ids.extend(
            enqueue(
                &producer,
                (0..20).map(|n| broker.message(round * 20 + n)).collect(),
            )
            .await,
        );
    }
    // Cut while messages are still flowing.
    wait_until("some messages were handled", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n > 0 }
    })
    .await;
    proxy.cut();
    for round in 10..20 {
        ids.extend(
            enqueue(
                &producer,
                (0..20).map(|n| broker.message(round * 20 + n)).collect(),
            )
            .await,
        );
    }
    wait_until("health shows the transport down", DEADLINE, || async {
        matches!(relay.health().await.transport, TransportHealth::Down(_))
    })
    .await;
    let health = relay.health().await;
    eprintln!("while cut: {health:?}");
    assert!(
        health.reasons.iter().any(|r| r.contains("transport down")),
        "{health:?}"
    );
    assert!(health.pending > 0, "{health:?}");
    // Stays down while cut: a probe was refused since, and it is still down.
    let refused = proxy.refused();
    wait_until("a probe was refused by the cut", DEADLINE, || async {
        proxy.refused() > refused
    })
    .await;
    assert!(matches!(
        relay.health().await.transport,
        TransportHealth::Down(_)
    ));
    assert_eq!(
        counted_attempts(&producer).await,
        0,
        "an outage counted as an attempt"
    );

    proxy.heal();
    let expected: HashSet<String> = ids.iter().map(ToString::to_string).collect();
    wait_for_effects(&receiver, &expected, DEADLINE).await;
    wait_until("the relay marks everything processed", DEADLINE, || async {
        relay.health().await.pending == 0
    })
    .await;
    assert_eq!(relay.health().await.transport, TransportHealth::Up);
    assert_eq!(
        counted_attempts(&producer).await,
        0,
        "an outage counted as an attempt"
    );

    let effects = receiver.effects().await;
    let distinct: HashSet<&String> = effects.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "exactly the set enqueued");
    assert!(effects.iter().all(|e| expected.contains(e)));
    assert_eq!(
        effects.len(),
        ids.len(),
        "the inbox made every effect happen once"
    );
    let stats = consumer.stats();
    eprintln!(
        "{} messages, {} duplicate deliveries deduplicated by the inbox (at-least-once), relay totals {:?}",
        ids.len(),
        stats.duplicates,
        relay.totals()
    );
    consumer.shutdown().await;
    relay.shutdown().await;
    broker.cleanup().await;
}

/// (d) `docs/rules.md#outage`: random cuts of random length during a
/// 10k-message run (`OUTBOX_SOAK=1`: 100k messages and more cuts): nothing
/// lost, no attempt counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_cuts_during_a_long_run_lose_nothing() {
    let soak = std::env::var("OUTBOX_SOAK").is_ok_and(|v| v == "1");
    let (total, cuts, enqueue_for) = if soak {
        (
            100_000usize,
            fastrand::usize(20..=40),
            Duration::from_secs(120),
        )
    } else {
        (10_000usize, fastrand::usize(5..=8), Duration::from_secs(8))
    };
    let broker = Broker::new().await;
    let producer = producer().await;
    let receiver = Receiver::new().await;
    let consumer = receiver.consume(&broker, Recorder::default()).await;
    let url = amqp_url();
    let proxy = Arc::new(TcpProxy::start(broker_addr(&url).await).await);
    let relay = relay(&producer, transport(url_via(&url, proxy.addr())).await);
    let start = Instant::now();

    // Chaos: `cuts` cuts of 50–500 ms at random points while enqueuing.
    let chaos = {
        let proxy = Arc::clone(&proxy);
        let slot = enqueue_for / cuts as u32;
        tokio::spawn(async move {
            let mut log = Vec::new();
            for _ in 0..cuts {
                let before = slot.mul_f64(fastrand::f64() * 0.6);
                tokio::time::sleep(before).await;
                let down = Duration::from_millis(fastrand::u64(50..=500));
                proxy.cut();
                tokio::time::sleep(down).await;
                proxy.heal();
                log.push(down);
                tokio::time::sleep(slot.saturating_sub(before + down)).await;
            }
            log
        })
    };

    // Enqueue `total` messages in transactions of 100, spread over `enqueue_for`.
    let batches = total / 100;
    let mut ids: Vec<MessageId> = Vec::with_capacity(total);
    for b in 0..batches {
        ids.extend(
            enqueue(
                &producer,
                (0..100).map(|n| broker.message(b * 100 + n)).collect(),
            )
            .await,
        );
        let due = enqueue_for.mul_f64((b + 1) as f64 / batches as f64);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
    let cut_log = chaos.await.expect("chaos task");
    let deadline = if soak {
        Duration::from_secs(600)
    } else {
        Duration::from_secs(60)
    };
    let expected: HashSet<String> = ids.iter().map(ToString::to_string).collect();
    wait_for_effects(&receiver, &expected, deadline).await;
    wait_until("the relay marks everything processed", deadline, || async {
        relay.health().await.pending == 0
    })
    .await;

    assert_eq!(
        counted_attempts(&producer).await,
        0,
        "an outage counted as an attempt"
    );
    let effects = receiver.effects().await;
    let distinct: HashSet<&String> = effects.iter().collect();
    assert_eq!(distinct.len(), total, "every message arrived");
    assert_eq!(effects.len(), total, "each effect happened once");
    let stats = consumer.stats();
    eprintln!(
        "{total} messages in {:?}; {} cuts {:?}; proxy refused {} connections; \
         {} duplicate deliveries deduplicated (at-least-once); relay totals {:?}",
        start.elapsed(),
        cut_log.len(),
        cut_log,
        proxy.refused(),
        stats.duplicates,
        relay.totals()
    );
    assert_eq!(cut_log.len(), cuts);
    consumer.shutdown().await;
    relay.shutdown().await;
    broker.cleanup().await;
}

/// (e) the same message_id delivered twice: the handler's effect happens
/// once and both deliveries are acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_delivery_is_deduplicated_by_the_inbox() {
    let broker = Broker::new().await;
    let receiver = Receiver::new().await;
    let recorder = Recorder::default();
    let consumer = receiver.consume(&broker, recorder.clone()).await;
    let id = MessageId::new().to_string();
    broker.publish_raw(Some(&id), b"first").await;
    broker.publish_raw(Some(&id), b"second").await;
    wait_until("both deliveries settled", DEADLINE, || {
        let s = consumer.stats();
        async move { s.handled + s.duplicates >= 2 }
    })
    .await;
    let stats = consumer.stats();
    assert_eq!((stats.handled, stats.duplicates), (1, 1), "{stats:?}");
    assert_eq!(recorder.calls.load(Ordering::SeqCst), 1, "handler ran once");
    assert_eq!(receiver.effects().await, vec![id.clone()]);
    assert_eq!(receiver.inbox_count().await, 1);
    consumer.shutdown().await;
    // Unacknowledged deliveries would be back in the queue now.
    assert_eq!(
        broker.ready(&broker.queue).await,
        0,
        "both were acknowledged"
    );
    assert_eq!(broker.ready(&broker.dead).await, 0);
    broker.cleanup().await;
}

/// (f) a failing handler is retried the bounded number of times, then the
/// delivery goes to the dead-letter exchange; nothing of it is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_handler_is_retried_then_dead_lettered() {
    let broker = Broker::new().await;
    let receiver = Receiver::new().await;
    let recorder = Recorder {
        fail: true,
        outbox: Some(receiver.db.sqlite().outbox()),
        ..Recorder::default()
    };
    let consumer = RabbitConsumer::builder(amqp_url(), broker.queue.as_str())
        .max_attempts(3)
        .retry_delay(Duration::from_millis(20))
        .spawn(
            outbox_sqlite::SqliteInbox::new(receiver.db.sqlite().outbox(), receiver.pool.clone()),
            recorder.clone(),
        )
        .await
        .unwrap();
    let id = MessageId::new().to_string();
    broker.publish_raw(Some(&id), b"doomed").await;
    // A delivery without a message id goes straight to the dead letters.
    broker.publish_raw(None, b"anonymous").await;

    let mut dead: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let start = Instant::now();
    while dead.len() < 2 {
        assert!(start.elapsed() < DEADLINE, "dead letters so far: {dead:?}");
        match broker
            .channel
            .basic_get(
                broker.dead.as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        {
            Some(m) => {
                let mid = m
                    .delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map_or_else(|| "<none>".to_owned(), |s| s.as_str().to_owned());
                dead.insert(mid, m.delivery.data.clone());
            }
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert_eq!(dead.get(&id).map(Vec::as_slice), Some(&b"doomed"[..]));
    assert_eq!(
        dead.get("<none>").map(Vec::as_slice),
        Some(&b"anonymous"[..])
    );
    assert_eq!(
        recorder.calls.load(Ordering::SeqCst),
        3,
        "tried max_attempts times"
    );
    let attempts: Vec<u32> = recorder
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.attempt)
        .collect();
    assert_eq!(attempts, vec![1, 2, 3]);
    let stats = consumer.stats();
    assert_eq!(
        (
            stats.retried,
            stats.dead_lettered,
            stats.invalid,
            stats.handled
        ),
        (2, 1, 1, 0),
        "{stats:?}"
    );
    // Every try was rolled back: no effect, no inbox row, no reply.
    assert_eq!(receiver.effect_count().await, 0);
    assert_eq!(receiver.inbox_count().await, 0);
    let stats = receiver.db.sqlite().stats().await.unwrap();
    assert_eq!(stats.pending, 0, "the reply was rolled back too");
    consumer.shutdown().await;
    assert_eq!(broker.ready(&broker.queue).await, 0);
    broker.cleanup().await;
}

/// (g) wrong credentials: a clear error naming the user, never the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_fail_clearly_without_the_password() {
    let broker = Broker::new().await;
    let receiver = Receiver::new().await;
    let secret = "n0t-the-Pa55word-z3";
    let url = url_with_password(&amqp_url(), secret);
    let user: String = amqp_url()
        .parse::<outbox_rabbitmq::lapin::uri::AMQPUri>()
        .unwrap()
        .authority
        .userinfo
        .username;

    let err = RabbitConsumer::builder(url.as_str(), broker.queue.as_str())
        .spawn(
            outbox_sqlite::SqliteInbox::new(receiver.db.sqlite().outbox(), receiver.pool.clone()),
            Recorder::default(),
        )
        .await
        .unwrap_err();
    let text = format!("{err} / {err:?}");
    eprintln!("consumer: {text}");
    assert_eq!(err.kind(), ErrorKind::Config, "{text}");
    assert!(
        text.contains(&format!("authentication failed for user `{user}`")),
        "{text}"
    );
    assert!(!text.contains(secret), "{text}");

    let err = RabbitTransport::builder(url.as_str())
        .build()
        .await
        .unwrap_err();
    let text = format!("{err} / {err:?}");
    eprintln!("transport: {text}");
    assert_eq!(err.kind(), ErrorKind::Config, "{text}");
    assert!(text.contains(&format!("user `{user}`")), "{text}");
    assert!(!text.contains(secret), "{text}");

    // A missing queue is named too.
    let missing = unique_name("missing");
    let err = RabbitConsumer::builder(amqp_url(), missing.as_str())
        .spawn(
            outbox_sqlite::SqliteInbox::new(receiver.db.sqlite().outbox(), receiver.pool.clone()),
            Recorder::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(err.to_string().contains(&missing), "{err}");
    broker.cleanup().await;
}
