//! Part `postgres-tenants` (`cargo bench --bench outbox -- tenants`): a
//! fleet over 1,000 tenant schemas of the local database (20 in quick
//! mode), on 7 pools of one connection each (`PgTenantPools`, a tenant
//! pinned to one), a bulk pool of one for the large statements of a
//! tenant with a backlog, and one shared `LISTEN` connection (with its
//! shared commit watcher's connection), each figure beside
//! its baseline from the same run:
//!
//! * the other 999 each commit 1 msg/s, open loop, for a warm-up of 20 s
//!   (its latency reported apart), then one tenant drains a backlog of
//!   100,000 while they go on for 20 s more: the quiet tenants' commit →
//!   handled latency in that window, and the hot tenant's drain rate
//!   against a relay of its own draining the same backlog under the same
//!   load (the hot tenant taken out of the fleet, which goes on relaying
//!   the others while they write) and against a relay alone with nobody
//!   writing (`OUTBOX_BENCH_TENANTS_CHECKPOINT` set: a `CHECKPOINT` just
//!   before the backlog, the worst moment for the drain to begin);
//! * the connections the fleet holds, against what single relays hold;
//! * idle cost (transactions a second and CPU) against 1,000 single relays
//!   at their default poll on the same pool and listener;
//! * memory per tenant added.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use outbox::{Fleet, Handlers, Message, MessageKind, NewMessage, Relay, RelayHandle};
use outbox_postgres::sqlx::{self, AssertSqlSafe, PgPool, postgres::PgConnectOptions};
use outbox_postgres::{PgSharedListener, PgStore, PgTenantPools};

use crate::common::{Figure, counting_handlers, histogram, latency_rows};

const APP: &str = "outbox-tenants-bench";
/// The fleet's pinned pools, of one connection each (and a bulk pool of
/// one).
const POOLS: usize = 7;

fn schema(i: usize) -> String {
    format!("tenants_bench_{i}")
}

/// The options of connections named `name` (the fleet's, `APP`, are
/// counted).
fn options(url: &str, name: &str) -> PgConnectOptions {
    let options: PgConnectOptions = url.parse().expect("a PostgreSQL URL");
    options.application_name(name)
}

/// A pool of `size` whose connections are named `name`.
async fn pool(url: &str, name: &str, size: u32) -> PgPool {
    outbox_postgres::sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options(url, name))
        .await
        .expect("connect to PostgreSQL")
}

async fn store(pools: &PgTenantPools, shared: &PgSharedListener, i: usize) -> PgStore {
    pools
        .builder(&schema(i))
        .schema(schema(i))
        .listen_through(shared)
        .connect()
        .await
        .unwrap()
}

/// Fresh tenant schemas 0..n, migrated, four at a time.
async fn create_tenants(
    pool: &PgPool,
    pools: &PgTenantPools,
    shared: &PgSharedListener,
    n: usize,
) -> Vec<PgStore> {
    drop_tenants(pool, n).await;
    let mut stores = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(4) {
        let made = futures_util::future::join_all(chunk.iter().map(|&i| async move {
            let s = store(pools, shared, i).await;
            s.migrate().await.unwrap();
            s
        }))
        .await;
        stores.extend(made);
    }
    stores
}

async fn drop_tenants(pool: &PgPool, n: usize) {
    for i in 0..n {
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"DROP SCHEMA IF EXISTS "{}" CASCADE"#,
            schema(i)
        )))
        .execute(pool)
        .await
        .unwrap();
    }
    // Each run creates and drops 1,000 schemas of tables and indexes: left
    // to autovacuum, the catalog's dead rows pile up faster than it clears
    // them (pg_attribute had grown to 490 MB after 25 runs), and every
    // later run, of any bench, is slower for it.
    sqlx::raw_sql(
        "VACUUM pg_catalog.pg_class, pg_catalog.pg_attribute, pg_catalog.pg_depend, \
         pg_catalog.pg_type, pg_catalog.pg_index, pg_catalog.pg_constraint, \
         pg_catalog.pg_namespace, pg_catalog.pg_attrdef, pg_catalog.pg_sequence",
    )
    .execute(pool)
    .await
    .unwrap();
}

async fn fill(pool: &PgPool, store: &PgStore, n: usize) {
    super::enqueue_bench_messages(pool, &store.outbox(), n).await;
}

/// Microseconds since `t0`.
fn micros(t0: Instant) -> u64 {
    t0.elapsed().as_micros() as u64
}

/// Transactions committed in the database so far.
async fn commits(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// CPU seconds this process has used.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command's closing parenthesis: utime is the 12th,
    // stime the 13th (1-based, counting from the state field).
    let after = stat.rsplit_once(')').map(|(_, a)| a).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn rss_kb() -> u64 {
    crate::sqlite::rss_kb("VmRSS:")
}

/// Database transactions a second and this process's CPU share over
/// `window`.
async fn idle_cost(pool: &PgPool, window: Duration) -> (f64, f64) {
    // Past the relays' start (each takes back its leases, purges and reads
    // its gauges once when it starts).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (c0, cpu0, t0) = (commits(pool).await, cpu_seconds(), Instant::now());
    tokio::time::sleep(window).await;
    let (c1, cpu1) = (commits(pool).await, cpu_seconds());
    let secs = t0.elapsed().as_secs_f64();
    // The two readings are transactions of their own.
    (
        (c1 - c0 - 1).max(0) as f64 / secs,
        (cpu1 - cpu0) / secs * 100.0,
    )
}

async fn connections(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(APP)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A fleet over every store, each relayed with `handlers(i)`.
fn fleet_of(name: &str, stores: &[PgStore], handlers: impl Fn(usize) -> Handlers) -> Fleet {
    let fleet = Fleet::builder()
        .worker_id(format!("tenants-{name}-{}", std::process::id()))
        .build()
        .unwrap();
    for (i, s) in stores.iter().enumerate() {
        let batch = if i == 0 { 500 } else { 20 };
        fleet
            .add(
                schema(i),
                Relay::builder(s.clone())
                    .dispatcher(handlers(i))
                    .batch_size(batch),
            )
            .unwrap();
    }
    fleet
}

/// Whether part `name` (`idle`, `busy`) of this bench runs: all of them
/// unless `OUTBOX_BENCH_TENANTS_PARTS` lists some (e.g. `busy`), to look
/// at one figure without waiting for the others. Memory is always read.
fn part(name: &str) -> bool {
    std::env::var("OUTBOX_BENCH_TENANTS_PARTS")
        .map(|parts| parts.split(',').any(|p| p.trim() == name))
        .unwrap_or(true)
}

pub async fn tenants(quick: bool, url: &str) -> Vec<Figure> {
    let n = if quick { 20 } else { 1_000 };
    let window = Duration::from_secs(if quick { 2 } else { 20 });
    // The bench's own statements (fills, counts, drops).
    let pool = pool(url, "outbox-tenants-bench-admin", 4).await;
    // The fleet's pools; the application's writers have a pool of their own.
    let pools = PgTenantPools::connect(options(url, APP), POOLS, 1)
        .await
        .unwrap()
        .with_bulk_pool(1)
        .unwrap();
    let app = self::pool(url, "outbox-tenants-bench-app", 16).await;
    let shared = PgSharedListener::new(&pools.pools()[0]);
    let mut out = Vec::new();

    // Memory and idle cost: every tenant registered, none writing.
    let rss_before = rss_kb();
    let stores = create_tenants(&pool, &pools, &shared, n).await;
    let rss_stores = rss_kb();
    // The database's own background work (autovacuum of the new tables),
    // with no relay running, over a window longer than a sweep.
    let idle_window = if quick {
        window
    } else {
        outbox::DEFAULT_SWEEP * 3 / 2
    };
    let fleet = fleet_of("idle", &stores, |_| Handlers::new());
    fleet.until_idle().await.unwrap();
    let rss_fleet = rss_kb();
    out.push(Figure::new(
        format!("tenants: memory per tenant in the fleet (store + relay; RSS growth over {n})"),
        rss_fleet.saturating_sub(rss_before) as f64 / n as f64,
        "KB",
        "≤ 50 KB",
    ));
    out.push(Figure::new(
        "tenants: … of which the store (RSS growth over the stores alone)",
        rss_stores.saturating_sub(rss_before) as f64 / n as f64,
        "KB",
        "—",
    ));
    if part("idle") {
        out.extend(idle_figures(&pool, &stores, fleet, idle_window).await);
    } else {
        fleet.shutdown().await;
    }
    if part("busy") {
        // Which tenants share the hot tenant's pinned pool.
        let with_hot: Vec<bool> = (0..n)
            .map(|i| std::ptr::eq(pools.for_name(&schema(i)), pools.for_name(&schema(0))))
            .collect();
        out.extend(busy_figures(quick, &pool, &app, &stores, &with_hot, window).await);
    }
    drop(stores);
    drop_tenants(&pool, n).await;
    out
}

/// Idle cost: transactions a second and CPU of the fleet (`fleet`, running)
/// against the database alone and against single relays.
async fn idle_figures(
    pool: &PgPool,
    stores: &[PgStore],
    fleet: Fleet,
    idle_window: Duration,
) -> Vec<Figure> {
    let n = stores.len();
    let mut out = Vec::new();
    fleet.shutdown().await;
    // The database's own background work (autovacuum of the new tables),
    // with no relay running, over a window longer than a sweep.
    let (none_tps, _) = idle_cost(pool, idle_window).await;
    let fleet = fleet_of("idle-again", stores, |_| Handlers::new());
    fleet.until_idle().await.unwrap();
    let (fleet_tps, fleet_cpu) = idle_cost(pool, idle_window).await;
    fleet.shutdown().await;
    let mut singles: Vec<RelayHandle> = Vec::new();
    for (i, s) in stores.iter().enumerate() {
        singles.push(
            Relay::builder(s.clone())
                .dispatcher(Handlers::new())
                .worker_id(format!("tenants-single-{}-{i}", std::process::id()))
                .spawn()
                .unwrap(),
        );
    }
    for s in &singles {
        s.until_idle().await.unwrap();
    }
    let (single_tps, single_cpu) = idle_cost(pool, idle_window).await;
    for s in &singles {
        s.shutdown().await;
    }
    drop(singles);
    out.push(
        Figure::new(
            format!(
                "tenants: idle fleet of {n}, database transactions (/s; with no relay at all: {none_tps:.0})"
            ),
            fleet_tps,
            "tx/s",
            "one slow sweep",
        )
        .beside(format!("{n} single relays, default 2 s poll"), single_tps),
    );
    out.push(
        Figure::new(
            format!("tenants: idle fleet of {n}, CPU of the relay process (%)"),
            fleet_cpu,
            "%",
            "—",
        )
        .beside(format!("{n} single relays"), single_cpu),
    );

    out
}

/// With `OUTBOX_BENCH_TENANTS_PROFILE=FILE`, where the window's quiet
/// messages waited, by quarter second of commit: the messages committed,
/// and the median and largest wait from commit to the claim being asked
/// for, and from there to the handler. `stages` are each message's
/// (commit, claim asked for, handled), in µs since the bench began; the
/// window begins at `from`.
fn write_profile(path: &str, from: u64, stages: impl Iterator<Item = (u64, u64, u64)>) {
    use std::collections::BTreeMap;
    use std::fmt::Write;
    let mut quarters: BTreeMap<u64, (Vec<u64>, Vec<u64>)> = BTreeMap::new();
    for (committed, claimed, handled) in stages.filter(|s| s.0 >= from) {
        let q = quarters.entry((committed - from) / 250_000).or_default();
        q.0.push(claimed.saturating_sub(committed));
        q.1.push(handled.saturating_sub(claimed.max(committed)));
    }
    let ms = |us: u64| us as f64 / 1000.0;
    let mut out = String::from(
        "from (s)\tmessages\tcommit → claim p50 / max (ms)\tclaim → handled p50 / max (ms)\n",
    );
    for (q, (mut to_claim, mut to_handler)) in quarters {
        to_claim.sort_unstable();
        to_handler.sort_unstable();
        let _ = writeln!(
            out,
            "{:.2}\t{}\t{:.1} / {:.1}\t{:.1} / {:.1}",
            q as f64 / 4.0,
            to_claim.len(),
            ms(to_claim[to_claim.len() / 2]),
            ms(to_claim[to_claim.len() - 1]),
            ms(to_handler[to_handler.len() / 2]),
            ms(to_handler[to_handler.len() - 1]),
        );
    }
    std::fs::write(path, out).expect("write the profile");
}

/// `backlog` messages put in `store`, drained by a relay of its own (worker
/// `tenants-<name>`): its rate.
async fn drain_alone(pool: &PgPool, store: &PgStore, backlog: usize, name: &str) -> f64 {
    fill(pool, store, backlog).await;
    let count = Arc::new(AtomicU64::new(0));
    let alone = Relay::builder(store.clone())
        .dispatcher(counting_handlers(count.clone()))
        .batch_size(500)
        .worker_id(format!("tenants-{name}-{}", std::process::id()))
        .spawn()
        .unwrap();
    let t = Instant::now();
    alone.until_idle().await.unwrap();
    let rate = backlog as f64 / t.elapsed().as_secs_f64();
    alone.shutdown().await;
    assert_eq!(count.load(Ordering::Relaxed), backlog as u64);
    rate
}

/// One tenant draining a backlog while the others write: the quiet
/// tenants' latency, the hot tenant's drain against a relay alone, and the
/// connections held.
async fn busy_figures(
    quick: bool,
    pool: &PgPool,
    app: &PgPool,
    stores: &[PgStore],
    with_hot: &[bool],
    window: Duration,
) -> Vec<Figure> {
    let (n, writers) = (stores.len(), 16);
    let backlog = if quick { 2_000 } else { 100_000 };
    let mut out = Vec::new();
    // The machine's drain: a relay alone on the hot tenant's backlog, nobody
    // writing.
    let alone_rate = drain_alone(pool, &stores[0], backlog, "alone").await;

    // The others start writing and the fleet relays every tenant: first a
    // warm-up as long as the window (each connection prepares its tenants'
    // statements once), then the hot tenant gets its backlog again and the
    // window begins. After the window the hot tenant leaves the fleet and a
    // relay of its own drains the same backlog, the others still writing
    // and relayed by the fleet: the baseline of the hot tenant's drain, one
    // relay per tenant under the same load.
    let hot_done = Arc::new(AtomicU64::new(0));
    // Commit and handling times of the quiet messages, by sequence number.
    let sent = if quick { 4_000 } else { 200_000 };
    let committed: Arc<Vec<AtomicU64>> = Arc::new((0..sent).map(|_| AtomicU64::new(0)).collect());
    let handled: Arc<Vec<AtomicU64>> = Arc::new((0..sent).map(|_| AtomicU64::new(0)).collect());
    // When the claim that took each was asked for (µs since `t0`, read from
    // its lease to the millisecond): for the profile.
    let claimed: Arc<Vec<AtomicU64>> = Arc::new((0..sent).map(|_| AtomicU64::new(0)).collect());
    let t0 = Instant::now();
    let wall_t0 = outbox::Timestamp::now();
    // When the writers stop (µs since `t0`): set once the window begins.
    let stop_at = Arc::new(AtomicU64::new(u64::MAX));
    // Open loop: the quiet tenants in turn, each once a second.
    let quiet = n - 1;
    let every = Duration::from_secs_f64(1.0 / quiet as f64);
    let next = Arc::new(AtomicUsize::new(0));
    let mut producers = Vec::new();
    for w in 0..writers {
        let (pool, stores, committed, next, stop_at) = (
            app.clone(),
            stores.to_vec(),
            committed.clone(),
            next.clone(),
            stop_at.clone(),
        );
        producers.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(
                tokio::time::Instant::now() + every * w as u32,
                every * writers as u32,
            );
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            while micros(t0) < stop_at.load(Ordering::Relaxed) {
                tick.tick().await;
                let seq = next.fetch_add(1, Ordering::Relaxed);
                if seq >= committed.len() {
                    break;
                }
                let tenant = 1 + seq % quiet;
                let m = NewMessage::new(
                    MessageKind::Domain,
                    "Quiet",
                    (seq as u64).to_le_bytes().to_vec(),
                );
                let mut tx = pool.begin().await.unwrap();
                stores[tenant].outbox().enqueue(&mut tx, m).await.unwrap();
                tx.commit().await.unwrap();
                committed[seq].store(micros(t0), Ordering::Relaxed);
            }
        }));
    }
    // Messages committed before the fleet began are in no figure.
    let fleet_from = micros(t0);
    let fleet = fleet_of("busy", stores, |i| {
        if i == 0 {
            counting_handlers(hot_done.clone())
        } else {
            let (handled, claimed) = (handled.clone(), claimed.clone());
            let lease = outbox::RelayConfig::default().lease;
            Handlers::new().on_message("Quiet", move |m: &Message| {
                let seq = u64::from_le_bytes(m.payload[..8].try_into().unwrap()) as usize;
                handled[seq].store(micros(t0), Ordering::Relaxed);
                if let Some(until) = m.locked_until {
                    let asked = until.saturating_sub(lease).since(wall_t0);
                    claimed[seq].store(asked.as_millis() as u64 * 1000, Ordering::Relaxed);
                }
                async { Ok::<_, std::io::Error>(()) }
            })
        }
    });
    tokio::time::sleep(window).await;
    if std::env::var_os("OUTBOX_BENCH_TENANTS_CHECKPOINT").is_some() {
        // The worst case: a checkpoint just before the drain, so that the
        // drain's first write to each page carries the whole page.
        sqlx::query("CHECKPOINT").execute(pool).await.unwrap();
    }
    fill(pool, &stores[0], backlog).await;
    let hot_start = Instant::now();
    let warm_until = micros(t0);
    let window_end = warm_until + window.as_micros() as u64;
    let mut hot_rate = None;
    let mut held = 0;
    while micros(t0) < window_end || hot_rate.is_none() {
        held = held.max(connections(pool).await);
        if hot_rate.is_none() && hot_done.load(Ordering::Relaxed) >= backlog as u64 {
            hot_rate = Some(backlog as f64 / hot_start.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let own_from = micros(t0);
    fleet.remove(&schema(0)).await.unwrap();
    let own_rate = drain_alone(pool, &stores[0], backlog, "own").await;
    stop_at.store(micros(t0), Ordering::Relaxed);
    for p in producers {
        p.await.unwrap();
    }
    let produced = next.load(Ordering::Relaxed).min(sent);
    fleet.until_idle().await.unwrap();
    if let Ok(path) = std::env::var("OUTBOX_BENCH_TENANTS_PROFILE") {
        let stages = |seq: usize| {
            let load = |v: &[AtomicU64]| v[seq].load(Ordering::Relaxed);
            (load(&committed), load(&claimed), load(&handled))
        };
        write_profile(&path, warm_until, (0..produced).map(stages));
    }
    // Split by commit time: the warm-up, the window, and the baseline's
    // drain (from the hot tenant's leaving the fleet).
    let (mut warming, mut measured, mut own) = (histogram(), histogram(), histogram());
    // The window's latencies of the quiet tenants pinned with the hot one,
    // and of the others.
    let (mut beside_hot, mut apart) = (histogram(), histogram());
    for seq in 0..produced {
        let (c, h) = (
            committed[seq].load(Ordering::Relaxed),
            handled[seq].load(Ordering::Relaxed),
        );
        if c < fleet_from {
            continue;
        }
        // A message can be handled before its writer reads the clock
        // after commit: that counts as no wait.
        let wait = h.saturating_sub(c).max(1);
        if c < warm_until {
            warming.record(wait).unwrap();
        } else if c >= own_from {
            own.record(wait).unwrap();
        } else if c < window_end {
            measured.record(wait).unwrap();
            let split = if with_hot[1 + seq % quiet] {
                &mut beside_hot
            } else {
                &mut apart
            };
            split.record(wait).unwrap();
        }
    }
    let rate = measured.len() as f64 / window.as_secs_f64();
    out.extend(latency_rows(
        &format!(
            "tenants: {quiet} quiet tenants at 1 msg/s each ({rate:.0} msg/s reached), one tenant draining {backlog}: commit → handled"
        ),
        &measured,
        "—",
        "≤ 50 ms",
    ));
    out.extend(latency_rows(
        &format!(
            "tenants: … of which the {} quiet tenants pinned with the hot one",
            with_hot[1..].iter().filter(|w| **w).count()
        ),
        &beside_hot,
        "—",
        "—",
    ));
    out.extend(latency_rows(
        "tenants: … of which the others",
        &apart,
        "—",
        "—",
    ));
    out.extend(latency_rows(
        &format!(
            "tenants: … in the {} s of warm-up before, no backlog (the connections preparing their tenants' statements)",
            window.as_secs()
        ),
        &warming,
        "—",
        "—",
    ));
    out.extend(latency_rows(
        "tenants: … while the hot tenant drains on a relay of its own instead (the baseline below)",
        &own,
        "—",
        "—",
    ));
    let hot_rate = hot_rate.unwrap_or(f64::NAN);
    out.push(
        Figure::new(
            "tenants: the hot tenant's drain in the fleet, the others writing (msg/s)",
            hot_rate,
            "msg/s",
            "≥ 0.8 × its own relay",
        )
        .beside(
            "a relay of its own on the same backlog, the others writing and relayed by the fleet (just after the window)",
            own_rate,
        ),
    );
    out.push(
        Figure::new(
            "tenants: … the same drain against a relay alone with nobody writing (what the writers and the others' relaying leave)",
            hot_rate,
            "msg/s",
            "—",
        )
        .beside("a relay alone on the same backlog, nobody writing", alone_rate),
    );
    // Connections: the fleet's pools, its LISTEN connection and its commit
    // watcher's, against single relays, each with a pool (of at least one
    // connection) and a LISTEN connection of its own.
    let max: i64 =
        sqlx::query_scalar("SELECT setting::int8 FROM pg_settings WHERE name = 'max_connections'")
            .fetch_one(pool)
            .await
            .unwrap();
    out.push(
        Figure::new(
            format!(
                "tenants: connections held by the fleet of {n} ({POOLS} pinned pools of 1 + 1 bulk + 1 LISTEN + 1 commit watcher)"
            ),
            held as f64,
            "conns",
            "≤ 10",
        )
        .beside(
            format!(
                "{n} single relays, 2 each (pool of 1 + LISTEN): more than max_connections = {max}"
            ),
            2.0 * n as f64,
        ),
    );

    fleet.shutdown().await;
    out
}
