//! Three consumer processes on one partitioned topology, one SIGKILLed
//! mid-run and restarted (issue 13, item 4): 20,000 messages over 200 keys,
//! sent through `RabbitTransport` to a partitioned exchange as the relay
//! sends them; every message's effect exactly once (PostgreSQL inbox), each
//! key's effects in order, every queue empty, nothing dead-lettered.
//!
//! `harness = false`: run without arguments this is the test; run with
//! `OUTBOX_SIGKILL_CHILD` set it is one consumer process (replica
//! `OUTBOX_SIGKILL_CHILD` of 3) until its stdin closes — or until it is
//! killed.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};

use outbox_api::testing::{ChildProcess, until_stdin_closes, wait_until};
use outbox_api::{HandlerError, Message, MessageKind, NewMessage, Outcome, Timestamp, Transport};
use outbox_postgres::PgStore;
use outbox_postgres::sqlx::{self, PgConnection, postgres::PgPoolOptions};
use outbox_postgres::testing::{PgUnderTest, database_url};
use outbox_rabbitmq::testing::{amqp_url, unique_name};
use outbox_rabbitmq::{
    ExchangeType, HandlerFuture, Partitions, RabbitConsumer, RabbitTransport, Received, Topology,
    handler_fn,
};

const CHILD: &str = "OUTBOX_SIGKILL_CHILD";
const REPLICAS: u16 = 3;
const PARTITIONS: u16 = 6;
const KEYS: usize = 200;
const PER_KEY: usize = 100;
const TOTAL: usize = KEYS * PER_KEY;
const DEADLINE: Duration = Duration::from_secs(50);

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    match std::env::var(CHILD) {
        Ok(replica) => rt.block_on(child(replica.parse().expect("replica index"))),
        Err(_) if !outbox_api::testing::selected("three_consumers_one_sigkilled_and_restarted") => {
        }
        Err(_) => {
            let started = Instant::now();
            rt.block_on(three_consumers_one_sigkilled_and_restarted());
            println!(
                "test three_consumers_one_sigkilled_and_restarted ... ok ({:.1} s)",
                started.elapsed().as_secs_f64()
            );
        }
    }
}

/// What a child needs, passed in its environment.
struct Setup {
    schema: String,
    prefix: String,
}

impl Setup {
    fn from_env() -> Setup {
        let var = |n: &str| std::env::var(n).unwrap_or_else(|_| panic!("{n} is not set"));
        Setup {
            schema: var("OUTBOX_SIGKILL_SCHEMA"),
            prefix: var("OUTBOX_SIGKILL_PREFIX"),
        }
    }
}

/// One consumer process: replica `replica` of 3, into the shared
/// PostgreSQL inbox; logs `(label, key, seq)` per handled message.
async fn child(replica: u16) {
    let setup = Setup::from_env();
    let url = database_url();
    let store = PgStore::builder(url.clone())
        .schema(setup.schema.clone())
        .table("test_outbox")
        .inbox_table("test_inbox")
        .max_connections(2)
        .connect()
        .await
        .expect("the test's outbox schema");
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await
        .expect("application pool");
    let label = format!("c{replica}-{}", std::process::id());
    let schema = setup.schema.clone();
    let handler = handler_fn(
        move |msg: &Received, tx: &mut PgConnection| -> HandlerFuture<'_> {
            let body = String::from_utf8(msg.payload.clone()).unwrap();
            let (schema, label) = (schema.clone(), label.clone());
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
                Ok::<(), HandlerError>(())
            })
        },
    );
    let partitions = Partitions::new(setup.prefix, PARTITIONS).unwrap();
    let consumer = RabbitConsumer::partitioned(amqp_url(), partitions)
        .consumer_name("sigkill")
        .replica(replica, REPLICAS)
        .takeover_check(Duration::from_millis(250))
        .prefetch(50)
        .spawn(outbox_postgres::PgInbox::new(store.outbox(), pool), handler)
        .await
        .expect("start the consumer");
    println!("ready");
    std::io::stdout().flush().unwrap();
    // Tell the parent which partitions this process consumes, on change.
    let consumer = std::sync::Arc::new(consumer);
    let watched = std::sync::Arc::clone(&consumer);
    tokio::spawn(async move {
        let mut last = Vec::new();
        loop {
            let now = watched.consuming();
            if now != last {
                println!("consuming {}", now.join(","));
                std::io::stdout().flush().unwrap();
                last = now;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    // Until the parent closes stdin (a graceful stop) — or kills us.
    until_stdin_closes().await;
    consumer.shutdown().await;
}

/// A consumer process: replica `replica` of [`REPLICAS`].
struct Replica(ChildProcess);

impl Replica {
    fn start(replica: u16, schema: &str, prefix: &str) -> Replica {
        Replica(ChildProcess::start(
            &[
                (CHILD, &replica.to_string()),
                ("OUTBOX_SIGKILL_SCHEMA", schema),
                ("OUTBOX_SIGKILL_PREFIX", prefix),
            ],
            "ready",
            DEADLINE,
        ))
    }

    /// Waits until the child says it consumes exactly `queues`.
    fn wait_consuming(&mut self, queues: &[String]) {
        let want = format!("consuming {}", queues.join(","));
        self.0.wait_line(|line| line.trim() == want);
    }

    fn sigkill(self) {
        self.0.sigkill();
    }

    fn stop(self) {
        self.0.stop();
    }
}

async fn three_consumers_one_sigkilled_and_restarted() {
    let (exchange, dlx, dlq) = (unique_name("kx"), unique_name("kdlx"), unique_name("kdlq"));
    let partitions = Partitions::new(unique_name("kpart"), PARTITIONS).unwrap();
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
    let db = PgUnderTest::fresh(None).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"CREATE TABLE "{}".log (n BIGSERIAL PRIMARY KEY, consumer TEXT NOT NULL, key TEXT NOT NULL, seq INT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())"#,
        db.schema()
    )))
    .execute(db.pool())
    .await
    .unwrap();
    let logged = || async {
        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
            r#"SELECT COUNT(*) FROM "{}".log"#,
            db.schema()
        )))
        .fetch_one(db.pool())
        .await
        .unwrap() as usize
    };

    let (schema, prefix) = (db.schema().to_owned(), partitions.prefix().to_owned());
    let mut replicas: Vec<Option<Replica>> = (0..REPLICAS)
        .map(|i| Some(Replica::start(i, &schema, &prefix)))
        .collect();

    // The relay's side: each key's messages in order, 500 per send.
    let send = |seqs: std::ops::Range<usize>| {
        let transport = &transport;
        async move {
            let mut batch = Vec::with_capacity(500);
            for seq in seqs {
                for k in 0..KEYS {
                    batch.push(message(&format!("k{k}"), &format!("k{k}:{seq}")));
                    if batch.len() == 500 {
                        let outcomes = transport.send(&batch).await;
                        assert!(
                            outcomes.iter().all(|o| *o == Outcome::Delivered),
                            "{outcomes:?}"
                        );
                        batch.clear();
                    }
                }
            }
        }
    };
    let killed_at = std::sync::OnceLock::<std::time::SystemTime>::new();
    // Replica 1 is SIGKILLed while the first half is handled…
    let killing = async {
        wait_until("a quarter is handled", DEADLINE, || async {
            logged().await >= TOTAL / 4
        })
        .await;
        replicas[1].take().unwrap().sigkill();
        killed_at.set(std::time::SystemTime::now()).unwrap();
        let at_kill = logged().await;
        wait_until(
            "the others go on with the killed one's partitions",
            DEADLINE,
            || async { logged().await >= at_kill + TOTAL / 8 },
        )
        .await;
    };
    tokio::join!(send(0..PER_KEY / 2), killing);
    // …restarted, it takes its partitions back, and the second half follows.
    let mut restarted = Replica::start(1, &schema, &prefix);
    let own: Vec<String> = (0..PARTITIONS)
        .filter(|i| i % REPLICAS == 1)
        .map(|i| partitions.queue(i))
        .collect();
    let restarted = tokio::task::spawn_blocking(move || {
        restarted.wait_consuming(&own);
        restarted
    })
    .await
    .unwrap();
    replicas[1] = Some(restarted);
    send(PER_KEY / 2..PER_KEY).await;
    wait_until("every message is handled", DEADLINE, || async {
        logged().await >= TOTAL
    })
    .await;

    let admin = AdminQueue::new().await;
    wait_until("every partition queue is drained", DEADLINE, || async {
        let mut ready = 0;
        for q in partitions.queues() {
            ready += admin.ready(&q).await;
        }
        ready == 0
    })
    .await;
    for r in replicas.into_iter().flatten() {
        r.stop();
    }
    // Stopped gracefully: anything not acknowledged would be back now.
    for q in partitions.queues() {
        assert_eq!(admin.ready(&q).await, 0, "{q} is empty");
    }
    assert_eq!(admin.ready(&dlq).await, 0, "nothing was dead-lettered");

    let log: Vec<(String, String, i32, f64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        r#"SELECT consumer, key, seq, EXTRACT(EPOCH FROM at)::float8 FROM "{}".log ORDER BY n"#,
        db.schema()
    )))
    .fetch_all(db.pool())
    .await
    .unwrap();
    assert_eq!(log.len(), TOTAL, "each message's effect exactly once");
    let mut keys: BTreeMap<&str, Vec<i32>> = BTreeMap::new();
    for (_, key, seq, _) in &log {
        keys.entry(key.as_str()).or_default().push(*seq);
    }
    assert_eq!(keys.len(), KEYS);
    let want: Vec<i32> = (0..PER_KEY as i32).collect();
    for (key, seqs) in &keys {
        assert_eq!(seqs, &want, "key {key}: each effect once, in order");
    }
    // The killed replica's partitions went on elsewhere before it came back.
    let killed = killed_at
        .get()
        .expect("the kill happened")
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let first_taken_over = log
        .iter()
        .filter(|(by, key, _, at)| {
            Partitions::of_key(key, PARTITIONS) % REPLICAS == 1
                && !by.starts_with("c1-")
                && *at > killed
        })
        .map(|e| e.3)
        .fold(f64::INFINITY, f64::min);
    assert!(
        first_taken_over.is_finite(),
        "the survivors took the killed replica's partitions over"
    );
    println!(
        "the killed replica's partitions were consumed again {:.0} ms after the SIGKILL (takeover_check 250 ms)",
        (first_taken_over - killed) * 1000.0
    );
    let consumers: std::collections::BTreeSet<&str> = log.iter().map(|e| e.0.as_str()).collect();
    assert!(
        consumers.len() >= 4,
        "three replicas and the restarted one handled messages: {consumers:?}"
    );

    for q in partitions.queues().iter().chain([&dlq]) {
        admin.delete(q).await;
        admin.delete(&format!("{q}.owner")).await;
    }
    admin.delete_exchange(&exchange).await;
    admin.delete_exchange(&dlx).await;
}

fn message(key: &str, body: &str) -> Message {
    NewMessage::new(MessageKind::Integration, "Event", body.as_bytes().to_vec())
        .key(key)
        .into_message(Timestamp::now())
        .unwrap()
}

/// The test's own broker connection for looking at and deleting queues.
struct AdminQueue {
    _connection: lapin::Connection,
    channel: lapin::Channel,
}

impl AdminQueue {
    async fn new() -> AdminQueue {
        let connection =
            lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
                .await
                .expect("admin connection");
        let channel = connection.create_channel().await.expect("channel");
        AdminQueue {
            _connection: connection,
            channel,
        }
    }

    async fn ready(&self, queue: &str) -> u32 {
        self.channel
            .queue_declare(
                queue.into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .expect("passive declare")
            .message_count()
    }

    async fn delete(&self, queue: &str) {
        let _ = self
            .channel
            .queue_delete(queue.into(), Default::default())
            .await;
    }

    async fn delete_exchange(&self, exchange: &str) {
        let _ = self
            .channel
            .exchange_delete(exchange.into(), Default::default())
            .await;
    }
}
