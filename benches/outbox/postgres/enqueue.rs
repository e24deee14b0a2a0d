//! Enqueue figures: overhead against a raw INSERT (sqlx and tokio-postgres), bulk against single, the wake-up's cost.

use super::*;

pub(super) fn orders_insert(f: &PgUnderTest) -> String {
    format!(
        r#"INSERT INTO "{}".orders (id, customer, total) VALUES ($1, 'alice', 4200)"#,
        f.schema()
    )
}

/// The baseline's INSERT: the row an enqueue of `bench_message` writes
/// (its defaults are the table's), with no validation, no key lock, no
/// transaction id returned and nothing announced.
fn raw_insert(f: &PgUnderTest) -> String {
    format!(
        r#"INSERT INTO "{}"."{}" (id, kind, message_type, payload, content_type, created_at, available_at)
           VALUES ($1, 'domain', 'Bench', $2, 'application/octet-stream', $3, $3)"#,
        f.schema(),
        f.pg().table()
    )
}

/// What the business transaction writes besides its order row.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    /// A raw INSERT of the outbox row.
    Raw,
    /// `PgOutbox::enqueue` (or `enqueue_tokio_postgres`).
    Enqueue,
    /// `PgOutbox::enqueue_prepared`, its statements prepared once per
    /// connection (tokio-postgres only).
    EnqueuePrepared,
    /// `enqueue` and a `pg_notify` inside the transaction: the way this
    /// crate avoids, for contrast.
    EnqueueNotifyInside,
}

/// Business transactions through sqlx: `writers` tasks, each on its own
/// pooled connection, `per_writer` transactions each.
async fn sqlx_block(
    f: &PgUnderTest,
    outbox: &PgOutbox,
    writers: usize,
    per_writer: usize,
    variant: Variant,
    next_id: &Arc<AtomicI64>,
) -> Duration {
    let start = Instant::now();
    let tasks: Vec<_> = (0..writers)
        .map(|_| {
            let (pool, outbox, next_id) = (f.pool().clone(), outbox.clone(), next_id.clone());
            let (orders, raw, channel) = (orders_insert(f), raw_insert(f), f.pg().channel());
            tokio::spawn(async move {
                let mut conn = pool.acquire().await.unwrap();
                for _ in 0..per_writer {
                    let id = next_id.fetch_add(1, Ordering::Relaxed);
                    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
                    sqlx::query(AssertSqlSafe(orders.as_str()))
                        .bind(id)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    match variant {
                        Variant::Raw => {
                            sqlx::query(AssertSqlSafe(raw.as_str()))
                                .bind(MessageId::new().as_uuid())
                                .bind((id as usize).to_le_bytes().to_vec())
                                .bind(Timestamp::now().as_millis())
                                .execute(&mut *tx)
                                .await
                                .unwrap();
                        }
                        // sqlx prepares and caches every statement per
                        // connection: there is no separate prepared path.
                        Variant::Enqueue
                        | Variant::EnqueuePrepared
                        | Variant::EnqueueNotifyInside => {
                            outbox
                                .enqueue(&mut tx, bench_message(id as usize))
                                .await
                                .unwrap();
                        }
                    }
                    if variant == Variant::EnqueueNotifyInside {
                        sqlx::query("SELECT pg_notify($1, '')")
                            .bind(&channel)
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                    }
                    tx.commit().await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    start.elapsed()
}

/// The same through tokio-postgres, each writer on a client of its own
/// with its statements prepared once (the raw baseline at its best).
async fn tokio_block(
    clients: &[Arc<tokio::sync::Mutex<tokio_postgres::Client>>],
    f: &PgUnderTest,
    outbox: &PgOutbox,
    per_writer: usize,
    variant: Variant,
    next_id: &Arc<AtomicI64>,
) -> Duration {
    let start = Instant::now();
    let tasks: Vec<_> = clients
        .iter()
        .map(|client| {
            let (client, outbox, next_id) = (client.clone(), outbox.clone(), next_id.clone());
            let (orders, raw) = (orders_insert(f), raw_insert(f));
            tokio::spawn(async move {
                let mut client = client.lock().await;
                let orders = client.prepare(&orders).await.unwrap();
                let raw = client.prepare(&raw).await.unwrap();
                let prepared = outbox.prepare_tokio_postgres(&*client).await.unwrap();
                for _ in 0..per_writer {
                    let id = next_id.fetch_add(1, Ordering::Relaxed);
                    let tx = client.transaction().await.unwrap();
                    tx.execute(&orders, &[&id]).await.unwrap();
                    match variant {
                        Variant::Raw => {
                            let payload = (id as usize).to_le_bytes().to_vec();
                            tx.execute(
                                &raw,
                                &[
                                    &MessageId::new().as_uuid(),
                                    &payload,
                                    &Timestamp::now().as_millis(),
                                ],
                            )
                            .await
                            .unwrap();
                        }
                        Variant::EnqueuePrepared => {
                            outbox
                                .enqueue_prepared(&tx, &prepared, bench_message(id as usize))
                                .await
                                .unwrap();
                        }
                        _ => {
                            outbox
                                .enqueue_tokio_postgres(&tx, bench_message(id as usize))
                                .await
                                .unwrap();
                        }
                    }
                    tx.commit().await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    start.elapsed()
}

async fn tokio_client(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

/// `a` and `b` in alternating blocks of `per_writer` transactions per
/// writer, `rounds` of each; µs of wall time per transaction of each.
async fn alternate<F, Fut>(rounds: usize, txs: usize, mut block: F) -> (f64, f64)
where
    F: FnMut(bool) -> Fut,
    Fut: std::future::Future<Output = Duration>,
{
    let (mut a, mut b) = (Duration::ZERO, Duration::ZERO);
    for round in 0..rounds {
        for first in [round % 2 == 0, round % 2 != 0] {
            let took = block(first).await;
            *(if first { &mut a } else { &mut b }) += took;
        }
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / (rounds * txs) as f64;
    (per(a), per(b))
}

/// The outbox of `f`'s table through a store that announces nothing
/// (`announce_commits(false)`): enqueues without the commit watcher.
async fn silent_outbox(f: &PgUnderTest) -> PgOutbox {
    PgStore::builder(f.url())
        .schema(f.schema())
        .table(f.pg().table())
        .inbox_table(f.pg().inbox_table())
        .announce_commits(false)
        .max_connections(1)
        .connect()
        .await
        .unwrap()
        .outbox()
}

/// Business transactions with one enqueue against the same with a raw
/// INSERT of the same row, alternating, through sqlx and tokio-postgres,
/// with the store's wake-up on (the default) and off — the statement's own
/// cost, and what the commit watcher adds (the figure "wake-up on vs off"
/// measures the latter at 8 writers).
pub(super) async fn enqueue_overhead(quick: bool) -> Vec<Figure> {
    let mut out = Vec::new();
    let (rounds, block) = if quick { (2, 40) } else { (10, 200) };
    let next_id = Arc::new(AtomicI64::new(1));
    let wake = |on: bool| if on { "wake-up on" } else { "wake-up off" };
    for writers in [1usize, 8] {
        let per_writer = (block / writers).max(5);
        let txs = per_writer * writers;
        let f = fixture(|b| b).await;
        let (on, off) = (f.pg().outbox(), silent_outbox(&f).await);
        // Warm the connections and the statement caches.
        for (outbox, v) in [
            (&on, Variant::Raw),
            (&on, Variant::Enqueue),
            (&off, Variant::Enqueue),
        ] {
            sqlx_block(&f, outbox, writers, 5, v, &next_id).await;
        }
        for announce in [true, false] {
            let outbox = if announce { &on } else { &off };
            let (with, raw) = alternate(rounds, txs, |enqueue| {
                let v = if enqueue {
                    Variant::Enqueue
                } else {
                    Variant::Raw
                };
                sqlx_block(&f, outbox, writers, per_writer, v, &next_id)
            })
            .await;
            out.push(
                Figure::new(
                    format!(
                        "business tx + one enqueue, PostgreSQL, sqlx, {writers} writer(s), {}",
                        wake(announce)
                    ),
                    with,
                    "µs/tx",
                    "ratio ≤ 1.1",
                )
                .beside("the same tx + a raw INSERT of the same row", raw),
            );
        }
        // A fixture of its own, so that the sqlx pool's connections are
        // closed before the tokio-postgres clients open theirs.
        drop((f, on, off));
        let f = fixture(|b| b).await;
        let (on, off) = (f.pg().outbox(), silent_outbox(&f).await);
        let mut clients = Vec::new();
        for _ in 0..writers {
            clients.push(Arc::new(tokio::sync::Mutex::new(
                tokio_client(f.url()).await,
            )));
        }
        for v in [Variant::Raw, Variant::Enqueue, Variant::EnqueuePrepared] {
            tokio_block(&clients, &f, &on, 5, v, &next_id).await;
        }
        for (variant, how, announce) in [
            (
                Variant::Enqueue,
                "enqueue_tokio_postgres, parsed per call",
                true,
            ),
            (
                Variant::EnqueuePrepared,
                "enqueue_prepared, prepared once per connection",
                true,
            ),
            (
                Variant::EnqueuePrepared,
                "enqueue_prepared, prepared once per connection",
                false,
            ),
        ] {
            let outbox = if announce { &on } else { &off };
            let (with, raw) = alternate(rounds, txs, |enqueue| {
                let v = if enqueue { variant } else { Variant::Raw };
                tokio_block(&clients, &f, outbox, per_writer, v, &next_id)
            })
            .await;
            out.push(
                Figure::new(
                    format!(
                        "business tx + one enqueue, PostgreSQL, tokio-postgres ({how}), {writers} writer(s), {}",
                        wake(announce)
                    ),
                    with,
                    "µs/tx",
                    "ratio ≤ 1.1",
                )
                .beside(
                    "the same tx + a raw INSERT of the same row (prepared statement)",
                    raw,
                ),
            );
        }
    }
    out
}

/// One writer, transactions of `size` messages: `enqueue_many` against
/// `size` single enqueues; µs per message.
pub(super) async fn bulk(quick: bool) -> Figure {
    let size = 100;
    let (rounds, txs) = if quick { (2, 3) } else { (10, 20) };
    let f = fixture(|b| b).await;
    let outbox = f.pg().outbox();
    let mut n = 0usize;
    let mut block = async |many: bool| {
        let start = Instant::now();
        for _ in 0..txs {
            let mut tx = f.pool().begin().await.unwrap();
            let messages: Vec<NewMessage> = (n..n + size).map(bench_message).collect();
            n += size;
            if many {
                outbox.enqueue_many(&mut tx, messages).await.unwrap();
            } else {
                for m in messages {
                    outbox.enqueue(&mut tx, m).await.unwrap();
                }
            }
            tx.commit().await.unwrap();
        }
        start.elapsed()
    };
    block(true).await;
    block(false).await;
    let (mut many, mut single) = (Duration::ZERO, Duration::ZERO);
    for round in 0..rounds {
        for first in [round % 2 == 0, round % 2 != 0] {
            let took = block(first).await;
            *(if first { &mut many } else { &mut single }) += took;
        }
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / (rounds * txs * size) as f64;
    Figure::new(
        format!("enqueue_many of {size} in one tx, PostgreSQL, sqlx, per message"),
        per(many),
        "µs/msg",
        "—",
    )
    .beside(format!("{size} single enqueues in one tx"), per(single))
}

/// 8 writers: the default store (each commit watched and announced)
/// against one with `announce_commits(false)`, on the same table; and, for
/// contrast, a `pg_notify` inside each writer's transaction.
pub(super) async fn wake_up_cost(quick: bool) -> Vec<Figure> {
    let writers = 8;
    let (rounds, per_writer) = if quick { (2, 5) } else { (10, 40) };
    let f = fixture(|b| b).await;
    let (on, off) = (f.pg().outbox(), silent_outbox(&f).await);
    let next_id = Arc::new(AtomicI64::new(1));
    sqlx_block(&f, &on, writers, 5, Variant::Enqueue, &next_id).await;
    sqlx_block(&f, &off, writers, 5, Variant::Enqueue, &next_id).await;
    let txs = writers * per_writer;
    let (with, without) = alternate(rounds, txs, |announce| {
        let outbox = if announce { &on } else { &off };
        sqlx_block(&f, outbox, writers, per_writer, Variant::Enqueue, &next_id)
    })
    .await;
    let (inside, without2) = alternate(rounds, txs, |inside| {
        let (outbox, v) = if inside {
            (&off, Variant::EnqueueNotifyInside)
        } else {
            (&off, Variant::Enqueue)
        };
        sqlx_block(&f, outbox, writers, per_writer, v, &next_id)
    })
    .await;
    let rate = |us: f64| 1e6 / us;
    vec![
        Figure::new(
            "enqueue throughput, PostgreSQL, 8 writers, wake-up on (commits watched, NOTIFY after commit, debounced)",
            rate(with),
            "tx/s",
            "≥ 0.9 × off",
        )
        .beside("wake-up off (announce_commits(false))", rate(without)),
        Figure::new(
            "… with a pg_notify inside each writer's transaction (for contrast; not what the crate does)",
            rate(inside),
            "tx/s",
            "—",
        )
        .beside("wake-up off", rate(without2)),
    ]
}
