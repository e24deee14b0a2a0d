//! Fault tests of outbox-rs (work in progress).
