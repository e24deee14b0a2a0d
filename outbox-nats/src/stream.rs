//! [`StreamSpec`]: the JetStream stream a relay publishes to, provisioned
//! on request.

use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::stream::{Config, StorageType};
use outbox_api::{Error, Result};

use crate::transport::source_words;

/// JetStream's own default duplicate window.
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// A stream to create if missing, or to check if present: its name, the
/// subjects it captures, file storage, its replicas, and its **duplicate
/// window** — how long the server remembers a `Nats-Msg-Id` to drop a
/// message published again.
///
/// A relay that crashes after a publish, before it recorded the delivery,
/// publishes the message again once its lease expired, at most `lease +
/// handler_timeout` after the first publish; within the window, the server
/// drops that copy. [`covering`](Self::covering) makes the window at least
/// that long. (Past the window the copy is stored: at-least-once, and the
/// consumer's inbox drops it.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSpec {
    name: String,
    subjects: Vec<String>,
    replicas: usize,
    duplicate_window: Duration,
    max_age: Duration,
}

impl StreamSpec {
    /// A stream `name` capturing `subjects` (wildcards allowed:
    /// `orders.>`), file storage, one replica, the default duplicate window
    /// (2 min), messages kept until removed by limits (none set).
    pub fn new(
        name: impl Into<String>,
        subjects: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        StreamSpec {
            name: name.into(),
            subjects: subjects.into_iter().map(Into::into).collect(),
            replicas: 1,
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
            max_age: Duration::ZERO,
        }
    }

    /// Replicas in a cluster (1 to 5).
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// How long message ids are remembered to drop duplicates.
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = window;
        self
    }

    /// Raises the duplicate window to at least `lease + handler_timeout`
    /// of the relays publishing to it (their `RelayConfig`).
    pub fn covering(mut self, lease: Duration, handler_timeout: Duration) -> Self {
        self.duplicate_window = self.duplicate_window.max(lease + handler_timeout);
        self
    }

    /// Removes messages older than this (zero: never).
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = age;
        self
    }

    /// The stream's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The subjects it captures.
    pub fn subjects(&self) -> &[String] {
        &self.subjects
    }

    /// Its duplicate window.
    pub fn get_duplicate_window(&self) -> Duration {
        self.duplicate_window
    }

    /// Checks the spec; a `Config` error names what is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.name.is_empty()
            || self
                .name
                .chars()
                .any(|c| c == '.' || c == '*' || c == '>' || c.is_whitespace() || c.is_control())
        {
            return Err(Error::config(
                "stream name",
                format!(
                    "`{}` is not a stream name: not empty, no `.`, `*`, `>` or whitespace",
                    self.name
                ),
            ));
        }
        if self.subjects.is_empty() {
            return Err(Error::config(
                "subjects",
                format!("stream `{}` captures no subject", self.name),
            ));
        }
        if !(1..=5).contains(&self.replicas) {
            return Err(Error::config(
                "replicas",
                format!("{} replicas; JetStream allows 1 to 5", self.replicas),
            ));
        }
        if self.duplicate_window.is_zero() {
            return Err(Error::config(
                "duplicate_window",
                "must be longer than zero: the server would keep every resent copy",
            ));
        }
        if !self.max_age.is_zero() && self.duplicate_window > self.max_age {
            return Err(Error::config(
                "duplicate_window",
                format!(
                    "{:?} is longer than the stream's max_age {:?}; JetStream refuses that",
                    self.duplicate_window, self.max_age
                ),
            ));
        }
        Ok(())
    }

    fn config(&self) -> Config {
        Config {
            name: self.name.clone(),
            subjects: self.subjects.clone(),
            storage: StorageType::File,
            num_replicas: self.replicas,
            duplicate_window: self.duplicate_window,
            max_age: self.max_age,
            ..Default::default()
        }
    }

    /// Creates it on `js` if missing, else checks it (see
    /// [`NatsTransport::declare`](crate::NatsTransport::declare)).
    pub(crate) async fn declare_on(
        &self,
        js: &Context,
        scrub: &dyn Fn(&str) -> String,
    ) -> Result<()> {
        self.validate()?;
        let unavailable = |what: &str, e: &dyn std::error::Error| {
            Error::unavailable(format!(
                "{what} stream `{}`: {}",
                self.name,
                scrub(&format!("{e}{}", source_words(e)))
            ))
        };
        match js.get_stream(&self.name).await {
            Ok(mut stream) => {
                let info = stream
                    .info()
                    .await
                    .map_err(|e| unavailable("reading", &e))?;
                self.check(&info.config)
            }
            Err(e) if matches!(e.kind(), GetStreamErrorKind::JetStream(api) if api.code() == 404) =>
            {
                match js.create_stream(self.config()).await {
                    Ok(_) => Ok(()),
                    Err(e) => {
                        let words = scrub(&format!("{e}{}", source_words(&e)));
                        // A refusal of the spec (overlapping subjects, …) is
                        // the configuration's fault, not an outage.
                        if matches!(e.kind(), async_nats::jetstream::context::CreateStreamErrorKind::JetStream(api) if api.code() < 500)
                        {
                            Err(Error::config(
                                "stream",
                                format!(
                                    "JetStream refused creating stream `{}`: {words}",
                                    self.name
                                ),
                            ))
                        } else {
                            Err(Error::unavailable(format!(
                                "creating stream `{}`: {words}",
                                self.name
                            )))
                        }
                    }
                }
            }
            Err(e) => Err(unavailable("looking up", &e)),
        }
    }

    /// Checks an existing stream's configuration against the spec.
    fn check(&self, have: &Config) -> Result<()> {
        let missing: Vec<&String> = self
            .subjects
            .iter()
            .filter(|s| !have.subjects.contains(s))
            .collect();
        if !missing.is_empty() {
            return Err(Error::config(
                "subjects",
                format!(
                    "stream `{}` exists but does not capture {missing:?} (it captures {:?}); add them (`nats stream edit {} --subjects …`) or name another stream",
                    self.name, have.subjects, self.name
                ),
            ));
        }
        if have.duplicate_window < self.duplicate_window {
            return Err(Error::config(
                "duplicate_window",
                format!(
                    "stream `{}` remembers message ids for {:?}, shorter than the {:?} asked for: a message a crashed relay publishes again (up to lease + handler_timeout after the first time) would be stored twice; raise it (`nats stream edit {} --dupe-window {}s`) or shorten the relays' lease",
                    self.name,
                    have.duplicate_window,
                    self.duplicate_window,
                    self.name,
                    self.duplicate_window.as_secs().max(1)
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covering_raises_the_window_to_lease_plus_handler_timeout() {
        let spec = StreamSpec::new("S", ["a.>"])
            .covering(Duration::from_secs(300), Duration::from_secs(30));
        assert_eq!(spec.get_duplicate_window(), Duration::from_secs(330));
        let spec =
            StreamSpec::new("S", ["a.>"]).covering(Duration::from_secs(10), Duration::from_secs(5));
        assert_eq!(spec.get_duplicate_window(), DEFAULT_DUPLICATE_WINDOW);
    }

    #[test]
    fn a_short_window_or_missing_subject_is_explained() {
        let spec = StreamSpec::new("S", ["a.>", "b.>"]).duplicate_window(Duration::from_secs(90));
        let mut have = spec.config();
        spec.check(&have).unwrap();
        have.duplicate_window = Duration::from_secs(30);
        let e = spec.check(&have).unwrap_err();
        assert!(
            e.to_string().contains("30s") && e.to_string().contains("--dupe-window 90s"),
            "{e}"
        );
        have.duplicate_window = Duration::from_secs(120);
        have.subjects = vec!["a.>".into()];
        let e = spec.check(&have).unwrap_err();
        assert!(e.to_string().contains("b.>"), "{e}");
    }

    #[test]
    fn bad_specs_are_named() {
        for (spec, says) in [
            (StreamSpec::new("a.b", ["x"]), "stream name"),
            (
                StreamSpec::new("S", Vec::<String>::new()),
                "captures no subject",
            ),
            (StreamSpec::new("S", ["x"]).replicas(7), "replicas"),
            (
                StreamSpec::new("S", ["x"]).duplicate_window(Duration::ZERO),
                "duplicate_window",
            ),
            (
                StreamSpec::new("S", ["x"]).max_age(Duration::from_secs(10)),
                "max_age",
            ),
        ] {
            let e = spec.validate().unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
        }
    }
}
