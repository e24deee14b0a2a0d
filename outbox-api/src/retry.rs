//! When a failed message is tried again.

use std::time::Duration;

use crate::error::{Error, Result};

/// When a message whose delivery failed (a counted attempt) may be claimed again.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub enum RetryPolicy {
    /// At the relay's next round: one `poll_interval` later (the original
    /// system's behaviour, and the default).
    #[default]
    NextRound,
    /// After a fixed delay.
    Fixed(Duration),
    /// `initial × multiplier^(attempts-1)`, capped at `max`, with full jitter
    /// of `jitter` (0.0–1.0) subtracted at random.
    Exponential {
        /// Delay after the first failure.
        initial: Duration,
        /// Largest delay.
        max: Duration,
        /// Growth factor per failure (≥ 1.0).
        multiplier: f64,
        /// Fraction of the delay that is randomised (0.0–1.0).
        jitter: f64,
    },
}

impl RetryPolicy {
    /// The longest delay a policy may give (365 days): a retry further away
    /// is an operator's decision, and every store can represent this one.
    pub const MAX_DELAY: Duration = Duration::from_secs(365 * 24 * 3600);

    /// Exponential backoff from 1 s to 5 min, doubling, 20 % jitter.
    pub fn exponential() -> Self {
        RetryPolicy::Exponential {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
            multiplier: 2.0,
            jitter: 0.2,
        }
    }

    /// Checks the parameters, naming the one that is wrong.
    pub fn validate(&self) -> Result<()> {
        let at_most = |field: &str, d: &Duration| {
            if *d > Self::MAX_DELAY {
                Err(Error::config(
                    field,
                    format!(
                        "must be at most {} days (got {d:?})",
                        Self::MAX_DELAY.as_secs() / 86_400
                    ),
                ))
            } else {
                Ok(())
            }
        };
        if let RetryPolicy::Fixed(d) = self {
            at_most("retry_policy.fixed", d)?;
        }
        if let RetryPolicy::Exponential {
            initial,
            max,
            multiplier,
            jitter,
        } = self
        {
            at_most("retry_policy.max", max)?;
            if initial > max {
                return Err(Error::config(
                    "retry_policy.initial",
                    "must not exceed `max`",
                ));
            }
            if !(multiplier.is_finite() && *multiplier >= 1.0) {
                return Err(Error::config(
                    "retry_policy.multiplier",
                    "must be a number ≥ 1.0",
                ));
            }
            if !(0.0..=1.0).contains(jitter) {
                return Err(Error::config(
                    "retry_policy.jitter",
                    "must be between 0.0 and 1.0",
                ));
            }
        }
        Ok(())
    }

    /// The delay before the next try after `attempts` counted failures
    /// (1 after the first), given the relay's poll interval.
    pub fn delay(&self, attempts: u32, poll_interval: Duration) -> Duration {
        match self {
            RetryPolicy::NextRound => poll_interval,
            RetryPolicy::Fixed(d) => *d,
            RetryPolicy::Exponential {
                initial,
                max,
                multiplier,
                jitter,
            } => {
                let exp = attempts.saturating_sub(1).min(64) as i32;
                let raw = initial.as_secs_f64() * multiplier.powi(exp);
                let capped = raw.min(max.as_secs_f64());
                let jittered = capped * (1.0 - jitter * fastrand::f64());
                // Never a panic, even for a policy that skipped `validate`.
                Duration::try_from_secs_f64(jittered.max(0.0))
                    .unwrap_or(Self::MAX_DELAY)
                    .min(Self::MAX_DELAY)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_grows_and_caps() {
        let p = RetryPolicy::Exponential {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
            multiplier: 2.0,
            jitter: 0.0,
        };
        let poll = Duration::from_secs(2);
        assert_eq!(p.delay(1, poll), Duration::from_millis(100));
        assert_eq!(p.delay(2, poll), Duration::from_millis(200));
        assert_eq!(p.delay(4, poll), Duration::from_millis(800));
        assert_eq!(p.delay(10, poll), Duration::from_secs(1));
        assert_eq!(RetryPolicy::NextRound.delay(3, poll), poll);
    }

    #[test]
    fn jitter_stays_within_bounds() {
        let p = RetryPolicy::exponential();
        for attempt in 1..20 {
            let d = p.delay(attempt, Duration::ZERO);
            assert!(d <= Duration::from_secs(300));
            assert!(d >= Duration::from_millis(800));
        }
    }

    #[test]
    fn a_delay_too_long_is_refused_not_a_panic() {
        let huge = RetryPolicy::Exponential {
            initial: Duration::from_secs(1),
            max: Duration::MAX,
            multiplier: 2.0,
            jitter: 0.2,
        };
        let e = huge.validate().unwrap_err();
        assert!(e.to_string().contains("retry_policy.max"), "{e}");
        // Unvalidated, it still gives a delay instead of panicking.
        assert_eq!(huge.delay(200, Duration::ZERO), RetryPolicy::MAX_DELAY);
        let e = RetryPolicy::Fixed(Duration::MAX).validate().unwrap_err();
        assert!(e.to_string().contains("retry_policy.fixed"), "{e}");
        RetryPolicy::Fixed(RetryPolicy::MAX_DELAY)
            .validate()
            .unwrap();
    }

    #[test]
    fn invalid_parameters_name_the_field() {
        let p = RetryPolicy::Exponential {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(10),
            multiplier: 0.5,
            jitter: 0.1,
        };
        assert!(p.validate().unwrap_err().to_string().contains("multiplier"));
    }
}
