//! A fleet process over 100 tenant schemas (one pool, one shared `LISTEN`
//! connection) is SIGKILLed twice mid-run and started again — once under
//! the same worker id (it takes its leases back at once), once under a new
//! one (the leases expire first). Afterwards, in every tenant's schema,
//! every message took effect exactly once (through the inbox), per-key
//! order held and no attempt was counted.
//!
//! Only the fleet's own process is killed, never the server: the test uses
//! the shared PostgreSQL.

use std::path::Path;
use std::time::Duration;

use outbox_faults::check::{self, Expected};
use outbox_faults::postgres::{self as pg, lazy_pool, with_application_name};
use outbox_faults::{ChildArgs, RelayChild};
use outbox_postgres::PgStore;
use outbox_postgres::sqlx::{self, AssertSqlSafe, PgPool};
use outbox_postgres::testing::{database_url, unique_schema};

/// Messages processed in every tenant's schema, summed.
async fn processed(pool: &PgPool, schemas: &[String]) -> Option<u64> {
    let mut sum = 0;
    for s in schemas {
        sum += pg::in_state(pool, s, "processed").await?;
    }
    Some(sum)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_killed_mid_run_and_restarted_loses_nothing_and_repeats_nothing() {
    let seed = check::seed();
    eprintln!("fleet fault test seed: {seed} (rerun with OUTBOX_FAULTS_SEED={seed})");
    let mut rng = fastrand::Rng::with_seed(seed);
    let (tenants, per_tenant) = if check::soak() {
        (300, 300)
    } else {
        (100, 100)
    };
    let url = database_url();
    let prefix = unique_schema("faults_fleet");
    let admin = lazy_pool(
        &with_application_name(&url, "outbox-faults-fleet-admin"),
        4,
        Duration::from_secs(10),
    )
    .unwrap();
    let schemas: Vec<String> = (0..tenants).map(|i| format!("{prefix}_{i}")).collect();
    let mut expected: Vec<Vec<Expected>> = Vec::new();
    for (i, schema) in schemas.iter().enumerate() {
        sqlx::query(AssertSqlSafe(format!(r#"CREATE SCHEMA "{schema}""#)))
            .execute(&admin)
            .await
            .unwrap();
        let store = PgStore::builder_with_pool(admin.clone())
            .schema(schema)
            .connect()
            .await
            .unwrap();
        store.migrate().await.unwrap();
        pg::prepare_receiver(&admin, schema).await.unwrap();
        let enqueued = pg::enqueue_many(
            &store.outbox(),
            &admin,
            &mut rng,
            (i * per_tenant) as i64,
            per_tenant,
            8,
            "key-",
        )
        .await
        .unwrap();
        expected.push(enqueued.settle(&admin, schema).await.unwrap());
    }
    let total: u64 = expected.iter().map(|e| e.len() as u64).sum();
    assert_eq!(total, (tenants * per_tenant) as u64);

    let exe = Path::new(env!("CARGO_BIN_EXE_relay-child"));
    let dir = tempfile::tempdir().unwrap();
    let spawn = |worker: &str| {
        let mut args = ChildArgs::postgres(&prefix, worker);
        args.pg_tenants = tenants;
        args.batch_size = 20;
        args.concurrency = 8;
        args.lease = Duration::from_secs(3);
        args.handler_timeout = Duration::from_secs(2);
        // The fleet's sweep: how soon expired leases are found.
        args.poll_interval = Duration::from_millis(500);
        // Each delivery takes a moment, so a kill finds work in flight.
        args.handler_delay = Duration::from_millis(5);
        let log = dir.path().join(format!("{worker}.log"));
        RelayChild::spawn_postgres(exe, &args, &url, &log).unwrap()
    };

    let mut fleet = spawn("fleet-a");
    for (share, next) in [(3, "fleet-a"), (6, "fleet-b")] {
        let at = total * share / 10;
        pg::wait_until(
            &format!("{share}0 % of the messages processed"),
            Duration::from_secs(300),
            || async { processed(&admin, &schemas).await.map(|n| n >= at) },
        )
        .await;
        assert!(
            fleet.is_running(),
            "the fleet process died before it was killed:\n{}",
            check::log_tail(fleet.log(), 20)
        );
        fleet.kill().unwrap();
        eprintln!("killed the fleet at {share}0 %; starting it as {next}");
        fleet = spawn(next);
    }
    pg::wait_until(
        "every tenant's messages processed",
        Duration::from_secs(300),
        || async { processed(&admin, &schemas).await.map(|n| n == total) },
    )
    .await;
    let context = format!("fleet fault test, seed {seed}");
    outbox_faults::stop_all(
        std::slice::from_mut(&mut fleet),
        Duration::from_secs(20),
        &context,
    );
    let (mut turned_away, mut by_worker) = (0, std::collections::BTreeMap::new());
    for (schema, expected) in schemas.iter().zip(&expected) {
        let report = pg::verify(&admin, schema, expected).await;
        turned_away += report.duplicate_calls;
        for (w, n) in &report.per_worker {
            *by_worker.entry(w.clone()).or_insert(0) += n;
        }
        report.assert_exactly_once(&format!("{context}, schema {schema}"));
        assert_eq!(
            pg::leased(&admin, schema).await,
            Some(0),
            "{schema}: leases left"
        );
    }
    eprintln!(
        "fleet fault test: {total} messages in {tenants} schemas, each one effect; \
         effects by process: {by_worker:?}; deliveries the inboxes turned away: {turned_away}"
    );
    // Both worker ids did part of the work (the first two processes share one).
    assert_eq!(by_worker.len(), 2, "effects by worker id: {by_worker:?}");
    for schema in &schemas {
        sqlx::query(AssertSqlSafe(format!(r#"DROP SCHEMA "{schema}" CASCADE"#)))
            .execute(&admin)
            .await
            .unwrap();
    }
}
