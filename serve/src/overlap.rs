//! When the model thread was busy, so the loader can say how much of its own work ran
//! behind compute.
//!
//! The model thread marks the start and end of each query it computes; the loader, when it
//! finishes loading a query, asks for the overlap of its interval with those busy spans. The
//! answer is exact at that moment: compute that starts later cannot overlap a load that has
//! ended. This is what `Timings::load_hidden_ms` and `ragkv_kv_load_hidden_seconds_total`
//! report: load time during which the model was computing another query, i.e. load time that
//! did not delay anybody's first token by itself (on a machine where loader and model share
//! cores, the loader can still slow the model; the throughput comparison of `bench ttft`
//! shows that part).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Ended busy spans kept for overlap queries; a load never spans more than a few queries, so
/// a short history suffices (older spans end before any load still running began).
const HISTORY: usize = 64;

#[derive(Debug, Default)]
struct Spans {
    since: Option<Instant>,
    ended: VecDeque<(Instant, Instant)>,
}

/// The model thread's busy spans.
#[derive(Debug, Default)]
pub struct Timeline {
    spans: Mutex<Spans>,
}

impl Timeline {
    /// The model thread starts computing (idempotent while busy).
    pub fn start(&self, at: Instant) {
        let mut s = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        s.since.get_or_insert(at);
    }

    /// The model thread is idle again.
    pub fn stop(&self, at: Instant) {
        let mut s = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(since) = s.since.take() {
            if s.ended.len() == HISTORY {
                s.ended.pop_front();
            }
            s.ended.push_back((since, at));
        }
    }

    /// Whether the model is computing now.
    pub fn busy(&self) -> bool {
        let s = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        s.since.is_some()
    }

    /// How much of `[from, to]` the model spent busy, counting a span still open as busy
    /// until `to`.
    pub fn overlap(&self, from: Instant, to: Instant) -> Duration {
        let s = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        let clip = |a: Instant, b: Instant| {
            let (a, b) = (a.max(from), b.min(to));
            b.saturating_duration_since(a)
        };
        let mut d = s.ended.iter().map(|&(a, b)| clip(a, b)).sum::<Duration>();
        if let Some(since) = s.since {
            d += clip(since, to);
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn idle_model_hides_nothing() {
        let t = Timeline::default();
        let t0 = Instant::now();
        assert!(!t.busy());
        assert_eq!(t.overlap(at(t0, 0), at(t0, 100)), Duration::ZERO);
        t.start(at(t0, 200));
        assert!(t.busy());
        t.stop(at(t0, 300));
        assert!(!t.busy());
        assert_eq!(t.overlap(at(t0, 0), at(t0, 100)), Duration::ZERO);
        assert_eq!(t.overlap(at(t0, 300), at(t0, 400)), Duration::ZERO);
    }

    #[test]
    fn counts_ended_and_open_spans_clipped_to_the_load() {
        let t = Timeline::default();
        let t0 = Instant::now();
        t.start(at(t0, 0));
        t.stop(at(t0, 50));
        t.start(at(t0, 80));
        // Load from 30 to 120: busy 30..50 and 80..120 (still open).
        assert_eq!(
            t.overlap(at(t0, 30), at(t0, 120)),
            Duration::from_millis(60)
        );
        t.start(at(t0, 90)); // already busy: keeps 80
        t.stop(at(t0, 100));
        assert_eq!(
            t.overlap(at(t0, 30), at(t0, 120)),
            Duration::from_millis(40)
        );
        assert_eq!(t.overlap(at(t0, 85), at(t0, 95)), Duration::from_millis(10));
    }

    #[test]
    fn history_is_bounded() {
        let t = Timeline::default();
        let t0 = Instant::now();
        for i in 0..(HISTORY as u64 * 2) {
            t.start(at(t0, 10 * i));
            t.stop(at(t0, 10 * i + 5));
        }
        let spans = t.spans.lock().unwrap();
        assert_eq!(spans.ended.len(), HISTORY);
    }
}
