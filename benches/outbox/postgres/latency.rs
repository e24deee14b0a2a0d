//! Commit → handled at 1k msg/s, with the relay on the writers' store and in another process.

use super::enqueue::orders_insert;
use super::*;

/// Where the relay of a latency run is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// On the writers' own store: woken by the commit watcher at once.
    SameStore,
    /// On a store of its own that shares nothing with the writers' (as in
    /// another process): woken only by LISTEN / NOTIFY.
    OtherProcess,
}

/// One open-loop run: business transactions (an order and one message)
/// committed at `rate` msg/s through sqlx, with a relay placed at `relay`.
async fn open_loop(rate: u32, count: usize, relay: Option<Placement>, url: &str) -> Run {
    let f = fixture(|b| b).await;
    let base = Instant::now();
    let times = Arc::new(Times::new(count, 1e6 / f64::from(rate), 100_000));
    let relay = match relay {
        Some(placement) => {
            let store = match placement {
                Placement::SameStore => f.pg().clone(),
                Placement::OtherProcess => relay_store(&f, url, 4).await,
            };
            let relay = Relay::builder(store)
                .dispatcher(times.recording_handlers(base))
                .spawn()
                .unwrap();
            relay.until_idle().await.unwrap();
            // Its LISTEN connection is up before the first message.
            tokio::time::sleep(Duration::from_millis(50)).await;
            Some(relay)
        }
        None => None,
    };
    let (outbox, orders) = (f.pg().outbox(), orders_insert(&f));
    let (t, url) = (times.clone(), f.url().to_owned());
    let producer = std::thread::spawn(move || writers(&t, base, &url, &outbox, &orders));
    tokio::task::spawn_blocking(move || producer.join().unwrap())
        .await
        .unwrap();
    times.settle(relay).await;
    times.run(&times.committing_times())
}

/// How many business transactions may be open at once: the application's
/// writers.
const WRITERS: u32 = 8;

/// The application: each business transaction (an order row and one message)
/// starts at its scheduled time, on a runtime and a pool of its own (as in
/// the application's own process), with up to [`WRITERS`] of them open at
/// once. A single serial writer would not be an open loop: each of its
/// transactions is four round trips and a WAL flush, about 1 ms on this
/// machine, so at 1k msg/s it runs at its own capacity and any slower
/// transaction delays every later one (docs/performance.md).
fn writers(times: &Arc<Times>, base: Instant, url: &str, outbox: &PgOutbox, orders: &str) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let pool = rt.block_on(async {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(WRITERS)
            .min_connections(WRITERS)
            .connect(url)
            .await
            .unwrap();
        // Every connection is open before the first transaction.
        let held: Vec<_> =
            futures_util::future::join_all((0..WRITERS).map(|_| pool.acquire())).await;
        drop(held);
        pool
    });
    let mut open = Vec::with_capacity(times.scheduled.len());
    for (i, scheduled) in times.scheduled.iter().enumerate() {
        let at = base + Duration::from_micros(*scheduled);
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let (t, pool, outbox, orders) = (
            times.clone(),
            pool.clone(),
            outbox.clone(),
            orders.to_owned(),
        );
        open.push(rt.spawn(async move {
            Times::stamp(&t.began, i, base);
            let mut tx = pool.begin().await.unwrap();
            sqlx::query(AssertSqlSafe(orders))
                .bind(i as i64)
                .execute(&mut *tx)
                .await
                .unwrap();
            outbox.enqueue(&mut tx, bench_message(i)).await.unwrap();
            Times::stamp(&t.committing, i, base);
            tx.commit().await.unwrap();
            Times::stamp(&t.committed, i, base);
        }));
    }
    rt.block_on(async {
        for tx in open {
            tx.await.unwrap();
        }
        pool.close().await;
    });
}

pub(super) async fn latency(quick: bool, url: &str) -> Vec<Figure> {
    let mut out = Vec::new();
    let rate = 1000;
    let rounds = if quick { 1 } else { 2 };
    let count = if quick { 200 } else { 5_000 };
    // The same server under another host name: a store that shares no
    // in-process signal with the writers' (as a relay in another process).
    let other_url = url
        .contains("127.0.0.1")
        .then(|| url.replacen("127.0.0.1", "localhost", 1));
    for placement in [Placement::SameStore, Placement::OtherProcess] {
        let (name, p50, p99) = match placement {
            Placement::SameStore => ("relay on the writers' store", "≤ 2 ms", "≤ 10 ms"),
            Placement::OtherProcess => (
                "relay in another process (woken by LISTEN/NOTIFY only)",
                "≤ 2 ms",
                "≤ 10 ms",
            ),
        };
        let relay_url = match (placement, &other_url) {
            (Placement::SameStore, _) => url.to_owned(),
            (Placement::OtherProcess, Some(u)) => u.clone(),
            (Placement::OtherProcess, None) => {
                out.push(not_measured(
                    &format!("scheduled → handled, PostgreSQL, {name}"),
                    "the database URL is not on 127.0.0.1",
                ));
                continue;
            }
        };
        let (mut alone, mut with) = (Run::new(), Run::new());
        for round in 0..rounds {
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for relay in order {
                let run =
                    open_loop(rate, count / rounds, relay.then_some(placement), &relay_url).await;
                (if relay { &mut with } else { &mut alone }).add(&run);
            }
        }
        let rows = latency_rows(
            &format!(
                "scheduled → handled, PostgreSQL, sqlx, {name}, open loop {rate} msg/s ({count} msgs)"
            ),
            &with.handled,
            p50,
            p99,
        );
        out.extend(beside(
            rows,
            "scheduled → commit returned, no relay",
            &alone.commit,
        ));
        let ms = |q: f64| with.commit_to_handled.value_at_quantile(q) as f64 / 1000.0;
        for (q, at) in [("p50", 0.5), ("p99", 0.99)] {
            out.push(Figure::new(
                format!("… just before COMMIT → handled, PostgreSQL, {name}, {q}"),
                ms(at),
                "ms",
                "—",
            ));
        }
    }
    out
}
