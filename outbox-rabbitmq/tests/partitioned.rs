//! Per-key order across consumer processes: a key-partitioned topology
//! (the transport routes by key hash to N quorum queues, each with a single
//! active consumer), two partitioned `RabbitConsumer`s on a PostgreSQL
//! inbox, real broker and database. Names and schema are the test's own.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_api::testing::wait_until;
use outbox_api::{HandlerError, Message, MessageKind, NewMessage, Outcome, Timestamp, Transport};
use outbox_postgres::sqlx::{self, PgConnection};
use outbox_postgres::testing::PgUnderTest;
use outbox_rabbitmq::testing::{amqp_url, unique_name};
use outbox_rabbitmq::{
    ConsumerHandle, ExchangeType, HandlerFuture, Partitions, RabbitConsumer, RabbitTransport,
    Received, Topology, handler_fn,
};

mod support;
use support::Queue;

const DEADLINE: Duration = Duration::from_secs(60);
const PARTITIONS: u16 = 4;
const KEYS: usize = 20;

struct Fixture {
    exchange: String,
    dlx: String,
    dlq: String,
    partitions: Partitions,
    transport: RabbitTransport,
    admin: Queue,
    db: PgUnderTest,
}

impl Fixture {
    async fn new() -> Fixture {
        let (exchange, dlx, dlq) = (unique_name("px"), unique_name("pdlx"), unique_name("pdlq"));
        let partitions = Partitions::new(unique_name("part"), PARTITIONS).unwrap();
        let transport = RabbitTransport::builder(amqp_url())
            .default_exchange(exchange.as_str())
            .partitioned_exchange(exchange.as_str(), PARTITIONS)
            .build()
            .await
            .expect("transport");
        transport
            .declare(
                &Topology::new()
                    .exchange(exchange.as_str(), ExchangeType::Direct)
                    .exchange(dlx.as_str(), ExchangeType::Fanout)
                    .queue(dlq.as_str())
                    .bind(dlq.as_str(), dlx.as_str(), "")
                    .partitioned(&partitions)
                    .bind_partitioned(&partitions, exchange.as_str(), "Event")
                    .dead_letter_partitioned(&partitions, dlx.as_str()),
            )
            .await
            .expect("declare the partitioned topology");
        let admin = Queue::existing(&partitions.queue(0)).await;
        let db = PgUnderTest::fresh(None).await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            r#"CREATE TABLE "{}".log (n BIGSERIAL PRIMARY KEY, consumer TEXT NOT NULL, key TEXT NOT NULL, seq INT NOT NULL)"#,
            db.schema()
        )))
        .execute(db.pool())
        .await
        .unwrap();
        Fixture {
            exchange,
            dlx,
            dlq,
            partitions,
            transport,
            admin,
            db,
        }
    }

    /// Replica `index` of two, on the shared inbox (one consumer name).
    async fn consumer(&self, label: &'static str, index: u16) -> ConsumerHandle {
        let schema = self.db.schema().to_owned();
        let handler = handler_fn(
            move |msg: &Received, tx: &mut PgConnection| -> HandlerFuture<'_> {
                let body = String::from_utf8(msg.payload.clone()).unwrap();
                let schema = schema.clone();
                Box::pin(async move {
                    let (key, seq) = body.split_once(':').unwrap();
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        r#"INSERT INTO "{schema}".log (consumer, key, seq) VALUES ($1, $2, $3)"#
                    )))
                    .bind(label)
                    .bind(key)
                    .bind(seq.parse::<i32>().unwrap())
                    .execute(&mut *tx)
                    .await?;
                    // A little work per message, so that a stop lands mid-stream.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    Ok::<(), HandlerError>(())
                })
            },
        );
        RabbitConsumer::partitioned(amqp_url(), self.partitions.clone())
            .consumer_name("shop")
            .replica(index, 2)
            .takeover_check(Duration::from_millis(200))
            .prefetch(16)
            .spawn(
                outbox_postgres::PgInbox::new(self.db.pg().outbox(), self.db.pool().clone()),
                handler,
            )
            .await
            .expect("start a partitioned consumer")
    }

    /// Sends `seqs` of every key (in order per key), plus `keyless` messages
    /// without a key, as the relay would.
    async fn send(&self, seqs: std::ops::Range<usize>, keyless: usize) {
        let mut batch = Vec::new();
        for seq in seqs.clone() {
            for k in 0..KEYS {
                batch.push(message(Some(&format!("k{k}")), &format!("k{k}:{seq}")));
            }
        }
        for i in 0..keyless {
            batch.push(message(None, &format!("none-{}-{i}:0", seqs.start)));
        }
        for chunk in batch.chunks(100) {
            let outcomes = self.transport.send(chunk).await;
            assert!(
                outcomes.iter().all(|o| *o == Outcome::Delivered),
                "{outcomes:?}"
            );
        }
    }

    async fn log(&self) -> Vec<(String, String, i32)> {
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            r#"SELECT consumer, key, seq FROM "{}".log ORDER BY n"#,
            self.db.schema()
        )))
        .fetch_all(self.db.pool())
        .await
        .unwrap()
    }

    async fn logged(&self) -> usize {
        self.log().await.len()
    }

    async fn cleanup(self) {
        let markers = self
            .partitions
            .queues()
            .iter()
            .map(|q| format!("{q}.owner"))
            .collect::<Vec<_>>();
        for q in self
            .partitions
            .queues()
            .iter()
            .chain(&markers)
            .chain([&self.dlq])
        {
            let _ = self
                .admin
                .channel
                .queue_delete(q.as_str().into(), Default::default())
                .await;
        }
        for x in [&self.exchange, &self.dlx] {
            let _ = self
                .admin
                .channel
                .exchange_delete(x.as_str().into(), Default::default())
                .await;
        }
    }
}

fn message(key: Option<&str>, body: &str) -> Message {
    let mut m = NewMessage::new(MessageKind::Integration, "Event", body.as_bytes().to_vec());
    if let Some(key) = key {
        m = m.key(key);
    }
    m.into_message(Timestamp::now()).unwrap()
}

/// Each key's sequence numbers in the order their effects committed.
fn per_key(log: &[(String, String, i32)]) -> BTreeMap<String, Vec<i32>> {
    let mut keys: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    for (_, key, seq) in log {
        if key.starts_with('k') {
            keys.entry(key.clone()).or_default().push(*seq);
        }
    }
    keys
}

fn owned(p: &Partitions, index: u16) -> Vec<String> {
    (0..p.count())
        .filter(|i| i % 2 == index)
        .map(|i| p.queue(i))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_share_the_partitions_keep_each_keys_order_and_take_over_a_stopped_ones() {
    let f = Fixture::new().await;
    let a = f.consumer("a", 0).await;
    // Alone, A takes B's partitions over…
    wait_until("A alone consumes every partition", DEADLINE, || {
        let ca = a.consuming();
        let all = f.partitions.queues();
        async move { ca == all }
    })
    .await;
    // …and hands them back once B is there: each consumes what it owns.
    let b = f.consumer("b", 1).await;
    wait_until(
        "each replica consumes the partitions it owns",
        DEADLINE,
        || {
            let (ca, cb) = (a.consuming(), b.consuming());
            let want = (owned(&f.partitions, 0), owned(&f.partitions, 1));
            async move { (ca, cb) == want }
        },
    )
    .await;
    let a_stats = a.stats();
    assert!(
        a_stats.takeovers >= 2 && a_stats.handovers >= 2,
        "{a_stats:?}"
    );

    f.send(0..20, 20).await;
    let first = 20 * KEYS + 20;
    wait_until("the first messages are handled", DEADLINE, || async {
        f.logged().await == first
    })
    .await;
    let log = f.log().await;
    assert!(
        log.iter().any(|e| e.0 == "a") && log.iter().any(|e| e.0 == "b"),
        "both replicas handled messages"
    );
    // A key lives in one partition, so one replica handles it.
    for (key, _) in per_key(&log) {
        let by: std::collections::BTreeSet<&str> = log
            .iter()
            .filter(|e| e.1 == key)
            .map(|e| e.0.as_str())
            .collect();
        assert_eq!(by.len(), 1, "key {key} handled by {by:?}");
    }

    // Stop A while the next messages flow: B takes its partitions over.
    let sending = f.send(20..40, 20);
    let before = a.stats().handled;
    let stopping = async {
        wait_until("A handled some of the second run", DEADLINE, || {
            let n = a.stats().handled;
            async move { n >= before + 40 }
        })
        .await;
        a.shutdown().await;
    };
    tokio::join!(sending, stopping);
    wait_until("B consumes every partition", DEADLINE, || {
        let cb = b.consuming();
        let all = f.partitions.queues();
        async move { cb == all }
    })
    .await;
    let total = 40 * KEYS + 40;
    wait_until("every message is handled", DEADLINE, || async {
        f.logged().await == total
    })
    .await;
    let log = f.log().await;
    for (key, seqs) in per_key(&log) {
        assert_eq!(
            seqs,
            (0..40).collect::<Vec<_>>(),
            "key {key}: effects once, in order"
        );
    }
    let stats = b.stats();
    assert!(stats.takeovers >= 2, "{stats:?}");
    b.shutdown().await;
    for q in f.partitions.queues() {
        assert_eq!(f.admin.ready_in(&q).await, 0, "{q} is empty");
    }
    assert_eq!(f.admin.ready_in(&f.dlq).await, 0, "nothing dead-lettered");
    f.cleanup().await;
}

#[tokio::test]
async fn bad_partition_settings_are_refused_naming_the_field() {
    let p = Partitions::new("wh", 4).unwrap();
    let e = RabbitConsumer::partitioned("amqp://u:s3cret@h:5672/%2f", p.clone())
        .replica(2, 2)
        .validate()
        .unwrap_err();
    assert!(
        e.to_string().contains("replica") && !e.to_string().contains("s3cret"),
        "{e}"
    );
    let e = RabbitConsumer::builder("amqp://u:s3cret@h:5672/%2f", "q")
        .replica(0, 2)
        .validate()
        .unwrap_err();
    assert!(e.to_string().contains("replica"), "{e}");
    let e = RabbitConsumer::partitioned("amqp://u:s3cret@h:5672/%2f", p)
        .takeover_check(Duration::ZERO)
        .validate()
        .unwrap_err();
    assert!(e.to_string().contains("takeover_check"), "{e}");
    let e = RabbitTransport::builder("amqp://u:s3cret@h:5672/%2f")
        .partitioned_exchange("x", 0)
        .validate()
        .unwrap_err();
    assert!(e.to_string().contains("partition"), "{e}");
}
