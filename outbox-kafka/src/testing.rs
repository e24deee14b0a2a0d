//! Test helpers (feature `testing`): the broker's address from the
//! environment, topic names no other test uses, creating topics and
//! reading them back.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message as _};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// The Kafka broker the tests use: `OUTBOX_KAFKA_URL` (`host:port`), else
/// the local default `127.0.0.1:9092` if it answers (`scripts/services`
/// starts a `tansu` broker there). No container step: this crate does not
/// enable `outbox-api/containers`, so a missing broker fails the test
/// saying how to start one.
pub const KAFKA: outbox_api::testing::ServiceSpec = outbox_api::testing::ServiceSpec {
    name: "Kafka",
    variable: crate::URL_ENV,
    local_url: "127.0.0.1:9092",
    local_addr: ([127, 0, 0, 1], 9092),
    setup: "a Kafka-protocol broker: `bash scripts/services` installs and starts tansu \
            (`cargo install tansu --version 0.6.0 --no-default-features --features libsql`)",
    container: outbox_api::testing::ContainerSpec {
        image_variable: "OUTBOX_KAFKA_IMAGE",
        image: "apache/kafka:3.9.0",
        port: 9092,
        extra_ports: 0,
        env: &[],
        cmd: &[],
        ready: "Kafka Server started",
        url: "{host}:{port}",
    },
};

/// The broker for a test ([`KAFKA`]).
///
/// # Panics
/// When there is none (tests that need a broker fail, never skip), with a
/// message saying how to provide one.
pub fn kafka_url() -> String {
    outbox_api::testing::service_url(&KAFKA)
}

/// A topic name no other test uses: `t.{prefix}.{uuid v7 without dashes}`.
pub fn unique_topic(prefix: &str) -> String {
    format!(
        "t.{prefix}.{}",
        outbox_api::MessageId::new().to_string().replace('-', "")
    )
}

/// Creates `topic` with `partitions` partitions (replication 1) on the
/// brokers `bootstrap`, and waits until its metadata shows them.
///
/// # Panics
/// When the broker refuses, or the topic does not show within 30 s.
pub async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("an admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("the CreateTopics request");
    for r in results {
        if let Err((name, code)) = r {
            panic!("creating topic {name}: {code:?}");
        }
    }
    let (bootstrap, name) = (bootstrap.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let consumer = reader(&bootstrap);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let shown = consumer
                .fetch_metadata(Some(&name), Duration::from_secs(5))
                .ok()
                .and_then(|m| {
                    m.topics()
                        .iter()
                        .find(|t| t.name() == name && t.error().is_none())
                        .map(|t| t.partitions().len())
                });
            if shown == Some(partitions as usize) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "topic {name} did not show {partitions} partitions within 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .expect("waiting for the topic");
}

/// One record read back from a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its partition.
    pub partition: i32,
    /// Its offset in the partition.
    pub offset: i64,
    /// Its Kafka key.
    pub key: Option<Vec<u8>>,
    /// Its value.
    pub payload: Vec<u8>,
    /// Its headers (the last value of each name).
    pub headers: BTreeMap<String, String>,
}

impl Record {
    /// The outbox message id of its `outbox-id` header.
    pub fn id(&self) -> Option<&str> {
        self.headers.get(crate::ID_HEADER).map(String::as_str)
    }
}

fn reader(bootstrap: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "outbox-kafka-testing-reader")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("a reading consumer")
}

/// Every record of `topic` (all `partitions`) from the beginning up to
/// each partition's high watermark when the call began — every record the
/// broker had acknowledged by then —, in offset order within each
/// partition.
///
/// # Panics
/// When the broker does not answer, or the records are not all read
/// within `within`.
pub async fn read_topic(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    within: Duration,
) -> Vec<Record> {
    let (bootstrap, topic) = (bootstrap.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let consumer = reader(&bootstrap);
        let mut list = TopicPartitionList::new();
        let mut left: BTreeMap<i32, i64> = BTreeMap::new();
        for p in 0..partitions {
            let (low, high) = consumer
                .fetch_watermarks(&topic, p, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("the watermarks of {topic}/{p}: {e}"));
            if high > low {
                left.insert(p, high);
            }
            list.add_partition_offset(&topic, p, Offset::Beginning)
                .expect("a partition to read");
        }
        let mut out = Vec::new();
        if left.is_empty() {
            return out;
        }
        consumer.assign(&list).expect("assigning the partitions");
        let deadline = Instant::now() + within;
        while !left.is_empty() {
            assert!(
                Instant::now() < deadline,
                "reading {topic}: {} record(s) read, partitions {left:?} not read to their end \
                 within {within:?}",
                out.len()
            );
            match consumer.poll(Duration::from_millis(50)) {
                Some(Ok(m)) => {
                    let mut headers = BTreeMap::new();
                    if let Some(h) = m.headers() {
                        for header in h.iter() {
                            headers.insert(
                                header.key.to_owned(),
                                String::from_utf8_lossy(header.value.unwrap_or_default())
                                    .into_owned(),
                            );
                        }
                    }
                    if left
                        .get(&m.partition())
                        .is_some_and(|high| m.offset() + 1 >= *high)
                    {
                        left.remove(&m.partition());
                    }
                    out.push(Record {
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key().map(<[u8]>::to_vec),
                        payload: m.payload().unwrap_or_default().to_vec(),
                        headers,
                    });
                }
                Some(Err(e)) => panic!("reading topic {topic}: {e}"),
                None => {}
            }
        }
        out
    })
    .await
    .expect("reading the topic")
}

/// A `tansu` broker of a test's own, on a free port of `127.0.0.1`, its
/// topics in a SQLite file of its own, for tests that kill and restart the
/// broker or cut its connections (never the shared one). Killed when
/// dropped.
///
/// It can advertise an address other than its own
/// ([`start_advertising`](Self::start_advertising)): clients then reach it
/// through a proxy there, which a test can cut (Kafka clients connect to
/// the advertised address after the first metadata answer).
#[derive(Debug)]
pub struct OwnTansu {
    port: u16,
    advertised: std::net::SocketAddr,
    dir: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl OwnTansu {
    /// A broker under `dir` advertising its own address.
    ///
    /// # Panics
    /// As [`restart`](Self::restart).
    pub fn start(dir: &std::path::Path) -> OwnTansu {
        let port = free_port();
        Self::start_advertising(dir, port, ([127, 0, 0, 1], port).into())
    }

    /// A broker under `dir` listening on `port` and advertising
    /// `advertised` to its clients.
    ///
    /// # Panics
    /// As [`restart`](Self::restart).
    pub fn start_advertising(
        dir: &std::path::Path,
        port: u16,
        advertised: std::net::SocketAddr,
    ) -> OwnTansu {
        let mut own = OwnTansu {
            port,
            advertised,
            dir: dir.to_owned(),
            child: None,
        };
        own.restart();
        own
    }

    /// The address clients bootstrap from (the advertised one).
    pub fn bootstrap(&self) -> String {
        self.advertised.to_string()
    }

    /// The address the broker itself listens on.
    pub fn addr(&self) -> std::net::SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }

    /// Stops it at once (SIGKILL), as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again (after [`kill`](Self::kill)) on the same port and
    /// storage, and waits until it accepts connections.
    ///
    /// # Panics
    /// When `tansu` is not installed (the message says how to install it)
    /// or does not accept connections within 20 s.
    pub fn restart(&mut self) {
        self.kill();
        std::fs::create_dir_all(&self.dir).expect("the broker's directory");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("tansu.log"))
            .expect("the broker's log file");
        let child = std::process::Command::new("tansu")
            .arg("broker")
            .arg("--listener-url")
            .arg(format!("tcp://127.0.0.1:{}", self.port))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://{}", self.advertised))
            // tansu reads the file of a `sqlite://` URL relative to its
            // working directory.
            .arg("--storage-engine")
            .arg("sqlite://tansu.db")
            .current_dir(&self.dir)
            .stdout(log.try_clone().expect("the log file"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run tansu ({e}); install it (`cargo install tansu --version 0.6.0 \
                     --locked --no-default-features --features libsql`, or `bash \
                     scripts/services`) to run the tests that kill a broker of their own"
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect_timeout(&self.addr(), Duration::from_millis(200))
            .is_err()
        {
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            assert!(
                exited.is_none(),
                "tansu exited ({exited:?}) while starting; its log: {}",
                std::fs::read_to_string(self.dir.join("tansu.log")).unwrap_or_default()
            );
            assert!(
                Instant::now() < deadline,
                "tansu did not accept connections on {} within 20 s; its log: {}",
                self.addr(),
                std::fs::read_to_string(self.dir.join("tansu.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for OwnTansu {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free TCP port on 127.0.0.1 (bound and released at once).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}
