//! Failover: a relay killed holding work, its work delivered by another relay or by itself restarted.

use super::*;

/// A relay on its own runtime in a thread of its own, whose handler never
/// returns: it claims and holds its leases. [`Killable::kill`] drops the
/// runtime with the relay's tasks and connections, never shutting it down
/// — to the database, as a SIGKILLed process looks.
struct Killable {
    kill: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Killable {
    fn start(f: &PgUnderTest, worker: &str, lease: Duration) -> Killable {
        let (kill, killed) = tokio::sync::oneshot::channel::<()>();
        let (url, schema, table, inbox) = (
            f.url().to_owned(),
            f.schema().to_owned(),
            f.pg().table().to_owned(),
            f.pg().inbox_table().to_owned(),
        );
        let worker = worker.to_owned();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let store = PgStore::builder(url)
                    .schema(schema)
                    .table(table)
                    .inbox_table(inbox)
                    .max_connections(2)
                    .connect()
                    .await
                    .unwrap();
                let stuck = Handlers::new().on_message("Bench", |_m: &Message| async {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Ok::<_, std::io::Error>(())
                });
                let relay = Relay::builder(store)
                    .dispatcher(stuck)
                    .worker_id(worker)
                    .lease(lease)
                    .handler_timeout(lease - Duration::from_secs(1))
                    .spawn()
                    .unwrap();
                let _ = killed.await;
                std::mem::forget(relay);
            });
            rt.shutdown_background();
        });
        Killable {
            kill: Some(kill),
            thread: Some(thread),
        }
    }

    fn kill(mut self) {
        let _ = self.kill.take().map(|k| k.send(()));
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

/// One failover: `n` messages claimed and held by a relay that is then
/// killed; a relay with `successor`'s worker id (another relay's, or the
/// killed one's own, restarted) delivers them. Returns (seconds from the
/// kill to the last delivered, seconds the killed relay's leases had left).
async fn failover_once(successor_same_id: bool, lease: Duration) -> (f64, f64) {
    let f = fixture(|b| b).await;
    let n = 50;
    fill(&f, n).await;
    let victim = if successor_same_id {
        "bench-restarted"
    } else {
        "bench-victim"
    };
    let killable = Killable::start(&f, victim, lease);
    let held = format!(
        r#"SELECT count(*), COALESCE(max(locked_until), 0) FROM "{}"."{}" WHERE locked_by = $1"#,
        f.schema(),
        f.pg().table()
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let until = loop {
        let row = sqlx::query(AssertSqlSafe(held.as_str()))
            .bind(victim)
            .fetch_one(f.pool())
            .await
            .unwrap();
        if row.get::<i64, _>(0) == n as i64 {
            break row.get::<i64, _>(1);
        }
        assert!(
            Instant::now() < deadline,
            "the victim never claimed its work"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    killable.kill();
    let killed_at = Instant::now();
    let left = (until - Timestamp::now().as_millis()) as f64 / 1000.0;
    let count = Arc::new(AtomicU64::new(0));
    let successor = if successor_same_id {
        victim
    } else {
        "bench-survivor"
    };
    let relay = Relay::builder(relay_store(&f, f.url(), 2).await)
        .dispatcher(counting_handlers(count.clone()))
        .worker_id(successor.to_owned())
        .poll_interval(Duration::from_millis(100))
        .spawn()
        .unwrap();
    let deadline = Instant::now() + lease * 4;
    while count.load(Ordering::Relaxed) < n as u64 {
        assert!(Instant::now() < deadline, "the work was never taken over");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let took = killed_at.elapsed().as_secs_f64();
    relay.shutdown().await;
    (took, left)
}

/// Failover: the time from the kill of a relay holding work to that work
/// delivered by another (after the leases expire: beside what the leases
/// had left), and by the same relay restarted under its worker id (which
/// takes its leases back at start).
pub(super) async fn failover(quick: bool) -> Vec<Figure> {
    let lease = Duration::from_secs(if quick { 2 } else { 5 });
    let (other, left) = failover_once(false, lease).await;
    let (same, left_same) = failover_once(true, lease).await;
    vec![
        Figure::new(
            format!(
                "failover, PostgreSQL: relay holding 50 messages killed → all delivered by another relay (lease {} s, its poll 100 ms)",
                lease.as_secs()
            ),
            other,
            "s",
            "≈ the lease left",
        )
        .beside("the killed relay's leases had left", left),
        Figure::new(
            "… killed → delivered by the same relay restarted under its worker id",
            same,
            "s",
            "≪ the lease left",
        )
        .beside("the killed relay's leases had left", left_same),
    ]
}
