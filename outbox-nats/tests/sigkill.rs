//! Two partitioned NATS consumer processes (replicas 0 and 1 of 2, four
//! partitions), one SIGKILLed mid-run and started again: 2,000 messages
//! over 50 keys, sent through a partitioned `NatsTransport` as the relay
//! sends them, into a PostgreSQL inbox; every message's effect exactly
//! once and each key's effects in order, nothing dead-lettered or retried
//! (the kill is an outage, not a failure), nothing left unacknowledged.
//! What the killed process held comes again after `ack_wait` (3 s here),
//! before anything later of its partitions.
//!
//! `harness = false`: run without arguments this is the test; run with
//! `OUTBOX_NATS_SIGKILL_CHILD` set it is one consumer process, until its
//! stdin closes (then it prints its stats) — or until it is killed.

use std::io::Write;
use std::time::{Duration, Instant};

use outbox_api::receive::{HandlerFuture, Received, handler_fn};
use outbox_api::testing::{ChildProcess, until_stdin_closes, wait_until};
use outbox_api::{HandlerError, MessageKind, NewMessage, Outcome, Timestamp, Transport};
use outbox_nats::testing::{nats_url, unique_name};
use outbox_nats::{NatsConfig, NatsConsumer, NatsTransport, StreamSpec};
use outbox_postgres::PgStore;
use outbox_postgres::sqlx::{self, PgConnection, postgres::PgPoolOptions};
use outbox_postgres::testing::{PgUnderTest, database_url};

const CHILD: &str = "OUTBOX_NATS_SIGKILL_CHILD";
const KEYS: usize = 50;
const PER_KEY: usize = 40;
const TOTAL: usize = KEYS * PER_KEY;
const PARTITIONS: u16 = 4;
const DEADLINE: Duration = Duration::from_secs(60);

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    match std::env::var(CHILD) {
        Ok(setup) => rt.block_on(child(&setup)),
        Err(_)
            if !outbox_api::testing::selected(
                "a_replica_sigkilled_mid_run_loses_nothing_and_keeps_each_keys_order",
            ) => {}
        Err(_) => {
            let started = Instant::now();
            rt.block_on(a_replica_sigkilled_mid_run_loses_nothing_and_keeps_each_keys_order());
            println!(
                "test a_replica_sigkilled_mid_run_loses_nothing_and_keeps_each_keys_order ... ok ({:.1} s)",
                started.elapsed().as_secs_f64()
            );
        }
    }
}

/// One consumer process: `<schema> <stream> <replica>` in its
/// environment; logs each handled message in the inbox transaction.
async fn child(setup: &str) {
    let mut words = setup.split(' ');
    let (Some(schema), Some(stream), Some(replica)) = (words.next(), words.next(), words.next())
    else {
        panic!("<schema> <stream> <replica>, got `{setup}`");
    };
    let replica: u16 = replica.parse().expect("a replica index");
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
    let consumer = NatsConsumer::partitioned(
        NatsConfig::new(nats_url()),
        stream,
        "sigkill",
        format!("{stream}.*"),
        PARTITIONS,
    )
    .replica(replica, 2)
    .takeover_check(Duration::from_millis(200))
    .ownership_bucket(format!("{stream}_owners"))
    .dead_letter_subject(format!("{stream}-dead.sigkill"))
    .max_ack_pending(50)
    .handler_timeout(Duration::from_secs(1))
    .ack_wait(Duration::from_secs(3))
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
        "stats retried={} dead_lettered={} deferred={}",
        s.retried, s.dead_lettered, s.deferred
    );
}

async fn a_replica_sigkilled_mid_run_loses_nothing_and_keeps_each_keys_order() {
    let stream = unique_name("kill");
    let transport = NatsTransport::connect(
        NatsTransport::builder(nats_url()).partitioned(stream.as_str(), PARTITIONS),
    )
    .await
    .expect("connect to NATS");
    for (name, subjects) in [
        (stream.clone(), format!("{stream}.>")),
        (format!("{stream}_DEAD"), format!("{stream}-dead.>")),
    ] {
        transport
            .declare(&StreamSpec::new(name, [subjects]))
            .await
            .expect("declare the test's streams");
    }
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
    let setup = |replica: u16| format!("{} {stream} {replica}", db.schema());
    let (zero, one) = (setup(0), setup(1));
    let steady = ChildProcess::start(&[(CHILD, &zero)], "ready", DEADLINE);
    let first = ChildProcess::start(&[(CHILD, &one)], "ready", DEADLINE);

    // The relay's side: each key's messages in order, 500 per send.
    let mut batch = Vec::new();
    for seq in 0..PER_KEY {
        for k in 0..KEYS {
            let m = NewMessage::new(MessageKind::Integration, "Event", format!("k{k}:{seq}"))
                .destination(stream.as_str(), "events")
                .key(format!("k{k}"))
                .into_message(Timestamp::now())
                .unwrap();
            batch.push(m);
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
    wait_until("a quarter is handled", DEADLINE, || async {
        count("COUNT(*)").await >= TOTAL / 4
    })
    .await;
    first.sigkill();
    let killed_at = count("COUNT(*)").await;
    assert!(killed_at < TOTAL, "killed after everything was handled");
    let second = tokio::task::spawn_blocking(move || {
        ChildProcess::start(&[(CHILD, &one)], "ready", DEADLINE)
    })
    .await
    .unwrap();
    wait_until("every message is handled", DEADLINE, || async {
        count("COUNT(DISTINCT id)").await >= TOTAL
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
    let js_stream = transport.jetstream().get_stream(&stream).await.unwrap();
    for p in 0..PARTITIONS {
        let mut c: outbox_nats::async_nats::jetstream::consumer::PullConsumer = js_stream
            .get_consumer(&format!("sigkill-{p}"))
            .await
            .unwrap();
        let info = c.info().await.unwrap();
        assert_eq!(
            (info.num_pending, info.num_ack_pending),
            (0, 0),
            "partition {p}: nothing left unacknowledged"
        );
    }
    let dead = transport
        .jetstream()
        .get_stream(format!("{stream}_DEAD"))
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(dead, 0, "nothing dead-lettered");
    println!(
        "nats sigkill: {TOTAL} messages, {killed_at} handled when the first process was killed, {stats}"
    );
    for name in [
        stream.clone(),
        format!("{stream}_DEAD"),
        format!("KV_{stream}_owners"),
    ] {
        let _ = transport.jetstream().delete_stream(&name).await;
    }
}
