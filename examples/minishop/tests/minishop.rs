//! End-to-end tests of the `minishop` binary: load runs on SQLite, on
//! PostgreSQL and on MySQL/MariaDB, over the embedded bus, RabbitMQ and
//! NATS, the HTTP API, and bad input.
//!
//! The RabbitMQ tests need a broker: `OUTBOX_AMQP_URL` if set, else the
//! local default (`amqp://guest:guest@127.0.0.1:5672/%2f`) if it answers;
//! the PostgreSQL tests a database: `OUTBOX_PG_URL`, else
//! `postgres://postgres@127.0.0.1:5432/test` if it answers; the MySQL tests
//! a server: `OUTBOX_MYSQL_URL`, else `mysql://root@127.0.0.1:3306/test` if
//! it answers (a user that may create and drop databases). Otherwise those
//! tests fail saying how to provide one (they are never skipped).

mod common;
mod summary;

use std::process::{Child, Command};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use summary::figure;

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

/// The MySQL databases a run named in its banner (`… (databases `a`, `b`), …`).
fn databases_of(stderr: &str) -> Vec<String> {
    let line = stderr
        .lines()
        .find(|l| l.contains("data in MySQL"))
        .unwrap_or_else(|| panic!("no MySQL banner in:\n{stderr}"));
    let list = line
        .split_once("(databases ")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(list, _)| list)
        .unwrap_or_else(|| panic!("no databases in: {line}"));
    list.split(", ")
        .map(|s| s.trim_matches('`').to_owned())
        .collect()
}

/// Which of `databases` exist on the MySQL server at `url`.
fn existing_databases(url: &str, databases: &[String]) -> Vec<String> {
    use outbox::mysql::sqlx::{self, Connection as _};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut conn = sqlx::MySqlConnection::connect(url)
            .await
            .expect("connect to MySQL");
        let mut found = Vec::new();
        for database in databases {
            let hit: Option<String> = sqlx::query_scalar(
                "SELECT SCHEMA_NAME FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?",
            )
            .bind(database)
            .fetch_optional(&mut conn)
            .await
            .unwrap();
            found.extend(hit);
        }
        let _ = conn.close().await;
        found
    })
}

/// A load run on MySQL/MariaDB in databases of its own (`--isolated`),
/// which are gone after it.
fn mysql_load_run(extra: &[&str]) -> Finished {
    let url = outbox_mysql::testing::database_url();
    let database = url
        .rsplit_once('/')
        .map(|(_, db)| db.split(['?', '#']).next().unwrap_or_default().to_owned())
        .unwrap_or_default();
    let dir = tempfile::tempdir().unwrap();
    let f = run(
        minishop()
            .args([
                "--orders",
                "200",
                "--isolated",
                "--timeout",
                "60s",
                "--mysql",
                &url,
            ])
            .args(extra)
            // Not used on MySQL: nothing may appear in it.
            .arg("--data-dir")
            .arg(dir.path().join("unused")),
        Duration::from_secs(90),
    );
    check_load_run(&f, 200);
    let databases = databases_of(&f.stderr);
    assert_eq!(databases.len(), 2, "{}", f.stderr);
    assert!(
        databases[0].starts_with(&format!("{database}_ordering_run_"))
            && databases[1].starts_with(&format!("{database}_warehouse_run_")),
        "{databases:?}"
    );
    assert_eq!(
        existing_databases(&url, &databases),
        Vec::<String>::new(),
        "an isolated run drops its databases"
    );
    assert!(!dir.path().join("unused").exists(), "SQLite files made");
    f
}

#[test]
fn two_hundred_orders_on_mysql() {
    let f = mysql_load_run(&[]);
    assert!(f.stdout.contains("embedded bus"), "{}", f.stdout);
}

#[test]
fn two_hundred_orders_on_mysql_through_nats() {
    let nats = outbox_api::testing::service_url(&outbox_nats::testing::NATS);
    let f = mysql_load_run(&["--nats", &nats]);
    assert!(f.stdout.contains("NATS JetStream"), "{}", f.stdout);
}

#[test]
fn two_hundred_orders_on_mysql_through_rabbitmq() {
    let amqp = outbox_api::testing::service_url(&outbox_rabbitmq::testing::RABBITMQ);
    let f = mysql_load_run(&["--amqp", &amqp]);
    assert!(f.stdout.contains("RabbitMQ"), "{}", f.stdout);
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

    // MySQL: a URL of another scheme, one without a database, an
    // unreachable server, and both databases at once.
    let f = run(
        minishop().args([
            "--orders",
            "1",
            "--mysql",
            "postgres://shop:secretpw@localhost/shop",
        ]),
        limit,
    );
    assert_one_line_error(
        &f,
        "--mysql: `postgres://shop:***@localhost/shop` is not a MySQL URL",
    );
    let f = run(
        minishop().args([
            "--orders",
            "1",
            "--mysql",
            "mysql://shop:secretpw@localhost:3306",
        ]),
        limit,
    );
    assert_one_line_error(&f, "names no database");
    let f = run(
        minishop().args([
            "--orders",
            "1",
            "--mysql",
            "mariadb://shop:secretpw@127.0.0.1:1/shop",
        ]),
        limit,
    );
    assert_one_line_error(&f, "mariadb://shop:***@127.0.0.1:1/shop");
    let f = run(
        minishop().args([
            "--orders",
            "1",
            "--mysql",
            "mysql://shop:secretpw@127.0.0.1:1/shop",
            "--postgres",
            "postgres://shop:secretpw@127.0.0.1:1/shop",
        ]),
        limit,
    );
    assert!(!f.status.success(), "should fail: {}", f.stderr);
    assert!(
        f.stderr.contains("cannot be used with") && !f.stderr.contains("secretpw"),
        "{}",
        f.stderr
    );
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

fn run(cmd: &mut Command, limit: Duration) -> Finished {
    wait(cmd.spawn().expect("start minishop"), limit)
}

fn password(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let userinfo = rest.split_once('@')?.0;
    Some(userinfo.split_once(':')?.1.to_owned())
}

/// Starts MiniShop's HTTP server on a free port over SQLite in `dir`;
/// returns the process and the address it listens on.
fn serve_http(dir: &std::path::Path) -> (Child, String) {
    serve_http_with(dir, &[], &[])
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
