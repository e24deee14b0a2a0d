//! `KafkaConsumer` through the consumer conformance suite
//! (`outbox_api::testing::consumer`) on the memory, SQLite, PostgreSQL and
//! MySQL inboxes. Each test has a tansu broker of its own behind a proxy
//! it can cut (the broker advertises the proxy, so every client connects
//! through it), and its own topics and database.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_api::receive::{ConsumerStats, InboxHandler, Received};
use outbox_api::testing::{ConsumerSettings, ConsumerUnderTest, TcpProxy};
use outbox_api::{
    ErrorKind, Inbox, MessageId, MessageKind, NewMessage, Outcome, Timestamp, Transport,
};
use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use outbox_kafka::testing::{OwnTansu, create_topic, free_port, read_topic, unique_topic};
use outbox_kafka::{KafkaConfig, KafkaConsumer, KafkaConsumerHandle, KafkaTransport};

/// Partitions of the consumed topic.
const PARTITIONS: i32 = 3;
const DEADLINE: Duration = Duration::from_secs(30);

/// The test's own broker behind a proxy, its topic and dead-letter topic,
/// a transport publishing to them as the relay would, and the consumer
/// under test.
struct Kafka {
    topic: String,
    dead: String,
    group: String,
    proxy: TcpProxy,
    transport: KafkaTransport,
    /// Sends made while the proxy was cut finish after the heal.
    later: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    consumer: Mutex<Option<Arc<KafkaConsumerHandle>>>,
    broker: Mutex<OwnTansu>,
    _dir: tempfile::TempDir,
}

impl Kafka {
    async fn new() -> Kafka {
        let dir = tempfile::tempdir().expect("a directory for the broker");
        let port = free_port();
        let proxy = TcpProxy::start(([127, 0, 0, 1], port).into()).await;
        let broker = OwnTansu::start_advertising(dir.path(), port, proxy.addr());
        let bootstrap = broker.bootstrap();
        let topic = unique_topic("cons");
        let dead = format!("{topic}.dead");
        create_topic(&bootstrap, &topic, PARTITIONS).await;
        create_topic(&bootstrap, &dead, 1).await;
        let transport = KafkaTransport::connect(
            KafkaTransport::builder(&bootstrap).delivery_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("connect the transport");
        Kafka {
            topic,
            dead,
            group: "c1".to_owned(),
            proxy,
            transport,
            later: Mutex::new(Vec::new()),
            consumer: Mutex::new(None),
            broker: Mutex::new(broker),
            _dir: dir,
        }
    }

    fn handle(&self) -> Arc<KafkaConsumerHandle> {
        self.consumer
            .lock()
            .unwrap()
            .clone()
            .expect("the consumer was spawned")
    }

    fn bootstrap(&self) -> String {
        self.proxy.addr().to_string()
    }

    /// Sends until the broker has it: at once, or (while the proxy is cut)
    /// in the background, finished by `stop_and_count_left`.
    async fn send(&self, id: MessageId, key: Option<&str>, body: &[u8]) {
        let mut m = NewMessage::new(MessageKind::Integration, "T", body.to_vec())
            .destination(self.topic.as_str(), "")
            .with_id(id);
        if let Some(key) = key {
            m = m.key(key);
        }
        let m = m.into_message(Timestamp::now()).unwrap();
        let transport = self.transport.clone();
        let sending = tokio::spawn(async move {
            let deadline = Instant::now() + DEADLINE * 2;
            loop {
                match transport.send(std::slice::from_ref(&m)).await.as_slice() {
                    [Outcome::Delivered] => return,
                    [Outcome::Unavailable(_)] if Instant::now() < deadline => {}
                    other => panic!("publishing {}: {other:?}", m.id),
                }
            }
        });
        // A send through the cut proxy only ends after the heal.
        let answered = tokio::time::timeout(Duration::from_millis(500), async {
            while !sending.is_finished() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await;
        if answered.is_ok() {
            sending.await.expect("the send");
        } else {
            self.later.lock().unwrap().push(sending);
        }
    }

    /// Records of the group's partitions past its committed offsets.
    async fn left(&self) -> u64 {
        let (bootstrap, topic, group) = (self.bootstrap(), self.topic.clone(), self.group.clone());
        tokio::task::spawn_blocking(move || {
            let reader: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .set("group.id", &group)
                .set("enable.auto.commit", "false")
                .create()
                .expect("a reading consumer");
            let mut list = TopicPartitionList::new();
            for p in 0..PARTITIONS {
                list.add_partition(&topic, p);
            }
            let committed = reader
                .committed_offsets(list, Duration::from_secs(10))
                .expect("the group's committed offsets");
            let mut left = 0;
            for p in 0..PARTITIONS {
                let (low, high) = reader
                    .fetch_watermarks(&topic, p, Duration::from_secs(10))
                    .expect("the partition's watermarks");
                let at = match committed.find_partition(&topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => o,
                    _ => low,
                };
                left += (high - at).max(0) as u64;
            }
            left
        })
        .await
        .expect("counting what is left")
    }
}

#[async_trait]
impl ConsumerUnderTest for Kafka {
    async fn spawn<I>(
        &self,
        inbox: I,
        handler: Arc<dyn InboxHandler<I::Conn>>,
        settings: ConsumerSettings,
    ) where
        I: Inbox + Clone,
    {
        // Every client goes through the proxy: `through_proxy` holds always.
        let mut b = KafkaConsumer::builder(
            KafkaConfig::new(self.bootstrap()),
            [self.topic.as_str()],
            self.group.as_str(),
        )
        .dead_letter_topic(self.dead.as_str())
        .handler_timeout(Duration::from_secs(2))
        .commit_interval(Duration::from_millis(50));
        if let Some(n) = settings.max_attempts {
            b = b.max_attempts(n);
        }
        if let Some(d) = settings.retry_delay {
            b = b.retry_delay(d);
        }
        if let Some((first, max)) = settings.unavailable_backoff {
            b = b.unavailable_backoff(first, max);
        }
        if let Some((retention, every)) = settings.inbox_retention {
            b = b
                .inbox_retention(Some(retention))
                .inbox_purge_interval(every);
        }
        if let Some(n) = settings.prefetch {
            b = b.max_in_flight(n);
        }
        let handle = Arc::new(b.spawn(inbox, handler).await.expect("start the consumer"));
        *self.consumer.lock().unwrap() = Some(handle.clone());
        let deadline = Instant::now() + DEADLINE;
        while !(handle.is_connected() && handle.partitions().len() == PARTITIONS as usize) {
            assert!(
                Instant::now() < deadline,
                "the consumer did not join its group within {DEADLINE:?}: {handle:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn publish(&self, id: MessageId, key: Option<&str>, body: &[u8]) {
        self.send(id, key, body).await;
    }

    async fn publish_again(&self, id: MessageId, body: &[u8]) {
        // Kafka keeps every record: the copy is a record of its own.
        self.send(id, None, body).await;
    }

    fn stats(&self) -> ConsumerStats {
        self.handle().stats()
    }

    fn is_connected(&self) -> bool {
        self.handle().is_connected()
    }

    async fn break_connection(&self) {
        self.proxy.cut();
    }

    async fn heal_connection(&self) {
        self.proxy.heal();
    }

    async fn dead_letters(&self) -> Vec<(Option<MessageId>, Vec<u8>)> {
        read_topic(&self.bootstrap(), &self.dead, 1, DEADLINE)
            .await
            .into_iter()
            .map(|r| (r.id().and_then(|id| id.parse().ok()), r.payload))
            .collect()
    }

    async fn stop_and_count_left(&self) -> u64 {
        let later: Vec<_> = std::mem::take(&mut *self.later.lock().unwrap());
        for sending in later {
            sending.await.expect("a send made during the cut");
        }
        // While the consumer runs, its commits catch up.
        let deadline = Instant::now() + DEADLINE;
        while self.left().await > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.handle().shutdown().await;
        self.left().await
    }

    async fn finish(&self) {}
}

/// A group that cannot start says why: a consumed topic or the
/// dead-letter topic missing, a guarantee configured away, no broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_refuses_to_start_without_its_topics_or_with_its_guarantees_weakened() {
    let fx = Kafka::new().await;
    let inbox = outbox_memory::MemoryInbox::new(outbox_memory::MemoryStore::new());
    let handler = || {
        outbox_api::receive::handler_fn(
            |_: &Received,
             _: &mut outbox_memory::MemoryTransaction|
             -> outbox_api::receive::HandlerFuture<'_> { Box::pin(async { Ok(()) }) },
        )
    };
    let config = || KafkaConfig::new(fx.bootstrap());
    let e = KafkaConsumer::builder(config(), [fx.topic.as_str()], "g")
        .dead_letter_topic("t.nowhere.dead")
        .spawn(inbox.clone(), handler())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("t.nowhere.dead"), "{e}");
    let e = KafkaConsumer::builder(config(), ["t.no-such-topic"], "g")
        .dead_letter_topic(fx.dead.as_str())
        .spawn(inbox.clone(), handler())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(e.to_string().contains("t.no-such-topic"), "{e}");
    for (property, value) in [
        ("enable.auto.commit", "true"),
        ("partition.assignment.strategy", "cooperative-sticky"),
    ] {
        let e = KafkaConsumer::builder(config(), [fx.topic.as_str()], "g")
            .dead_letter_topic(fx.dead.as_str())
            .set(property, value)
            .spawn(inbox.clone(), handler())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.to_string().contains(property), "{e}");
    }
    let e = KafkaConsumer::builder(
        KafkaConfig::new(format!("127.0.0.1:{}", free_port()))
            .metadata_timeout(Duration::from_millis(500))
            .set("sasl.password", "s3cret-value"),
        [fx.topic.as_str()],
        "g",
    )
    .spawn(inbox, handler())
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(!e.to_string().contains("s3cret-value"), "{e}");
}

/// Members joining and leaving a group mid-run (each a rebalance that
/// revokes every partition) lose nothing, run each message's effect once
/// (a shared inbox), and keep each key's order: a partition's next owner
/// starts at the oldest record its last owner had not settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_joining_and_leaving_keep_each_keys_order_and_lose_nothing() {
    const KEYS: usize = 30;
    const PER_KEY: usize = 30;
    const TOTAL: usize = KEYS * PER_KEY;
    let fx = Kafka::new().await;
    let inbox = outbox_memory::MemoryInbox::new(outbox_memory::MemoryStore::new());
    let effects: Arc<Mutex<Vec<String>>> = Arc::default();
    let member = |name: &'static str| {
        let effects = effects.clone();
        let handler = outbox_api::receive::handler_fn(
            move |msg: &Received,
                  _: &mut outbox_memory::MemoryTransaction|
                  -> outbox_api::receive::HandlerFuture<'_> {
                let effects = effects.clone();
                let body = String::from_utf8_lossy(&msg.payload).into_owned();
                Box::pin(async move {
                    // Slow enough that a rebalance finds work in flight.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    effects.lock().unwrap().push(body);
                    Ok(())
                })
            },
        );
        let builder = KafkaConsumer::builder(
            KafkaConfig::new(fx.bootstrap()),
            [fx.topic.as_str()],
            fx.group.as_str(),
        )
        .dead_letter_topic(fx.dead.as_str())
        .session_timeout(Duration::from_secs(6))
        .max_in_flight(20)
        .set("client.id", name);
        let inbox = inbox.clone();
        async move {
            builder
                .spawn(inbox, handler)
                .await
                .expect("a member starts")
        }
    };
    let handled = || effects.lock().unwrap().len();
    let publish = |rounds: std::ops::Range<usize>| {
        let fx = &fx;
        async move {
            for seq in rounds {
                let batch: Vec<_> = (0..KEYS)
                    .map(|k| {
                        NewMessage::new(MessageKind::Integration, "T", format!("k{k}:{seq}"))
                            .destination(fx.topic.as_str(), "")
                            .key(format!("k{k}"))
                            .into_message(Timestamp::now())
                            .unwrap()
                    })
                    .collect();
                let outcomes = fx.transport.send(&batch).await;
                assert!(
                    outcomes.iter().all(|o| *o == Outcome::Delivered),
                    "{outcomes:?}"
                );
            }
        }
    };
    let first = member("first").await;
    publish(0..10).await;
    outbox_api::testing::wait_until("a sixth is handled", DEADLINE, || {
        let n = handled();
        async move { n >= TOTAL / 6 }
    })
    .await;
    // A member joins: every partition is revoked and shared out again.
    let second = member("second").await;
    outbox_api::testing::wait_until("both members hold partitions", DEADLINE, || {
        let both = !first.partitions().is_empty() && !second.partitions().is_empty();
        async move { both }
    })
    .await;
    publish(10..20).await;
    outbox_api::testing::wait_until("the second member handles its share", DEADLINE, || {
        let n = second.stats().handled;
        async move { n > 0 }
    })
    .await;
    // A member leaves with records in flight: the other takes them.
    publish(20..PER_KEY).await;
    first.shutdown().await;
    let by_first = first.stats();
    outbox_api::testing::wait_until("everything is handled", DEADLINE * 2, || {
        let n = handled();
        async move { n >= TOTAL }
    })
    .await;
    assert!(
        by_first.handled > 0 && by_first.handled < TOTAL as u64,
        "both members handled a share: {by_first:?}"
    );
    *fx.consumer.lock().unwrap() = Some(Arc::new(second));
    println!("the member left standing: {:?}", fx.stats());
    assert_eq!(fx.stop_and_count_left().await, 0, "every offset committed");
    let effects = effects.lock().unwrap().clone();
    assert_eq!(effects.len(), TOTAL, "each message's effect once");
    let mut next = std::collections::HashMap::new();
    for body in &effects {
        let (key, seq) = body.split_once(':').expect("<key>:<seq>");
        let seq: usize = seq.parse().unwrap();
        let expected = next.entry(key.to_owned()).or_insert(0);
        assert_eq!(seq, *expected, "key {key}: effects in order");
        *expected += 1;
    }
}

/// The broker SIGKILLed and restarted while a member consumes into a
/// PostgreSQL inbox: nothing is lost, each effect happens once, each key's
/// effects stay in order, no attempt is counted (an outage, not the
/// records' fault), and every offset is committed at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_and_restarted_mid_run_loses_nothing_and_counts_no_attempt() {
    use outbox_api::testing::InboxUnderTest;
    const KEYS: usize = 20;
    const PER_KEY: usize = 50;
    const TOTAL: usize = KEYS * PER_KEY;
    let fx = Kafka::new().await;
    let db = outbox_postgres::testing::PgUnderTest::fresh(None).await;
    let sut = Arc::new(db);
    let replier = Arc::new(outbox_api::testing::consumer::Replier::new(&sut));
    fx.spawn(
        sut.inbox().clone(),
        replier.clone(),
        ConsumerSettings::default(),
    )
    .await;
    let sent = |seq: usize| -> Vec<_> {
        (0..KEYS)
            .map(|k| {
                NewMessage::new(MessageKind::Integration, "T", format!("k{k}:{seq}"))
                    .destination(fx.topic.as_str(), "")
                    .key(format!("k{k}"))
                    .into_message(Timestamp::now())
                    .unwrap()
            })
            .collect()
    };
    for seq in 0..PER_KEY / 2 {
        let outcomes = fx.transport.send(&sent(seq)).await;
        assert!(
            outcomes.iter().all(|o| *o == Outcome::Delivered),
            "{outcomes:?}"
        );
    }
    outbox_api::testing::wait_until("a fifth is handled", DEADLINE, || {
        let n = fx.stats().handled;
        async move { n >= (TOTAL / 5) as u64 }
    })
    .await;
    fx.broker.lock().unwrap().kill();
    outbox_api::testing::wait_until("the member notices", DEADLINE, || {
        let up = fx.is_connected();
        async move { !up }
    })
    .await;
    tokio::task::block_in_place(|| fx.broker.lock().unwrap().restart());
    // The relay's side goes on once the broker is back.
    for seq in PER_KEY / 2..PER_KEY {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let outcomes = fx.transport.send(&sent(seq)).await;
            if outcomes.iter().all(|o| *o == Outcome::Delivered) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the broker did not come back: {outcomes:?}"
            );
        }
    }
    outbox_api::testing::wait_until("every record is handled", DEADLINE * 2, || {
        let n = replier
            .order
            .lock()
            .unwrap()
            .values()
            .map(Vec::len)
            .sum::<usize>();
        async move { n >= TOTAL }
    })
    .await;
    let stats = fx.stats();
    assert_eq!((stats.retried, stats.dead_lettered), (0, 0), "{stats:?}");
    assert!(stats.reconnects >= 1, "the reconnect is counted: {stats:?}");
    assert_eq!(fx.stop_and_count_left().await, 0, "every offset committed");
    let order = replier.order.lock().unwrap().clone();
    for (key, bodies) in &order {
        let expected: Vec<String> = (0..PER_KEY).map(|seq| format!("{key}:{seq}")).collect();
        assert_eq!(bodies, &expected, "key {key}: each effect once, in order");
    }
    assert_eq!(
        sut.store().stats().await.expect("stats").pending,
        TOTAL as u64,
        "one reply per record: each effect once"
    );
    println!("broker killed and restarted: {stats:?}");
}

mod memory {
    outbox_api::consumer_conformance_tests!(
        super::Kafka::new().await,
        outbox_memory::MemoryInbox::new(outbox_memory::MemoryStore::new())
    );
}

mod sqlite {
    outbox_api::consumer_conformance_tests!(
        super::Kafka::new().await,
        outbox_sqlite::testing::SqlxUnderTest::fresh(None).await
    );
}

mod postgres {
    outbox_api::consumer_conformance_tests!(
        super::Kafka::new().await,
        outbox_postgres::testing::PgUnderTest::fresh(None).await
    );
}

mod mysql {
    outbox_api::consumer_conformance_tests!(
        super::Kafka::new().await,
        outbox_mysql::testing::MySqlUnderTest::fresh(None).await
    );
}
