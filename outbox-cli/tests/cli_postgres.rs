//! Runs the built `outbox` binary against outbox tables in PostgreSQL, each
//! test in a schema of its own (`outbox_postgres::testing`).
//!
//! They need PostgreSQL: `OUTBOX_PG_URL` if set, else the local default
//! (`postgres://postgres@127.0.0.1:5432/test`) if it answers; otherwise
//! they fail saying how to provide one — never a silent skip.

use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_api::{
    ClaimRequest, FailOutcome, Failure, MessageId, MessageKind, MessageState, NewMessage,
    OperatorStore, Store, Timestamp,
};
use outbox_postgres::sqlx;
use outbox_postgres::testing::{PgUnderTest, unique_schema};

mod common;
use common::{assert_error, assert_ok, json_of, stderr, stdout};

const TRACE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const TABLE: &str = "test_outbox";

/// A fresh schema with one poisoned, one processed and one pending message.
struct Fixture {
    pg: PgUnderTest,
    poisoned: MessageId,
    processed: MessageId,
    pending: MessageId,
}

async fn enqueue(pg: &PgUnderTest, message: NewMessage) -> MessageId {
    let mut tx = pg.pool().begin().await.unwrap();
    let id = pg.pg().outbox().enqueue(&mut tx, message).await.unwrap();
    tx.commit().await.unwrap();
    id
}

fn claim_one() -> ClaimRequest {
    ClaimRequest::new(
        "w",
        1,
        Duration::from_secs(30),
        Timestamp::now().saturating_add(Duration::from_secs(1)),
    )
}

async fn fixture() -> Fixture {
    let pg = PgUnderTest::fresh(None).await;
    let store = pg.pg();
    let order = serde_json::json!({"order": 1, "items": ["a", "b"]});
    let poisoned = enqueue(
        &pg,
        NewMessage::json(MessageKind::Domain, "OrderPlaced", &order)
            .unwrap()
            .key("order-1")
            .header("tenant", "acme")
            .trace_parent(TRACE),
    )
    .await;
    assert_eq!(store.claim(&claim_one()).await.unwrap()[0].id, poisoned);
    let outcome = store
        .fail(&Failure::new(
            "w",
            poisoned,
            "boom: handler exploded",
            Timestamp::now(),
            1,
            Timestamp::now(),
        ))
        .await
        .unwrap();
    assert_eq!(outcome, FailOutcome::Poisoned { attempts: 1 });

    let processed = enqueue(
        &pg,
        NewMessage::new(MessageKind::Domain, "Shipped", b"plain text".to_vec()),
    )
    .await;
    assert_eq!(store.claim(&claim_one()).await.unwrap()[0].id, processed);
    store
        .complete(&[processed], Timestamp::now())
        .await
        .unwrap();

    let pending = enqueue(
        &pg,
        NewMessage::new(MessageKind::Integration, "Binary", vec![0xff, 0x00, 0x10]),
    )
    .await;
    Fixture {
        pg,
        poisoned,
        processed,
        pending,
    }
}

/// `outbox ARGS…` with a clean environment.
fn outbox_raw(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_outbox"))
        .env_remove("OUTBOX_DATABASE")
        .env_remove("OUTBOX_TABLE")
        .env_remove("OUTBOX_SCHEMA")
        .env("USER", "tester")
        .args(args)
        .output()
        .unwrap()
}

/// `outbox --database URL --schema S --table test_outbox ARGS…`.
fn outbox(pg: &PgUnderTest, args: &[&str]) -> Output {
    outbox_at(pg.url(), pg.schema(), TABLE, args)
}

fn outbox_at(url: &str, schema: &str, table: &str, args: &[&str]) -> Output {
    let mut all = vec!["--database", url, "--schema", schema, "--table", table];
    all.extend_from_slice(args);
    outbox_raw(&all)
}

/// `url` with `password` put in (replacing any there was).
fn with_password(url: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (user, host) = match authority.rsplit_once('@') {
        Some((userinfo, host)) => (userinfo.split(':').next().unwrap_or(""), host),
        None => ("postgres", authority),
    };
    format!("{scheme}://{user}:{password}@{host}{path}")
}

async fn get(pg: &PgUnderTest, id: MessageId) -> outbox_api::Message {
    pg.pg().get(id).await.unwrap().expect("the message exists")
}

/// Waits until `check` holds, failing with `what` after `limit`.
async fn wait_for<F: AsyncFnMut() -> bool>(what: &str, limit: Duration, mut check: F) {
    let deadline = Instant::now() + limit;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn postgres_list_show_and_stats() {
    let f = fixture().await;
    let text = assert_ok(&outbox(&f.pg, &["list", "--state", "poisoned"]));
    assert!(text.contains(&f.poisoned.to_string()), "{text}");
    assert!(text.contains("boom: handler exploded"), "{text}");
    assert!(!text.contains(&f.pending.to_string()), "{text}");

    let all = json_of(&outbox(&f.pg, &["--json", "list"]));
    let ids: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [
            f.poisoned.to_string(),
            f.processed.to_string(),
            f.pending.to_string()
        ]
    );
    let shipped = json_of(&outbox(&f.pg, &["list", "--type", "Shipped", "--json"]));
    assert_eq!(shipped.as_array().unwrap().len(), 1);
    assert_eq!(shipped[0]["state"], "processed");

    let id = f.poisoned.to_string();
    let text = assert_ok(&outbox(&f.pg, &["show", &id]));
    for want in [
        id.as_str(),
        "poisoned",
        "OrderPlaced",
        "order-1",
        TRACE,
        "tenant: acme",
        "\"items\": [\n",
    ] {
        assert!(text.contains(want), "want `{want}` in:\n{text}");
    }
    let v = json_of(&outbox(&f.pg, &["--json", "show", &f.pending.to_string()]));
    assert_eq!(v["payload"], "ff0010");
    assert_eq!(v["kind"], "integration");

    let v = json_of(&outbox(&f.pg, &["stats", "--json"]));
    assert_eq!(v["table"], format!("{}.{TABLE}", f.pg.schema()));
    assert_eq!(
        (&v["pending"], &v["poisoned"], &v["processed"]),
        (&1.into(), &1.into(), &1.into())
    );
    let text = assert_ok(&outbox(&f.pg, &["stats"]));
    assert!(
        text.contains(&format!("{}.{TABLE}", f.pg.schema())),
        "{text}"
    );

    let unknown = MessageId::new().to_string();
    assert_error(&outbox(&f.pg, &["show", &unknown]), 1, &unknown);
}

#[tokio::test]
async fn postgres_health_reads_the_backlog() {
    let f = fixture().await;
    let out = outbox(&f.pg, &["health", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let v = json_of(&out);
    assert_eq!(v["status"], "degraded");
    assert_eq!((&v["pending"], &v["poisoned"]), (&1.into(), &1.into()));

    assert_ok(&outbox(&f.pg, &["discard", &f.poisoned.to_string()]));
    assert_ok(&outbox(&f.pg, &["discard", &f.pending.to_string()]));
    let out = outbox(&f.pg, &["health"]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(stdout(&out).starts_with("healthy"), "{}", stdout(&out));
}

#[tokio::test]
async fn postgres_retry_and_discard_change_the_row_and_wake_the_relays() {
    let f = fixture().await;
    // Discard the pending message (dry run first: nothing changes).
    let pending = f.pending.to_string();
    let text = assert_ok(&outbox(&f.pg, &["discard", &pending, "--dry-run"]));
    assert!(text.contains("would discard"), "{text}");
    assert_eq!(get(&f.pg, f.pending).await.state, MessageState::Pending);
    assert_ok(&outbox(&f.pg, &["discard", &pending, "--by", "bob"]));
    let m = get(&f.pg, f.pending).await;
    assert_eq!(m.state, MessageState::Processed);
    assert!(m.last_error.unwrap().contains("discarded by bob"));
    assert_error(
        &outbox(&f.pg, &["discard", &pending]),
        1,
        "processed already",
    );
    assert_error(&outbox(&f.pg, &["retry", &pending]), 1, "not poisoned");

    // A relay that polls only once a minute: only the CLI's NOTIFY can
    // bring it the retried message within the deadline below.
    let delivered = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&delivered);
    let relay = outbox::Relay::builder(f.pg.pg().clone())
        .poll_interval(Duration::from_secs(60))
        .dispatcher(outbox::Handlers::new().on_message(
            "OrderPlaced",
            move |m: &outbox::Message| {
                seen.lock().unwrap().push(m.id);
                async { Ok::<_, std::io::Error>(()) }
            },
        ))
        .spawn()
        .unwrap();
    // Its listener's connection carries the fixture's schema as its
    // application name; wait until it listens.
    let schema = f.pg.schema().to_owned();
    let pool = f.pg.pool().clone();
    wait_for("the relay listens", Duration::from_secs(30), async || {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query ILIKE 'LISTEN%'",
        )
        .bind(&schema)
        .fetch_one(&pool)
        .await
        .unwrap()
            > 0
    })
    .await;

    let id = f.poisoned.to_string();
    let text = assert_ok(&outbox(&f.pg, &["retry", "--all-poisoned", "--dry-run"]));
    assert!(text.contains("would retry") && text.contains(&id), "{text}");
    assert_eq!(get(&f.pg, f.poisoned).await.state, MessageState::Poisoned);
    let text = assert_ok(&outbox(&f.pg, &["retry", &id, "--by", "alice"]));
    assert!(text.contains("retried") && text.contains(&id), "{text}");
    let store = f.pg.pg().clone();
    let poisoned = f.poisoned;
    wait_for(
        "the relay delivers the retried message (woken by the CLI's NOTIFY)",
        Duration::from_secs(20),
        async || get_state(&store, poisoned).await == MessageState::Processed,
    )
    .await;
    relay.shutdown().await;
    assert_eq!(*delivered.lock().unwrap(), [f.poisoned]);
    let note = get(&f.pg, f.poisoned).await.last_error.unwrap();
    assert!(
        note.contains("retried by alice") && note.contains("boom"),
        "{note}"
    );

    let text = assert_ok(&outbox(&f.pg, &["retry", "--all-poisoned"]));
    assert!(text.contains("no poisoned messages"), "{text}");
}

async fn get_state(store: &outbox_postgres::PgStore, id: MessageId) -> MessageState {
    store.get(id).await.unwrap().expect("exists").state
}

#[tokio::test]
async fn postgres_purge_deletes_old_processed_messages_in_batches() {
    let pg = PgUnderTest::fresh(None).await;
    let mut tx = pg.pool().begin().await.unwrap();
    let ids = pg
        .pg()
        .outbox()
        .enqueue_many(
            &mut tx,
            (0..1_203)
                .map(|i| NewMessage::new(MessageKind::Domain, "T", format!("{i}").into_bytes()))
                .collect(),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let kept = enqueue(
        &pg,
        NewMessage::new(MessageKind::Domain, "T", b"x".to_vec()),
    )
    .await;
    pg.pg().complete(&ids, Timestamp::now()).await.unwrap();

    let text = assert_ok(&outbox(&pg, &["purge", "--older-than", "7d"]));
    assert!(text.contains("purged 0 "), "{text}");
    assert_eq!(pg.pg().stats().await.unwrap().processed, 1_203);

    // Processed at least a millisecond before the purge's cut-off.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let v = json_of(&outbox(&pg, &["purge", "--older-than", "0s", "--json"]));
    assert_eq!(v["purged"], 1_203);
    let stats = pg.pg().stats().await.unwrap();
    assert_eq!((stats.pending, stats.processed), (1, 0));
    assert!(pg.pg().get(kept).await.unwrap().is_some());
}

#[tokio::test]
async fn postgres_url_schema_and_table_come_from_the_environment() {
    let f = fixture().await;
    // `postgresql://` is the same as `postgres://`.
    let url = f.pg.url().replacen("postgres://", "postgresql://", 1);
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .env("OUTBOX_DATABASE", &url)
        .env("OUTBOX_SCHEMA", f.pg.schema())
        .env("OUTBOX_TABLE", TABLE)
        .args(["stats", "--json"])
        .output()
        .unwrap();
    assert_eq!(json_of(&out)["poisoned"], 1, "{}", stderr(&out));
}

/// The schemas and tables of the fixture's schema, and whether `missing`
/// exists: what the CLI must never change.
async fn catalogue(pg: &PgUnderTest, missing: &str) -> (Vec<String>, bool) {
    let tables = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 ORDER BY 1",
    )
    .bind(pg.schema())
    .fetch_all(pg.pool())
    .await
    .unwrap();
    let exists =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(missing)
            .fetch_one(pg.pool())
            .await
            .unwrap();
    (tables, exists)
}

#[tokio::test]
async fn postgres_bad_targets_are_clear_errors_and_nothing_is_created() {
    let pg = PgUnderTest::fresh(None).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"CREATE TABLE "{s}".orders (id bigint PRIMARY KEY);
           CREATE VIEW "{s}".outbox_view AS SELECT * FROM "{s}".{TABLE}"#,
        s = pg.schema()
    )))
    .execute(pg.pool())
    .await
    .unwrap();
    let missing = unique_schema("cli_missing");
    let before = catalogue(&pg, &missing).await;
    assert!(!before.1);
    let url = pg.url();
    let schema = pg.schema();

    // A schema that does not exist: named, and not created.
    for cmd in [&["stats"][..], &["list"], &["purge", "--older-than", "1d"]] {
        assert_error(
            &outbox_at(url, &missing, TABLE, cmd),
            1,
            &format!("no schema `{missing}`"),
        );
    }
    // A table that does not exist: named, with this schema's outbox tables.
    let out = outbox_at(url, schema, "nope", &["stats"]);
    assert_error(&out, 1, "has no outbox table `nope`");
    assert!(
        stderr(&out).contains("its outbox tables: test_outbox"),
        "{}",
        stderr(&out)
    );
    // Tables that are not outboxes: the inbox, a business table, a view.
    assert_error(
        &outbox_at(url, schema, "test_inbox", &["list"]),
        1,
        "is not an outbox table (it lacks the columns seq, id,",
    );
    assert_error(
        &outbox_at(url, schema, "orders", &["stats"]),
        1,
        "not an outbox table",
    );
    assert_error(
        &outbox_at(url, schema, "outbox_view", &["stats"]),
        1,
        "is not a table (a view)",
    );
    // Names the store refuses are usage errors naming them.
    assert_error(&outbox_at(url, "Bad", TABLE, &["stats"]), 2, "`Bad`");
    assert_error(&outbox_at(url, schema, "Orders", &["stats"]), 2, "`Orders`");
    assert_error(
        &outbox_at(url, "pg_catalog", TABLE, &["stats"]),
        2,
        "reserved",
    );
    // A probe of a missing schema is unhealthy, naming it.
    let out = outbox_at(url, &missing, TABLE, &["health"]);
    assert_error(&out, 2, &format!("no schema `{missing}`"));
    assert!(stdout(&out).starts_with("unhealthy"), "{}", stdout(&out));

    assert_eq!(
        catalogue(&pg, &missing).await,
        before,
        "the CLI changed the database"
    );
}

#[tokio::test]
async fn postgres_passwords_never_appear() {
    let pg = PgUnderTest::fresh(None).await;
    let secret = "s3cretpw";
    // A server that does not answer: the error names it, without the password.
    let out = outbox_raw(&[
        "--database",
        &format!("postgres://shop:{secret}@127.0.0.1:1/shop"),
        "stats",
    ]);
    assert_error(&out, 1, "postgres://shop:***@127.0.0.1:1/shop");
    assert!(!stderr(&out).contains(secret), "{}", stderr(&out));
    let out = outbox_raw(&[
        "--database",
        &format!("postgres://shop:{secret}@127.0.0.1:1/shop"),
        "health",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(!stdout(&out).contains(secret) && !stderr(&out).contains(secret));
    // The real server with a password in the URL (trust auth accepts it; a
    // server that checks refuses it): whatever happens, it is not shown.
    let url = with_password(pg.url(), secret);
    let missing = unique_schema("cli_missing");
    for args in [&["stats"][..], &["list"], &["health"]] {
        for schema in [pg.schema(), missing.as_str()] {
            let out = outbox_at(&url, schema, TABLE, args);
            assert!(
                !stdout(&out).contains(secret) && !stderr(&out).contains(secret),
                "password shown:\n{}\n{}",
                stdout(&out),
                stderr(&out)
            );
        }
    }
    // A scheme the CLI does not speak: a usage error, the password hidden.
    let out = outbox_raw(&[
        "--database",
        &format!("mssql://shop:{secret}@h/db"),
        "stats",
    ]);
    assert_error(&out, 2, "mssql://shop:***@h/db");
    assert!(!stderr(&out).contains(secret));
}

#[tokio::test]
async fn serve_shows_the_schemas_outbox_over_tcp() {
    let f = fixture().await;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.env_remove("OUTBOX_DATABASE")
        .env_remove("OUTBOX_TABLE")
        .env_remove("OUTBOX_SCHEMA")
        .env_remove("OUTBOX_CONSOLE_TOKEN")
        .args([
            "--db",
            f.pg.url(),
            "--schema",
            f.pg.schema(),
            "--table",
            TABLE,
        ])
        .args(["serve", "--listen", "127.0.0.1:0"]);
    let server = common::start(cmd);
    let host = server.addr.to_string();
    // Named `schema-table` (a console name allows no `.`).
    let name = format!("{}-{TABLE}", f.pg.schema());

    let (status, body) = common::get(server.addr, &host, "/", None);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(&format!(">{name}</a>")), "{body}");
    let (status, body) = common::get(
        server.addr,
        &host,
        &format!("/{name}/messages?state=poisoned"),
        None,
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(&f.poisoned.to_string()), "{body}");
    assert!(!body.contains(&f.pending.to_string()), "{body}");
}

/// Schemas a test made itself (`outbox outboxes` needs several that share
/// a prefix), each with a migrated outbox table `test_outbox`; dropped
/// with the value, as `PgUnderTest` drops its own.
struct Tenants {
    url: String,
    /// The prefix every schema of this test starts with (unique).
    prefix: String,
    stores: Vec<outbox_postgres::PgStore>,
}

impl Tenants {
    /// `{prefix}_{suffix}` for each suffix, migrated.
    async fn new(suffixes: &[&str]) -> Tenants {
        let url = outbox_postgres::testing::database_url();
        let prefix = unique_schema("cli_fleet");
        let mut tenants = Tenants {
            url,
            prefix,
            stores: Vec::new(),
        };
        for suffix in suffixes {
            let store = tenants
                .migrated(&format!("{}{suffix}", tenants.prefix))
                .await;
            tenants.stores.push(store);
        }
        tenants
    }

    /// A migrated outbox in schema `name`, dropped with the others.
    async fn migrated(&self, name: &str) -> outbox_postgres::PgStore {
        let store = outbox_postgres::PgStore::builder(self.url.clone())
            .schema(name)
            .table(TABLE)
            .inbox_table("test_inbox")
            .max_connections(2)
            .connect()
            .await
            .expect("connect to PostgreSQL");
        store.migrate().await.expect("migrate");
        store
    }

    fn schema(&self, i: usize) -> &str {
        self.stores[i].schema()
    }

    async fn enqueue(&self, i: usize, message_type: &str) -> MessageId {
        let store = &self.stores[i];
        let mut tx = store.pool().begin().await.unwrap();
        let id = store
            .outbox()
            .enqueue(
                &mut tx,
                NewMessage::new(MessageKind::Domain, message_type, b"{}".to_vec()),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        id
    }

    /// Enqueues a message in tenant `i` and poisons it (one failure, max 1).
    async fn poisoned(&self, i: usize) -> MessageId {
        let id = self.enqueue(i, "Poison").await;
        let store = &self.stores[i];
        assert_eq!(store.claim(&claim_one()).await.unwrap()[0].id, id);
        let now = Timestamp::now();
        let outcome = store
            .fail(&Failure::new("w", id, "tenant handler failed", now, 1, now))
            .await
            .unwrap();
        assert_eq!(outcome, FailOutcome::Poisoned { attempts: 1 });
        id
    }
}

impl Drop for Tenants {
    /// Drops every schema whose name starts with the test's prefix (the
    /// tenants' and any the test made beside them).
    fn drop(&mut self) {
        let prefix = self.prefix.clone();
        let dropped = outbox_postgres::testing::clean_up_now(&self.url, move |conn| {
            Box::pin(async move {
                let schemas: Vec<String> = sqlx::query_scalar(
                    "SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)",
                )
                .bind(&prefix)
                .fetch_all(&mut *conn)
                .await?;
                for schema in &schemas {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        r#"DROP SCHEMA IF EXISTS "{schema}" CASCADE"#
                    )))
                    .execute(&mut *conn)
                    .await?;
                }
                Ok(())
            })
        });
        if !dropped {
            eprintln!("could not drop the test schemas {}*", self.prefix);
        }
    }
}

/// `outbox --database URL --table test_outbox ARGS…` (no schema).
fn outbox_db(url: &str, args: &[&str]) -> Output {
    let mut all = vec!["--database", url, "--table", TABLE];
    all.extend_from_slice(args);
    outbox_raw(&all)
}

/// The names of the outboxes a `--json` listing lists.
fn listed(v: &serde_json::Value) -> Vec<&str> {
    v["outboxes"]
        .as_array()
        .unwrap_or_else(|| panic!("no outboxes in {v}"))
        .iter()
        .map(|o| o["name"].as_str().unwrap())
        .collect()
}

/// Three tenants' schemas that share a prefix, one with a poisoned
/// message, beside a schema that only starts like them and one of the
/// prefix whose `test_outbox` is not an outbox: `--matching` lists exactly
/// the three, with their counts and health; `--not-healthy` only the
/// poisoned one; the summary names it.
#[tokio::test]
async fn postgres_outboxes_lists_the_schemas_a_pattern_matches() {
    // 0, 1, 2 match `{prefix}_*`; 3 starts with the prefix but not `_`.
    let t = Tenants::new(&["_a", "_b", "_c", "x_decoy"]).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"CREATE SCHEMA "{p}_plain"; CREATE TABLE "{p}_plain".{TABLE} (id bigint)"#,
        p = t.prefix
    )))
    .execute(t.stores[0].pool())
    .await
    .unwrap();
    t.enqueue(0, "A").await;
    t.enqueue(0, "A").await;
    t.poisoned(1).await;
    t.enqueue(1, "B").await;
    t.poisoned(3).await;
    let (a, b, c) = (t.schema(0), t.schema(1), t.schema(2));
    let glob = format!("{}_*", t.prefix);

    let v = json_of(&outbox_db(
        &t.url,
        &["outboxes", "--matching", &glob, "--json"],
    ));
    assert_eq!(listed(&v), [a, b, c], "{v}");
    let row = |i: usize| &v["outboxes"][i];
    assert_eq!(
        (&row(0)["status"], &row(0)["pending"], &row(0)["poisoned"]),
        (&"healthy".into(), &2.into(), &0.into()),
        "{v}"
    );
    assert!(row(0)["oldest_pending_age_seconds"].as_f64().unwrap() >= 0.0);
    assert_eq!(
        (&row(1)["status"], &row(1)["pending"], &row(1)["poisoned"]),
        (&"degraded".into(), &1.into(), &1.into()),
        "{v}"
    );
    assert!(
        row(1)["reasons"][0]
            .as_str()
            .unwrap()
            .contains("1 poisoned message(s) wait for an operator"),
        "{v}"
    );
    assert_eq!(
        (&row(2)["status"], &row(2)["pending"], &row(2)["poisoned"]),
        (&"healthy".into(), &0.into(), &0.into()),
        "{v}"
    );
    assert!(row(2)["oldest_pending_age_seconds"].is_null(), "{v}");
    assert_eq!(
        v["count"],
        serde_json::json!({"outboxes": 3, "healthy": 2, "degraded": 1, "unhealthy": 0})
    );
    assert_eq!(v["not_healthy"], serde_json::json!([b]));
    assert_eq!(v["table"], TABLE);
    assert_eq!(v["matching"], glob.as_str());

    // Text: a table of the three, then the summary naming the degraded one.
    let text = assert_ok(&outbox_db(&t.url, &["outboxes", "--matching", &glob]));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 5, "{text}");
    assert!(lines[0].starts_with("OUTBOX"), "{text}");
    for (line, (name, status)) in
        lines[1..4]
            .iter()
            .zip([(a, "healthy"), (b, "degraded"), (c, "healthy")])
    {
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cells[..2], [name, status], "{text}");
    }
    assert_eq!(
        lines[4],
        format!("3 outboxes: 2 healthy, 1 degraded ({b})"),
        "{text}"
    );

    // Only the degraded one, the summary still counting all three.
    let text = assert_ok(&outbox_db(
        &t.url,
        &["outboxes", "--matching", &glob, "--not-healthy"],
    ));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[1].starts_with(&format!("{b}  degraded")), "{text}");
    assert!(lines[2].starts_with("3 outboxes:"), "{text}");
    let v = json_of(&outbox_db(
        &t.url,
        &["outboxes", "--matching", &glob, "--not-healthy", "--json"],
    ));
    assert_eq!(listed(&v), [b], "{v}");
    assert_eq!(v["count"]["outboxes"], 3);

    // With no age allowed, a pending message is a backlog too old.
    let v = json_of(&outbox_db(
        &t.url,
        &[
            "outboxes",
            "--matching",
            &glob,
            "--not-healthy",
            "--backlog-alert",
            "0s",
            "--json",
        ],
    ));
    assert_eq!(listed(&v), [a, b], "{v}");
    assert!(
        v["outboxes"][0]["reasons"][0]
            .as_str()
            .unwrap()
            .contains("the oldest pending message is"),
        "{v}"
    );

    // `?` is one character: `_?` matches the three, `_??` none of them.
    let v = json_of(&outbox_db(
        &t.url,
        &[
            "outboxes",
            "--matching",
            &format!("{}_?", t.prefix),
            "--json",
        ],
    ));
    assert_eq!(listed(&v), [a, b, c], "{v}");
    let out = outbox_db(
        &t.url,
        &["outboxes", "--matching", &format!("{}_??", t.prefix)],
    );
    assert_error(&out, 1, "no schema matching");
    assert!(
        stderr(&out).contains(&format!("{}_??", t.prefix)),
        "{}",
        stderr(&out)
    );
}

/// What `outboxes` refuses, and how: a bad pattern is a usage error naming
/// the character; a table no schema holds names the outbox tables there
/// are; `--schema` does not apply.
#[tokio::test]
async fn postgres_outboxes_errors_are_clear() {
    let t = Tenants::new(&["_a"]).await;
    // An outbox table in a schema whose name the stores refuse (upper
    // case): listed, as unhealthy, saying why; the others still are.
    let upper = format!("{}_Upper", t.prefix);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"CREATE SCHEMA "{upper}";
           CREATE TABLE "{upper}".{TABLE} (LIKE "{a}".{TABLE} INCLUDING ALL)"#,
        a = t.schema(0)
    )))
    .execute(t.stores[0].pool())
    .await
    .unwrap();
    let out = outbox_db(
        &t.url,
        &[
            "outboxes",
            "--matching",
            &format!("{}_*", t.prefix),
            "--json",
        ],
    );
    let v = json_of(&out);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(listed(&v), [upper.as_str(), t.schema(0)], "{v}");
    assert_eq!(v["outboxes"][0]["status"], "unhealthy", "{v}");
    assert!(v["outboxes"][0]["pending"].is_null(), "{v}");
    assert!(
        v["outboxes"][0]["reasons"][0]
            .as_str()
            .unwrap()
            .contains(&format!("`{upper}`")),
        "{v}"
    );
    assert_eq!(v["outboxes"][1]["status"], "healthy", "{v}");
    assert_eq!(v["count"]["unhealthy"], 1);
    let text = assert_ok(&outbox_db(
        &t.url,
        &["outboxes", "--matching", &format!("{}_*", t.prefix)],
    ));
    assert!(
        text.ends_with(&format!("2 outboxes: 1 healthy, 1 unhealthy ({upper})\n")),
        "{text}"
    );

    let out = outbox_db(&t.url, &["outboxes", "--matching", "tenant_[0-9]"]);
    assert_error(&out, 2, "`[`");
    assert!(stderr(&out).contains("`*`"), "{}", stderr(&out));
    assert_error(
        &outbox_db(&t.url, &["outboxes", "--matching", "tenant.*"]),
        2,
        "`.`",
    );
    let out = outbox_raw(&[
        "--database",
        &t.url,
        "--table",
        "no_such_outbox",
        "outboxes",
    ]);
    assert_error(
        &out,
        1,
        "no schema of the database has an outbox table `no_such_outbox`",
    );
    assert!(
        stderr(&out).contains("its outbox tables:"),
        "the hint names some: {}",
        stderr(&out)
    );
    assert_error(
        &outbox_raw(&[
            "--database",
            &t.url,
            "--schema",
            t.schema(0),
            "--table",
            TABLE,
            "outboxes",
        ]),
        2,
        "--matching",
    );
    // The password is not shown when the server cannot be reached.
    let out = outbox_raw(&[
        "--database",
        "postgres://shop:s3cretpw@127.0.0.1:1/shop",
        "outboxes",
    ]);
    assert_error(&out, 1, "postgres://shop:***@127.0.0.1:1/shop");
    assert!(!stderr(&out).contains("s3cretpw"));
}

/// `serve --matching`: one console over every matching schema's outbox,
/// each under the schema's name; its overview filters them by status.
#[tokio::test]
async fn postgres_serve_matching_shows_every_matching_schema() {
    let t = Tenants::new(&["_a", "_b", "x_decoy"]).await;
    let poisoned = t.poisoned(1).await;
    let (a, b, decoy) = (t.schema(0), t.schema(1), t.schema(2));
    let glob = format!("{}_*", t.prefix);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.env_remove("OUTBOX_DATABASE")
        .env_remove("OUTBOX_TABLE")
        .env_remove("OUTBOX_SCHEMA")
        .env_remove("OUTBOX_CONSOLE_TOKEN")
        .args(["--db", &t.url, "--table", TABLE])
        .args(["serve", "--listen", "127.0.0.1:0", "--matching", &glob])
        .args(["--refresh", "1s"]);
    let server = common::start(cmd);
    let host = server.addr.to_string();

    let (status, body) = common::get(server.addr, &host, "/", None);
    assert_eq!(status, 200, "{body}");
    for name in [a, b] {
        assert!(body.contains(&format!(">{name}</a>")), "{name}: {body}");
    }
    assert!(!body.contains(decoy), "{body}");
    assert!(body.contains("2 outboxes:"), "{body}");

    let (status, body) = common::get(server.addr, &host, "/?status=not-healthy", None);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(&format!("href=\"/{b}/activity\"")), "{body}");
    assert!(!body.contains(&format!("href=\"/{a}/activity\"")), "{body}");

    let (status, body) = common::get(
        server.addr,
        &host,
        &format!("/{b}/messages?state=poisoned"),
        None,
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(&poisoned.to_string()), "{body}");

    // While it serves, a tenant's new schema shows and a dropped one leaves
    // (it looks again every --refresh).
    let c = format!("{}_c", t.prefix);
    let _store_c = t.migrated(&c).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(r#"DROP SCHEMA "{a}" CASCADE"#)))
        .execute(t.stores[1].pool())
        .await
        .unwrap();
    wait_for(
        "the console shows the new schema and not the dropped one",
        Duration::from_secs(30),
        async || {
            let (status, body) = common::get(server.addr, &host, "/", None);
            status == 200
                && body.contains(&format!(">{c}</a>"))
                && !body.contains(&format!(">{a}</a>"))
                && body.contains("2 outboxes:")
        },
    )
    .await;
    let (status, _) = common::get(
        server.addr,
        &host,
        &format!("/{a}/messages?state=pending"),
        None,
    );
    assert_eq!(status, 404, "a dropped schema's pages are gone");

    // With --schema too, or matching nothing: refused, nothing served.
    let out = outbox_db(
        &t.url,
        &[
            "--schema",
            a,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--matching",
            &glob,
        ],
    );
    assert_error(&out, 2, "not both");
    let out = outbox_db(
        &t.url,
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--matching",
            &format!("{}_zz*", t.prefix),
        ],
    );
    assert_error(&out, 1, "no schema matching");
    // --refresh needs --matching, and a pause.
    let out = outbox_db(&t.url, &["--schema", a, "serve", "--refresh", "5s"]);
    assert_error(&out, 2, "--matching");
    let out = outbox_db(&t.url, &["serve", "--matching", &glob, "--refresh", "0s"]);
    assert_error(&out, 2, "at least 1s");
}
