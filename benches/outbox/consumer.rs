//! Figures of the receiving side against a real RabbitMQ and, for the
//! PostgreSQL inbox, a real PostgreSQL (`OUTBOX_AMQP_URL` / `OUTBOX_PG_URL`,
//! else the local defaults if they answer):
//!
//! * `RabbitConsumer` draining a queue into the inbox on SQLite and on
//!   PostgreSQL, beside a bare lapin consumer that runs the same handler
//!   work (one row inserted in a transaction of its own, committed) and then
//!   acks — same quorum queue, same prefetch, same database settings — with
//!   1 consumer and with 3 (three tasks with a connection each, in this
//!   process);
//! * the partitioned topology drained by 3 replicas beside 1 (PostgreSQL
//!   inbox; three tasks in this process);
//! * redelivery after a consumer is SIGKILLed: a child process consumes its
//!   partitions and holds their deliveries; it is killed, and the time until
//!   the standby replica (in this process) handles them is measured.
//!
//! Each throughput run gets a fresh database and queue, filled before the
//! consumers start; the rate is taken from the first handled delivery to the
//! last, so connecting is not counted on either side.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use outbox::{Message, MessageId, MessageKind, NewMessage, Outcome, Timestamp, Transport};
use outbox_postgres::testing::PgUnderTest;
use outbox_rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeleteOptions,
};
use outbox_rabbitmq::lapin::types::FieldTable;
use outbox_rabbitmq::lapin::{BasicProperties, Connection, ConnectionProperties};
use outbox_rabbitmq::postgres::sqlx::{self as pgsqlx, PgConnection};
use outbox_rabbitmq::sqlite::sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use outbox_rabbitmq::sqlite::sqlx::{self as sqlitesqlx, SqliteConnection};
use outbox_rabbitmq::sqlite::{SqliteOutbox, SqliteStore};
use outbox_rabbitmq::{
    ConsumerHandle, ExchangeType, HandlerFuture, Partitions, RabbitConsumer, RabbitTransport,
    Received, Topology, handler_fn,
};

use crate::common::{Figure, not_measured};

/// Deliveries the broker sends ahead to each consumer, bare or not.
const PREFETCH: u16 = 32;
const PAYLOAD: usize = 200;
/// The partitioned figures' partition count.
const PARTITIONS: u16 = 6;
/// How long any one wait of this module may last before the bench fails.
const DEADLINE: Duration = Duration::from_secs(120);

/// The child process of the kill figure: `OUTBOX_BENCH_CONSUMER_CHILD` =
/// `<amqp url> <pg url> <schema> <partition prefix>`.
pub const CHILD_ENV: &str = "OUTBOX_BENCH_CONSUMER_CHILD";

fn payload(i: usize) -> Vec<u8> {
    let mut p = vec![b'x'; PAYLOAD];
    p[..8].copy_from_slice(&i.to_le_bytes());
    p
}

/// Counts handled deliveries; keeps when the first and the last came.
#[derive(Default)]
struct Tally {
    n: AtomicU64,
    first: Mutex<Option<Instant>>,
    last: Mutex<Option<Instant>>,
}

impl Tally {
    fn hit(&self) {
        let now = Instant::now();
        self.first.lock().unwrap().get_or_insert(now);
        *self.last.lock().unwrap() = Some(now);
        self.n.fetch_add(1, Ordering::SeqCst);
    }

    async fn wait_for(&self, n: u64) {
        let deadline = Instant::now() + DEADLINE;
        while self.n.load(Ordering::SeqCst) < n {
            assert!(
                Instant::now() < deadline,
                "only {} of {n} deliveries handled within {DEADLINE:?}",
                self.n.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Deliveries per second from the first handled to the last.
    fn rate(&self) -> f64 {
        let n = self.n.load(Ordering::SeqCst);
        let (first, last) = (self.first.lock().unwrap(), self.last.lock().unwrap());
        let secs = last.unwrap().duration_since(first.unwrap()).as_secs_f64();
        (n.saturating_sub(1)) as f64 / secs.max(1e-9)
    }
}

/// The inbox database of one run, with the handler's `effects` table.
enum Db {
    Sqlite {
        _dir: tempfile::TempDir,
        outbox: SqliteOutbox,
        pool: SqlitePool,
    },
    Postgres(PgUnderTest),
}

impl Db {
    /// A SQLite file as MiniShop opens it: WAL, synchronous NORMAL, one
    /// connection shared by the consumers (writers queue in-process).
    async fn sqlite() -> Db {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("consumer.db");
        let store = SqliteStore::open(&path).await.unwrap();
        store.migrate().await.unwrap();
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap();
        sqlitesqlx::query("CREATE TABLE effects (id TEXT PRIMARY KEY, len INTEGER NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        Db::Sqlite {
            _dir: dir,
            outbox: store.outbox(),
            pool,
        }
    }

    /// A fresh schema (outbox, inbox, `effects`); the application pool has
    /// 8 connections.
    async fn postgres() -> Db {
        let f = PgUnderTest::fresh(None).await;
        pgsqlx::query(pgsqlx::AssertSqlSafe(format!(
            r#"CREATE TABLE "{}".effects (id TEXT PRIMARY KEY, len BIGINT NOT NULL)"#,
            f.schema()
        )))
        .execute(f.pool())
        .await
        .unwrap();
        Db::Postgres(f)
    }

    fn name(&self) -> &'static str {
        match self {
            Db::Sqlite { .. } => "SQLite",
            Db::Postgres(_) => "PostgreSQL",
        }
    }

    async fn effects(&self) -> i64 {
        match self {
            Db::Sqlite { pool, .. } => sqlitesqlx::query_scalar("SELECT count(*) FROM effects")
                .fetch_one(pool)
                .await
                .unwrap(),
            Db::Postgres(f) => pgsqlx::query_scalar(pgsqlx::AssertSqlSafe(format!(
                r#"SELECT count(*) FROM "{}".effects"#,
                f.schema()
            )))
            .fetch_one(f.pool())
            .await
            .unwrap(),
        }
    }

    /// A `RabbitConsumer` into this inbox running the handler: insert the
    /// effect row, count.
    async fn consumer(
        &self,
        builder: outbox_rabbitmq::RabbitConsumerBuilder,
        tally: Arc<Tally>,
    ) -> ConsumerHandle {
        let builder = builder.consumer_name("bench").prefetch(PREFETCH);
        match self {
            Db::Sqlite { outbox, pool, .. } => {
                let handler = handler_fn(
                    move |msg: &Received, tx: &mut SqliteConnection| -> HandlerFuture<'_> {
                        let tally = Arc::clone(&tally);
                        Box::pin(async move {
                            sqlitesqlx::query("INSERT INTO effects (id, len) VALUES ($1, $2)")
                                .bind(msg.id.to_string())
                                .bind(msg.payload.len() as i64)
                                .execute(&mut *tx)
                                .await?;
                            tally.hit();
                            Ok(())
                        })
                    },
                );
                builder
                    .spawn(outbox.clone(), pool.clone(), handler)
                    .await
                    .unwrap()
            }
            Db::Postgres(f) => {
                let insert = format!(
                    r#"INSERT INTO "{}".effects (id, len) VALUES ($1, $2)"#,
                    f.schema()
                );
                let handler = handler_fn(
                    move |msg: &Received, tx: &mut PgConnection| -> HandlerFuture<'_> {
                        let (tally, insert) = (Arc::clone(&tally), insert.clone());
                        Box::pin(async move {
                            pgsqlx::query(pgsqlx::AssertSqlSafe(insert))
                                .bind(msg.id.to_string())
                                .bind(msg.payload.len() as i64)
                                .execute(&mut *tx)
                                .await?;
                            tally.hit();
                            Ok(())
                        })
                    },
                );
                builder
                    .spawn_postgres(f.pg().outbox(), f.pool().clone(), handler)
                    .await
                    .unwrap()
            }
        }
    }

    /// The bare handler: the same insert in a transaction of its own
    /// (`BEGIN IMMEDIATE` on SQLite, as the inbox begins), committed; with
    /// `inbox`, the inbox's own statement first (`try_receive`, the insert
    /// of the inbox row), without the consumer around it.
    async fn bare_handle(&self, id: &str, len: usize, tally: &Tally, inbox: bool) {
        let message_id: MessageId = id.parse().unwrap();
        match self {
            Db::Sqlite { pool, outbox, .. } => {
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
                if inbox {
                    assert!(
                        outbox
                            .try_receive(&mut *tx, "bench", message_id)
                            .await
                            .unwrap()
                    );
                }
                sqlitesqlx::query("INSERT INTO effects (id, len) VALUES ($1, $2)")
                    .bind(id)
                    .bind(len as i64)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tally.hit();
                tx.commit().await.unwrap();
            }
            Db::Postgres(f) => {
                let mut tx = f.pool().begin().await.unwrap();
                if inbox {
                    let outbox = f.pg().outbox();
                    assert!(
                        outbox
                            .try_receive(&mut tx, "bench", message_id)
                            .await
                            .unwrap()
                    );
                }
                pgsqlx::query(pgsqlx::AssertSqlSafe(format!(
                    r#"INSERT INTO "{}".effects (id, len) VALUES ($1, $2)"#,
                    f.schema()
                )))
                .bind(id)
                .bind(len as i64)
                .execute(&mut *tx)
                .await
                .unwrap();
                tally.hit();
                tx.commit().await.unwrap();
            }
        }
    }
}

/// A quorum queue of the run's own, filled with `n` persistent messages
/// (message id, type, as the relay publishes them).
async fn filled_queue(conn: &Connection, n: usize) -> String {
    let queue = outbox_rabbitmq::testing::unique_name("bench-consume");
    let ch = conn.create_channel().await.unwrap();
    Topology::new()
        .queue(queue.as_str())
        .declare_on(&ch)
        .await
        .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for start in (0..n).step_by(1000) {
        let mut confirms = Vec::new();
        for i in start..(start + 1000).min(n) {
            let props = BasicProperties::default()
                .with_message_id(MessageId::new().to_string().into())
                .with_type("Bench".into())
                .with_content_type("application/octet-stream".into())
                .with_delivery_mode(2);
            confirms.push(
                ch.basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &payload(i),
                    props,
                )
                .await
                .unwrap(),
            );
        }
        for c in confirms {
            assert!(c.await.unwrap().is_ack());
        }
    }
    queue
}

async fn delete_queue(conn: &Connection, queue: &str) {
    let ch = conn.create_channel().await.unwrap();
    let _ = ch
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
}

/// `consumers` RabbitConsumers drain `n` messages into the inbox: msg/s.
async fn inbox_run(url: &str, conn: &Connection, db: &Db, n: usize, consumers: usize) -> f64 {
    let queue = filled_queue(conn, n).await;
    let tally = Arc::new(Tally::default());
    let mut handles = Vec::new();
    for _ in 0..consumers {
        let builder = RabbitConsumer::builder(url, queue.as_str());
        handles.push(db.consumer(builder, Arc::clone(&tally)).await);
    }
    tally.wait_for(n as u64).await;
    for h in &handles {
        h.shutdown().await;
    }
    delete_queue(conn, &queue).await;
    assert_eq!(db.effects().await, n as i64, "every effect once");
    tally.rate()
}

/// `consumers` bare lapin consumers (a connection each, same prefetch)
/// drain `n` messages, running the same handler work (with `inbox`, after
/// the inbox's own statement), then acking: msg/s.
async fn bare_run(
    url: &str,
    conn: &Connection,
    db: Arc<Db>,
    n: usize,
    consumers: usize,
    inbox: bool,
) -> f64 {
    let queue = filled_queue(conn, n).await;
    let tally = Arc::new(Tally::default());
    let mut tasks = Vec::new();
    for c in 0..consumers {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.basic_qos(PREFETCH, BasicQosOptions::default())
            .await
            .unwrap();
        let mut deliveries = ch
            .basic_consume(
                queue.as_str().into(),
                format!("bare-{c}").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let (db, tally) = (Arc::clone(&db), Arc::clone(&tally));
        let total = n as u64;
        tasks.push(tokio::spawn(async move {
            while tally.n.load(Ordering::SeqCst) < total {
                let next = tokio::time::timeout(Duration::from_millis(50), deliveries.next());
                let Ok(Some(delivery)) = next.await else {
                    continue;
                };
                let delivery = delivery.unwrap();
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap();
                db.bare_handle(&id, delivery.data.len(), &tally, inbox)
                    .await;
                delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .unwrap();
            }
            let _ = conn.close(200, "bench done".into()).await;
        }));
    }
    tally.wait_for(n as u64).await;
    for t in tasks {
        t.await.unwrap();
    }
    delete_queue(conn, &queue).await;
    assert_eq!(db.effects().await, n as i64, "every effect once");
    tally.rate()
}

/// A partitioned topology of the run's own: a direct exchange and
/// [`PARTITIONS`] partition queues bound for `Bench`.
struct PartitionedSetup {
    exchange: String,
    partitions: Partitions,
    transport: RabbitTransport,
}

impl PartitionedSetup {
    async fn new(url: &str, count: u16) -> PartitionedSetup {
        let exchange = outbox_rabbitmq::testing::unique_name("bench-px");
        let partitions =
            Partitions::new(outbox_rabbitmq::testing::unique_name("bench-part"), count).unwrap();
        let transport = RabbitTransport::builder(url)
            .with_default_exchange(exchange.as_str())
            .with_partitioned_exchange(exchange.as_str(), count)
            .build()
            .await
            .unwrap();
        transport
            .declare(
                &Topology::new()
                    .exchange(exchange.as_str(), ExchangeType::Direct)
                    .partitioned(&partitions)
                    .bind_partitioned(&partitions, exchange.as_str(), "Bench"),
            )
            .await
            .unwrap();
        PartitionedSetup {
            exchange,
            partitions,
            transport,
        }
    }

    /// Publishes `keys.len()` messages with these keys, as the relay would.
    async fn send(&self, keys: &[String]) {
        let messages: Vec<Message> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                NewMessage::new(MessageKind::Integration, "Bench", payload(i))
                    .key(k.as_str())
                    .into_message(Timestamp::now())
                    .unwrap()
            })
            .collect();
        for chunk in messages.chunks(500) {
            let outcomes = self.transport.send(chunk).await;
            assert!(outcomes.iter().all(|o| *o == Outcome::Delivered));
        }
    }

    async fn delete(&self, conn: &Connection) {
        let ch = conn.create_channel().await.unwrap();
        for q in self.partitions.queues() {
            let _ = ch
                .queue_delete(
                    format!("{q}.owner").as_str().into(),
                    QueueDeleteOptions::default(),
                )
                .await;
            let _ = ch
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = ch
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
    }
}

/// `replicas` partitioned consumers (PostgreSQL inbox) drain `n` keyed
/// messages from [`PARTITIONS`] partitions: msg/s.
async fn partitioned_run(url: &str, conn: &Connection, n: usize, replicas: u16) -> f64 {
    let db = Db::postgres().await;
    let setup = PartitionedSetup::new(url, PARTITIONS).await;
    let keys: Vec<String> = (0..n).map(|i| format!("key-{}", i % 600)).collect();
    setup.send(&keys).await;
    let tally = Arc::new(Tally::default());
    let spawns = (0..replicas).map(|i| {
        let builder = RabbitConsumer::partitioned(url, setup.partitions.clone())
            .replica(i, replicas)
            .takeover_check(Duration::from_secs(5));
        db.consumer(builder, Arc::clone(&tally))
    });
    let handles = futures_util::future::join_all(spawns).await;
    tally.wait_for(n as u64).await;
    for h in &handles {
        h.shutdown().await;
    }
    setup.delete(conn).await;
    assert_eq!(db.effects().await, n as i64, "every effect once");
    tally.rate()
}

/// The kill figure's child: replica 0 of 2 on the partitions, with a
/// handler that never returns (it holds its deliveries, unacknowledged,
/// until it is killed). Prints `consuming` once it consumes its own
/// partitions and `holding` once its handler runs.
pub fn victim_child(spec: &str) {
    let parts: Vec<&str> = spec.split(' ').collect();
    let [amqp, pg, schema, prefix] = parts[..] else {
        panic!("{CHILD_ENV}: want `<amqp url> <pg url> <schema> <prefix>`, got `{spec}`");
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = outbox_postgres::PgStore::builder(pg)
            .schema(schema)
            .table("test_outbox")
            .inbox_table("test_inbox")
            .max_connections(2)
            .connect()
            .await
            .unwrap();
        let pool = store.pool().clone();
        let handler = handler_fn(
            move |_msg: &Received, _tx: &mut PgConnection| -> HandlerFuture<'_> {
                Box::pin(async move {
                    println!("holding");
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Ok(())
                })
            },
        );
        let partitions = Partitions::new(prefix, 2).unwrap();
        let handle = RabbitConsumer::partitioned(amqp, partitions)
            .consumer_name("bench")
            .replica(0, 2)
            .prefetch(PREFETCH)
            .spawn_postgres(store.outbox(), pool, handler)
            .await
            .unwrap();
        while handle.consuming().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        println!("consuming");
        std::future::pending::<()>().await;
    });
}

/// One kill: the child (replica 0 of 2 partitions) holds `m` deliveries of
/// its partition; it is SIGKILLed; replica 1 (here, standing by with the
/// default takeover check) takes the partition over. Returns (seconds from
/// the kill to the first of them handled again, to the last).
async fn kill_once(url: &str, conn: &Connection, m: usize) -> (f64, f64) {
    use std::io::BufRead;
    let db = Db::postgres().await;
    let Db::Postgres(f) = &db else { unreachable!() };
    let setup = PartitionedSetup::new(url, 2).await;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .env(
            CHILD_ENV,
            format!(
                "{url} {} {} {}",
                f.url(),
                f.schema(),
                setup.partitions.prefix()
            ),
        )
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the consumer child");
    let (tx, lines) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let wait_line = |want: &str| {
        let line = lines.recv_timeout(DEADLINE).expect("the child's line");
        assert_eq!(line, want);
    };
    tokio::task::block_in_place(|| wait_line("consuming"));
    let tally = Arc::new(Tally::default());
    let builder = RabbitConsumer::partitioned(url, setup.partitions.clone()).replica(1, 2);
    let survivor = db.consumer(builder, Arc::clone(&tally)).await;
    let deadline = Instant::now() + DEADLINE;
    while survivor.consuming().is_empty() {
        assert!(Instant::now() < deadline, "the survivor never consumed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Keys of the child's partition (0) only.
    let keys: Vec<String> = (0..)
        .map(|i| format!("key-{i}"))
        .filter(|k| Partitions::of_key(k, 2) == 0)
        .take(m)
        .collect();
    setup.send(&keys).await;
    tokio::task::block_in_place(|| wait_line("holding"));
    let killed_at = Instant::now();
    child.kill().expect("SIGKILL the child");
    let _ = child.wait();
    tally.wait_for(m as u64).await;
    let first = tally.first.lock().unwrap().unwrap();
    let last = tally.last.lock().unwrap().unwrap();
    survivor.shutdown().await;
    setup.delete(conn).await;
    assert_eq!(db.effects().await, m as i64, "every effect once");
    (
        first.duration_since(killed_at).as_secs_f64(),
        last.duration_since(killed_at).as_secs_f64(),
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub async fn figures(quick: bool) -> Vec<Figure> {
    use outbox_api::testing::{Service, services::find};
    let url = match find(Service::RabbitMq) {
        Ok(url) => url,
        Err(how) => return vec![not_measured("consumer figures", &how)],
    };
    let pg = find(Service::Postgres);
    let conn = match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(c) => c,
        Err(e) => return vec![not_measured("consumer figures", &e.to_string())],
    };
    let n = if quick { 500 } else { 10_000 };
    let rounds = if quick { 1 } else { 3 };
    let mut out = Vec::new();
    for postgres in [false, true] {
        if let (true, Err(how)) = (postgres, &pg) {
            out.push(not_measured("consumer figures on PostgreSQL", how));
            continue;
        }
        for consumers in [1, 3] {
            // Bare and inbox take turns, `rounds` times, on fresh databases
            // and queues; each figure is the median of its runs.
            let (mut bares, mut inboxes, mut hands) = (Vec::new(), Vec::new(), Vec::new());
            let mut name = "";
            for _ in 0..rounds {
                let fresh = async || {
                    Arc::new(if postgres {
                        Db::postgres().await
                    } else {
                        Db::sqlite().await
                    })
                };
                let db = fresh().await;
                name = db.name();
                bares.push(bare_run(&url, &conn, db, n, consumers, false).await);
                hands.push(bare_run(&url, &conn, fresh().await, n, consumers, true).await);
                let db = if postgres {
                    Db::postgres().await
                } else {
                    Db::sqlite().await
                };
                inboxes.push(inbox_run(&url, &conn, &db, n, consumers).await);
            }
            let bare = median(bares);
            let who = if consumers == 1 {
                "1 consumer".to_owned()
            } else {
                format!("{consumers} consumers (tasks with a connection each, one process)")
            };
            out.push(
                Figure::new(
                    format!(
                        "RabbitConsumer, {name} inbox, drain {n} (quorum queue, prefetch {PREFETCH}, handler: insert one row), {who}, median of {rounds}"
                    ),
                    median(inboxes),
                    "msg/s",
                    "≥ 0.8 × bare lapin",
                )
                .beside(
                    "bare lapin: same handler in its own transaction, then ack",
                    bare,
                ),
            );
            // Where the difference goes: the inbox's statement by hand.
            out.push(
                Figure::new(
                    format!(
                        "… bare lapin with the inbox's statement by hand (try_receive, then the handler, in one transaction), {name}, {who}"
                    ),
                    median(hands),
                    "msg/s",
                    "—",
                )
                .beside("bare lapin without it", bare),
            );
        }
    }
    match &pg {
        Err(how) => out.push(not_measured("partitioned consumer figures", how)),
        Ok(_) => {
            let (mut ones, mut threes) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                ones.push(partitioned_run(&url, &conn, n, 1).await);
                threes.push(partitioned_run(&url, &conn, n, 3).await);
            }
            out.push(
                Figure::new(
                    format!(
                        "partitioned topology ({PARTITIONS} partitions, PostgreSQL inbox), drain {n} over 600 keys, 3 replicas (tasks, one process), median of {rounds}"
                    ),
                    median(threes),
                    "msg/s",
                    "—",
                )
                .beside("1 replica", median(ones)),
            );
            let kills = if quick { 1 } else { 5 };
            let (mut firsts, mut lasts) = (Vec::new(), Vec::new());
            for _ in 0..kills {
                let (first, last) = kill_once(&url, &conn, 100).await;
                firsts.push(first * 1000.0);
                lasts.push(last * 1000.0);
            }
            let max = firsts.iter().copied().fold(0.0, f64::max);
            out.push(Figure::new(
                format!(
                    "consumer SIGKILLed (child process) holding 100 deliveries of its partition → first handled by the standby replica (takeover check 1 s, the default), median of {kills}"
                ),
                median(firsts),
                "ms",
                "—",
            ));
            out.push(Figure::new(
                format!("the same, worst of {kills}"),
                max,
                "ms",
                "—",
            ));
            out.push(Figure::new(
                format!("the same → all 100 handled again, median of {kills}"),
                median(lasts),
                "ms",
                "—",
            ));
        }
    }
    let _ = conn.close(200, "bench done".into()).await;
    out
}
