//! Two Kafka consumer processes in one group (four partitions), one
//! SIGKILLed mid-run and replaced: 2,000 messages over 50 keys, sent
//! through `KafkaTransport` as the relay sends them, into a PostgreSQL
//! inbox; every message's effect exactly once and each key's effects in
//! order, nothing dead-lettered or retried (the kill is an outage, not a
//! failure), every offset committed at the end. The killed process's
//! partitions go to the others after its session times out (3 s here),
//! read again from their committed offsets: what it handled past them is
//! a duplicate for the inbox.
//!
//! `harness = false`: run without arguments this is the test; run with
//! `OUTBOX_KAFKA_SIGKILL_CHILD` set it is one consumer process, until its
//! stdin closes (then it prints its stats) — or until it is killed.

use std::io::Write;
use std::time::{Duration, Instant};

use outbox_api::receive::{HandlerFuture, Received, handler_fn};
use outbox_api::testing::{ChildProcess, until_stdin_closes, wait_until};
use outbox_api::{HandlerError, MessageKind, NewMessage, Outcome, Timestamp, Transport};
use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use outbox_kafka::testing::{create_topic, kafka_url, read_topic, unique_topic};
use outbox_kafka::{KafkaConfig, KafkaConsumer, KafkaTransport};
use outbox_postgres::PgStore;
use outbox_postgres::sqlx::{self, PgConnection, postgres::PgPoolOptions};
use outbox_postgres::testing::{PgUnderTest, database_url};

const CHILD: &str = "OUTBOX_KAFKA_SIGKILL_CHILD";
const NAME: &str = "a_consumer_sigkilled_mid_run_loses_nothing_and_keeps_each_keys_order";
const KEYS: usize = 50;
const PER_KEY: usize = 40;
const TOTAL: usize = KEYS * PER_KEY;
const PARTITIONS: i32 = 4;
const GROUP: &str = "sigkill";
const DEADLINE: Duration = Duration::from_secs(90);

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    match std::env::var(CHILD) {
        Ok(setup) => rt.block_on(child(&setup)),
        Err(_) if !outbox_api::testing::selected(NAME) => {}
        Err(_) => {
            let started = Instant::now();
            rt.block_on(a_consumer_sigkilled_mid_run_loses_nothing_and_keeps_each_keys_order());
            println!(
                "test {NAME} ... ok ({:.1} s)",
                started.elapsed().as_secs_f64()
            );
        }
    }
}

/// One consumer process: `<schema> <topic>` in its environment; logs each
/// handled message in the inbox transaction.
async fn child(setup: &str) {
    let Some((schema, topic)) = setup.split_once(' ') else {
        panic!("<schema> <topic>, got `{setup}`");
    };
    let url = database_url();
    let store = PgStore::builder(url.clone())
        .schema(schema)
        .table("test_outbox")
        .inbox_table("test_inbox")
        .max_connections(2)
        .connect()
        .await
        .expect("the test's schema");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("application pool");
    let log = format!(r#"INSERT INTO "{schema}".log (id, body) VALUES ($1, $2)"#);
    let handler = handler_fn(
        move |msg: &Received, tx: &mut PgConnection| -> HandlerFuture<'_> {
            let log = log.clone();
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(log))
                    .bind(msg.id.to_string())
                    .bind(String::from_utf8_lossy(&msg.payload).into_owned())
                    .execute(&mut *tx)
                    .await?;
                Ok::<(), HandlerError>(())
            })
        },
    );
    let consumer = KafkaConsumer::builder(KafkaConfig::new(kafka_url()), [topic], GROUP)
        .dead_letter_topic(format!("{topic}.dead"))
        .session_timeout(Duration::from_secs(3))
        .max_in_flight(50)
        .handler_timeout(Duration::from_secs(1))
        .spawn(outbox_postgres::PgInbox::new(store.outbox(), pool), handler)
        .await
        .expect("start the consumer");
    println!("ready");
    std::io::stdout().flush().unwrap();
    // Until the parent closes stdin (a graceful stop) — or kills us.
    until_stdin_closes().await;
    consumer.shutdown().await;
    let s = consumer.stats();
    println!(
        "stats retried={} dead_lettered={} deferred={} duplicates={}",
        s.retried, s.dead_lettered, s.deferred, s.duplicates
    );
}

/// Records of `topic` past the group's committed offsets.
async fn left(bootstrap: String, topic: String) -> i64 {
    tokio::task::spawn_blocking(move || {
        let reader: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", GROUP)
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
        (0..PARTITIONS)
            .map(|p| {
                let (low, high) = reader
                    .fetch_watermarks(&topic, p, Duration::from_secs(10))
                    .expect("the partition's watermarks");
                let at = match committed.find_partition(&topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => o,
                    _ => low,
                };
                high - at
            })
            .sum()
    })
    .await
    .expect("counting what is left")
}

async fn a_consumer_sigkilled_mid_run_loses_nothing_and_keeps_each_keys_order() {
    let bootstrap = kafka_url();
    let topic = unique_topic("kill");
    create_topic(&bootstrap, &topic, PARTITIONS).await;
    create_topic(&bootstrap, &format!("{topic}.dead"), 1).await;
    let transport = KafkaTransport::connect(KafkaTransport::builder(&bootstrap))
        .await
        .expect("connect to Kafka");
    let db = PgUnderTest::fresh(None).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"CREATE TABLE "{}".log (n BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, body TEXT NOT NULL)"#,
        db.schema()
    )))
    .execute(db.pool())
    .await
    .unwrap();
    let count = |what: &'static str| {
        let (pool, schema) = (db.pool().clone(), db.schema().to_owned());
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                r#"SELECT {what} FROM "{schema}".log"#
            )))
            .fetch_one(&pool)
            .await
            .unwrap() as usize
        }
    };
    let setup = format!("{} {topic}", db.schema());
    let steady = ChildProcess::start(&[(CHILD, &setup)], "ready", DEADLINE);
    let first = ChildProcess::start(&[(CHILD, &setup)], "ready", DEADLINE);

    // The relay's side: each key's messages in order, a key's next one
    // only after the previous was acknowledged (as the relay holds one
    // message per key in flight), 50 keys per send.
    for seq in 0..PER_KEY {
        let batch: Vec<_> = (0..KEYS)
            .map(|k| {
                NewMessage::new(MessageKind::Integration, "Event", format!("k{k}:{seq}"))
                    .destination(topic.as_str(), "")
                    .key(format!("k{k}"))
                    .into_message(Timestamp::now())
                    .unwrap()
            })
            .collect();
        let outcomes = transport.send(&batch).await;
        assert!(
            outcomes.iter().all(|o| *o == Outcome::Delivered),
            "{outcomes:?}"
        );
    }
    wait_until("a quarter is handled", DEADLINE, || async {
        count("COUNT(*)").await >= TOTAL / 4
    })
    .await;
    first.sigkill();
    let killed_at = count("COUNT(*)").await;
    assert!(killed_at < TOTAL, "killed after everything was handled");
    let setup_again = setup.clone();
    let second = tokio::task::spawn_blocking(move || {
        ChildProcess::start(&[(CHILD, &setup_again)], "ready", DEADLINE)
    })
    .await
    .unwrap();
    wait_until("every message is handled", DEADLINE, || async {
        count("COUNT(DISTINCT id)").await >= TOTAL
    })
    .await;
    wait_until("every offset is committed", DEADLINE, || {
        let left = left(bootstrap.clone(), topic.clone());
        async move { left.await == 0 }
    })
    .await;
    let stats = tokio::task::spawn_blocking(move || {
        let said = |l: &str| l.starts_with("stats");
        format!("{}; {}", second.stop_saying(said), steady.stop_saying(said))
    })
    .await
    .unwrap();
    assert_eq!(
        count("COUNT(*)").await,
        TOTAL,
        "each message's effect exactly once (the inbox drops what the killed process had committed)"
    );
    let bodies: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        r#"SELECT body FROM "{}".log ORDER BY n"#,
        db.schema()
    )))
    .fetch_all(db.pool())
    .await
    .unwrap();
    let mut next = std::collections::HashMap::new();
    for body in &bodies {
        let (key, seq) = body.split_once(':').expect("<key>:<seq>");
        let seq: usize = seq.parse().unwrap();
        let expected = next.entry(key.to_owned()).or_insert(0);
        assert_eq!(seq, *expected, "key {key}: effects in order");
        *expected += 1;
    }
    assert_eq!(
        stats.matches("retried=0 dead_lettered=0").count(),
        2,
        "the kill is not the messages' fault: {stats}"
    );
    assert_eq!(
        left(bootstrap.clone(), topic.clone()).await,
        0,
        "every offset committed after the graceful stops"
    );
    let dead = read_topic(&bootstrap, &format!("{topic}.dead"), 1, DEADLINE).await;
    assert!(dead.is_empty(), "nothing dead-lettered: {dead:?}");
    println!(
        "kafka sigkill: {TOTAL} messages, {killed_at} handled when the first process was killed, {stats}"
    );
}
