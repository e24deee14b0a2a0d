//! The inbox databases the consumer figures run on: a SQLite file or a PostgreSQL schema, and the handler work on each.

use super::*;

/// A store's inbox and the figures' handler on its connection type.
pub(super) enum BenchInbox {
    Sqlite(
        outbox_sqlite::SqliteInbox,
        Arc<dyn outbox_api::receive::InboxHandler<SqliteConnection>>,
    ),
    Postgres(
        outbox_postgres::PgInbox,
        Arc<dyn outbox_api::receive::InboxHandler<PgConnection>>,
    ),
}

/// The inbox database of one run, with the handler's `effects` table.
pub(super) enum Db {
    Sqlite {
        _dir: tempfile::TempDir,
        outbox: SqliteOutbox,
        pool: SqlitePool,
    },
    Postgres(PgUnderTest),
}

impl Db {
    /// A SQLite file as MiniShop opens it: WAL, synchronous NORMAL, one
    /// connection shared by the consumers (writers queue in-process).
    pub(super) async fn sqlite() -> Db {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("consumer.db");
        let store = SqliteStore::connect(&path).await.unwrap();
        store.migrate().await.unwrap();
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap();
        sqlitesqlx::query("CREATE TABLE effects (id TEXT PRIMARY KEY, len INTEGER NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        Db::Sqlite {
            _dir: dir,
            outbox: store.outbox(),
            pool,
        }
    }

    /// A fresh schema (outbox, inbox, `effects`); the application pool has
    /// 8 connections.
    pub(super) async fn postgres() -> Db {
        let f = PgUnderTest::fresh(None).await;
        pgsqlx::query(pgsqlx::AssertSqlSafe(format!(
            r#"CREATE TABLE "{}".effects (id TEXT PRIMARY KEY, len BIGINT NOT NULL)"#,
            f.schema()
        )))
        .execute(f.pool())
        .await
        .unwrap();
        Db::Postgres(f)
    }

    pub(super) fn name(&self) -> &'static str {
        match self {
            Db::Sqlite { .. } => "SQLite",
            Db::Postgres(_) => "PostgreSQL",
        }
    }

    pub(super) async fn effects(&self) -> i64 {
        match self {
            Db::Sqlite { pool, .. } => sqlitesqlx::query_scalar("SELECT count(*) FROM effects")
                .fetch_one(pool)
                .await
                .unwrap(),
            Db::Postgres(f) => pgsqlx::query_scalar(pgsqlx::AssertSqlSafe(format!(
                r#"SELECT count(*) FROM "{}".effects"#,
                f.schema()
            )))
            .fetch_one(f.pool())
            .await
            .unwrap(),
        }
    }

    /// This database's inbox and the handler every consumer figure runs:
    /// insert the effect row, count.
    pub(super) fn inbox(&self, tally: Arc<Tally>) -> BenchInbox {
        match self {
            Db::Sqlite { outbox, pool, .. } => {
                let handler = handler_fn(
                    move |msg: &Received, tx: &mut SqliteConnection| -> HandlerFuture<'_> {
                        let tally = Arc::clone(&tally);
                        Box::pin(async move {
                            sqlitesqlx::query("INSERT INTO effects (id, len) VALUES ($1, $2)")
                                .bind(msg.id.to_string())
                                .bind(msg.payload.len() as i64)
                                .execute(&mut *tx)
                                .await?;
                            tally.hit();
                            Ok(())
                        })
                    },
                );
                BenchInbox::Sqlite(
                    outbox_sqlite::SqliteInbox::new(outbox.clone(), pool.clone()),
                    Arc::new(handler),
                )
            }
            Db::Postgres(f) => {
                let insert = format!(
                    r#"INSERT INTO "{}".effects (id, len) VALUES ($1, $2)"#,
                    f.schema()
                );
                let handler = handler_fn(
                    move |msg: &Received, tx: &mut PgConnection| -> HandlerFuture<'_> {
                        let (tally, insert) = (Arc::clone(&tally), insert.clone());
                        Box::pin(async move {
                            pgsqlx::query(pgsqlx::AssertSqlSafe(insert))
                                .bind(msg.id.to_string())
                                .bind(msg.payload.len() as i64)
                                .execute(&mut *tx)
                                .await?;
                            tally.hit();
                            Ok(())
                        })
                    },
                );
                BenchInbox::Postgres(
                    outbox_postgres::PgInbox::new(f.pg().outbox(), f.pool().clone()),
                    Arc::new(handler),
                )
            }
        }
    }

    /// A `RabbitConsumer` into this inbox running the handler.
    pub(super) async fn consumer(
        &self,
        builder: outbox_rabbitmq::RabbitConsumerBuilder,
        tally: Arc<Tally>,
    ) -> ConsumerHandle {
        let builder = builder.consumer_name("bench").prefetch(PREFETCH);
        match self.inbox(tally) {
            BenchInbox::Sqlite(inbox, handler) => builder.spawn(inbox, handler).await.unwrap(),
            BenchInbox::Postgres(inbox, handler) => builder.spawn(inbox, handler).await.unwrap(),
        }
    }

    /// The bare handler: the same insert in a transaction of its own
    /// (`BEGIN IMMEDIATE` on SQLite, as the inbox begins), committed; with
    /// `inbox`, the inbox's own statement first (`try_receive`, the insert
    /// of the inbox row), without the consumer around it.
    pub(super) async fn bare_handle(&self, id: &str, len: usize, tally: &Tally, inbox: bool) {
        let message_id: MessageId = id.parse().unwrap();
        match self {
            Db::Sqlite { pool, outbox, .. } => {
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
                if inbox {
                    assert!(
                        outbox
                            .try_receive(&mut *tx, "bench", message_id)
                            .await
                            .unwrap()
                    );
                }
                sqlitesqlx::query("INSERT INTO effects (id, len) VALUES ($1, $2)")
                    .bind(id)
                    .bind(len as i64)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tally.hit();
                tx.commit().await.unwrap();
            }
            Db::Postgres(f) => {
                let mut tx = f.pool().begin().await.unwrap();
                if inbox {
                    let outbox = f.pg().outbox();
                    assert!(
                        outbox
                            .try_receive(&mut tx, "bench", message_id)
                            .await
                            .unwrap()
                    );
                }
                pgsqlx::query(pgsqlx::AssertSqlSafe(format!(
                    r#"INSERT INTO "{}".effects (id, len) VALUES ($1, $2)"#,
                    f.schema()
                )))
                .bind(id)
                .bind(len as i64)
                .execute(&mut *tx)
                .await
                .unwrap();
                tally.hit();
                tx.commit().await.unwrap();
            }
        }
    }
}
