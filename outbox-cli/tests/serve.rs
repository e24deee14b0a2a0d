//! Runs `outbox serve` as a process on a prepared SQLite outbox and talks
//! HTTP to it over TCP: the overview, a token, and the refusal to serve a
//! non-loopback address without one.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use outbox_api::{MessageKind, NewMessage};
use outbox_sqlite::SqliteStore;
use outbox_sqlite::rusqlite;

mod common;
use common::{assert_error, get, start};

const TOKEN: &str = "serve-test-token-0123456789";

/// A migrated database with two pending messages.
async fn db() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let store = SqliteStore::connect(&path).await.unwrap();
    store.migrate().await.unwrap();
    let mut conn = rusqlite::Connection::open(&path).unwrap();
    let tx = conn.transaction().unwrap();
    for n in 0..2 {
        let m = NewMessage::json(
            MessageKind::Domain,
            "OrderPlaced",
            &serde_json::json!({"n": n}),
        )
        .unwrap();
        store.outbox().enqueue_rusqlite(&tx, m).unwrap();
    }
    tx.commit().unwrap();
    (dir, path)
}

fn command(path: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.env_remove("OUTBOX_DATABASE")
        .env_remove("OUTBOX_TABLE")
        .env_remove("OUTBOX_SCHEMA")
        .env_remove(outbox_console::TOKEN_ENV)
        .arg("--db")
        .arg(format!("sqlite:{}", path.display()));
    cmd
}

#[tokio::test]
async fn serve_shows_the_overview_over_tcp() {
    let (_dir, path) = db().await;
    let mut cmd = command(&path);
    cmd.args(["serve", "--listen", "127.0.0.1:0"]);
    let server = start(cmd);
    assert!(server.addr.ip().is_loopback(), "{}", server.addr);
    assert_ne!(server.addr.port(), 0);

    let host = server.addr.to_string();
    let (status, body) = get(server.addr, &host, "/", None);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("Overview"), "{body}");
    // The outbox row, named after the table, with its two pending messages.
    assert!(body.contains(">outbox</a>"), "{body}");
    assert!(body.contains("/outbox/messages?state=pending"), "{body}");
    assert!(body.contains(">2</a>"), "{body}");

    let (status, body) = get(server.addr, &host, "/outbox/messages?state=pending", None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body.matches(">OrderPlaced</a>").count(), 2, "{body}");
}

#[tokio::test]
async fn serve_refuses_a_public_address_without_a_token() {
    let (_dir, path) = db().await;
    let out = command(&path)
        .args(["serve", "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_error(
        &out,
        2,
        "refusing to serve the console on 0.0.0.0:0 without a token",
    );
    assert!(common::stderr(&out).contains("--token"));

    // An empty token variable is no token.
    let out = command(&path)
        .env(outbox_console::TOKEN_ENV, "")
        .args(["serve", "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_error(&out, 2, "without a token");

    // A token too short to be one is refused, and not printed.
    let out = command(&path)
        .args(["serve", "--listen", "0.0.0.0:0", "--token", "short-s3cret"])
        .output()
        .unwrap();
    assert_error(&out, 2, "too short");
    assert!(!common::stderr(&out).contains("short-s3cret"));
}

#[tokio::test]
async fn serve_with_a_token_from_the_environment_requires_it() {
    let (_dir, path) = db().await;
    let mut cmd = command(&path);
    cmd.env(outbox_console::TOKEN_ENV, TOKEN)
        .args(["serve", "--listen", "0.0.0.0:0"]);
    let server = start(cmd);
    let local = SocketAddr::from(([127, 0, 0, 1], server.addr.port()));

    let (status, body) = get(local, "shop.internal", "/", None);
    assert_ne!(status, 200, "{body}");
    assert!(
        !body.contains("OrderPlaced") && !body.contains(">outbox</a>"),
        "{body}"
    );

    let (status, body) = get(local, "shop.internal", "/", Some("wrong-token-0123456789"));
    assert_ne!(status, 200, "{body}");

    let (status, body) = get(local, "shop.internal", "/", Some(TOKEN));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(">outbox</a>"), "{body}");
    assert!(!body.contains(TOKEN), "the token is never shown");
}

#[tokio::test]
async fn serve_logs_json_lines_when_asked() {
    use std::io::{BufRead, BufReader};
    let (_dir, path) = db().await;
    let mut cmd = command(&path);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json"])
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("start outbox serve");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // The console's own line saying where it listens, as one JSON object.
    let line = rx.recv_timeout(std::time::Duration::from_secs(30));
    let _ = child.kill();
    let _ = child.wait();
    let line = line.expect("a log line within 30 s");
    let logged: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
    assert_eq!(logged["level"], "INFO", "{line}");
    assert!(
        logged["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("outbox console listening on http://127.0.0.1:")),
        "{line}"
    );
    assert!(
        logged["timestamp"].is_string() && logged["target"].is_string(),
        "{line}"
    );
}

/// `--matching` picks PostgreSQL schemas: on SQLite it is a usage error,
/// before anything is served.
#[tokio::test]
async fn serve_matching_is_refused_on_sqlite() {
    let (_dir, path) = db().await;
    let out = command(&path)
        .args(["serve", "--listen", "127.0.0.1:0", "--matching", "tenant_*"])
        .output()
        .unwrap();
    assert_error(&out, 2, "--matching applies to PostgreSQL only");
    assert!(common::stdout(&out).is_empty(), "nothing was served");
}
