//! outbox-rs rabbitmq backend (work in progress).
