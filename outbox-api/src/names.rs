//! The names of outbox tables: one set of rules valid on every store, so
//! that a name accepted on SQLite is accepted on PostgreSQL too (and an
//! operator types it unquoted in `sqlite3` and `psql` alike).

use crate::{Error, Result};

/// The table every SQL store records applied migrations in, beside the
/// outbox and inbox tables (a name no outbox or inbox table may take).
pub const MIGRATIONS_TABLE: &str = "outbox_schema_versions";

/// Longest table name: the longest name a store derives from it
/// (`<table>_processed_idx`) must fit PostgreSQL's 63 bytes.
pub const MAX_TABLE_NAME_LEN: usize = 48;

/// Longest schema name (PostgreSQL's identifier limit).
pub const MAX_SCHEMA_NAME_LEN: usize = 63;

/// Checks an outbox or inbox table name (`field` names the setting in the
/// error): `[a-z_][a-z0-9_]*`, at most [`MAX_TABLE_NAME_LEN`] bytes, not
/// [`MIGRATIONS_TABLE`], not starting with `pg_` or `sqlite_` (reserved by
/// the databases). Spliced into SQL, such a name needs no quoting.
pub fn validate_table_name(field: &str, name: &str) -> Result<()> {
    validate_identifier(field, "table", name, MAX_TABLE_NAME_LEN)?;
    if name == MIGRATIONS_TABLE {
        return Err(Error::config(
            field,
            format!("table name `{name}` is reserved (the stores' migrations table)"),
        ));
    }
    Ok(())
}

/// The inbox table name a store opened only to read its outbox (an
/// operator's `connect_existing`) is given when the configured one equals
/// `table`: the store never touches its inbox, but its names must differ.
/// `outbox_inbox` (every store's default inbox), or `outbox` when `table`
/// is that; neither ends in `_keys`, which MySQL's key-lock table takes.
pub fn unused_inbox_table(table: &str) -> &'static str {
    if table == "outbox_inbox" {
        "outbox"
    } else {
        "outbox_inbox"
    }
}

/// Checks a PostgreSQL schema name by the same rules, at most
/// [`MAX_SCHEMA_NAME_LEN`] bytes, not `information_schema`.
pub fn validate_schema_name(field: &str, name: &str) -> Result<()> {
    validate_identifier(field, "schema", name, MAX_SCHEMA_NAME_LEN)?;
    if name == "information_schema" {
        return Err(Error::config(
            field,
            "schema name `information_schema` is reserved",
        ));
    }
    Ok(())
}

fn validate_identifier(field: &str, what: &str, name: &str, max: usize) -> Result<()> {
    let mut chars = name.chars();
    let ok_first = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let ok_rest = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !ok_first || !ok_rest {
        return Err(Error::config(
            field,
            format!(
                "{what} name `{}` is not a valid identifier (lower-case letters, digits and `_`, not starting with a digit)",
                name.escape_debug()
            ),
        ));
    }
    if name.len() > max {
        return Err(Error::config(
            field,
            format!(
                "{what} name `{name}` is {} characters long; at most {max} are allowed",
                name.len()
            ),
        ));
    }
    for prefix in ["pg_", "sqlite_"] {
        if name.starts_with(prefix) {
            return Err(Error::config(
                field,
                format!(
                    "{what} name `{name}` is reserved (the `{prefix}` prefix belongs to the database)"
                ),
            ));
        }
    }
    Ok(())
}

/// The first `max` of `names`, comma-separated, then ` and N more`: how an
/// error or a page names what there is without listing a thousand tenants.
pub fn some_names<S: AsRef<str>>(names: &[S], max: usize) -> String {
    let mut text = names
        .iter()
        .take(max)
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > max {
        text.push_str(&format!(" and {} more", names.len() - max));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_set_of_names_for_every_store() {
        for ok in ["outbox", "_x", "orders_outbox2", &"a".repeat(48)] {
            validate_table_name("table", ok).unwrap();
        }
        for bad in [
            "",
            "1abc",
            "x; DROP TABLE y",
            "a-b",
            "ü",
            "Orders",
            "pg_thing",
            "sqlite_master",
            MIGRATIONS_TABLE,
            "x\"y",
            &"a".repeat(49),
        ] {
            let err = validate_table_name("table", bad).unwrap_err();
            assert_eq!(err.kind(), crate::ErrorKind::Config, "{bad}: {err}");
            assert!(err.to_string().contains("`table`"), "{err}");
        }
        validate_schema_name("schema", &"s".repeat(63)).unwrap();
        for bad in ["", "pg_catalog", "information_schema", "a b", "S"] {
            let err = validate_schema_name("schema", bad).unwrap_err();
            assert!(err.to_string().contains("`schema`"), "{bad}: {err}");
        }
    }
}
