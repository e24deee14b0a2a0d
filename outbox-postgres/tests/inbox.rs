//! `PgOutbox::receive_once`: the inbox transaction on PostgreSQL (the
//! mirror of `SqliteOutbox::receive_once`'s tests). Each test on a fresh
//! schema of the test database.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use outbox_api::{HandlerError, InboxOutcome, MessageId, MessageKind, NewMessage, Store};
use outbox_postgres::sqlx::{self, PgConnection};
use outbox_postgres::testing::PgUnderTest;

const LIMIT: Duration = Duration::from_secs(10);

struct Db {
    f: PgUnderTest,
}

impl Db {
    async fn new() -> Db {
        let f = PgUnderTest::fresh(None).await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            r#"CREATE TABLE "{}".effects (message_id UUID NOT NULL)"#,
            f.schema()
        )))
        .execute(f.pool())
        .await
        .unwrap();
        Db { f }
    }

    async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            r#"SELECT COUNT(*) FROM "{}"."{table}""#,
            self.f.schema()
        )))
        .fetch_one(self.f.pool())
        .await
        .unwrap()
    }

    async fn rows(&self) -> (i64, i64) {
        (
            self.count("effects").await,
            self.count(self.f.pg().inbox_table()).await,
        )
    }

    async fn receive<F>(&self, consumer: &str, id: MessageId, limit: Duration, f: F) -> InboxOutcome
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<(), HandlerError>,
    {
        self.f
            .pg()
            .outbox()
            .receive_once(self.f.pool(), consumer, id, limit, f)
            .await
    }
}

async fn effect(schema: &str, tx: &mut PgConnection, id: MessageId) -> Result<(), HandlerError> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"INSERT INTO "{schema}".effects (message_id) VALUES ($1)"#
    )))
    .bind(id.as_uuid())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

#[tokio::test]
async fn success_commits_effects_inbox_row_and_replies_together_and_a_duplicate_skips_the_handler()
{
    let db = Db::new().await;
    let schema = db.f.schema().to_owned();
    let outbox = db.f.pg().outbox();
    let id = MessageId::new();
    let runs = AtomicU32::new(0);
    let first = db
        .receive("billing", id, LIMIT, async |tx| {
            runs.fetch_add(1, Ordering::SeqCst);
            effect(&schema, tx, id).await?;
            outbox
                .enqueue(
                    tx,
                    NewMessage::new(MessageKind::Integration, "Invoiced", b"{}".to_vec()),
                )
                .await?;
            Ok(())
        })
        .await;
    assert_eq!(first, InboxOutcome::Committed);
    assert_eq!(db.rows().await, (1, 1));
    assert_eq!(
        db.f.pg().stats().await.unwrap().pending,
        1,
        "the reply committed"
    );

    let again = db
        .receive("billing", id, LIMIT, async |tx| {
            runs.fetch_add(1, Ordering::SeqCst);
            effect(&schema, tx, id).await
        })
        .await;
    assert_eq!(again, InboxOutcome::Duplicate);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler did not run");
    assert_eq!(db.rows().await, (1, 1));

    // Another consumer of the same message is not a duplicate.
    let other = db
        .receive("shipping", id, LIMIT, async |tx| {
            effect(&schema, tx, id).await
        })
        .await;
    assert_eq!(other, InboxOutcome::Committed);
    assert_eq!(db.rows().await, (2, 2));
}

#[tokio::test]
async fn failure_panic_timeout_and_a_swallowed_sql_error_roll_back_so_a_retry_runs_again() {
    let db = Db::new().await;
    let schema = db.f.schema().to_owned();
    let outbox = db.f.pg().outbox();
    let id = MessageId::new();
    let reply = || NewMessage::new(MessageKind::Integration, "Invoiced", b"{}".to_vec());

    let failed = db
        .receive("billing", id, LIMIT, async |tx| {
            effect(&schema, tx, id).await?;
            outbox.enqueue(tx, reply()).await?;
            Err("the order is unknown".into())
        })
        .await;
    assert_eq!(
        failed,
        InboxOutcome::HandlerFailed("the order is unknown".into())
    );
    assert_eq!(db.rows().await, (0, 0));

    let panicked = db
        .receive("billing", id, LIMIT, async |tx| {
            effect(&schema, tx, id).await?;
            if true {
                panic!("handler blew up");
            }
            Ok(())
        })
        .await;
    assert_eq!(
        panicked,
        InboxOutcome::HandlerFailed("handler panicked: handler blew up".into())
    );
    assert_eq!(db.rows().await, (0, 0));

    let slow = db
        .receive("billing", id, Duration::from_millis(50), async |tx| {
            effect(&schema, tx, id).await?;
            std::future::pending::<()>().await;
            Ok(())
        })
        .await;
    assert!(
        matches!(&slow, InboxOutcome::HandlerFailed(e) if e.contains("timed out")),
        "{slow:?}"
    );
    assert_eq!(db.rows().await, (0, 0));

    // An SQL error the handler ignores aborts the transaction: PostgreSQL
    // would turn the COMMIT into a rollback; it is a failure, not a commit.
    let swallowed = db
        .receive("billing", id, LIMIT, async |tx| {
            effect(&schema, tx, id).await?;
            let _ignored = sqlx::query("SELECT * FROM no_such_table")
                .execute(&mut *tx)
                .await;
            Ok(())
        })
        .await;
    assert!(
        matches!(&swallowed, InboxOutcome::HandlerFailed(e) if e.contains("transaction had failed")),
        "{swallowed:?}"
    );
    assert_eq!(db.rows().await, (0, 0));

    let retried = db
        .receive("billing", id, LIMIT, async |tx| {
            effect(&schema, tx, id).await?;
            outbox.enqueue(tx, reply()).await?;
            Ok(())
        })
        .await;
    assert_eq!(retried, InboxOutcome::Committed, "the retry ran again");
    assert_eq!(db.rows().await, (1, 1));
    assert_eq!(
        db.f.pg().stats().await.unwrap().pending,
        1,
        "one reply, from the commit"
    );
}

#[tokio::test]
async fn a_handlers_database_outage_is_not_counted() {
    let db = Db::new().await;
    let id = MessageId::new();
    // The handler's own statement loses its connection: an outage of the
    // database, retried uncounted, never a counted failure.
    let outcome = db
        .receive("billing", id, LIMIT, async |tx| {
            sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
                .execute(&mut *tx)
                .await?;
            Ok(())
        })
        .await;
    assert!(
        matches!(&outcome, InboxOutcome::HandlerUnavailable { .. }),
        "{outcome:?}"
    );
    assert_eq!(db.rows().await, (0, 0));
    // And the next try, on a fresh connection, commits.
    let schema = db.f.schema().to_owned();
    let outcome = db
        .receive("billing", id, LIMIT, async |tx| {
            effect(&schema, tx, id).await
        })
        .await;
    assert_eq!(outcome, InboxOutcome::Committed);
}

#[tokio::test]
async fn a_database_failure_is_a_store_failure() {
    let db = Db::new().await;
    db.f.pool().close().await;
    let outcome = db
        .receive("billing", MessageId::new(), LIMIT, async |_| Ok(()))
        .await;
    assert!(
        matches!(&outcome, InboxOutcome::StoreFailed(e) if e.contains("beginning")),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn a_second_receiver_of_the_same_message_waits_then_is_a_duplicate() {
    let db = Db::new().await;
    let schema = db.f.schema().to_owned();
    let id = MessageId::new();
    let (entered, mut entered_rx) = tokio::sync::mpsc::channel::<()>(1);
    let (release, release_rx) = tokio::sync::oneshot::channel::<()>();
    let first = async {
        db.receive("billing", id, LIMIT, async |tx| {
            effect(&schema, tx, id).await?;
            entered.send(()).await.unwrap();
            release_rx.await.unwrap();
            Ok(())
        })
        .await
    };
    let second = async {
        entered_rx.recv().await.unwrap();
        let runs = AtomicU32::new(0);
        let waiting = db.receive("billing", id, LIMIT, async |tx| {
            runs.fetch_add(1, Ordering::SeqCst);
            effect(&schema, tx, id).await
        });
        tokio::pin!(waiting);
        // It waits on the first one's uncommitted inbox row…
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut waiting)
                .await
                .is_err(),
            "the second receiver must wait for the first"
        );
        release.send(()).unwrap();
        let outcome = waiting.await;
        (outcome, runs.load(Ordering::SeqCst))
    };
    let (first, (second, runs)) = tokio::join!(first, second);
    assert_eq!(first, InboxOutcome::Committed);
    assert_eq!((second, runs), (InboxOutcome::Duplicate, 0));
    assert_eq!(db.rows().await, (1, 1));
}
