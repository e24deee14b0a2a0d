//! PostgreSQL under fire: four relay processes share one outbox while the
//! test SIGKILLs relays, ends their and their listeners' connections with
//! `pg_terminate_backend`, and restarts the server — and the application
//! keeps enqueueing throughout. Afterwards every message took effect
//! exactly once (through the inbox), per-key order held, no attempt was
//! counted for any of it, and the duplicates the inbox turned away are
//! bounded by what the disruptions could have left half-done.
//!
//! The test restarts its server, so it runs a server of its own
//! ([`OwnPostgres`], in a temporary directory, on a free port), never the
//! shared one.

use std::path::Path;
use std::time::{Duration, Instant};

use outbox_faults::check::{self, Expected};
use outbox_faults::own_postgres::OwnPostgres;
use outbox_faults::postgres::{
    self as pg, Enqueued, in_state, lazy_pool, log_problems_beyond_outages, terminate_one,
    with_application_name,
};
use outbox_faults::{ChildArgs, RelayChild, assert_all_running};
use outbox_postgres::PgStore;
use outbox_postgres::sqlx::{self, AssertSqlSafe};
use outbox_postgres::testing::unique_schema;

/// One disruption, done when the relays have processed a given share of
/// the messages.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Disruption {
    /// SIGKILL a relay; start it again under the same worker id (it takes
    /// its leases back at once) or, every other time, under a new one (the
    /// others take its work when its leases expire).
    Kill,
    /// `pg_terminate_backend` one of the relays' connections, or every
    /// fourth time one of their `LISTEN` connections.
    Terminate,
    /// Restart the PostgreSQL server.
    Restart,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_survive_kills_ended_connections_and_a_server_restart() {
    let seed = check::seed();
    eprintln!("postgres fault test seed: {seed} (rerun with OUTBOX_FAULTS_SEED={seed})");
    let mut rng = fastrand::Rng::with_seed(seed);
    let (messages, kills, terminations) = if check::soak() {
        (300_000, 60, 60)
    } else {
        (100_000, 20, 20)
    };
    let relays = 4;
    // The test restarts its server, so it runs one of its own (declared
    // first, so dropped last: the relays are killed before it stops).
    let mut server =
        tokio::task::block_in_place(OwnPostgres::new).unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    let schema = unique_schema("faults_pg");
    let tag = format!("faults-{schema}");
    let admin = lazy_pool(
        &with_application_name(&url, "outbox-faults-admin"),
        4,
        Duration::from_secs(5),
    )
    .unwrap();
    sqlx::query(AssertSqlSafe(format!(r#"CREATE SCHEMA "{schema}""#)))
        .execute(&admin)
        .await
        .unwrap();
    // The application's commits need not wait for the disk (the server is
    // restarted, never crashed): the 60k messages written up front go in
    // several times faster.
    let app_url = format!(
        "{}&options=-c%20synchronous_commit%3Doff",
        with_application_name(&url, "outbox-faults-app")
    );
    let store = PgStore::builder(app_url)
        .schema(&schema)
        .max_connections(4)
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    pg::prepare_receiver(&admin, &schema).await.unwrap();
    let outbox = store.outbox();
    let app = store.pool().clone();

    // 60 % before the relays start, the rest while they run.
    let before = messages * 6 / 10;
    let mut enqueued = pg::enqueue_many(&outbox, &app, &mut rng, 0, before, 200, "key-")
        .await
        .unwrap();
    let writer = {
        let (outbox, app) = (outbox.clone(), app.clone());
        let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
        tokio::spawn(async move {
            pg::enqueue_many(
                &outbox,
                &app,
                &mut rng,
                before as i64,
                messages - before,
                200,
                "key-",
            )
            .await
        })
    };

    let exe = Path::new(env!("CARGO_BIN_EXE_relay-child"));
    let dir = tempfile::tempdir().unwrap();
    let spawn = |worker: &str| {
        let mut args = ChildArgs::postgres(&schema, worker);
        args.batch_size = 50;
        // 4 relays × (8 receiver + 4 store + 1 LISTEN connections) stay
        // well within a default server's 100.
        args.concurrency = 8;
        // A handler timeout counts an attempt, so it is far above what a
        // receiver transaction takes even on a loaded 2-core machine; the
        // handler's pool gives up after half of it (an outage is then
        // `TemporarilyUnavailable`, uncounted).
        args.lease = Duration::from_secs(8);
        args.handler_timeout = Duration::from_secs(5);
        args.poll_interval = Duration::from_millis(200);
        let log = dir.path().join(format!("{worker}.log"));
        RelayChild::spawn_postgres(exe, &args, &url, &log).unwrap()
    };
    let started = Instant::now();
    let mut children: Vec<RelayChild> = (0..relays).map(|r| spawn(&format!("relay-{r}"))).collect();

    let mut plan: Vec<Disruption> = std::iter::repeat_n(Disruption::Kill, kills)
        .chain(std::iter::repeat_n(Disruption::Terminate, terminations))
        .chain([Disruption::Restart])
        .collect();
    rng.shuffle(&mut plan);
    let (mut renamed, mut ended, mut ended_listeners, mut restarted) = (0, 0, 0, None);
    let mut logs: Vec<std::path::PathBuf> = children.iter().map(|c| c.log().to_owned()).collect();
    for (i, disruption) in plan.iter().enumerate() {
        // Spread the disruptions from 5 % to 85 % of the messages processed.
        let share = 0.05 + 0.80 * i as f64 / plan.len() as f64;
        let target = (messages as f64 * share) as u64;
        pg::wait_until(
            &format!("{target} messages processed before disruption {i}"),
            Duration::from_secs(300),
            || async {
                in_state(&admin, &schema, "processed")
                    .await
                    .map(|n| n >= target)
            },
        )
        .await;
        assert_all_running(&mut children, &format!("seed {seed}"));
        match disruption {
            Disruption::Kill => {
                let r = rng.usize(..relays);
                children[r].kill().unwrap();
                let worker = if i % 2 == 0 {
                    children[r].worker().to_owned()
                } else {
                    renamed += 1;
                    format!("relay-{r}-{i}")
                };
                children[r] = spawn(&worker);
                logs.push(children[r].log().to_owned());
            }
            Disruption::Terminate => {
                let listeners = ended % 4 == 3;
                let n = terminate_one(&admin, &tag, listeners).await.unwrap();
                ended += n;
                if listeners {
                    ended_listeners += n;
                }
            }
            Disruption::Restart => {
                let at = Instant::now();
                tokio::task::block_in_place(|| server.restart())
                    .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
                restarted = Some(at.elapsed());
            }
        }
    }

    let written: Enqueued = writer.await.unwrap().unwrap();
    let interrupted = enqueued.interrupted + written.interrupted;
    enqueued.committed.extend(written.committed);
    enqueued.uncertain.extend(written.uncertain);
    let uncertain = enqueued.uncertain.len();
    let expected: Vec<Expected> = enqueued.settle(&admin, &schema).await.unwrap();
    let drained = pg::drain_and_stop(&admin, &schema, &mut children, &format!("seed {seed}")).await;
    let elapsed = started.elapsed();

    let report = pg::verify(&admin, &schema, &expected).await;
    let disruptions = kills + terminations + 1;
    // Each disruption can leave at most the work one relay had claimed
    // (its in-flight deliveries and one waiting batch) handled but not
    // recorded; the inbox turns each such redelivery away.
    let bound = (50 + 8) * disruptions as u64;
    eprintln!(
        "postgres fault test: messages={} relays={relays} kills={kills} (under a new id: \
         {renamed}) connections ended={ended} (listeners: {ended_listeners}) restart: server \
         away {restarted:?}; enqueue transactions interrupted={interrupted} (commit uncertain: {uncertain}); duplicates={} \
         (bound {bound}) per relay={:?} drained after the last disruption in {drained:.2?}, \
         elapsed={elapsed:.2?} seed={seed}",
        expected.len(),
        report.duplicates,
        report.per_worker
    );
    assert!(
        expected.len() + 8 * uncertain >= messages,
        "seed {seed}: only {} messages enqueued",
        expected.len()
    );
    assert!(
        restarted.is_some(),
        "seed {seed}: the server was not restarted"
    );
    report.assert_exactly_once(&format!("seed {seed}"));
    assert!(
        report.duplicates <= bound,
        "seed {seed}: {} duplicates exceed the bound {bound}",
        report.duplicates
    );
    let mut problems = Vec::new();
    for log in &logs {
        problems.extend(log_problems_beyond_outages(log));
    }
    assert!(
        problems.is_empty(),
        "seed {seed}: the relays reported problems that no outage explains:\n{}",
        problems.join("\n")
    );
    assert_eq!(
        pg::leased(&admin, &schema).await,
        Some(0),
        "seed {seed}: leases left after a graceful stop"
    );
    sqlx::query(AssertSqlSafe(format!(r#"DROP SCHEMA "{schema}" CASCADE"#)))
        .execute(&admin)
        .await
        .unwrap();
}
