//! `PgTenantPools`: many stores of one database, each pinned by name to
//! one small pool whose connections keep every statement of their stores
//! prepared (rule "Fleets" in `docs/rules.md`).

use std::collections::HashSet;
use std::str::FromStr;

use outbox_api::{ErrorKind, Store};
use outbox_postgres::sqlx::{self, AssertSqlSafe, postgres::PgConnectOptions};
use outbox_postgres::testing::{claim_request, commit_one, database_url, unique_schema};
use outbox_postgres::{PgStore, PgTenantPools, TENANT_STATEMENT_CACHE};

fn options() -> PgConnectOptions {
    PgConnectOptions::from_str(&database_url()).unwrap()
}

#[test]
fn no_pool_or_no_connection_is_refused_naming_it() {
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
    let pinned = PgStore::builder_with_pool(pools.pools()[0].clone())
        .schema(schema.clone())
        .connect()
        .await
        .unwrap();
    let other = PgStore::builder_with_pool(plain)
        .schema(schema.clone())
        .connect()
        .await
        .unwrap();
    pinned.migrate().await.unwrap();
    assert!(pinned.claims_in_one_statement());
    assert!(!other.claims_in_one_statement());
    for (store, name) in [(&pinned, &schema), (&other, &plain_name)] {
        commit_one(store).await;
        assert_eq!(store.claim(&claim_request(10)).await.unwrap().len(), 1);
        let last = last_statement(name).await;
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
