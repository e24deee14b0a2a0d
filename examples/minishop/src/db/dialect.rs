//! The SQL dialects of the modules' databases: each module's tables per
//! dialect ([`Ddl`]), and the one statement text turned into each
//! dialect's ([`Dialect::sql`]).

use outbox::sqlite::sqlx;

/// A module's own tables, in each dialect (kept side by side: the only
/// SQL that is written once per dialect).
#[derive(Debug, Clone, Copy)]
pub struct Ddl {
    /// `CREATE TABLE IF NOT EXISTS …` for SQLite.
    pub sqlite: &'static [&'static str],
    /// `CREATE TABLE IF NOT EXISTS …` for PostgreSQL (in the module's schema).
    pub postgres: &'static [&'static str],
    /// `CREATE TABLE IF NOT EXISTS …` for MySQL/MariaDB (InnoDB, in the
    /// module's database).
    pub mysql: &'static [&'static str],
}

/// The SQL dialect of a module's database: what `with_conn!` and
/// `with_pool!` hand their body beside the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// SQLite.
    Sqlite,
    /// PostgreSQL.
    Postgres,
    /// MySQL or MariaDB.
    MySql,
}

impl Dialect {
    /// The statement `text`, written with `$1, $2, …` parameters (each once,
    /// in increasing order), as this dialect takes it: unchanged on SQLite
    /// and PostgreSQL, with `?` placeholders on MySQL
    /// ([`mysql_placeholders`]).
    ///
    /// # Panics
    ///
    /// If `text` breaks that rule (a mistake in the program's own SQL): on
    /// MySQL always, elsewhere in debug builds, so that the SQLite tests
    /// catch it too.
    pub fn sql(self, text: &'static str) -> sqlx::SqlStr {
        match self {
            Dialect::Sqlite | Dialect::Postgres => {
                #[cfg(debug_assertions)]
                mysql_placeholders(text);
                sqlx::SqlStr::from_static(text)
            }
            // The text is the program's own (`&'static`), only its
            // placeholders rewritten.
            Dialect::MySql => {
                sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(mysql_placeholders(text)))
            }
        }
    }
}

/// `text` with its `$1, $2, …` parameters as MySQL's `?`.
///
/// MySQL binds `?` placeholders by position, so this is right only when
/// each parameter appears once and in increasing order (`$1` … `$N`):
/// a statement that needs a value twice binds it twice (`$1` and `$3`).
/// `$` inside quoted strings or identifiers (`'…'`, `"…"`, `` `…` ``) is
/// left alone.
///
/// # Panics
///
/// If a parameter appears out of that order (naming it and the
/// statement): the modules' SQL is fixed text, so this is a programming
/// error that the first run of the statement reveals.
pub fn mysql_placeholders(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut expected = 1u32;
    let mut quote: Option<char> = None;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match quote {
            Some(q) => {
                if c == q {
                    quote = None;
                }
                out.push(c);
            }
            None if matches!(c, '\'' | '"' | '`') => {
                quote = Some(c);
                out.push(c);
            }
            None if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) => {
                let mut n = 0u32;
                while let Some(d) = chars.next_if(char::is_ascii_digit) {
                    n = n
                        .saturating_mul(10)
                        .saturating_add(d.to_digit(10).unwrap_or(0));
                }
                assert!(
                    n == expected,
                    "SQL parameter ${n} where ${expected} was expected: MiniShop's statements \
                     use each parameter once, in increasing order (MySQL binds `?` by position), \
                     in: {text}"
                );
                expected += 1;
                out.push('?');
            }
            None => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_become_question_marks_for_mysql_only() {
        assert_eq!(
            mysql_placeholders("UPDATE t SET a = $1, b = 'x$2' WHERE c = $2 AND d >= $3"),
            "UPDATE t SET a = ?, b = 'x$2' WHERE c = ? AND d >= ?"
        );
        let ten = (1..=10)
            .map(|i| format!("${i}"))
            .collect::<Vec<_>>()
            .join(", ");
        assert_eq!(mysql_placeholders(&ten), ["?"; 10].join(", "));
        assert_eq!(
            Dialect::MySql.sql("SELECT 1 WHERE a = $1").as_str(),
            "SELECT 1 WHERE a = ?"
        );
        assert_eq!(
            Dialect::Postgres.sql("SELECT 1 WHERE a = $1").as_str(),
            "SELECT 1 WHERE a = $1"
        );
        assert_eq!(
            Dialect::Sqlite.sql("SELECT $ FROM t").as_str(),
            "SELECT $ FROM t"
        );
        for bad in [
            "UPDATE t SET a = a - $1 WHERE b = $2 AND a >= $1",
            "SELECT 1 WHERE a = $2 AND b = $1",
        ] {
            let e = std::panic::catch_unwind(|| mysql_placeholders(bad)).unwrap_err();
            let text = e.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(
                text.contains("increasing order") && text.contains(bad),
                "{text}"
            );
        }
    }
}
