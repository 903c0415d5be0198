//! Backoff between attempts: exponential from the configured base, with full jitter so a
//! fleet retrying the same registry does not stampede in step, capped, and overridden by
//! a registry's `Retry-After` (in seconds). Public for callers that retry whole
//! operations the client does not (a Range read whose body failed midway), so they back
//! off the same way.

use std::time::Duration;

use reqwest::header::{HeaderMap, RETRY_AFTER};

use super::ClientConfig;

const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The delay before attempt `attempt + 1`.
pub fn backoff(cfg: &ClientConfig, attempt: u32, retry_after: Option<Duration>) -> Duration {
    if let Some(d) = retry_after {
        return d.min(MAX_BACKOFF);
    }
    let exp = cfg
        .base_backoff
        .saturating_mul(1u32 << attempt.saturating_sub(1).min(16))
        .min(MAX_BACKOFF);
    // Half fixed, half random: never zero, never in lock-step.
    let jitter: f64 = rand::random();
    exp / 2 + exp.mul_f64(jitter / 2.0)
}

/// Sleeps for [`backoff`].
pub async fn sleep(cfg: &ClientConfig, attempt: u32, retry_after: Option<Duration>) {
    tokio::time::sleep(backoff(cfg, attempt, retry_after)).await;
}

/// `Retry-After: <seconds>` (HTTP dates are treated as absent).
pub(crate) fn retry_after(h: &HeaderMap) -> Option<Duration> {
    h.get(RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_is_capped() {
        let cfg = ClientConfig {
            base_backoff: Duration::from_millis(100),
            ..ClientConfig::default()
        };
        for attempt in 1..40 {
            let d = backoff(&cfg, attempt, None);
            let exp = Duration::from_millis(100)
                .saturating_mul(1u32 << (attempt - 1).min(16))
                .min(MAX_BACKOFF);
            assert!(d >= exp / 2 && d <= exp, "attempt {attempt}: {d:?}");
        }
        assert_eq!(
            backoff(&cfg, 1, Some(Duration::from_secs(3))),
            Duration::from_secs(3)
        );
        assert_eq!(
            backoff(&cfg, 1, Some(Duration::from_secs(3600))),
            MAX_BACKOFF
        );
    }

    #[test]
    fn parses_retry_after_seconds_only() {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, "7".parse().unwrap_or_else(|_| unreachable!()));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        h.insert(
            RETRY_AFTER,
            "Wed, 21 Oct 2015 07:28:00 GMT"
                .parse()
                .unwrap_or_else(|_| unreachable!()),
        );
        assert_eq!(retry_after(&h), None);
    }
}
