//! Runs the built `outbox` binary against outbox tables in MySQL/MariaDB,
//! each test on tables of its own (`outbox_mysql::testing`).
//!
//! They need MySQL or MariaDB: `OUTBOX_MYSQL_URL` if set, else the local
//! default (`mysql://root@127.0.0.1:3306/test`) if it answers; otherwise
//! they fail saying how to provide one — never a silent skip.

use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_api::{
    ClaimRequest, FailOutcome, Failure, MessageId, MessageKind, MessageState, NewMessage,
    OperatorStore, Store, Timestamp,
};
use outbox_mysql::sqlx::{self, AssertSqlSafe};
use outbox_mysql::testing::MySqlUnderTest;

mod common;
use common::{assert_error, assert_ok, get as http_get, json_of, start, stderr};

/// A fresh outbox with one poisoned, one processed and one pending message.
struct Fixture {
    my: MySqlUnderTest,
    poisoned: MessageId,
    processed: MessageId,
    pending: MessageId,
}

async fn enqueue(my: &MySqlUnderTest, message: NewMessage) -> MessageId {
    let mut tx = my.pool().begin().await.unwrap();
    let id = my.mysql().outbox().enqueue(&mut tx, message).await.unwrap();
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
    let my = MySqlUnderTest::fresh(None).await;
    let store = my.mysql();
    let poisoned = enqueue(
        &my,
        NewMessage::json(
            MessageKind::Domain,
            "OrderPlaced",
            &serde_json::json!({"order": 1}),
        )
        .unwrap()
        .key("order-1")
        .header("tenant", "acme"),
    )
    .await;
    assert_eq!(store.claim(&claim_one()).await.unwrap()[0].id, poisoned);
    let now = Timestamp::now();
    let outcome = store
        .fail(&Failure::new(
            "w",
            poisoned,
            "boom: handler exploded",
            now,
            1,
            now,
        ))
        .await
        .unwrap();
    assert_eq!(outcome, FailOutcome::Poisoned { attempts: 1 });
    let processed = enqueue(
        &my,
        NewMessage::new(MessageKind::Domain, "Shipped", b"plain text".to_vec()),
    )
    .await;
    assert_eq!(store.claim(&claim_one()).await.unwrap()[0].id, processed);
    store
        .complete(&[processed], Timestamp::now())
        .await
        .unwrap();
    let pending = enqueue(
        &my,
        NewMessage::new(MessageKind::Integration, "Binary", vec![0xff, 0x00, 0x10]),
    )
    .await;
    Fixture {
        my,
        poisoned,
        processed,
        pending,
    }
}

fn command() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.env_remove("OUTBOX_DATABASE")
        .env_remove("OUTBOX_TABLE")
        .env_remove("OUTBOX_SCHEMA")
        .env_remove(outbox_console::TOKEN_ENV)
        .env("USER", "tester");
    cmd
}

/// `outbox --database URL --table TABLE ARGS…`.
fn outbox_at(url: &str, table: &str, args: &[&str]) -> Output {
    command()
        .args(["--database", url, "--table", table])
        .args(args)
        .output()
        .unwrap()
}

fn outbox(my: &MySqlUnderTest, args: &[&str]) -> Output {
    outbox_at(my.url(), my.mysql().table(), args)
}

async fn state(my: &MySqlUnderTest, id: MessageId) -> MessageState {
    my.mysql().get(id).await.unwrap().expect("exists").state
}

#[tokio::test]
async fn mysql_list_show_stats_and_health() {
    let f = fixture().await;
    let table = f.my.mysql().table().to_owned();
    let text = assert_ok(&outbox(&f.my, &["list", "--state", "poisoned"]));
    assert!(text.contains(&f.poisoned.to_string()), "{text}");
    assert!(text.contains("boom: handler exploded"), "{text}");
    assert!(!text.contains(&f.pending.to_string()), "{text}");

    let all = json_of(&outbox(&f.my, &["--json", "list"]));
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
    let text = assert_ok(&outbox(&f.my, &["show", &f.poisoned.to_string()]));
    for want in ["poisoned", "OrderPlaced", "order-1", "tenant: acme"] {
        assert!(text.contains(want), "want `{want}` in:\n{text}");
    }
    let v = json_of(&outbox(&f.my, &["--json", "show", &f.pending.to_string()]));
    assert_eq!(
        (&v["payload"], &v["kind"]),
        (&"ff0010".into(), &"integration".into())
    );

    let v = json_of(&outbox(&f.my, &["stats", "--json"]));
    assert_eq!(v["table"], table);
    assert_eq!(
        (&v["pending"], &v["poisoned"], &v["processed"]),
        (&1.into(), &1.into(), &1.into())
    );
    let out = outbox(&f.my, &["health", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(json_of(&out)["status"], "degraded");

    let v = json_of(&outbox(&f.my, &["outboxes", "--json"]));
    assert_eq!(v["outboxes"][0]["name"], table, "{v}");
    let unknown = MessageId::new().to_string();
    assert_error(&outbox(&f.my, &["show", &unknown]), 1, &unknown);
}

#[tokio::test]
async fn mysql_retry_discard_and_purge_change_the_rows_and_a_relay_delivers_the_retried() {
    let f = fixture().await;
    let pending = f.pending.to_string();
    let text = assert_ok(&outbox(&f.my, &["discard", &pending, "--dry-run"]));
    assert!(text.contains("would discard"), "{text}");
    assert_eq!(state(&f.my, f.pending).await, MessageState::Pending);
    assert_ok(&outbox(&f.my, &["discard", &pending, "--by", "bob"]));
    let m = f.my.mysql().get(f.pending).await.unwrap().unwrap();
    assert_eq!(m.state, MessageState::Processed);
    assert!(m.last_error.unwrap().contains("discarded by bob"));
    assert_error(&outbox(&f.my, &["retry", &pending]), 1, "not poisoned");

    // A relay in this process: the CLI's retry reaches it by the store's
    // poll for other processes' commits.
    let delivered = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&delivered);
    let relay = outbox::Relay::builder(f.my.mysql().clone())
        .dispatcher(outbox::Handlers::new().on_message(
            "OrderPlaced",
            move |m: &outbox::Message| {
                seen.lock().unwrap().push(m.id);
                async { Ok::<_, std::io::Error>(()) }
            },
        ))
        .spawn()
        .unwrap();
    let id = f.poisoned.to_string();
    let text = assert_ok(&outbox(&f.my, &["retry", &id, "--by", "alice"]));
    assert!(text.contains("retried") && text.contains(&id), "{text}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while state(&f.my, f.poisoned).await != MessageState::Processed {
        assert!(
            Instant::now() < deadline,
            "the retried message was not delivered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    relay.shutdown().await;
    assert_eq!(*delivered.lock().unwrap(), [f.poisoned]);

    // Processed at least a millisecond before the purge's cut-off.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let v = json_of(&outbox(&f.my, &["purge", "--older-than", "0s", "--json"]));
    assert_eq!(v["purged"], 3, "{v}");
    assert_eq!(f.my.outbox_rows().await, 0);
}

#[tokio::test]
async fn mysql_bad_targets_are_clear_errors_and_nothing_is_created() {
    let my = MySqlUnderTest::fresh(None).await;
    let url = my.url().to_owned();
    let table = my.mysql().table().to_owned();
    let tables = async || -> Vec<String> {
        sqlx::query_scalar(
            "SELECT CAST(table_name AS CHAR) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name LIKE ? ORDER BY 1",
        )
        .bind(format!("{}%", my.prefix()))
        .fetch_all(my.pool())
        .await
        .unwrap()
    };
    let before = tables().await;
    let missing = format!("{}_nope", my.prefix());
    let out = outbox_at(&url, &missing, &["stats"]);
    assert_error(&out, 1, &format!("has no outbox table `{missing}`"));
    assert!(
        stderr(&out).contains(&table),
        "names the outboxes: {}",
        stderr(&out)
    );
    assert_error(
        &outbox_at(&url, my.mysql().inbox_table(), &["list"]),
        1,
        "is not an outbox table",
    );
    assert_eq!(tables().await, before, "the CLI created nothing");

    assert_error(
        &command()
            .args(["--database", &url, "--schema", "shop", "stats"])
            .output()
            .unwrap(),
        2,
        "the URL names the database",
    );
    // A password is never printed, whatever fails.
    let bad = url.replacen("root@", "root:Hunter2-secret@", 1);
    let out = outbox_at(&bad, &table, &["stats"]);
    // Refused credentials are configuration: a usage error, as on PostgreSQL.
    assert_error(&out, 2, "Access denied");
    assert!(!stderr(&out).contains("Hunter2"), "{}", stderr(&out));
    let unreachable = "mysql://root:Hunter2-secret@127.0.0.1:1/test";
    let out = outbox_at(unreachable, &table, &["stats"]);
    assert_error(&out, 1, "127.0.0.1:1");
    assert!(!stderr(&out).contains("Hunter2"), "{}", stderr(&out));
}

#[tokio::test]
async fn mysql_serve_shows_the_outbox() {
    let f = fixture().await;
    let table = f.my.mysql().table().to_owned();
    let mut cmd = command();
    cmd.args(["--database", f.my.url(), "--table", &table]);
    cmd.args(["serve", "--listen", "127.0.0.1:0"]);
    let server = start(cmd);
    let host = server.addr.to_string();
    let (status, body) = http_get(server.addr, &host, "/", None);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(&format!(">{table}</a>")), "{body}");
    let path = format!("/{table}/messages?state=poisoned");
    let (status, body) = http_get(server.addr, &host, &path, None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body.matches(">OrderPlaced</a>").count(), 1, "{body}");
    // The view is the rows' own: no table of the fixture changed.
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM `{table}`")))
        .fetch_one(f.my.pool())
        .await
        .unwrap();
    assert_eq!(n, 3);
}
