//! Helpers for authors of stores and transports. Using outbox-rs needs none
//! of them; a backend uses them so that every backend behaves alike.
//!
//! * [`purge_in_batches`] — delete old rows in small batches that rest
//!   between them, so writers are never starved (relay retention, inbox
//!   purges);
//! * [`audit_note`] — the `last_error` text an operator action leaves;
//! * [`Wakeup`] / [`WakeupListener`] — an in-process "something was
//!   committed" signal to build a [`WorkListener`](crate::WorkListener) from;
//! * [`redact_url`] — a connection URL with its password hidden, for
//!   `Debug`, logs and errors; [`password_of`] — that password, to scrub
//!   it from a driver's error texts;
//! * [`validate_table_name`], [`validate_schema_name`],
//!   [`MIGRATIONS_TABLE`] — the names of outbox tables, one set of rules
//!   valid on every store;
//! * [`some_names`] — the first few of a list of names for an error or a
//!   page, and how many more;
//! * [`OUTBOX_COLUMNS`], [`RowValues`], [`decode_row`] — the outbox row of
//!   every SQL store: its columns, a message encoded for an insert, a row
//!   decoded back tolerating corruption (only [`RowColumns`], reading one
//!   column, is the driver's).

pub use crate::error::{password_of, redact_url};
pub use crate::names::{
    MAX_SCHEMA_NAME_LEN, MAX_TABLE_NAME_LEN, MIGRATIONS_TABLE, some_names, unused_inbox_table,
    validate_schema_name, validate_table_name,
};
pub use crate::purge::{purge_in_batches, rest_after};
pub use crate::row::{
    DecodedRow, OUTBOX_COLUMNS, RowColumns, RowValues, decode_row, missing_outbox_columns,
};
pub use crate::store::{Wakeup, WakeupListener, audit_note};
