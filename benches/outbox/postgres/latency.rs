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
    let (pool, outbox, orders) = (f.pool().clone(), f.pg().outbox(), orders_insert(&f));
    let rt = tokio::runtime::Handle::current();
    let t = times.clone();
    let producer = std::thread::spawn(move || {
        keep_schedule(&t, base, |i, committing| {
            rt.block_on(async {
                let mut tx = pool.begin().await.unwrap();
                sqlx::query(AssertSqlSafe(orders.as_str()))
                    .bind(i as i64)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                outbox.enqueue(&mut tx, bench_message(i)).await.unwrap();
                committing();
                tx.commit().await.unwrap();
            })
        });
    });
    tokio::task::spawn_blocking(move || producer.join().unwrap())
        .await
        .unwrap();
    times.settle(relay).await;
    times.run(&times.committing_times())
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
