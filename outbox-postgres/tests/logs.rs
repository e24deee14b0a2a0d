//! The README's row "credentials never appear in `Debug`, logs or errors",
//! for PostgreSQL's logs. Alone in its test binary: the capture is a
//! thread's default subscriber, and tracing's interest in each log line is
//! shared by the process, so tests logging on other threads at the same
//! time made it miss lines (about one run in six).

use std::time::Duration;

use outbox_api::Store;
use outbox_postgres::PgStore;
use outbox_postgres::sqlx;
use outbox_postgres::testing::{
    claim_request as claim, database_url, listens, test_message as msg, unique_schema,
};

/// The README's row "credentials never appear in `Debug`, logs or errors",
/// for PostgreSQL's logs: everything logged at any level (the store's, the
/// listener's, sqlx's) while a store with a password in its URL connects,
/// migrates, enqueues, claims, loses its `LISTEN` connection and listens
/// again, and while another fails to reach a server.
#[tokio::test]
async fn logs_never_contain_the_password() {
    let (logs, _guard) = outbox_api::testing::LogBuffer::capture_all();
    let secret = "l0gged-pg-Pa55";
    let schema = unique_schema("outbox_logs");
    // Trust authentication ignores the password, so the store connects.
    let base = database_url();
    assert!(
        base.starts_with("postgres://postgres@"),
        "this test puts a password into the default URL; OUTBOX_PG_URL is `{}`",
        base.split('@').next_back().unwrap_or_default()
    );
    let separator = if base.contains('?') { '&' } else { '?' };
    let url = format!(
        "{}{separator}application_name={schema}",
        base.replacen(
            "postgres://postgres@",
            &format!("postgres://postgres:{secret}@"),
            1
        )
    );
    let store = PgStore::builder(url.clone())
        .schema(schema.clone())
        .poll_interval(Duration::from_millis(100))
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let mut listener = store.listen();
    assert!(listener.wait(Duration::from_secs(10)).await);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    store.outbox().enqueue(&mut tx, msg(1)).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(store.claim(&claim(10)).await.unwrap().len(), 1);
    // The listener's connection is ended: it logs, reconnects, listens again.
    listens(&pool, &schema).await;
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(&schema)
    .execute(&pool)
    .await
    .unwrap();
    assert!(listener.wait(Duration::from_secs(10)).await);
    // A server that does not answer.
    let unreachable = format!("postgres://outbox:{secret}@127.0.0.1:1/shop");
    assert!(PgStore::connect(&unreachable).await.is_err());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"DROP SCHEMA "{schema}" CASCADE"#
    )))
    .execute(&pool)
    .await
    .unwrap();
    drop(_guard);
    let text = logs.text();
    // The capture saw the store's own logging.
    assert!(
        text.contains("outbox schema migrated"),
        "the store's logs were captured:\n{text}"
    );
    assert!(!text.contains(secret), "a password in the logs:\n{text}");
}
