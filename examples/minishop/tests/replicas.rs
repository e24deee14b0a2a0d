//! MiniShop as several processes: one `--role ordering` process placing
//! orders and three `--role warehouse` replicas answering them, over
//! RabbitMQ (partitioned `OrderPlaced` queues) or NATS JetStream
//! (partitioned subjects) and PostgreSQL (one shared `warehouse` schema).
//! One replica is SIGKILLed mid-run and restarted.
//!
//! Needs RabbitMQ (`OUTBOX_AMQP_URL`, else the local default if it answers),
//! NATS (`OUTBOX_NATS_URL`, else `nats://127.0.0.1:4222` if it answers)
//! and PostgreSQL (`OUTBOX_PG_URL`, else `postgres://postgres@127.0.0.1:5432/test`
//! if it answers); otherwise it fails saying how to provide them. The run's
//! queues, exchanges, streams and schemas carry a suffix of its own
//! (`--run ID`) and are deleted afterwards.

mod summary;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use outbox::postgres::sqlx::{self, Connection as _, PgConnection};
use outbox_api::testing::service_url;
use summary::figure;

const BIN: &str = env!("CARGO_BIN_EXE_minishop");
const ORDERS: u64 = 300;
const REPLICAS: u16 = 3;
const PARTITIONS: u16 = 6;
/// The warehouse's initial stock (`warehouse::INITIAL_STOCK`).
const INITIAL_STOCK: &[(&str, i64)] = &[
    ("apple", 1_000_000),
    ("pear", 1_000_000),
    ("teapot", 40),
    ("golden-ticket", 10),
];
const DEADLINE: Duration = Duration::from_secs(120);

fn minishop(args: &[&str]) -> Child {
    Command::new(BIN)
        .args(args)
        .env_remove("OUTBOX_AMQP_URL")
        .env_remove("OUTBOX_NATS_URL")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start minishop")
}

/// A running minishop process whose output is collected by threads; its
/// stderr lines also arrive on `lines`, to wait for one.
struct Process {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    stdout: thread::JoinHandle<String>,
    stderr: thread::JoinHandle<String>,
}

struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Process {
    fn start(name: &str, args: &[&str]) -> Process {
        let mut child = minishop(args);
        let mut out = child.stdout.take().expect("piped stdout");
        let err = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        let stdout = thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let stderr = thread::spawn(move || {
            let mut all = String::new();
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line.clone());
                all.push_str(&line);
                all.push('\n');
            }
            all
        });
        Process {
            name: name.to_owned(),
            child,
            lines,
            stdout,
            stderr,
        }
    }

    /// Waits until a stderr line contains `needle`; fails at the deadline or
    /// if the process exits first.
    fn wait_for_line(&mut self, needle: &str) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(line) if line.contains(needle) => return,
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let f = self.finish(Duration::from_secs(10));
                    panic!(
                        "{} exited before saying `{needle}`: {:?}\n{}",
                        self.name, f.status, f.stderr
                    );
                }
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!("{} did not say `{needle}` within {DEADLINE:?}", self.name);
            }
        }
    }

    fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill {signal} {}", self.name);
    }

    /// Waits for the process to exit, killing it (and failing) after `limit`.
    fn finish(&mut self, limit: Duration) -> Finished {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("{} did not exit within {limit:?}", self.name);
            }
            thread::sleep(Duration::from_millis(10));
        };
        let join = |h: &mut thread::JoinHandle<String>| {
            std::mem::replace(h, thread::spawn(String::new))
                .join()
                .unwrap_or_default()
        };
        Finished {
            status,
            stdout: join(&mut self.stdout),
            stderr: join(&mut self.stderr),
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // A failed test leaves no process behind.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deletes the run's queues, exchanges and schemas when the test ends,
/// passed or failed.
struct Cleanup {
    broker: Broker,
    pg: String,
    run: String,
}

/// The broker a run goes through, by URL.
#[derive(Clone)]
enum Broker {
    Amqp(String),
    Nats(String),
}

impl Broker {
    fn flag(&self) -> [&str; 2] {
        match self {
            Broker::Amqp(url) => ["--amqp", url],
            Broker::Nats(url) => ["--nats", url],
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let run = &self.run;
        rt.block_on(async {
            match &self.broker {
                Broker::Amqp(url) => delete_amqp(url, run).await,
                Broker::Nats(url) => {
                    if let Ok(client) = outbox_nats::async_nats::connect(url.as_str()).await {
                        let js = outbox_nats::async_nats::jetstream::new(client);
                        for stream in [format!("MINISHOP_{run}"), format!("MINISHOP_DEAD_{run}")] {
                            let _ = js.delete_stream(&stream).await;
                        }
                    }
                }
            }
            if let Ok(mut db) = PgConnection::connect(&self.pg).await {
                for module in ["ordering", "warehouse"] {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                        r#"DROP SCHEMA IF EXISTS "{module}_run_{run}" CASCADE"#
                    )))
                    .execute(&mut db)
                    .await;
                }
                let _ = db.close().await;
            }
        });
    }
}

/// Deletes a RabbitMQ run's queues and exchanges.
async fn delete_amqp(url: &str, run: &str) {
    use outbox::rabbitmq::lapin::{Connection, ConnectionProperties};
    let Ok(conn) = Connection::connect(url, ConnectionProperties::default()).await else {
        return;
    };
    if let Ok(ch) = conn.create_channel().await {
        let mut queues: Vec<String> = (0..PARTITIONS)
            .flat_map(|p| {
                let q = format!("minishop.warehouse.run-{run}.{p}");
                [format!("{q}.owner"), q]
            })
            .collect();
        for q in ["ordering", "dead", "warehouse"] {
            queues.push(format!("minishop.{q}.run-{run}"));
        }
        for q in &queues {
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        for x in [
            format!("minishop.run-{run}"),
            format!("minishop.dlx.run-{run}"),
        ] {
            let _ = ch
                .exchange_delete(x.as_str().into(), Default::default())
                .await;
        }
    }
    let _ = conn.close(200, "test done".into()).await;
}

fn count(rt: &tokio::runtime::Runtime, db: &mut PgConnection, sql: &str) -> i64 {
    rt.block_on(sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned())).fetch_one(&mut *db))
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[test]
fn three_warehouse_replicas_answer_every_order_once_through_a_sigkill() {
    three_replicas_through_a_sigkill(Broker::Amqp(service_url(
        &outbox_rabbitmq::testing::RABBITMQ,
    )));
}

#[test]
fn three_warehouse_replicas_over_nats_answer_every_order_once_through_a_sigkill() {
    three_replicas_through_a_sigkill(Broker::Nats(service_url(&outbox_nats::testing::NATS)));
}

fn three_replicas_through_a_sigkill(broker: Broker) {
    let pg = service_url(&outbox_postgres::testing::POSTGRES);
    let run = format!(
        "t{:x}{}",
        std::process::id(),
        &uuid::Uuid::now_v7().simple().to_string()[20..]
    );
    let _cleanup = Cleanup {
        broker: broker.clone(),
        pg: pg.clone(),
        run: run.clone(),
    };
    let partitions = PARTITIONS.to_string();
    let replicas = REPLICAS.to_string();
    let [flag, url] = broker.flag();
    let common = [
        flag,
        url,
        "--postgres",
        &pg,
        "--run",
        &run,
        "--partitions",
        &partitions,
    ];
    let warehouse = |i: u16| {
        let index = i.to_string();
        let mut args = common.to_vec();
        args.extend(["--role", "warehouse", "--replica", &index]);
        args.extend(["--replicas", &replicas]);
        let mut p = Process::start(&format!("warehouse replica {i}"), &args);
        p.wait_for_line(&format!("replica {i} of {REPLICAS}"));
        p
    };
    let mut replicas_running: Vec<Process> = (0..REPLICAS).map(warehouse).collect();

    let orders = ORDERS.to_string();
    let mut args = common.to_vec();
    args.extend(["--role", "ordering", "--orders", &orders]);
    args.extend(["--rate", "150", "--timeout", "100s"]);
    let mut ordering = Process::start("ordering", &args);

    // Mid-run (a fifth of the orders answered), SIGKILL replica 1, then
    // start it again: its partitions are taken over meanwhile and handed
    // back, its relay's leases taken back by its successor.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut db = rt
        .block_on(PgConnection::connect(&pg))
        .expect("connect to PostgreSQL");
    let inbox = format!(r#""warehouse_run_{run}".warehouse_inbox"#);
    let deadline = Instant::now() + DEADLINE;
    loop {
        // The inbox table exists: the replicas created it before their banner.
        if count(&rt, &mut db, &format!("SELECT count(*) FROM {inbox}")) >= (ORDERS / 5) as i64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the warehouse answered too few orders in {DEADLINE:?}"
        );
        thread::sleep(Duration::from_millis(10));
    }
    replicas_running[1].signal("-KILL");
    let killed = replicas_running[1].finish(Duration::from_secs(30));
    assert!(!killed.status.success(), "{:?}", killed.status);
    replicas_running[1] = warehouse(1);

    let f = ordering.finish(Duration::from_secs(150));
    assert!(
        f.status.success(),
        "ordering exit {:?}\nstdout:\n{}\nstderr:\n{}",
        f.status,
        f.stdout,
        f.stderr
    );
    let confirmed = figure(&f.stdout, "confirmed");
    let cancelled = figure(&f.stdout, "cancelled");
    assert_eq!(confirmed + cancelled, ORDERS, "{}", f.stdout);
    assert!(confirmed > 0 && cancelled > 0, "{}", f.stdout);
    assert!(f.stdout.contains("partitions"), "{}", f.stdout);

    // Stop the replicas gracefully; each says what it handled.
    let mut handled = Vec::new();
    for (i, p) in replicas_running.iter_mut().enumerate() {
        p.signal("-INT");
        let r = p.finish(Duration::from_secs(30));
        assert!(
            r.status.success() && r.stderr.contains("MiniShop stopped."),
            "replica {i}: {:?}\n{}",
            r.status,
            r.stderr
        );
        assert!(!r.stderr.contains("panic"), "replica {i}:\n{}", r.stderr);
        handled.push(figure(&r.stdout.replace("handled", "\nhandled"), "handled"));
    }
    eprintln!(
        "{}\nhandled per replica (1 restarted after its SIGKILL): {handled:?}",
        f.stdout
    );
    // The replicas that were never killed consumed partitions of their own.
    assert!(
        handled[0] > 0 && handled[2] > 0,
        "handled per replica: {handled:?}"
    );

    // Every order decided once and consistently with the stock.
    let (o, w) = (
        format!(r#""ordering_run_{run}""#),
        format!(r#""warehouse_run_{run}""#),
    );
    let mut q = |sql: String| count(&rt, &mut db, &sql);
    let mut in_db = |status: &str| {
        q(format!(
            "SELECT count(*) FROM {o}.orders WHERE status = '{status}'"
        ))
    };
    assert_eq!(in_db("pending"), 0);
    assert_eq!(in_db("confirmed") as u64, confirmed);
    assert_eq!(in_db("cancelled") as u64, cancelled);
    assert_eq!(
        q(format!(
            "SELECT count(*) FROM {o}.orders WHERE status = 'confirmed' AND confirmed_at IS NULL"
        )),
        0,
        "every confirmation handled"
    );
    // One reservation per confirmed order, none for another.
    assert_eq!(
        q(format!("SELECT count(*) FROM {w}.reservations")) as u64,
        confirmed
    );
    assert_eq!(
        q(format!(
            "SELECT count(*) FROM {w}.reservations r JOIN {o}.orders o ON o.id = r.order_id COLLATE \"C\" WHERE o.status = 'confirmed' AND o.sku = r.sku AND o.qty = r.qty"
        )) as u64,
        confirmed
    );
    // No oversell: what left the stock is exactly what was reserved.
    for (sku, initial) in INITIAL_STOCK {
        let available = q(format!(
            "SELECT available FROM {w}.stock WHERE sku = '{sku}'"
        ));
        let reserved = q(format!(
            "SELECT COALESCE(SUM(qty), 0)::BIGINT FROM {w}.reservations WHERE sku = '{sku}'"
        ));
        assert!(available >= 0, "{sku}: {available}");
        assert_eq!(initial - available, reserved, "{sku}");
    }
    // Each order answered exactly once, each OrderPlaced handled once.
    assert_eq!(
        q(format!("SELECT count(*) FROM {w}.warehouse_outbox")) as u64,
        ORDERS
    );
    assert_eq!(
        q(format!(
            "SELECT count(DISTINCT key) FROM {w}.warehouse_outbox"
        )) as u64,
        ORDERS
    );
    assert_eq!(
        q(format!(
            "SELECT count(*) FROM {w}.warehouse_outbox WHERE state <> 'processed'"
        )),
        0
    );
    assert_eq!(
        q(format!("SELECT count(*) FROM {w}.warehouse_inbox")) as u64,
        ORDERS
    );
    assert_eq!(
        q(format!("SELECT count(*) FROM {o}.ordering_inbox")) as u64,
        ORDERS
    );
    rt.block_on(db.close()).unwrap();
}

#[test]
fn role_flags_are_checked_naming_the_missing_one() {
    let pg = "postgres://postgres@127.0.0.1:1/none";
    let amqp = "amqp://guest:guest@127.0.0.1:1/%2f";
    for (args, needle) in [
        (vec!["--role", "warehouse"], "--role warehouse needs --amqp"),
        (
            vec!["--role", "ordering", "--amqp", amqp],
            "--role ordering needs --postgres",
        ),
        (
            vec![
                "--role",
                "warehouse",
                "--amqp",
                amqp,
                "--postgres",
                pg,
                "--replica",
                "3",
                "--replicas",
                "3",
            ],
            "--replica must be 0 to --replicas - 1",
        ),
        (
            vec![
                "--role",
                "warehouse",
                "--amqp",
                amqp,
                "--postgres",
                pg,
                "--orders",
                "5",
            ],
            "--orders needs --role all or ordering",
        ),
        (
            vec![
                "--role",
                "ordering",
                "--amqp",
                amqp,
                "--postgres",
                pg,
                "--isolated",
            ],
            "--run ID",
        ),
        // MySQL serves the replicas as PostgreSQL does: past the database
        // check, to the next flag's.
        (
            vec![
                "--role",
                "warehouse",
                "--amqp",
                amqp,
                "--mysql",
                "mysql://root@127.0.0.1:1/none",
                "--replica",
                "3",
                "--replicas",
                "3",
            ],
            "--replica must be 0 to --replicas - 1",
        ),
        (vec!["--replicas", "2"], "--replicas needs --role warehouse"),
    ] {
        let mut p = Process::start("minishop", &args);
        let f = p.finish(Duration::from_secs(30));
        assert!(!f.status.success(), "{args:?} succeeded");
        assert!(
            f.stderr.contains(needle),
            "{args:?}: want `{needle}` in:\n{}",
            f.stderr
        );
    }
}
