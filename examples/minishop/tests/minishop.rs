//! End-to-end tests of the `minishop` binary: load runs on SQLite and on
//! PostgreSQL, over the embedded bus and RabbitMQ, the HTTP API, and bad
//! input.
//!
//! The RabbitMQ tests need a broker: `OUTBOX_AMQP_URL` if set, else the
//! local default (`amqp://guest:guest@127.0.0.1:5672/%2f`) if it answers;
//! the PostgreSQL tests a database: `OUTBOX_PG_URL`, else
//! `postgres://postgres@127.0.0.1:5432/test` if it answers. Otherwise those
//! tests fail saying how to provide one (they are never skipped).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_minishop");

struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

fn minishop() -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("OUTBOX_AMQP_URL")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn drain(r: impl Read + Send + 'static) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut s = String::new();
        let _ = BufReader::new(r).read_to_string(&mut s);
        s
    })
}

/// Waits for the child to exit, killing it (and failing) at the deadline.
fn wait(mut child: Child, limit: Duration) -> Finished {
    let out = child.stdout.take().map(drain);
    let err = drain(child.stderr.take().expect("piped stderr"));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "minishop did not exit within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                out.map(|o| o.join().unwrap_or_default())
                    .unwrap_or_default(),
                err.join().unwrap_or_default()
            );
        }
        thread::sleep(Duration::from_millis(10));
    };
    Finished {
        status,
        stdout: out
            .map(|o| o.join().unwrap_or_default())
            .unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

fn run(cmd: &mut Command, limit: Duration) -> Finished {
    wait(cmd.spawn().expect("start minishop"), limit)
}

/// The number after `label` at the start of a summary line.
fn figure(stdout: &str, label: &str) -> u64 {
    stdout
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix(label))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no `{label}` figure in the summary:\n{stdout}"))
}

fn check_load_run(f: &Finished, orders: u64) {
    assert!(
        f.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        f.status,
        f.stdout,
        f.stderr
    );
    let confirmed = figure(&f.stdout, "confirmed");
    let cancelled = figure(&f.stdout, "cancelled");
    assert_eq!(confirmed + cancelled, orders, "{}", f.stdout);
    assert!(confirmed > 0 && cancelled > 0, "{}", f.stdout);
    for label in ["latency p50", "latency p99", "messages", "elapsed"] {
        assert!(f.stdout.contains(label), "`{label}` missing:\n{}", f.stdout);
    }
    // Every order sent OrderPlaced and got an answer; every confirmed one
    // also went through OrderConfirmed.
    assert!(
        figure(&f.stdout, "messages") >= 2 * orders + confirmed,
        "{}",
        f.stdout
    );
    assert!(!f.stderr.contains("panicked"), "{}", f.stderr);
}

#[test]
fn two_hundred_orders_on_the_embedded_bus() {
    let dir = tempfile::tempdir().unwrap();
    let f = run(
        minishop()
            .args(["--orders", "200", "--timeout", "60s", "--sample-pools"])
            .arg("--data-dir")
            .arg(dir.path()),
        Duration::from_secs(90),
    );
    check_load_run(&f, 200);
    assert!(f.stdout.contains("embedded bus"), "{}", f.stdout);
    // Placed as fast as they commit, the orders keep Ordering's one
    // application connection busy for part of the run at least.
    let shares = pool_shares(&f.stdout);
    let names: Vec<&str> = shares.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["ordering", "warehouse"], "{}", f.stdout);
    assert!(
        shares.iter().all(|(_, share)| (0..=100).contains(share)) && shares[0].1 > 0,
        "{}",
        f.stdout
    );
}

/// The `pools in use` line of a summary (`--sample-pools`): each module
/// and its share (%).
fn pool_shares(stdout: &str) -> Vec<(String, u32)> {
    let line = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("pools in use"))
        .unwrap_or_else(|| panic!("no `pools in use` line:\n{stdout}"));
    let shares = line.split("(share").next().unwrap_or_default();
    shares
        .split(',')
        .map(|part| {
            let words: Vec<&str> = part.split_whitespace().collect();
            match words[..] {
                [name, share, "%"] => (name.to_owned(), share.parse().expect("a share")),
                _ => panic!("`{part}` is not `NAME SHARE %`:\n{stdout}"),
            }
        })
        .collect()
}

#[test]
fn two_hundred_orders_through_rabbitmq() {
    let url = outbox_api::testing::service_url(&outbox_rabbitmq::testing::RABBITMQ);
    // Each module on partition queues (the default), then on one queue each.
    for partitions in ["6", "0"] {
        let dir = tempfile::tempdir().unwrap();
        let f = run(
            minishop()
                .args(["--orders", "200", "--isolated", "--timeout", "60s"])
                .args(["--partitions", partitions, "--amqp", &url])
                .arg("--data-dir")
                .arg(dir.path()),
            Duration::from_secs(90),
        );
        check_load_run(&f, 200);
        assert!(f.stdout.contains("RabbitMQ"), "{}", f.stdout);
        assert_eq!(
            f.stdout.contains("the warehouse consumes 6 partitions"),
            partitions == "6",
            "--partitions {partitions}: {}",
            f.stdout
        );
        if let Some(pw) = password(&url) {
            assert!(!f.stdout.contains(&format!(":{pw}@")), "password printed");
            assert!(!f.stderr.contains(&format!(":{pw}@")), "password printed");
        }
    }
}

/// The saga over NATS JetStream, on SQLite: every order ends, and an
/// isolated run deletes its streams.
#[test]
fn two_hundred_orders_through_nats() {
    let url = outbox_api::testing::service_url(&outbox_nats::testing::NATS);
    let dir = tempfile::tempdir().unwrap();
    let f = run(
        minishop()
            .args([
                "--orders",
                "200",
                "--isolated",
                "--timeout",
                "60s",
                "--nats",
                &url,
            ])
            .arg("--data-dir")
            .arg(dir.path()),
        Duration::from_secs(90),
    );
    check_load_run(&f, 200);
    assert!(f.stdout.contains("NATS JetStream"), "{}", f.stdout);
    let stream = f
        .stdout
        .split("stream `")
        .nth(1)
        .and_then(|rest| rest.split('`').next())
        .expect("the banner names the stream")
        .to_owned();
    let deleted = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let client = outbox_nats::async_nats::connect(url.as_str())
                .await
                .unwrap();
            let js = outbox_nats::async_nats::jetstream::new(client);
            js.get_stream(&stream).await.is_err()
        });
    assert!(deleted, "an isolated run deletes its stream `{stream}`");
}

/// The schemas a run named in its banner (`… (schemas `a`, `b`), …`).
fn schemas_of(stderr: &str) -> Vec<String> {
    let line = stderr
        .lines()
        .find(|l| l.contains("data in PostgreSQL"))
        .unwrap_or_else(|| panic!("no PostgreSQL banner in:\n{stderr}"));
    let list = line
        .split_once("(schemas ")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(list, _)| list)
        .unwrap_or_else(|| panic!("no schemas in: {line}"));
    list.split(", ")
        .map(|s| s.trim_matches('`').to_owned())
        .collect()
}

/// Which of `schemas` exist in the database at `url`.
fn existing_schemas(url: &str, schemas: &[String]) -> Vec<String> {
    use outbox::postgres::sqlx::{self, Connection as _};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut conn = sqlx::PgConnection::connect(url)
            .await
            .expect("connect to PostgreSQL");
        let found = sqlx::query_scalar(
            "SELECT nspname::text FROM pg_namespace WHERE nspname = ANY($1) ORDER BY 1",
        )
        .bind(schemas)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        let _ = conn.close().await;
        found
    })
}

/// A load run on PostgreSQL in schemas of its own (`--isolated`), which
/// are gone after it.
fn postgres_load_run(extra: &[&str]) -> Finished {
    let url = outbox_api::testing::service_url(&outbox_postgres::testing::POSTGRES);
    let dir = tempfile::tempdir().unwrap();
    let f = run(
        minishop()
            .args([
                "--orders",
                "200",
                "--isolated",
                "--timeout",
                "60s",
                "--postgres",
                &url,
            ])
            .args(extra)
            // Not used on PostgreSQL: nothing may appear in it.
            .arg("--data-dir")
            .arg(dir.path().join("unused")),
        Duration::from_secs(90),
    );
    check_load_run(&f, 200);
    let schemas = schemas_of(&f.stderr);
    assert_eq!(schemas.len(), 2, "{}", f.stderr);
    assert!(
        schemas[0].starts_with("ordering_run_") && schemas[1].starts_with("warehouse_run_"),
        "{schemas:?}"
    );
    assert_eq!(
        existing_schemas(&url, &schemas),
        Vec::<String>::new(),
        "an isolated run drops its schemas"
    );
    assert!(!dir.path().join("unused").exists(), "SQLite files made");
    f
}

#[test]
fn two_hundred_orders_on_postgres() {
    let f = postgres_load_run(&[]);
    assert!(f.stdout.contains("embedded bus"), "{}", f.stdout);
}

#[test]
fn two_hundred_orders_on_postgres_through_nats() {
    let nats = outbox_api::testing::service_url(&outbox_nats::testing::NATS);
    let f = postgres_load_run(&["--nats", &nats]);
    assert!(f.stdout.contains("NATS JetStream"), "{}", f.stdout);
}

#[test]
fn two_hundred_orders_on_postgres_through_rabbitmq() {
    let amqp = outbox_api::testing::service_url(&outbox_rabbitmq::testing::RABBITMQ);
    let f = postgres_load_run(&["--amqp", &amqp]);
    assert!(f.stdout.contains("RabbitMQ"), "{}", f.stdout);
}

fn password(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let userinfo = rest.split_once('@')?.0;
    Some(userinfo.split_once(':')?.1.to_owned())
}

/// A tiny HTTP/1.1 client: (status, body).
fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    http_with(addr, method, path, body, "")
}

/// [`http`] with more header lines (each ending in `\r\n`).
fn http_with(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &str,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect to minishop");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{headers}Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// Starts MiniShop's HTTP server on a free port over SQLite in `dir`;
/// returns the process and the address it listens on.
fn serve_http(dir: &std::path::Path) -> (Child, String) {
    serve_http_with(dir, &[], &[])
}

/// [`serve_http`] with more arguments and variables.
fn serve_http_with(dir: &std::path::Path, args: &[&str], vars: &[(&str, &str)]) -> (Child, String) {
    let mut child = minishop()
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir)
        .args(args)
        .envs(vars.iter().copied())
        .env_remove("OUTBOX_CONSOLE_TOKEN")
        .spawn()
        .expect("start minishop");
    // The first stdout line says where it listens.
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(line) => line,
        Err(_) => {
            let _ = child.kill();
            panic!("minishop did not say where it listens within 30 s");
        }
    };
    let addr = line
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("unexpected first line: {line}"))
        .trim()
        .to_owned();
    (child, addr)
}

/// Places an order over HTTP and waits until its saga has ended; returns
/// the order.
fn order_to_the_end(addr: &str, body: &str) -> serde_json::Value {
    let (status, created) = http(addr, "POST", "/orders", Some(body));
    assert_eq!(status, 201, "{created}");
    let id = json(&created)["id"].as_str().expect("id").to_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = http(addr, "GET", &format!("/orders/{id}"), None);
        assert_eq!(status, 200, "{body}");
        let order = json(&body);
        let ended = match order["status"].as_str() {
            Some("cancelled") => true,
            Some("confirmed") => order.get("confirmed_at").is_some(),
            _ => false,
        };
        if ended {
            return order;
        }
        assert!(Instant::now() < deadline, "order still not done: {order}");
        thread::sleep(Duration::from_millis(20));
    }
}

/// Stops MiniShop with Ctrl-C and checks that it stopped gracefully;
/// returns what it printed.
fn interrupt(child: Child) -> Finished {
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(killed.success());
    let f = wait(child, Duration::from_secs(30));
    assert!(f.status.success(), "exit {:?}\n{}", f.status, f.stderr);
    assert!(f.stderr.contains("MiniShop stopped."), "{}", f.stderr);
    f
}

#[test]
fn http_api_places_and_follows_an_order() {
    let dir = tempfile::tempdir().unwrap();
    let (child, addr) = serve_http(dir.path());

    let order = order_to_the_end(&addr, r#"{"customer":"ann","sku":"apple","qty":2}"#);
    assert_eq!(order["status"], "confirmed", "{order}");
    assert_eq!(order["total_cents"], 240, "{order}");

    let (status, body) = http(
        &addr,
        "POST",
        "/orders",
        Some(r#"{"customer":"ann","sku":"spaceship","qty":1}"#),
    );
    assert_eq!(status, 422, "{body}");
    assert!(json(&body)["error"].as_str().unwrap().contains("spaceship"));
    let (status, _) = http(&addr, "GET", "/orders/not-a-uuid", None);
    assert_eq!(status, 404);

    let (status, body) = http(&addr, "GET", "/health", None);
    assert_eq!(status, 200, "{body}");
    let health = json(&body);
    for field in [
        "state",
        "pending",
        "poisoned",
        "oldest_pending_age_ms",
        "transport",
    ] {
        assert!(health.get(field).is_some(), "`{field}` missing: {health}");
    }
    assert_eq!(health["state"], "healthy", "{health}");

    // Ctrl-C stops it gracefully.
    interrupt(child);
}

/// (message type, trace_parent) of every outbox row of `table` in the
/// SQLite file `db` whose payload names `order`.
fn outbox_traces(db: &std::path::Path, table: &str, order: &str) -> Vec<(String, Option<String>)> {
    use outbox::sqlite::sqlx::{self, Connection};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let url = format!("sqlite://{}?mode=ro", db.display());
        let mut c = sqlx::SqliteConnection::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("open {url}: {e}"));
        // `table` is one of the test's own two names.
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT message_type, trace_parent FROM {table} \
             WHERE CAST(payload AS TEXT) LIKE '%' || ?1 || '%' ORDER BY seq"
        )))
        .bind(order)
        .fetch_all(&mut c)
        .await
        .unwrap_or_else(|e| panic!("read {table}: {e}"))
    })
}

/// The trace id (32 hex digits) of a W3C `traceparent`.
fn trace_id(traceparent: &str) -> &str {
    traceparent.split('-').nth(1).unwrap_or("")
}

#[test]
fn every_message_of_a_saga_carries_the_requests_trace_and_json_logs_show_it() {
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let dir = tempfile::tempdir().unwrap();
    let (child, addr) = serve_http_with(
        dir.path(),
        &["--log-format", "json"],
        &[("RUST_LOG", "warn,minishop=debug")],
    );
    let traced = order_to_the_end_with(
        &addr,
        &format!("traceparent: 00-{TRACE}-00f067aa0ba902b7-01\r\n"),
    );
    let untraced = order_to_the_end_with(&addr, "");
    let f = interrupt(child);

    let rows = |id: &str| {
        let mut rows = outbox_traces(&dir.path().join("ordering.db"), "ordering_outbox", id);
        let warehouse = outbox_traces(&dir.path().join("warehouse.db"), "warehouse_outbox", id);
        assert!(
            !warehouse.is_empty() && rows.len() >= 2,
            "order {id}: the ordering module enqueues OrderPlaced and OrderConfirmed, the \
             warehouse its answer: {rows:?} {warehouse:?}"
        );
        rows.extend(warehouse);
        rows
    };
    // The order placed with a traceparent: every message of its saga, in
    // both modules, carries that trace.
    for (kind, tp) in rows(&traced) {
        let tp = tp.unwrap_or_else(|| panic!("{kind} of the traced order has no trace_parent"));
        assert_eq!(trace_id(&tp), TRACE, "{kind}: {tp}");
    }
    // The order placed without one: a trace of its own, the same for its
    // whole saga.
    let untraced_rows = rows(&untraced);
    let first = untraced_rows[0].1.clone().expect("a trace_parent");
    assert_ne!(trace_id(&first), TRACE);
    for (kind, tp) in &untraced_rows {
        let tp = tp
            .as_deref()
            .unwrap_or_else(|| panic!("{kind} has no trace_parent"));
        assert_eq!(
            trace_id(tp),
            trace_id(&first),
            "{kind}: one trace for one saga"
        );
    }

    // JSON logs: every line an object; the handler's line for the traced
    // order holds its trace id (from the delivery span it was logged in).
    let lines: Vec<serde_json::Value> = f
        .stderr
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(json)
        .collect();
    let confirmed: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| {
            l["fields"]["message"] == "order confirmed" && l["fields"]["order"] == traced.as_str()
        })
        .collect();
    assert_eq!(
        confirmed.len(),
        1,
        "one JSON line for the traced order's confirmation:\n{}",
        f.stderr
    );
    assert!(
        confirmed[0].to_string().contains(TRACE),
        "the line carries the trace id: {}",
        confirmed[0]
    );
}

/// The value of the Prometheus sample `name{labels…}` in a scrape: the
/// line whose name is `name` and whose labels include every one of `labels`.
fn sample(scrape: &str, name: &str, labels: &[&str]) -> f64 {
    let found: Vec<f64> = scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            (metric == name && labels.iter().all(|want| rest.contains(want)))
                .then(|| value.parse().ok())?
        })
        .collect();
    match found.as_slice() {
        [v] => *v,
        _ => panic!("want one {name} {labels:?}, found {found:?} in:\n{scrape}"),
    }
}

#[test]
fn console_and_metrics_are_served_beside_the_api() {
    let dir = tempfile::tempdir().unwrap();
    let (child, addr) = serve_http(dir.path());
    let order = order_to_the_end(&addr, r#"{"customer":"bob","sku":"apple","qty":1}"#);
    assert_eq!(order["status"], "confirmed", "{order}");
    // Health reads the backlog, which also sets the backlog gauges.
    let (status, body) = http(&addr, "GET", "/health", None);
    assert_eq!(status, 200, "{body}");

    // The console's overview, under /outbox, with both modules' outboxes
    // and their relays' health.
    let (status, page) = http(&addr, "GET", "/outbox", None);
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("Overview"), "{page}");
    for outbox in ["ordering", "warehouse"] {
        assert!(
            page.contains(&format!(
                "href=\"/outbox/{outbox}/messages?state=poisoned\""
            )),
            "{outbox} missing: {page}"
        );
    }
    assert!(page.contains(">healthy<"), "{page}");
    assert!(
        !page.contains("(from the table)"),
        "relay health expected: {page}"
    );
    let (status, page) = http(
        &addr,
        "GET",
        "/outbox/ordering/messages?state=processed",
        None,
    );
    assert_eq!(status, 200, "{page}");
    for ty in ["OrderPlaced", "OrderConfirmed"] {
        assert!(page.contains(&format!(">{ty}</a>")), "{ty} missing: {page}");
    }

    // The metrics, in Prometheus' text format.
    let (status, scrape) = http(&addr, "GET", "/metrics", None);
    assert_eq!(status, 200, "{scrape}");
    let delivered = |outbox: &str, kind: &str, ty: &str| {
        sample(
            &scrape,
            "outbox_messages_delivered_total",
            &[
                &format!("outbox_name=\"{outbox}\""),
                &format!("outbox_message_kind=\"{kind}\""),
                &format!("outbox_message_type=\"{ty}\""),
            ],
        )
    };
    assert_eq!(delivered("ordering", "integration", "OrderPlaced"), 1.0);
    assert_eq!(delivered("ordering", "domain", "OrderConfirmed"), 1.0);
    assert_eq!(delivered("warehouse", "integration", "StockReserved"), 1.0);
    for outbox in ["ordering", "warehouse"] {
        let label = format!("outbox_name=\"{outbox}\"");
        assert_eq!(sample(&scrape, "outbox_pending", &[&label]), 0.0);
        assert_eq!(sample(&scrape, "outbox_poisoned", &[&label]), 0.0);
        assert_eq!(sample(&scrape, "outbox_transport_up", &[&label]), 1.0);
    }
    assert_eq!(
        sample(
            &scrape,
            "outbox_delivery_lag_seconds_count",
            &[
                "outbox_name=\"ordering\"",
                "outbox_message_type=\"OrderPlaced\""
            ]
        ),
        1.0
    );
    assert!(
        scrape.contains("# HELP outbox_messages_delivered_total ")
            && scrape.contains("# TYPE outbox_delivery_lag_seconds histogram")
            && !scrape.contains(" summary\n"),
        "{scrape}"
    );
    interrupt(child);
}

fn assert_one_line_error(f: &Finished, needle: &str) {
    assert!(!f.status.success(), "should fail: {}", f.stderr);
    let first = f.stderr.lines().last().unwrap_or_default();
    assert!(first.starts_with("error: "), "{}", f.stderr);
    assert!(f.stderr.contains(needle), "`{needle}` not in: {}", f.stderr);
    assert!(!f.stderr.contains("panicked"), "{}", f.stderr);
    assert!(
        !f.stderr.contains("secretpw"),
        "password printed: {}",
        f.stderr
    );
    assert_eq!(f.stderr.trim().lines().count(), 1, "{}", f.stderr);
}

#[test]
fn bad_input_is_one_line_without_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let limit = Duration::from_secs(60);

    let f = run(
        minishop()
            .args([
                "--orders",
                "1",
                "--amqp",
                "amqp://shop:secretpw@localhost:notaport/%2f",
            ])
            .arg("--data-dir")
            .arg(dir.path()),
        limit,
    );
    assert_one_line_error(&f, "not a valid AMQP URL");

    let f = run(
        minishop()
            .args([
                "--orders",
                "1",
                "--amqp",
                "amqp://shop:secretpw@127.0.0.1:1/%2f",
            ])
            .arg("--data-dir")
            .arg(dir.path()),
        limit,
    );
    assert_one_line_error(&f, "127.0.0.1:1");

    // One queue per module cannot be shared by processes of one module.
    let f = run(
        minishop().args([
            "--role",
            "warehouse",
            "--partitions",
            "0",
            "--amqp",
            "amqp://shop:secretpw@127.0.0.1:5672/%2f",
            "--postgres",
            "postgres://shop:secretpw@127.0.0.1:5432/test",
        ]),
        limit,
    );
    assert_one_line_error(&f, "--partitions 0 (one queue per module) needs --role all");

    // PostgreSQL: a URL of another scheme, an unreachable server.
    let f = run(
        minishop().args([
            "--orders",
            "1",
            "--postgres",
            "mysql://shop:secretpw@localhost/shop",
        ]),
        limit,
    );
    assert_one_line_error(&f, "not a PostgreSQL URL");
    let f = run(
        minishop().args([
            "--orders",
            "1",
            "--postgres",
            "postgres://shop:secretpw@127.0.0.1:1/shop",
        ]),
        limit,
    );
    assert_one_line_error(&f, "postgres://shop:***@127.0.0.1:1/shop");
    let f = run(minishop().args(["--orders", "1", "--isolated"]), limit);
    assert_one_line_error(&f, "--isolated needs");

    let file = dir.path().join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let f = run(
        minishop()
            .args(["--orders", "1", "--data-dir"])
            .arg(file.join("data")),
        limit,
    );
    assert_one_line_error(&f, "data directory");
}

#[test]
fn a_timeout_says_what_is_stuck() {
    let dir = tempfile::tempdir().unwrap();
    let f = run(
        minishop()
            .args(["--orders", "1000000", "--timeout", "1s", "--data-dir"])
            .arg(dir.path()),
        Duration::from_secs(60),
    );
    assert!(!f.status.success(), "{}", f.stdout);
    assert!(
        f.stderr.contains("error: timed out after 1s"),
        "{}",
        f.stderr
    );
    assert!(
        f.stderr.contains("ordering outbox: pending"),
        "{}",
        f.stderr
    );
    assert!(
        f.stderr.contains("warehouse outbox: pending"),
        "{}",
        f.stderr
    );
}

/// One span as an OTLP receiver got it.
#[derive(Debug, Clone)]
struct ExportedSpan {
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    name: String,
    message_type: Option<String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An OTLP/HTTP receiver of the test's own on a free port: takes
/// `POST /v1/traces` with a protobuf `ExportTraceServiceRequest`, decodes
/// it and keeps the spans; answers 200 with an empty response.
fn otlp_receiver() -> (String, std::sync::Arc<std::sync::Mutex<Vec<ExportedSpan>>>) {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    use prost::Message as _;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let spans = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = std::sync::Arc::clone(&spans);
    thread::spawn(move || {
        for stream in listener.incoming().map_while(Result::ok) {
            let kept = std::sync::Arc::clone(&kept);
            thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut stream = stream;
                // One request after another on a kept-alive connection.
                loop {
                    let mut request_line = String::new();
                    if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
                        return;
                    }
                    let mut length = 0usize;
                    loop {
                        let mut line = String::new();
                        reader.read_line(&mut line).unwrap();
                        let line = line.trim_end();
                        if line.is_empty() {
                            break;
                        }
                        if let Some((k, v)) = line.split_once(':') {
                            if k.eq_ignore_ascii_case("content-length") {
                                length = v.trim().parse().unwrap();
                            }
                        }
                    }
                    let mut body = vec![0; length];
                    reader.read_exact(&mut body).unwrap();
                    assert!(
                        request_line.starts_with("POST /v1/traces "),
                        "the exporter posts to /v1/traces: {request_line}"
                    );
                    let request = ExportTraceServiceRequest::decode(&body[..])
                        .unwrap_or_else(|e| panic!("not an OTLP trace export: {e}"));
                    let mut got = Vec::new();
                    for rs in request.resource_spans {
                        for ss in rs.scope_spans {
                            for s in ss.spans {
                                let message_type = s
                                    .attributes
                                    .iter()
                                    .find(|a| a.key == "message.type")
                                    .and_then(|a| a.value.as_ref()?.value.as_ref())
                                    .and_then(|v| match v {
                                        Value::StringValue(s) => Some(s.clone()),
                                        _ => None,
                                    });
                                got.push(ExportedSpan {
                                    trace_id: hex(&s.trace_id),
                                    span_id: hex(&s.span_id),
                                    parent_span_id: hex(&s.parent_span_id),
                                    name: s.name,
                                    message_type,
                                });
                            }
                        }
                    }
                    kept.lock().unwrap().extend(got);
                    let _ = stream.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n",
                    );
                }
            });
        }
    });
    (addr, spans)
}

/// Whether `span` descends from the span `ancestor` in `spans`.
fn descends(spans: &[ExportedSpan], span: &ExportedSpan, ancestor: &str) -> bool {
    let mut parent = span.parent_span_id.clone();
    for _ in 0..spans.len() {
        if parent == ancestor {
            return true;
        }
        match spans.iter().find(|s| s.span_id == parent) {
            Some(p) => parent = p.parent_span_id.clone(),
            None => return false,
        }
    }
    false
}

#[test]
fn spans_of_each_saga_are_exported_over_otlp_as_one_trace_from_the_request() {
    saga_traces_over_otlp(&[]);
}

#[test]
fn spans_of_each_saga_through_rabbitmq_are_one_trace_from_the_request() {
    let url = outbox_api::testing::service_url(&outbox_rabbitmq::testing::RABBITMQ);
    saga_traces_over_otlp(&["--amqp", &url, "--isolated"]);
}

#[test]
fn spans_of_each_saga_on_postgresql_are_one_trace_from_the_request() {
    let url = outbox_api::testing::service_url(&outbox_postgres::testing::POSTGRES);
    saga_traces_over_otlp(&["--postgres", &url, "--isolated"]);
}

#[test]
fn spans_of_each_saga_on_postgresql_through_rabbitmq_are_one_trace_from_the_request() {
    let pg = outbox_api::testing::service_url(&outbox_postgres::testing::POSTGRES);
    let amqp = outbox_api::testing::service_url(&outbox_rabbitmq::testing::RABBITMQ);
    saga_traces_over_otlp(&["--postgres", &pg, "--amqp", &amqp, "--isolated"]);
}

#[test]
fn spans_of_each_saga_through_nats_are_one_trace_from_the_request() {
    let url = outbox_api::testing::service_url(&outbox_nats::testing::NATS);
    saga_traces_over_otlp(&["--nats", &url, "--isolated"]);
}

/// Places an order with a `traceparent` and one without through MiniShop's
/// HTTP API (with `args`), and checks what an OTLP receiver of the test's
/// own got: one trace per order, from the request to the confirmation.
fn saga_traces_over_otlp(args: &[&str]) {
    const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
    const CALLER: &str = "b7ad6b7169203331";
    let (endpoint, spans) = otlp_receiver();
    let dir = tempfile::tempdir().unwrap();
    let (child, addr) = serve_http_with(
        dir.path(),
        args,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    let traced = order_to_the_end_with(&addr, &format!("traceparent: 00-{TRACE}-{CALLER}-01\r\n"));
    let untraced = order_to_the_end_with(&addr, "");
    // Ctrl-C: MiniShop exports what is left before it exits.
    interrupt(child);
    let spans = spans.lock().unwrap().clone();

    let check = |trace: &str, caller: Option<&str>, order: &str| {
        let of: Vec<ExportedSpan> = spans
            .iter()
            .filter(|s| s.trace_id == trace)
            .cloned()
            .collect();
        let request: Vec<&ExportedSpan> = of.iter().filter(|s| s.name == "POST /orders").collect();
        assert_eq!(
            request.len(),
            1,
            "order {order}: one request span in trace {trace}: {of:#?}"
        );
        let request = request[0];
        assert_eq!(
            request.parent_span_id,
            caller.unwrap_or(""),
            "order {order}: the request span's parent is the caller's span (none without a traceparent)"
        );
        let find = |name: &str, message_type: &str| {
            of.iter()
                .find(|s| s.name == name && s.message_type.as_deref() == Some(message_type))
                .unwrap_or_else(|| {
                    panic!("order {order}: no {name} span of {message_type} in {of:#?}")
                })
        };
        // HTTP request → OrderPlaced enqueued → the warehouse receives it → the ordering
        // module receives its answer → OrderConfirmed delivered.
        let enqueued = find("outbox.enqueue", "OrderPlaced");
        let placed = find("outbox.receive", "OrderPlaced");
        let answer = find("outbox.receive", "StockReserved");
        let confirmed = find("outbox.deliver", "OrderConfirmed");
        assert!(
            descends(&of, enqueued, &request.span_id),
            "OrderPlaced enqueued under the request"
        );
        assert!(
            descends(&of, placed, &enqueued.span_id),
            "OrderPlaced received under its enqueue"
        );
        assert!(
            descends(&of, answer, &placed.span_id),
            "the answer under the warehouse's handling"
        );
        assert!(
            descends(&of, confirmed, &answer.span_id),
            "the confirmation under the answer"
        );
    };
    check(TRACE, Some(CALLER), &traced);
    // Without a traceparent, the order's request starts a trace of its own.
    let roots: Vec<&ExportedSpan> = spans
        .iter()
        .filter(|s| s.name == "POST /orders" && s.trace_id != TRACE)
        .collect();
    assert_eq!(
        roots.len(),
        1,
        "one more request, one more trace: {roots:#?}"
    );
    check(&roots[0].trace_id.clone(), None, &untraced);
}

/// Places an apple order over HTTP with extra `headers` and waits until it
/// is confirmed and its confirmation handled; returns its id.
fn order_to_the_end_with(addr: &str, headers: &str) -> String {
    let (status, created) = http_with(
        addr,
        "POST",
        "/orders",
        Some(r#"{"customer":"ann","sku":"apple","qty":1}"#),
        headers,
    );
    assert_eq!(status, 201, "{created}");
    let id = json(&created)["id"].as_str().expect("id").to_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = http(addr, "GET", &format!("/orders/{id}"), None);
        if json(&body).get("confirmed_at").is_some() {
            return id;
        }
        assert!(
            Instant::now() < deadline,
            "order {id} never confirmed: {body}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}
