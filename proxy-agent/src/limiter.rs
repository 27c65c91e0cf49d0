//! A token bucket: kube-proxy's bounded-frequency runner for the agent's syncs, and the pace of
//! its writes to the API (clientConnection.qps and burst).
use std::time::{Duration, Instant};

/// kube-proxy's bounded-frequency runner: at most `burst` syncs at once, then one per
/// `min_interval`. It paces the agent's Events too (clientConnection.qps and burst).
#[derive(Debug)]
pub struct Limiter {
    min_interval: Duration,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Limiter {
    pub fn new(min_interval: Duration, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Self { min_interval, burst, tokens: burst, last: now }
    }
    /// `rate` a second, `burst` at once.
    pub fn per_second(rate: f64, burst: u32, now: Instant) -> Self {
        Self::new(Duration::try_from_secs_f64(1.0 / rate).unwrap_or(Duration::ZERO), burst, now)
    }
    pub fn try_take(&mut self, now: Instant) -> bool {
        if self.min_interval.is_zero() {
            return true;
        }
        self.refill(now);
        if self.has_token() {
            self.tokens = (self.tokens - 1.0).max(0.0);
            true
        } else {
            false
        }
    }
    /// How long from `now` until `try_take` succeeds (zero: at once).
    pub fn wait(&mut self, now: Instant) -> Duration {
        if self.min_interval.is_zero() {
            return Duration::ZERO;
        }
        self.refill(now);
        if self.has_token() {
            return Duration::ZERO;
        }
        self.min_interval.mul_f64(1.0 - self.tokens)
    }
    /// Refills that add up to a whole token in steps may fall short of 1.0 in floating point.
    fn has_token(&self) -> bool {
        self.tokens >= 1.0 - 1e-9
    }
    fn refill(&mut self, now: Instant) {
        let refill = now.saturating_duration_since(self.last).as_secs_f64() / self.min_interval.as_secs_f64();
        self.tokens = (self.tokens + refill).min(self.burst);
        self.last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limiter_allows_a_burst_then_one_per_interval() {
        let t0 = Instant::now();
        let mut l = Limiter::new(Duration::from_secs(1), 2, t0);
        assert!(l.try_take(t0));
        assert!(l.try_take(t0));
        assert!(!l.try_take(t0 + Duration::from_millis(100)));
        assert!(l.try_take(t0 + Duration::from_millis(1200)));
        assert!(!l.try_take(t0 + Duration::from_millis(1300)));
    }

    /// The Events' pacing (clientConnection.qps and burst): a burst at once, then one each 1/qps,
    /// and `wait` says when the next may go.
    #[test]
    fn limiter_paces_at_a_rate_and_says_how_long_to_wait() {
        let t0 = Instant::now();
        let mut l = Limiter::per_second(5.0, 3, t0);
        assert!((0..3).all(|_| l.try_take(t0)), "the burst at once");
        assert!(!l.try_take(t0));
        assert_eq!(l.wait(t0), Duration::from_millis(200));
        assert_eq!(l.wait(t0 + Duration::from_millis(150)), Duration::from_millis(50));
        assert!(l.try_take(t0 + Duration::from_millis(200)));
        assert_eq!(l.wait(t0 + Duration::from_millis(200)), Duration::from_millis(200));
        assert_eq!(Limiter::per_second(5.0, 3, t0).wait(t0), Duration::ZERO, "a token is there");
    }
}
