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
use outbox_postgres::sqlx::{self as pgsqlx, PgConnection};
use outbox_postgres::testing::PgUnderTest;
use outbox_rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeleteOptions,
};
use outbox_rabbitmq::lapin::types::FieldTable;
use outbox_rabbitmq::lapin::{BasicProperties, Connection, ConnectionProperties};
use outbox_rabbitmq::{
    ConsumerHandle, ExchangeType, HandlerFuture, Partitions, RabbitConsumer, RabbitTransport,
    Received, Topology, handler_fn,
};
use outbox_sqlite::sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use outbox_sqlite::sqlx::{self as sqlitesqlx, SqliteConnection};
use outbox_sqlite::{SqliteOutbox, SqliteStore};

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

mod db;
pub mod nats;
mod partitioned;
mod runs;

use db::*;
pub use partitioned::victim_child;
use partitioned::*;
use runs::*;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub async fn figures(quick: bool) -> Vec<Figure> {
    use outbox_api::testing::services::find;
    let url = match find(&outbox_rabbitmq::testing::RABBITMQ) {
        Ok(url) => url,
        Err(how) => return vec![not_measured("consumer figures", &how)],
    };
    let pg = find(&outbox_postgres::testing::POSTGRES);
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
