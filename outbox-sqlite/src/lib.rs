//! outbox-rs sqlite backend (work in progress).
