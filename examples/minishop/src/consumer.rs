//! A module's inbox consumer, whichever broker carries the messages.

use outbox::nats::NatsConsumerHandle;
use outbox::rabbitmq::ConsumerHandle;
use outbox::receive::ConsumerStats;

/// A module's consumer: the library's `RabbitConsumer` or `NatsConsumer`,
/// into the module's SQLite, PostgreSQL or MySQL inbox.
#[derive(Debug)]
pub enum Consumer {
    /// Through RabbitMQ.
    Rabbit(ConsumerHandle),
    /// Through NATS JetStream: the handle and what it consumes (for humans).
    Nats(NatsConsumerHandle, String),
}

impl Consumer {
    /// What it consumes: a queue, partitions' prefix, or a stream's subjects.
    pub fn queue(&self) -> &str {
        match self {
            Consumer::Rabbit(h) => h.queue(),
            Consumer::Nats(_, what) => what,
        }
    }

    /// The queues it consumes now (a partitioned consumer: the partitions
    /// it owns, and those it took over).
    pub fn consuming(&self) -> Vec<String> {
        match self {
            Consumer::Rabbit(h) => h.consuming(),
            Consumer::Nats(h, what) => {
                let partitions = h.partitions();
                if !partitions.is_empty() {
                    partitions
                        .iter()
                        .map(|p| format!("partition {p}"))
                        .collect()
                } else if h.is_connected() {
                    vec![what.clone()]
                } else {
                    Vec::new()
                }
            }
        }
    }

    /// What it has done so far.
    pub fn stats(&self) -> ConsumerStats {
        match self {
            Consumer::Rabbit(h) => h.stats(),
            Consumer::Nats(h, _) => h.stats(),
        }
    }

    /// Whether it still runs.
    pub fn is_running(&self) -> bool {
        match self {
            Consumer::Rabbit(h) => h.is_running(),
            Consumer::Nats(h, _) => h.is_running(),
        }
    }

    /// Whether it is connected to the broker now.
    pub fn is_connected(&self) -> bool {
        match self {
            Consumer::Rabbit(h) => h.is_connected(),
            Consumer::Nats(h, _) => h.is_connected(),
        }
    }

    /// What it has done, for humans.
    pub fn describe(&self) -> String {
        let state = if self.is_connected() {
            "connected"
        } else {
            "NOT connected"
        };
        let s = self.stats();
        let consuming = self.consuming();
        // A partitioned consumer: which partitions it has now.
        let queues = if consuming.is_empty() || consuming == [self.queue()] {
            String::new()
        } else {
            format!(" (consuming now: {})", consuming.join(", "))
        };
        format!(
            "consumer of `{}`{queues}: {state}, handled {}, duplicates {}, retried {}, dead-lettered {}, store errors {}",
            self.queue(),
            s.handled,
            s.duplicates,
            s.retried,
            s.dead_lettered,
            s.store_errors
        )
    }

    /// Stops it.
    pub async fn shutdown(&self) {
        match self {
            Consumer::Rabbit(h) => h.shutdown().await,
            Consumer::Nats(h, _) => h.shutdown().await,
        }
    }
}
