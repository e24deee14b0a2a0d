//! Runs the built `outbox` binary against prepared SQLite outbox databases
//! (PostgreSQL: `cli_postgres.rs`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use outbox_api::{
    ClaimRequest, FailOutcome, Failure, MessageId, MessageKind, MessageState, NewMessage,
    OperatorStore, Store, Timestamp,
};
use outbox_sqlite::SqliteStore;
use outbox_sqlite::rusqlite;

mod common;
use common::{assert_error, assert_ok, json_of, stderr, stdout};

const TRACE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// A migrated database in a temp dir with one poisoned, one processed and
/// one pending message.
struct Fixture {
    _dir: tempfile::TempDir,
    path: PathBuf,
    store: SqliteStore,
    poisoned: MessageId,
    processed: MessageId,
    pending: MessageId,
}

fn enqueue(store: &SqliteStore, message: NewMessage) -> MessageId {
    let mut conn = rusqlite::Connection::open(store.path()).unwrap();
    let tx = conn.transaction().unwrap();
    let id = store.outbox().enqueue_rusqlite(&tx, message).unwrap();
    tx.commit().unwrap();
    id
}

fn claim_one(worker: &str) -> ClaimRequest {
    ClaimRequest::new(
        worker,
        1,
        Duration::from_secs(30),
        Timestamp::now().saturating_add(Duration::from_secs(1)),
    )
}

async fn empty_db() -> (tempfile::TempDir, PathBuf, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let store = SqliteStore::connect(&path).await.unwrap();
    store.migrate().await.unwrap();
    (dir, path, store)
}

async fn fixture() -> Fixture {
    let (dir, path, store) = empty_db().await;
    let order = serde_json::json!({"order": 1, "items": ["a", "b"]});
    let poisoned = enqueue(
        &store,
        NewMessage::json(MessageKind::Domain, "OrderPlaced", &order)
            .unwrap()
            .key("order-1")
            .header("tenant", "acme")
            .trace_parent(TRACE),
    );
    let claimed = store.claim(&claim_one("w")).await.unwrap();
    assert_eq!(claimed[0].id, poisoned);
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
        &store,
        NewMessage::new(MessageKind::Domain, "Shipped", b"plain text".to_vec()),
    );
    let claimed = store.claim(&claim_one("w")).await.unwrap();
    assert_eq!(claimed[0].id, processed);
    store
        .complete(&[processed], Timestamp::now())
        .await
        .unwrap();

    let pending = enqueue(
        &store,
        NewMessage::new(MessageKind::Integration, "Binary", vec![0xff, 0x00, 0x10]),
    );
    Fixture {
        _dir: dir,
        path,
        store,
        poisoned,
        processed,
        pending,
    }
}

fn url(path: &Path) -> String {
    format!("sqlite:{}", path.display())
}

/// Runs `outbox --database sqlite:PATH ARGS…` with a clean environment.
fn outbox(path: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.env_remove("OUTBOX_DATABASE")
        .env_remove("OUTBOX_TABLE")
        .env_remove("OUTBOX_SCHEMA")
        .env("USER", "tester")
        .env("RUST_BACKTRACE", "1")
        .arg("--database")
        .arg(url(path))
        .args(args);
    cmd.output().unwrap()
}

#[tokio::test]
async fn list_filters_by_state_and_type() {
    let f = fixture().await;
    let text = assert_ok(&outbox(&f.path, &["list", "--state", "poisoned"]));
    assert!(text.contains("ID") && text.contains("LAST_ERROR"), "{text}");
    assert!(text.contains(&f.poisoned.to_string()), "{text}");
    assert!(
        text.contains("OrderPlaced") && text.contains("order-1"),
        "{text}"
    );
    assert!(text.contains("boom: handler exploded"), "{text}");
    assert!(!text.contains(&f.pending.to_string()), "{text}");

    let all = json_of(&outbox(&f.path, &["--json", "list"]));
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

    let shipped = json_of(&outbox(&f.path, &["list", "--type", "Shipped", "--json"]));
    assert_eq!(shipped.as_array().unwrap().len(), 1);
    assert_eq!(shipped[0]["state"], "processed");

    let one = json_of(&outbox(&f.path, &["list", "--limit", "1", "--json"]));
    assert_eq!(one.as_array().unwrap().len(), 1);

    let none = assert_ok(&outbox(&f.path, &["list", "--type", "Nope"]));
    assert!(none.contains("no messages"), "{none}");
}

#[tokio::test]
async fn show_prints_every_field_and_the_payload() {
    let f = fixture().await;
    let id = f.poisoned.to_string();
    let text = assert_ok(&outbox(&f.path, &["show", &id]));
    for want in [
        id.as_str(),
        "poisoned",
        "OrderPlaced",
        "order-1",
        "boom: handler exploded",
        TRACE,
        "tenant: acme",
        "application/json",
        "\"order\": 1",
    ] {
        assert!(text.contains(want), "want `{want}` in:\n{text}");
    }
    // Pretty-printed: the array spans several lines.
    assert!(text.contains("\"items\": [\n"), "{text}");

    let v = json_of(&outbox(&f.path, &["show", &id, "--json"]));
    assert_eq!(v["id"], id.as_str());
    assert_eq!(v["state"], "poisoned");
    assert_eq!(v["attempts"], 1);
    assert_eq!(v["payload_encoding"], "json");
    assert_eq!(v["payload"]["items"][1], "b");
    assert_eq!(v["headers"]["tenant"], "acme");
    assert_eq!(v["trace_parent"], TRACE);
    assert!(v["last_error"].as_str().unwrap().contains("boom"));

    let text = assert_ok(&outbox(&f.path, &["show", &f.processed.to_string()]));
    assert!(
        text.contains("shown as utf8") && text.contains("plain text"),
        "{text}"
    );
    let text = assert_ok(&outbox(&f.path, &["show", &f.pending.to_string()]));
    assert!(
        text.contains("shown as hex") && text.contains("ff 00 10"),
        "{text}"
    );
    let v = json_of(&outbox(
        &f.path,
        &["--json", "show", &f.pending.to_string()],
    ));
    assert_eq!(v["payload"], "ff0010");
}

#[tokio::test]
async fn retry_moves_a_poisoned_message_back_to_pending() {
    let f = fixture().await;
    let id = f.poisoned.to_string();
    let text = assert_ok(&outbox(&f.path, &["retry", &id, "--by", "alice"]));
    assert!(text.contains("retried") && text.contains(&id), "{text}");
    let m = f.store.get(f.poisoned).await.unwrap().unwrap();
    assert_eq!(m.state, MessageState::Pending);
    assert_eq!(m.attempts, 0);
    let note = m.last_error.unwrap();
    assert!(note.contains("retried by alice"), "{note}");
    assert!(note.contains("boom"), "{note}");
    // The relay delivers it now (its handler succeeds this time).
    let delivered = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let d = delivered.clone();
    let relay = outbox::Relay::builder(f.store.clone())
        .dispatcher(outbox::Handlers::new().on_message(
            "OrderPlaced",
            move |m: &outbox::Message| {
                d.lock().unwrap().push(m.id);
                async { Ok::<_, std::io::Error>(()) }
            },
        ))
        .build()
        .unwrap();
    relay.drain().await.unwrap();
    assert!(
        delivered.lock().unwrap().contains(&f.poisoned),
        "the relay delivered the retried message"
    );
    let m = f.store.get(f.poisoned).await.unwrap().unwrap();
    assert_eq!(m.state, MessageState::Processed);

    // Retrying what is not poisoned is refused.
    assert_error(&outbox(&f.path, &["retry", &id]), 1, "not poisoned");
}

#[tokio::test]
async fn retry_by_defaults_to_user() {
    let f = fixture().await;
    assert_ok(&outbox(&f.path, &["retry", &f.poisoned.to_string()]));
    let m = f.store.get(f.poisoned).await.unwrap().unwrap();
    assert!(m.last_error.unwrap().contains("retried by tester"));
}

#[tokio::test]
async fn retry_all_poisoned_dry_run_changes_nothing() {
    let f = fixture().await;
    let before = f.store.get(f.poisoned).await.unwrap().unwrap();
    let text = assert_ok(&outbox(&f.path, &["retry", "--all-poisoned", "--dry-run"]));
    assert!(
        text.contains("would retry") && text.contains(&f.poisoned.to_string()),
        "{text}"
    );
    assert!(text.contains("nothing changed"), "{text}");
    let after = f.store.get(f.poisoned).await.unwrap().unwrap();
    assert_eq!(before, after);

    let v = json_of(&outbox(&f.path, &["retry", "--all-poisoned", "--json"]));
    assert_eq!(v["count"], 1);
    assert_eq!(v["dry_run"], false);
    let m = f.store.get(f.poisoned).await.unwrap().unwrap();
    assert_eq!((m.state, m.attempts), (MessageState::Pending, 0));

    let text = assert_ok(&outbox(&f.path, &["retry", "--all-poisoned"]));
    assert!(text.contains("no poisoned messages"), "{text}");
}

#[tokio::test]
async fn discard_marks_processed_without_delivery() {
    let f = fixture().await;
    let id = f.pending.to_string();
    let text = assert_ok(&outbox(&f.path, &["discard", &id, "--dry-run"]));
    assert!(text.contains("would discard"), "{text}");
    assert_eq!(
        f.store.get(f.pending).await.unwrap().unwrap().state,
        MessageState::Pending
    );

    let text = assert_ok(&outbox(&f.path, &["discard", &id, "--by", "bob"]));
    assert!(text.contains("discarded") && text.contains(&id), "{text}");
    let m = f.store.get(f.pending).await.unwrap().unwrap();
    assert_eq!(m.state, MessageState::Processed);
    assert!(m.last_error.unwrap().contains("discarded by bob"));

    assert_error(&outbox(&f.path, &["discard", &id]), 1, "processed already");
}

#[tokio::test]
async fn stats_counts_by_state() {
    let f = fixture().await;
    let v = json_of(&outbox(&f.path, &["stats", "--json"]));
    assert_eq!(v["pending"], 1);
    assert_eq!(v["poisoned"], 1);
    assert_eq!(v["processed"], 1);
    assert!(v["oldest_pending_created_at"].is_string());
    assert!(v["oldest_pending_age_seconds"].as_f64().unwrap() >= 0.0);

    let text = assert_ok(&outbox(&f.path, &["stats"]));
    for want in ["pending", "poisoned", "processed", "oldest pending", " ago"] {
        assert!(text.contains(want), "{text}");
    }
}

#[tokio::test]
async fn purge_deletes_old_processed_messages_only() {
    let f = fixture().await;
    let text = assert_ok(&outbox(&f.path, &["purge", "--older-than", "7d"]));
    assert!(text.contains("purged 0 "), "{text}");
    assert_eq!(f.store.stats().await.unwrap().processed, 1);

    tokio::time::sleep(Duration::from_millis(5)).await;
    let v = json_of(&outbox(&f.path, &["purge", "--older-than", "0s", "--json"]));
    assert_eq!(v["purged"], 1);
    let stats = f.store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.poisoned, stats.processed), (1, 1, 0));
    assert!(f.store.get(f.processed).await.unwrap().is_none());
}

#[tokio::test]
async fn purge_works_in_batches() {
    let (_dir, path, store) = empty_db().await;
    let mut conn = rusqlite::Connection::open(&path).unwrap();
    let tx = conn.transaction().unwrap();
    let ids: Vec<MessageId> = (0..1_203)
        .map(|i| {
            store
                .outbox()
                .enqueue_rusqlite(
                    &tx,
                    NewMessage::new(MessageKind::Domain, "T", format!("{i}").into_bytes()),
                )
                .unwrap()
        })
        .collect();
    tx.commit().unwrap();
    store.complete(&ids, Timestamp::now()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let text = assert_ok(&outbox(&path, &["purge", "--older-than", "0s"]));
    assert!(text.contains("purged 1203 "), "{text}");
    assert_eq!(store.stats().await.unwrap().processed, 0);
}

#[tokio::test]
async fn health_exit_codes() {
    let (_dir, path, store) = empty_db().await;
    let out = outbox(&path, &["health"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("healthy"));

    enqueue(
        &store,
        NewMessage::new(MessageKind::Domain, "T", b"x".to_vec()),
    );
    let out = outbox(&path, &["health", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert_eq!(json_of(&out)["status"], "healthy");

    // A backlog older than the alert degrades.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let out = outbox(&path, &["health", "--backlog-alert", "0s"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("oldest pending message"),
        "{}",
        stdout(&out)
    );

    // Poison degrades.
    let f = fixture().await;
    let out = outbox(&f.path, &["health", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v = json_of(&out);
    assert_eq!(v["status"], "degraded");
    assert_eq!(v["poisoned"], 1);
    assert!(v["reasons"][0].as_str().unwrap().contains("poisoned"));
    let out = outbox(&f.path, &["health"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).starts_with("degraded"));
}

#[tokio::test]
async fn health_of_a_broken_database_is_unhealthy() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "this is not a database, just some text\n").unwrap();
    let out = outbox(&text, &["health"]);
    assert_error(&out, 2, "not a SQLite database");
    assert!(stdout(&out).starts_with("unhealthy"), "{}", stdout(&out));

    let missing = dir.path().join("missing.db");
    let out = outbox(&missing, &["health", "--json"]);
    assert_error(&out, 2, "does not exist");
    assert_eq!(json_of(&out)["status"], "unhealthy");
    assert!(!missing.exists(), "health created the database");

    let (_d, path, _store) = empty_db().await;
    assert_error(
        &outbox(&path, &["--table", "other_outbox", "health"]),
        2,
        "other_outbox",
    );
}

#[tokio::test]
async fn bad_ids_and_values_are_one_line_errors() {
    let f = fixture().await;
    let unknown = MessageId::new().to_string();
    for cmd in ["show", "retry", "discard"] {
        assert_error(&outbox(&f.path, &[cmd, &unknown]), 1, &unknown);
        assert_error(&outbox(&f.path, &[cmd, "not-a-uuid"]), 2, "not-a-uuid");
    }
    assert_error(&outbox(&f.path, &["list", "--state", "bogus"]), 2, "bogus");
    assert_error(&outbox(&f.path, &["list", "--limit", "0"]), 2, "--limit");
    for bad in ["7", "7w", "-1d", "", "1.5h", "d"] {
        assert_error(
            &outbox(&f.path, &["purge", "--older-than", bad]),
            2,
            "--older-than",
        );
    }
    assert_error(&outbox(&f.path, &["purge"]), 2, "--older-than");
    assert_error(
        &outbox(&f.path, &["health", "--backlog-alert", "soon"]),
        2,
        "soon",
    );
    assert_error(&outbox(&f.path, &["retry"]), 2, "required");
    assert_error(
        &outbox(
            &f.path,
            &["retry", &f.poisoned.to_string(), "--all-poisoned"],
        ),
        2,
        "--all-poisoned",
    );
    assert_error(
        &outbox(&f.path, &["retry", "--all-poisoned", "--by", ""]),
        2,
        "--by",
    );
    assert_error(&outbox(&f.path, &["frobnicate"]), 2, "frobnicate");
    assert_error(
        &outbox(&f.path, &["--table", "x; DROP TABLE y", "stats"]),
        2,
        "x; DROP",
    );
    // Nothing above changed the data.
    let stats = f.store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.poisoned, stats.processed), (1, 1, 1));
}

#[tokio::test]
async fn bad_databases_are_errors_and_are_never_created_or_migrated() {
    let dir = tempfile::tempdir().unwrap();

    let missing = dir.path().join("missing.db");
    for cmd in [&["stats"][..], &["list"], &["purge", "--older-than", "1d"]] {
        assert_error(&outbox(&missing, cmd), 1, "does not exist");
    }
    assert!(!missing.exists(), "the CLI created the database");

    let text = dir.path().join("notes.txt");
    std::fs::write(
        &text,
        "hello, I am text, long enough to not be an empty database\n",
    )
    .unwrap();
    assert_error(&outbox(&text, &["stats"]), 1, "not a SQLite database");

    assert_error(&outbox(dir.path(), &["stats"]), 1, "not a file");

    // A SQLite database of something else: no outbox table, and none made.
    let other = dir.path().join("other.db");
    {
        let conn = rusqlite::Connection::open(&other).unwrap();
        conn.execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
            .unwrap();
    }
    assert_error(&outbox(&other, &["list"]), 1, "no outbox table `outbox`");
    let conn = rusqlite::Connection::open(&other).unwrap();
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(tables, ["orders"]);
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "delete", "the CLI changed the journal mode");
    // A table that exists but is not an outbox.
    assert_error(
        &outbox(&other, &["--table", "orders", "stats"]),
        1,
        "not an outbox table",
    );

    // An outbox database, but an unknown table: the known ones are named.
    let (_d, path, _store) = empty_db().await;
    assert_error(
        &outbox(&path, &["--table", "orders_outbox", "stats"]),
        1,
        "its outbox tables: outbox",
    );
    assert_error(
        &outbox(&path, &["--table", "outbox_inbox", "stats"]),
        1,
        "not an outbox table",
    );

    // Malformed URLs: not SQLite, PostgreSQL or MySQL, the password hidden.
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .env_remove("OUTBOX_DATABASE")
        .args(["--database", "mssql://u:secret@h/db", "stats"])
        .output()
        .unwrap();
    assert_error(&out, 2, "sqlite:PATH");
    assert!(!stderr(&out).contains("secret"), "{}", stderr(&out));
    // --schema is PostgreSQL's.
    assert_error(
        &outbox(&path, &["--schema", "shop", "stats"]),
        2,
        "--schema",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .env_remove("OUTBOX_DATABASE")
        .args(["stats"])
        .output()
        .unwrap();
    assert_error(&out, 2, "OUTBOX_DATABASE");
}

#[tokio::test]
async fn database_and_table_come_from_the_environment() {
    let f = fixture().await;
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .env("OUTBOX_DATABASE", url(&f.path))
        .env("OUTBOX_TABLE", "outbox")
        .args(["stats", "--json"])
        .output()
        .unwrap();
    assert_eq!(json_of(&out)["poisoned"], 1);
}

#[tokio::test]
async fn named_tables_work() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let store = SqliteStore::builder(&path)
        .table("orders_outbox")
        .inbox_table("orders_inbox")
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let id = enqueue(
        &store,
        NewMessage::new(MessageKind::Domain, "T", b"{}".to_vec()),
    );
    let out = outbox(&path, &["--table", "orders_outbox", "list", "--json"]);
    assert_eq!(json_of(&out)[0]["id"], id.to_string().as_str());
}

/// On SQLite, `outboxes` lists the one table of the file with its health,
/// as text and as JSON; a pattern that does not match it, a bad pattern
/// and `--schema` are errors.
#[tokio::test]
async fn outboxes_lists_the_one_table_of_a_sqlite_file() {
    let f = fixture().await;
    let v = json_of(&outbox(&f.path, &["outboxes", "--json"]));
    assert_eq!(v["table"], "outbox");
    let listed = v["outboxes"].as_array().unwrap();
    assert_eq!(listed.len(), 1, "{v}");
    assert_eq!(listed[0]["name"], "outbox");
    assert_eq!(listed[0]["status"], "degraded");
    assert_eq!(
        (&listed[0]["pending"], &listed[0]["poisoned"]),
        (&1.into(), &1.into())
    );
    assert!(
        listed[0]["reasons"][0]
            .as_str()
            .unwrap()
            .contains("1 poisoned message(s)"),
        "{v}"
    );
    assert_eq!(v["not_healthy"], serde_json::json!(["outbox"]));
    assert_eq!(v["count"]["outboxes"], 1);

    let text = assert_ok(&outbox(&f.path, &["outboxes", "--matching", "out*"]));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].starts_with("OUTBOX") && lines[0].contains("STATUS"),
        "{text}"
    );
    assert!(lines[1].starts_with("outbox  degraded  1"), "{text}");
    assert_eq!(lines[2], "1 outbox: 1 degraded (outbox)");

    assert_error(
        &outbox(&f.path, &["outboxes", "--matching", "orders_*"]),
        1,
        "does not match `orders_*`",
    );
    assert_error(
        &outbox(&f.path, &["outboxes", "--matching", "out[box]"]),
        2,
        "`[`",
    );
    assert_error(
        &outbox(&f.path, &["--schema", "shop", "outboxes"]),
        2,
        "--schema",
    );
}
