//! Per-key order across consumer processes over NATS JetStream: the
//! transport appends each message's key-hash partition to its subject, two
//! partitioned `NatsConsumer` replicas (each its own connection, as two
//! processes would have) share the partitions through leases in a
//! key-value bucket, on a PostgreSQL inbox. Streams, bucket and schema are
//! the test's own.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox_api::testing::{TcpProxy, wait_until};
use outbox_api::{HandlerError, Message, MessageKind, NewMessage, Outcome, Timestamp, Transport};
use outbox_nats::testing::{declare_consumer_streams, nats_url, server_addr, unique_name};
use outbox_nats::{
    HandlerFuture, NatsConfig, NatsConsumer, NatsConsumerHandle, NatsTransport, Received,
    handler_fn,
};
use outbox_postgres::sqlx::{self, PgConnection};
use outbox_postgres::testing::PgUnderTest;

const DEADLINE: Duration = Duration::from_secs(60);
const PARTITIONS: u16 = 4;
const KEYS: usize = 20;

struct Fixture {
    name: String,
    bucket: String,
    transport: NatsTransport,
    proxy: TcpProxy,
    db: PgUnderTest,
}

impl Fixture {
    async fn new() -> Fixture {
        let name = unique_name("part");
        let transport = NatsTransport::connect(
            NatsTransport::builder(nats_url()).partitioned(name.as_str(), PARTITIONS),
        )
        .await
        .expect("connect to NATS");
        declare_consumer_streams(&transport, &name, |s| s).await;
        let proxy = TcpProxy::start(server_addr(&nats_url())).await;
        let db = PgUnderTest::fresh(None).await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            r#"CREATE TABLE "{}".log (n BIGSERIAL PRIMARY KEY, consumer TEXT NOT NULL, key TEXT NOT NULL, seq INT NOT NULL)"#,
            db.schema()
        )))
        .execute(db.pool())
        .await
        .unwrap();
        Fixture {
            bucket: unique_name("owners"),
            name,
            transport,
            proxy,
            db,
        }
    }

    /// Replica `index` of two, on the shared inbox (one consumer name);
    /// through the proxy when `proxied`.
    async fn consumer(&self, label: &'static str, index: u16, proxied: bool) -> NatsConsumerHandle {
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
        let url = if proxied {
            format!("nats://{}", self.proxy.addr())
        } else {
            nats_url()
        };
        NatsConsumer::partitioned(
            NatsConfig::new(url),
            self.name.as_str(),
            "shop",
            format!("{}.*", self.name),
            PARTITIONS,
        )
        .replica(index, 2)
        .takeover_check(Duration::from_millis(200))
        .ownership_bucket(self.bucket.as_str())
        .dead_letter_subject(format!("{}-dead.shop", self.name))
        // More than a stalled replica's pull request can take in before
        // its partitions are taken over: the server's limit on
        // unacknowledged messages does not hide a takeover's mistakes.
        .max_ack_pending(256)
        .handler_timeout(Duration::from_secs(1))
        .ack_wait(Duration::from_secs(2))
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
                batch.push(self.message(Some(&format!("k{k}")), &format!("k{k}:{seq}")));
            }
        }
        for i in 0..keyless {
            batch.push(self.message(None, &format!("none-{}-{i}:0", seqs.start)));
        }
        for chunk in batch.chunks(20) {
            let outcomes = self.transport.send(chunk).await;
            assert!(
                outcomes.iter().all(|o| *o == Outcome::Delivered),
                "{outcomes:?}"
            );
            // Spread over time, so that hand-overs land mid-stream.
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }

    fn message(&self, key: Option<&str>, body: &str) -> Message {
        let mut m = NewMessage::new(MessageKind::Integration, "Event", body.as_bytes().to_vec())
            .destination(self.name.as_str(), "Event");
        if let Some(key) = key {
            m = m.key(key);
        }
        m.into_message(Timestamp::now()).unwrap()
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

    /// Waits until every message of `0..seqs` (and `keyless` per run of 20)
    /// is handled, then checks each key's effects: once each, in order.
    async fn check_all_handled_in_order(&self, seqs: i32, keyless: usize) {
        let total = seqs as usize * KEYS + keyless;
        wait_until("every message is handled", DEADLINE, || async {
            self.logged().await >= total
        })
        .await;
        let log = self.log().await;
        assert_eq!(log.len(), total, "each effect once");
        for (key, got) in per_key(&log) {
            assert_eq!(
                got,
                (0..seqs).collect::<Vec<_>>(),
                "key {key}: effects once, in order"
            );
        }
    }
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

fn owned(index: u16) -> Vec<u16> {
    (0..PARTITIONS).filter(|i| i % 2 == index).collect()
}

fn all() -> Vec<u16> {
    (0..PARTITIONS).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_the_partitions_keep_each_keys_order_and_take_over_a_stopped_or_stalled_one()
 {
    let f = Fixture::new().await;
    let a = f.consumer("a", 0, false).await;
    // Alone, A takes B's partitions over…
    wait_until("A alone consumes every partition", DEADLINE, || {
        let pa = a.partitions();
        async move { pa == all() }
    })
    .await;
    // …and hands them back once B is there: each consumes what it owns.
    let b = f.consumer("b", 1, true).await;
    wait_until(
        "each replica consumes the partitions it owns",
        DEADLINE,
        || {
            let (pa, pb) = (a.partitions(), b.partitions());
            async move { (pa, pb) == (owned(0), owned(1)) }
        },
    )
    .await;
    let stats = a.stats();
    assert!(stats.takeovers >= 2 && stats.handovers >= 2, "{stats:?}");

    f.send(0..20, 20).await;
    f.check_all_handled_in_order(20, 20).await;
    let log = f.log().await;
    assert!(
        log.iter().any(|e| e.0 == "a") && log.iter().any(|e| e.0 == "b"),
        "both replicas handled messages"
    );
    // A key lives in one partition, so one replica handles it.
    for (key, _) in per_key(&log) {
        let by: BTreeSet<&str> = log
            .iter()
            .filter(|e| e.1 == key)
            .map(|e| e.0.as_str())
            .collect();
        assert_eq!(by.len(), 1, "key {key} handled by {by:?}");
    }

    // A stops (a clean hand-back) while the next messages flow: B takes
    // its partitions over at once and gets what A gave back first.
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
        let pb = b.partitions();
        async move { pb == all() }
    })
    .await;
    f.check_all_handled_in_order(40, 40).await;

    // A comes back and gets its partitions; then B's connection stalls
    // mid-stream (no clean hand-back; the server goes on sending it
    // messages it never gets): B stops consuming before its leases expire,
    // and A takes its partitions over only once the server delivers again
    // what B left unacknowledged — first, so that no key is reordered.
    let a = f.consumer("a", 0, false).await;
    wait_until("A has its partitions back", DEADLINE, || {
        let (pa, pb) = (a.partitions(), b.partitions());
        async move { (pa, pb) == (owned(0), owned(1)) }
    })
    .await;
    let sending = f.send(40..80, 20);
    let before = b.stats().handled;
    let stalling = async {
        wait_until("B handled some of the third run", DEADLINE, || {
            let n = b.stats().handled;
            async move { n >= before + 40 }
        })
        .await;
        f.proxy.stall();
    };
    tokio::join!(sending, stalling);
    wait_until("A consumes every partition", DEADLINE, || {
        let (pa, pb) = (a.partitions(), b.partitions());
        async move { pa == all() && pb.is_empty() }
    })
    .await;
    f.check_all_handled_in_order(80, 60).await;
    let stats = a.stats();
    assert_eq!((stats.dead_lettered, stats.retried), (0, 0), "{stats:?}");
    assert!(
        stats.takeovers >= 2,
        "A took B's partitions over: {stats:?}"
    );
    let stats = b.stats();
    assert!(stats.takeovers >= 2 && stats.handovers >= 2, "{stats:?}");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn bad_partition_settings_are_refused_naming_the_field() {
    let config = || NatsConfig::new("nats://u:s3cret@127.0.0.1:4222");
    let refused = |b: outbox_nats::NatsConsumerBuilder, field: &str| {
        let e = b.validate().unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(field) && !text.contains("s3cret"),
            "{field}: {text}"
        );
    };
    refused(
        NatsConsumer::partitioned(config(), "S", "shop", "s.*", 4).replica(2, 2),
        "replica",
    );
    refused(
        NatsConsumer::builder(config(), "S", "shop").replica(0, 2),
        "replica",
    );
    refused(
        NatsConsumer::partitioned(config(), "S", "shop", "s.*", 0),
        "partitions",
    );
    refused(
        NatsConsumer::partitioned(config(), "S", "shop", "s.>", 4),
        "filter",
    );
    refused(
        NatsConsumer::partitioned(config(), "S", "shop", "s.*", 4).filter_subject("s.x"),
        "filter_subject",
    );
    refused(
        NatsConsumer::partitioned(config(), "S", "shop", "s.*", 4).takeover_check(Duration::ZERO),
        "takeover_check",
    );
    refused(
        NatsConsumer::partitioned(config(), "S", "shop", "s.*", 4).ownership_bucket("a.b"),
        "ownership_bucket",
    );
    let e = NatsTransport::builder("nats://u:s3cret@127.0.0.1:4222")
        .partitioned("s", 0)
        .validate()
        .unwrap_err();
    assert!(e.to_string().contains("partitioned"), "{e}");
    let e = NatsTransport::builder("nats://127.0.0.1:4222")
        .partitioned("a.*", 4)
        .validate()
        .unwrap_err();
    assert!(e.to_string().contains("partitioned"), "{e}");
}
