//! Many tenants, one relay process: a small invoicing service that keeps
//! each tenant in a PostgreSQL schema or a SQLite file of its own, and
//! relays every tenant's outbox from one [`Fleet`].
//!
//! ```text
//! cargo run --example tenants                                   # SQLite files in a temporary directory
//! cargo run --example tenants -- --postgres postgres://postgres@127.0.0.1:5432/test
//! cargo run --example tenants -- --tenants 200 --invoices 5000  # more of each
//! ```
//!
//! Each invoice is a row in its tenant's `invoices` table and an
//! `InvoiceIssued` message in its tenant's outbox, committed in one
//! transaction; the fleet's handler for that tenant marks the invoice sent,
//! in the tenant's own database. Invoices are spread over the tenants at
//! random. The fleet follows the application's register of tenants
//! ([`Fleet::discover`]): while invoices are relayed a tenant signs up and
//! joins the fleet, and another is suspended and leaves it (its invoices
//! wait in its store until it is signed up again). At
//! the end the example checks that every invoice was sent exactly once,
//! prints what the fleet cost (connections on PostgreSQL, files open on
//! SQLite) and exits 1 if anything is missing.
//!
//! On PostgreSQL the tenants' stores share four pools of two connections,
//! each tenant pinned to one ([`PgTenantPools`]), one `LISTEN` connection
//! and one commit watcher's ([`PgSharedListener`]); on SQLite their files are opened on
//! demand, at most 16 at once, and closed when idle ([`SqliteFiles`]). Its
//! schemas (`tenants_example_<pid>_<i>`) or files are dropped at the end.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox::{Catalogue, Fleet, Handlers, Message, MessageKind, NewMessage, Relay, RelayBuilder};
use outbox_postgres::sqlx::{self, AssertSqlSafe, PgPool};
use outbox_postgres::{PgSharedListener, PgStore, PgTenantPools};
use outbox_sqlite::sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use outbox_sqlite::sqlx::{SqlitePool, query as sqlite_query};
use outbox_sqlite::{SqliteFiles, SqliteStore};

type Failure = Box<dyn std::error::Error + Send + Sync>;

/// The example's settings, from its command line.
struct Args {
    tenants: usize,
    invoices: usize,
    postgres: Option<String>,
}

fn args() -> Result<Args, Failure> {
    let mut a = Args {
        tenants: 50,
        invoices: 2_000,
        postgres: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value (see the example's docs)"))
        };
        match flag.as_str() {
            "--tenants" => {
                a.tenants = value("--tenants")?
                    .parse()
                    .map_err(|_| "--tenants: not a number")?
            }
            "--invoices" => {
                a.invoices = value("--invoices")?
                    .parse()
                    .map_err(|_| "--invoices: not a number")?
            }
            "--postgres" => a.postgres = Some(value("--postgres")?),
            other => {
                return Err(format!("unknown argument `{other}` (see the example's docs)").into());
            }
        }
    }
    if a.tenants < 2 {
        return Err("--tenants: at least 2 (one of them leaves and comes back)".into());
    }
    Ok(a)
}

/// One tenant's database: where its invoices are and how to reach them.
#[derive(Clone)]
enum TenantDb {
    Postgres {
        pool: PgPool,
        schema: String,
        store: PgStore,
    },
    Sqlite {
        pool: SqlitePool,
        store: SqliteStore,
    },
}

impl TenantDb {
    /// A relay over this tenant's outbox whose handler marks the invoice
    /// sent in the tenant's own `invoices` table, once (a redelivery
    /// changes nothing).
    fn relay(&self, sent: Arc<AtomicU64>) -> RelayBuilder {
        let db = self.clone();
        let handlers = Handlers::new().on_message("InvoiceIssued", move |m: &Message| {
            let (db, sent) = (db.clone(), sent.clone());
            let id = String::from_utf8_lossy(&m.payload).into_owned();
            async move {
                let marked = db.mark_sent(&id).await?;
                sent.fetch_add(marked, Ordering::Relaxed);
                Ok::<_, Failure>(())
            }
        });
        let builder = match self {
            TenantDb::Postgres { store, .. } => Relay::builder(store.clone()),
            TenantDb::Sqlite { store, .. } => Relay::builder(store.clone()),
        };
        builder.dispatcher(handlers)
    }

    async fn mark_sent(&self, id: &str) -> Result<u64, Failure> {
        Ok(match self {
            TenantDb::Postgres { pool, schema, .. } => sqlx::query(AssertSqlSafe(format!(
                r#"UPDATE "{schema}".invoices SET sent = sent + 1 WHERE id = $1 AND sent = 0"#
            )))
            .bind(id)
            .execute(pool)
            .await?
            .rows_affected(),
            TenantDb::Sqlite { pool, .. } => {
                sqlite_query("UPDATE invoices SET sent = sent + 1 WHERE id = ?1 AND sent = 0")
                    .bind(id)
                    .execute(pool)
                    .await?
                    .rows_affected()
            }
        })
    }

    /// Issues invoice `id`: its row and its message, one transaction.
    async fn issue(&self, id: &str, cents: i64) -> Result<(), Failure> {
        let message = NewMessage::new(MessageKind::Domain, "InvoiceIssued", id.as_bytes().to_vec());
        match self {
            TenantDb::Postgres {
                pool,
                schema,
                store,
            } => {
                let mut tx = pool.begin().await?;
                sqlx::query(AssertSqlSafe(format!(
                    r#"INSERT INTO "{schema}".invoices (id, cents, sent) VALUES ($1, $2, 0)"#
                )))
                .bind(id)
                .bind(cents)
                .execute(&mut *tx)
                .await?;
                store.outbox().enqueue(&mut tx, message).await?;
                tx.commit().await?;
            }
            TenantDb::Sqlite { pool, store } => {
                let mut tx = pool.begin().await?;
                sqlite_query("INSERT INTO invoices (id, cents, sent) VALUES (?1, ?2, 0)")
                    .bind(id)
                    .bind(cents)
                    .execute(&mut *tx)
                    .await?;
                store.outbox().enqueue(&mut *tx, message).await?;
                tx.commit().await?;
            }
        }
        Ok(())
    }

    /// Invoices issued and invoices sent (each counted once; one sent
    /// twice would show as more than 1 in `sent`).
    async fn counts(&self) -> Result<(i64, i64, i64), Failure> {
        const Q: &str = "SELECT COUNT(*), COALESCE(SUM(CASE WHEN sent >= 1 THEN 1 ELSE 0 END), 0), \
            COALESCE(MAX(sent), 0) FROM ";
        Ok(match self {
            TenantDb::Postgres { pool, schema, .. } => {
                sqlx::query_as(AssertSqlSafe(format!(r#"{Q}"{schema}".invoices"#)))
                    .fetch_one(pool)
                    .await?
            }
            TenantDb::Sqlite { pool, .. } => {
                outbox_sqlite::sqlx::query_as(AssertSqlSafe(format!("{Q}invoices")))
                    .fetch_one(pool)
                    .await?
            }
        })
    }
}

/// The application's register of tenants, which the fleet follows
/// ([`Catalogue`]): a tenant signed up is relayed as `tenant-<i>`.
struct Register {
    tenants: Arc<Vec<TenantDb>>,
    signed_up: Mutex<BTreeSet<usize>>,
    sent: Arc<AtomicU64>,
}

impl Register {
    fn sign_up(&self, i: usize) {
        self.signed_up.lock().unwrap().insert(i);
    }

    fn suspend(&self, i: usize) {
        self.signed_up.lock().unwrap().remove(&i);
    }
}

#[async_trait::async_trait]
impl Catalogue for Register {
    async fn outboxes(&self) -> outbox::Result<BTreeSet<String>> {
        let signed_up = self.signed_up.lock().unwrap();
        Ok(signed_up.iter().map(|i| format!("tenant-{i}")).collect())
    }

    async fn relay(&self, name: &str) -> outbox::Result<RelayBuilder> {
        let tenant = name
            .strip_prefix("tenant-")
            .and_then(|i| i.parse::<usize>().ok())
            .and_then(|i| self.tenants.get(i))
            .ok_or_else(|| outbox::Error::invalid_input(format!("no tenant `{name}`")))?;
        Ok(tenant.relay(self.sent.clone()))
    }
}

/// Tenant `i`'s schema: this run's own (the process id in it), dropped at
/// the end.
fn schema(i: usize) -> String {
    format!("tenants_example_{}_{i}", std::process::id())
}

/// Every tenant on PostgreSQL: a schema each; for the stores, four small
/// pools (each tenant pinned to one, its statements kept prepared there),
/// a bulk pool for the large statements of tenants with a backlog, and one
/// `LISTEN` connection and one commit watcher's for all of them; for the
/// application's own statements, a pool of its own.
async fn postgres_tenants(url: &str, n: usize) -> Result<(Vec<TenantDb>, PgPool), Failure> {
    let pools = PgTenantPools::connect(url.parse()?, 4, 2)
        .await?
        .with_bulk_pool(1)?;
    let shared = PgSharedListener::new(&pools.pools()[0]);
    let app = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await?;
    let mut tenants = Vec::with_capacity(n);
    for i in 0..n {
        let schema = schema(i);
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"DROP SCHEMA IF EXISTS "{schema}" CASCADE;
               CREATE SCHEMA "{schema}";
               CREATE TABLE "{schema}".invoices (id text PRIMARY KEY, cents int8 NOT NULL, sent int8 NOT NULL)"#
        )))
        .execute(&app)
        .await?;
        let store = pools
            .builder(&schema)
            .schema(&schema)
            .listen_through(&shared)
            .connect()
            .await?;
        store.migrate().await?;
        tenants.push(TenantDb::Postgres {
            pool: app.clone(),
            schema,
            store,
        });
    }
    Ok((tenants, app))
}

/// Every tenant on SQLite: a file each in `dir`, the stores' connections
/// opened on demand through `files`.
async fn sqlite_tenants(
    dir: &std::path::Path,
    n: usize,
    files: &SqliteFiles,
) -> Result<Vec<TenantDb>, Failure> {
    let mut tenants = Vec::with_capacity(n);
    for i in 0..n {
        let path = dir.join(format!("tenant-{i}.db"));
        let store = SqliteStore::builder(&path)
            .open_through(files)
            .connect()
            .await?;
        store.migrate().await?;
        // The application's own connection to the file, closed when idle
        // too: a tenant file costs nothing while nobody uses it.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .idle_timeout(Duration::from_secs(1))
            .connect_with(SqliteConnectOptions::new().filename(&path))
            .await?;
        sqlite_query("CREATE TABLE invoices (id TEXT PRIMARY KEY, cents INTEGER NOT NULL, sent INTEGER NOT NULL)")
            .execute(&pool)
            .await?;
        tenants.push(TenantDb::Sqlite { pool, store });
    }
    Ok(tenants)
}

async fn run(a: Args) -> Result<bool, Failure> {
    let dir = tempfile::tempdir()?;
    let files = SqliteFiles::new(16, Duration::from_secs(2))?;
    let (tenants, pg) = match &a.postgres {
        Some(url) => {
            let (t, pool) = postgres_tenants(url, a.tenants).await?;
            (t, Some(pool))
        }
        None => (sqlite_tenants(dir.path(), a.tenants, &files).await?, None),
    };
    let where_ = match &a.postgres {
        Some(_) => format!(
            "{} PostgreSQL schemas (`tenants_example_<pid>_<i>`)",
            a.tenants
        ),
        None => format!("{} SQLite files in {}", a.tenants, dir.path().display()),
    };
    println!("tenants: {where_}, {} invoices", a.invoices);

    // One fleet follows the application's register of tenants: every
    // tenant but the last is signed up now; the last signs up later.
    let fleet = Fleet::builder()
        .worker_id(format!("tenants-example-{}", std::process::id()))
        .concurrency(32)
        .build()?;
    let sent = Arc::new(AtomicU64::new(0));
    let late = a.tenants - 1;
    let tenants = Arc::new(tenants);
    let register = Arc::new(Register {
        tenants: tenants.clone(),
        signed_up: Mutex::new((0..late).collect()),
        sent: sent.clone(),
    });
    let discovery = fleet.discover(register.clone(), Duration::from_secs(60))?;
    discovery.refresh().await?;

    // The application: 8 writers issue the invoices, each to a tenant
    // drawn at random.
    let started = Instant::now();
    let issued_so_far = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..8)
        .map(|_| {
            let (issued, tenants, total) =
                (issued_so_far.clone(), tenants.clone(), a.invoices as u64);
            tokio::spawn(async move {
                loop {
                    let n = issued.fetch_add(1, Ordering::Relaxed);
                    if n >= total {
                        return Ok::<_, Failure>(());
                    }
                    let tenant = fastrand::usize(..tenants.len());
                    tenants[tenant]
                        .issue(&format!("inv-{tenant}-{n}"), fastrand::i64(100..100_000))
                        .await?;
                }
            })
        })
        .collect();
    let progress = |share: u64| {
        let issued = issued_so_far.clone();
        let at = a.invoices as u64 * share / 3;
        async move {
            while issued.load(Ordering::Relaxed) < at {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    progress(1).await;
    // A tenant signs up and another is suspended for a while: the register
    // changes, and the fleet reads it at once rather than at its next
    // reading. The new tenant's invoices issued so far are relayed; the
    // suspended one's relay stops and what it had not sent waits in its
    // store.
    register.sign_up(late);
    register.suspend(0);
    let changed = discovery.refresh().await?;
    println!(
        "register read again: joined {:?}, left {:?}",
        changed.added, changed.removed
    );
    progress(2).await;
    register.sign_up(0);
    discovery.refresh().await?;
    for w in writers {
        w.await??;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while sent.load(Ordering::Relaxed) < a.invoices as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    fleet.until_idle().await?;
    let health = fleet.health().await;

    let (mut issued, mut delivered, mut most) = (0, 0, 0);
    for t in tenants.iter() {
        let (i, s, m) = t.counts().await?;
        (issued, delivered, most) = (issued + i, delivered + s, most.max(m));
    }
    let cost = match &pg {
        Some(pool) => {
            let held: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()",
            )
            .fetch_one(pool)
            .await?;
            format!(
                "{held} connections to the database (for every tenant's store, at most four pools of 2, one LISTEN and one commit watcher; the application's own pool, at most 4)"
            )
        }
        None => format!(
            "{} store files open now, at most {} at once",
            files.open(),
            files.max_open()
        ),
    };
    println!(
        "sent {delivered} of {issued} invoices in {:.2} s ({:.0}/s) across {} tenants; each sent at most {most} time(s)",
        elapsed.as_secs_f64(),
        delivered as f64 / elapsed.as_secs_f64(),
        fleet.len()
    );
    println!("fleet health: {:?}; {cost}", health.status);
    discovery.stop();
    fleet.shutdown().await;
    if let Some(pool) = &pg {
        for i in 0..a.tenants {
            sqlx::raw_sql(AssertSqlSafe(format!(
                r#"DROP SCHEMA IF EXISTS "{}" CASCADE"#,
                schema(i)
            )))
            .execute(pool)
            .await?;
        }
    }
    let ok = issued == a.invoices as i64 && delivered == issued && most == 1;
    if !ok {
        eprintln!("tenants: not every invoice was sent exactly once");
    }
    Ok(ok)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let result = match args() {
        Ok(a) => run(a).await,
        Err(e) => Err(e),
    };
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("tenants: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
