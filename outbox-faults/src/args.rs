//! The child relay's command line.

use std::path::PathBuf;
use std::time::Duration;

/// What a `relay-child` process is told: where the databases are, who it
/// is, and how its relay is configured. [`to_args`](Self::to_args) and
/// [`parse`](Self::parse) are inverses.
#[derive(Debug, Clone)]
pub struct ChildArgs {
    /// The SQLite file holding the outbox table (`outbox`).
    pub outbox_db: PathBuf,
    /// The SQLite file holding the receiver's tables (may equal `outbox_db`).
    pub receiver_db: PathBuf,
    /// The relay's worker id (`locked_by`), also recorded with each effect.
    pub worker: String,
    /// Messages claimed at once.
    pub batch_size: usize,
    /// The lease of each claim.
    pub lease: Duration,
    /// The relay's handler timeout (must be shorter than the lease).
    pub handler_timeout: Duration,
    /// The relay's poll interval (expired leases are found by polling).
    pub poll_interval: Duration,
    /// How long the handler sleeps before its receiver transaction, to keep
    /// leases held (takeover test).
    pub handler_delay: Duration,
    /// Handlers running at once within a batch.
    pub concurrency: usize,
    /// The inbox consumer name.
    pub consumer: String,
    /// On PostgreSQL instead of SQLite: the schema holding the outbox
    /// (table `outbox`) and the receiver's tables. The database URL is not
    /// an argument (it may hold a password): the child reads it from
    /// [`PG_URL_VARIABLE`], which [`RelayChild::spawn_postgres`](crate::RelayChild::spawn_postgres) sets.
    pub pg_schema: Option<String>,
    /// On PostgreSQL, with more than 0: a fleet over the schemas
    /// `<pg_schema>_0` … `<pg_schema>_<n-1>` (each with the outbox and the
    /// receiver's tables), one pool and one `LISTEN` connection, instead of
    /// one relay over `pg_schema`.
    pub pg_tenants: usize,
    /// On MySQL/MariaDB instead of SQLite: the prefix of the outbox table
    /// (`<prefix>_outbox`) and the receiver's tables. The database URL is
    /// read from [`MYSQL_URL_VARIABLE`], which
    /// [`RelayChild::spawn_mysql`](crate::RelayChild::spawn_mysql) sets.
    pub mysql_prefix: Option<String>,
}

/// The variable a `relay-child` on PostgreSQL reads its database URL from.
pub const PG_URL_VARIABLE: &str = "OUTBOX_FAULTS_PG_URL";

/// The variable a `relay-child` on MySQL/MariaDB reads its database URL from.
pub const MYSQL_URL_VARIABLE: &str = "OUTBOX_FAULTS_MYSQL_URL";

impl ChildArgs {
    /// Defaults for a quick child: batch 50, lease 1 s, handler timeout
    /// 800 ms, poll 50 ms, no handler delay, concurrency 16, consumer `faults`.
    pub fn new(
        outbox_db: impl Into<PathBuf>,
        receiver_db: impl Into<PathBuf>,
        worker: impl Into<String>,
    ) -> Self {
        ChildArgs {
            outbox_db: outbox_db.into(),
            receiver_db: receiver_db.into(),
            worker: worker.into(),
            batch_size: 50,
            lease: Duration::from_millis(1000),
            handler_timeout: Duration::from_millis(800),
            poll_interval: Duration::from_millis(50),
            handler_delay: Duration::ZERO,
            concurrency: 16,
            consumer: "faults".to_owned(),
            pg_schema: None,
            pg_tenants: 0,
            mysql_prefix: None,
        }
    }

    /// Defaults as [`new`](Self::new), on PostgreSQL: outbox and receiver
    /// tables in `schema`.
    pub fn postgres(schema: impl Into<String>, worker: impl Into<String>) -> Self {
        let mut a = ChildArgs::new("", "", worker);
        a.pg_schema = Some(schema.into());
        a
    }

    /// Defaults as [`new`](Self::new), on MySQL/MariaDB: outbox and
    /// receiver tables named `<prefix>_…`.
    pub fn mysql(prefix: impl Into<String>, worker: impl Into<String>) -> Self {
        let mut a = ChildArgs::new("", "", worker);
        a.mysql_prefix = Some(prefix.into());
        a
    }

    /// The command-line arguments that [`parse`](Self::parse) reads back.
    pub fn to_args(&self) -> Vec<String> {
        let ms = |d: Duration| d.as_millis().to_string();
        let mut args: Vec<String> = vec![
            "--outbox-db".into(),
            self.outbox_db.display().to_string(),
            "--receiver-db".into(),
            self.receiver_db.display().to_string(),
            "--worker".into(),
            self.worker.clone(),
            "--batch".into(),
            self.batch_size.to_string(),
            "--lease-ms".into(),
            ms(self.lease),
            "--handler-timeout-ms".into(),
            ms(self.handler_timeout),
            "--poll-ms".into(),
            ms(self.poll_interval),
            "--handler-delay-ms".into(),
            ms(self.handler_delay),
            "--concurrency".into(),
            self.concurrency.to_string(),
            "--consumer".into(),
            self.consumer.clone(),
        ];
        if let Some(schema) = &self.pg_schema {
            args.extend(["--pg-schema".into(), schema.clone()]);
        }
        if self.pg_tenants > 0 {
            args.extend(["--pg-tenants".into(), self.pg_tenants.to_string()]);
        }
        if let Some(prefix) = &self.mysql_prefix {
            args.extend(["--mysql-prefix".into(), prefix.clone()]);
        }
        args
    }

    /// Parses `--name value` pairs; every option of [`to_args`](Self::to_args)
    /// is optional except the worker id and the databases (the two SQLite
    /// files, or the PostgreSQL schema).
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Self, String> {
        let mut a = ChildArgs::new("", "", "");
        let mut it = args.into_iter();
        while let Some(name) = it.next() {
            let value = it
                .next()
                .ok_or_else(|| format!("option `{name}` needs a value"))?;
            let num = |v: &str| -> Result<u64, String> {
                v.parse::<u64>()
                    .map_err(|e| format!("option `{name}`: `{v}` is not a number: {e}"))
            };
            match name.as_str() {
                "--outbox-db" => a.outbox_db = value.into(),
                "--receiver-db" => a.receiver_db = value.into(),
                "--worker" => a.worker = value,
                "--batch" => a.batch_size = num(&value)? as usize,
                "--lease-ms" => a.lease = Duration::from_millis(num(&value)?),
                "--handler-timeout-ms" => a.handler_timeout = Duration::from_millis(num(&value)?),
                "--poll-ms" => a.poll_interval = Duration::from_millis(num(&value)?),
                "--handler-delay-ms" => a.handler_delay = Duration::from_millis(num(&value)?),
                "--concurrency" => a.concurrency = num(&value)? as usize,
                "--consumer" => a.consumer = value,
                "--pg-schema" => a.pg_schema = Some(value),
                "--pg-tenants" => a.pg_tenants = num(&value)? as usize,
                "--mysql-prefix" => a.mysql_prefix = Some(value),
                other => return Err(format!("unknown option `{other}`")),
            }
        }
        let server = a.pg_schema.is_some() || a.mysql_prefix.is_some();
        if a.pg_schema.is_some() && a.mysql_prefix.is_some() {
            return Err("`--pg-schema` and `--mysql-prefix` exclude each other".into());
        }
        if !server && a.outbox_db.as_os_str().is_empty() {
            return Err(
                "`--outbox-db PATH` (or `--pg-schema NAME`, or `--mysql-prefix NAME`) is required"
                    .into(),
            );
        }
        if !server && a.receiver_db.as_os_str().is_empty() {
            return Err(
                "`--receiver-db PATH` (or `--pg-schema NAME`, or `--mysql-prefix NAME`) is required"
                    .into(),
            );
        }
        if a.pg_tenants > 0 && a.pg_schema.is_none() {
            return Err("`--pg-tenants N` needs `--pg-schema PREFIX`".into());
        }
        if a.worker.is_empty() {
            return Err("`--worker ID` is required".into());
        }
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_round_trip() {
        let mut a = ChildArgs::new("/tmp/a.db", "/tmp/b.db", "w1");
        a.handler_delay = Duration::from_millis(1234);
        a.batch_size = 7;
        let b = ChildArgs::parse(a.to_args()).unwrap();
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert!(ChildArgs::parse(vec!["--worker".into(), "x".into()]).is_err());
        let p = ChildArgs::postgres("faults_1", "w2");
        let q = ChildArgs::parse(p.to_args()).unwrap();
        assert_eq!(q.pg_schema.as_deref(), Some("faults_1"));
        assert_eq!(format!("{p:?}"), format!("{q:?}"));
        let m = ChildArgs::mysql("faults_my", "w4");
        let n = ChildArgs::parse(m.to_args()).unwrap();
        assert_eq!(format!("{m:?}"), format!("{n:?}"));
        let mut f = ChildArgs::postgres("faults_fleet", "w3");
        f.pg_tenants = 100;
        let g = ChildArgs::parse(f.to_args()).unwrap();
        assert_eq!(format!("{f:?}"), format!("{g:?}"));
        let e = ChildArgs::parse(
            [
                "--worker",
                "w",
                "--outbox-db",
                "a",
                "--receiver-db",
                "b",
                "--pg-tenants",
                "3",
            ]
            .map(String::from),
        )
        .unwrap_err();
        assert!(e.contains("--pg-schema"), "{e}");
    }
}
