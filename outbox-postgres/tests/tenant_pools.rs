//! `PgTenantPools`: many stores of one database, each pinned by name to
//! one small pool whose connections keep every statement of their stores
//! prepared (rule "Fleets" in `docs/rules.md`).

use std::collections::HashSet;
use std::str::FromStr;
use std::time::Duration;

use outbox_api::{ErrorKind, Store, Timestamp};
use outbox_postgres::sqlx::{self, AssertSqlSafe, postgres::PgConnectOptions};
use outbox_postgres::testing::{
    claim_request, commit_one, database_url, test_message, unique_schema,
};
use outbox_postgres::{BULK_ROWS, PgStore, PgTenantPools, TENANT_STATEMENT_CACHE};

fn options() -> PgConnectOptions {
    PgConnectOptions::from_str(&database_url()).unwrap()
}

#[tokio::test]
async fn no_pool_or_no_connection_is_refused_naming_it() {
    for (pools, connections) in [(0, 1), (2, 0)] {
        let e = PgTenantPools::connect_lazy(options(), pools, connections).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("PgTenantPools"), "{e}");
        assert!(
            e.to_string()
                .contains(&format!("{pools} pools of {connections}")),
            "{e}"
        );
    }
    let pools = PgTenantPools::connect_lazy(options(), 1, 1).unwrap();
    let e = pools.with_bulk_pool(0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.to_string().contains("with_bulk_pool"), "{e}");
}

#[tokio::test]
async fn a_name_always_gets_the_same_pool_and_names_spread_over_all() {
    let pools = PgTenantPools::connect_lazy(options(), 4, 1).unwrap();
    let index = |name: &str| {
        let pool = pools.for_name(name);
        pools
            .pools()
            .iter()
            .position(|p| std::ptr::eq(p, pool))
            .unwrap()
    };
    let used: HashSet<usize> = (0..100).map(|i| index(&format!("tenant_{i}"))).collect();
    assert_eq!(used.len(), 4, "100 names use every pool");
    for i in 0..100 {
        let name = format!("tenant_{i}");
        assert_eq!(index(&name), index(&name));
    }
    // Stable across processes and releases: the same name, the same pool.
    assert_eq!(index("tenant_0"), index(&String::from("tenant_0")));
}

/// More stores on one connection than sqlx's default cache of 100
/// statements: each one's claim stays prepared, so the server plans it
/// once.
#[tokio::test]
async fn a_connection_keeps_the_claims_of_all_its_stores_prepared() {
    let n = 110;
    let pools = PgTenantPools::connect(options(), 1, 1).await.unwrap();
    let pool = pools.pools()[0].clone();
    let prefix = unique_schema("tenant_pools");
    let mut stores = Vec::new();
    for i in 0..n {
        let store = PgStore::builder_with_pool(pool.clone())
            .schema(format!("{prefix}_{i}"))
            .connect()
            .await
            .unwrap();
        store.migrate().await.unwrap();
        commit_one(&store).await;
        stores.push(store);
    }
    for store in &stores {
        assert_eq!(store.claim(&claim_request(10)).await.unwrap().len(), 1);
    }
    // The pool's one connection prepared each claim statement and kept it.
    let prepared: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_prepared_statements \
         WHERE statement LIKE '%FOR UPDATE OF m SKIP LOCKED%' \
           AND statement NOT LIKE '%pg_prepared_statements%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    for i in 0..n {
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"DROP SCHEMA IF EXISTS "{prefix}_{i}" CASCADE"#
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
    assert_eq!(prepared, n as i64, "every store's claim is still prepared");
    assert!(n <= TENANT_STATEMENT_CACHE);
}

/// The statement a connection named `name` ran last, as the server saw it.
async fn last_statement(name: &str) -> String {
    let observer = sqlx::PgPool::connect(&database_url()).await.unwrap();
    sqlx::query_scalar("SELECT query FROM pg_stat_activity WHERE application_name = $1")
        .bind(name)
        .fetch_one(&observer)
        .await
        .unwrap()
}

/// On the pools' connections, which have the claim's settings for their
/// whole session, a claim is one statement, its own transaction (one round
/// trip); on any other pool it is `BEGIN` with the settings, the claim,
/// `COMMIT`.
#[tokio::test]
async fn a_claim_on_the_tenant_pools_is_one_statement() {
    let schema = unique_schema("tenant_claim");
    let pools = PgTenantPools::connect(options().application_name(&schema), 1, 1)
        .await
        .unwrap();
    let plain_name = format!("{schema}_plain");
    let plain = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options().application_name(&plain_name))
        .await
        .unwrap();
    // No statement of the store's own after its claim: no commit watcher's
    // look, and the claim floor's first step (a task of its own, after a
    // claim, on an idle connection) is its last for an hour.
    let quiet = |b: outbox_postgres::PgStoreBuilder| {
        b.schema(schema.clone())
            .announce_commits(false)
            .claim_floor_step(Duration::from_secs(3600))
    };
    let pinned = quiet(PgStore::builder_with_pool(pools.pools()[0].clone()))
        .connect()
        .await
        .unwrap();
    let other = quiet(PgStore::builder_with_pool(plain))
        .connect()
        .await
        .unwrap();
    pinned.migrate().await.unwrap();
    assert!(pinned.claims_in_one_statement());
    assert!(!other.claims_in_one_statement());
    for (store, name) in [(&pinned, &schema), (&other, &plain_name)] {
        // If the floor's step ran after the first claim, the second claim
        // is the last statement.
        let mut last = String::new();
        for _ in 0..2 {
            commit_one(store).await;
            assert_eq!(store.claim(&claim_request(10)).await.unwrap().len(), 1);
            last = last_statement(name).await;
            if !last.contains("pg_current_xact_id") && !last.contains("pg_snapshot_xmin") {
                break;
            }
        }
        let expected = if store.claims_in_one_statement() {
            "picked AS ("
        } else {
            "COMMIT"
        };
        assert!(last.contains(expected), "{name} ran last: {last}");
    }
    let mode: String = sqlx::query_scalar("SHOW plan_cache_mode")
        .fetch_one(&pools.pools()[0])
        .await
        .unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(r#"DROP SCHEMA "{schema}" CASCADE"#)))
        .execute(other.pool())
        .await
        .unwrap();
    assert_eq!(mode, "force_generic_plan");
}

/// With a bulk pool, a store's large statements run there: a completion of
/// `BULK_ROWS` messages or more; while the store drains a backlog (its
/// last claim came back full) all its claims, completions and backlog
/// counts. They go on while the store's pinned connection is held by
/// someone else, as a hot tenant's go on while its quiet neighbours' short
/// statements hold theirs; until then they stay on the pinned pool, which
/// opens no connection of the bulk pool.
#[tokio::test]
async fn a_stores_large_statements_run_on_the_bulk_pool() {
    let schema = unique_schema("tenant_bulk");
    let pools = PgTenantPools::connect(options(), 1, 1)
        .await
        .unwrap()
        .with_bulk_pool(1)
        .unwrap();
    let bulk = pools.bulk().unwrap().clone();
    let store = migrated_store(&pools, &schema).await;
    let enqueue = |from: usize, n: usize| {
        let store = store.clone();
        async move {
            let mut tx = store.pool().begin().await.unwrap();
            for n in from..from + n {
                store
                    .outbox()
                    .enqueue(&mut tx, test_message(n))
                    .await
                    .unwrap();
            }
            tx.commit().await.unwrap();
        }
    };

    // A claim that is not full and its completion; then a full claim, as
    // the one before was not: the pinned pool.
    enqueue(0, 5).await;
    let first = store.claim(&claim_request(10)).await.unwrap();
    store
        .complete(&ids(&first), Timestamp::now())
        .await
        .unwrap();
    enqueue(5, 2 * BULK_ROWS).await;
    let second = store.claim(&claim_request(BULK_ROWS)).await.unwrap();
    assert_eq!((first.len(), second.len()), (5, BULK_ROWS));
    assert_eq!(bulk.size(), 0, "small statements opened no bulk connection");

    // The pinned pool's one connection is taken: the claim after a full
    // one, a large completion, a draining store's small one and the
    // backlog's counts still run.
    let held = store.pool().acquire().await.unwrap();
    let deadline = Duration::from_secs(30);
    let third = tokio::time::timeout(deadline, store.claim(&claim_request(10)))
        .await
        .expect("a claim after a full one runs on the bulk pool")
        .unwrap();
    assert_eq!(third.len(), 10);
    tokio::time::timeout(deadline, store.complete(&ids(&second), Timestamp::now()))
        .await
        .expect("a large completion runs on the bulk pool")
        .unwrap();
    tokio::time::timeout(
        deadline,
        store.complete(&ids(&third[..1]), Timestamp::now()),
    )
    .await
    .expect("a draining store's small completion runs on the bulk pool")
    .unwrap();
    let backlog = tokio::time::timeout(deadline, store.backlog())
        .await
        .expect("a draining store's backlog counts run on the bulk pool")
        .unwrap();
    assert_eq!(backlog.pending, (BULK_ROWS - 1) as u64);
    assert_eq!(bulk.size(), 1);
    drop(held);

    let left: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        r#"SELECT count(*) FROM "{schema}".outbox WHERE state = 'pending' AND locked_by IS NULL"#
    )))
    .fetch_one(&bulk)
    .await
    .unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(r#"DROP SCHEMA "{schema}" CASCADE"#)))
        .execute(&bulk)
        .await
        .unwrap();
    assert_eq!(left, (BULK_ROWS - 10) as i64);
}

/// A store of `pools` in `schema`, its tables made.
async fn migrated_store(pools: &PgTenantPools, schema: &str) -> PgStore {
    let store = pools
        .builder(schema)
        .schema(schema)
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    store
}

fn ids(messages: &[outbox_api::Message]) -> Vec<outbox_api::MessageId> {
    messages.iter().map(|m| m.id).collect()
}

/// The counts the gauges read every sweep read each state's partial index,
/// never the whole table, even under the tenant pools' generic plans (with
/// the completed messages kept, the table is far larger than its backlog).
#[tokio::test]
async fn the_backlog_counts_read_their_partial_indexes() {
    let schema = unique_schema("tenant_counts");
    let pools = PgTenantPools::connect(options(), 1, 1).await.unwrap();
    let store = migrated_store(&pools, &schema).await;
    let pool = pools.pools()[0].clone();
    // As the store runs it: prepared, under the connection's generic plans.
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "PREPARE count_probe(text) AS {}",
        store.count_statement()
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    let mut plans = Vec::new();
    for state in ["pending", "poisoned", "processed"] {
        let rows: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "EXPLAIN EXECUTE count_probe('{state}')"
        )))
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        plans.push((state, rows.join("\n")));
    }
    sqlx::raw_sql("DEALLOCATE count_probe")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);
    commit_one(&store).await;
    let pending = store.backlog().await.unwrap().pending;
    sqlx::raw_sql(AssertSqlSafe(format!(r#"DROP SCHEMA "{schema}" CASCADE"#)))
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(pending, 1);
    for (state, plan) in plans {
        assert!(!plan.contains("Seq Scan"), "{state}: {plan}");
        assert!(
            plan.contains(&format!("outbox_{state}_idx")),
            "{state}: {plan}"
        );
    }
}
