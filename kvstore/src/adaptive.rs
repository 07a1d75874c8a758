//! The adaptive compaction controller (after SGLang-LSM): workload-aware LSM parameters for
//! the `kv` column family of the index.
//!
//! Every `interval` the controller takes the store's operation counters, keeps their deltas for
//! a sliding `window`, and from the shares of puts, successful reads and empty lookups
//! (empty probes and misses) predicts the cost of one operation under each candidate pair
//! (size ratio `T`, L0 run trigger `K`) with the cost model below. When another pair beats the
//! current one by more than `hysteresis` on `confirm` evaluations in a row, it is applied
//! through RocksDB's dynamic options (`SetOptions`); RocksDB picks them up at its next flush or
//! compaction, so nothing is rewritten eagerly. Each transition is logged and counted.
//!
//! # Cost model (time per operation, microseconds)
//! With `D` bytes of index data, write buffer `W` and level-1 base `K·W` (L0 holds up to `K`
//! runs of `W` before they are merged into level 1):
//! - levels below L1: `Lx = max(0, ln(D / (K·W)) / ln T)`;
//! - a put costs its share of compaction I/O: `e · (4 + Lx · (T + 1)) · compaction_ns_per_byte`
//!   (L0→L1 reads and writes each byte about twice; every deeper level rewrites a byte about
//!   `(T + 1) / 2` times on the way in and reads it as often);
//! - a lookup passes `K / 2` L0 runs on average, each a filter probe (`run_probe_us`), and
//!   `1 + Lx` levels (`level_probe_us` each); a successful read also fetches one data block
//!   (`block_read_us`).
//!
//! Write-heavy windows (low hit rates: every miss is an empty probe and a put) favour a large
//! `K` and few levels; read-heavy windows favour few runs.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Options of the controller ([`crate::StoreOptions::adaptive`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveOptions {
    /// Sliding window of operation counts: each evaluation sees at least this much history.
    /// Default 60 s.
    pub window: Duration,
    /// Evaluation period. Default 5 s.
    pub interval: Duration,
    /// A candidate must predict at least this much lower cost than the current parameters.
    /// Default 0.15.
    pub hysteresis: f64,
    /// ... on this many evaluations in a row. Default 2.
    pub confirm: u32,
    /// Operations the window must hold before the controller acts. Default 1,000.
    pub min_ops: u64,
    /// Candidate size ratios (`max_bytes_for_level_multiplier`). Default 10 only: on the
    /// reference VM, size ratio 4 (which the model prefers for write-heavy windows) saved no
    /// compaction I/O over 10 and made requests 3-12 % slower (docs/BENCHMARKS.md, compaction).
    pub size_ratios: Vec<u32>,
    /// Candidate L0 run triggers (`level0_file_num_compaction_trigger`). Default 2, 4, 8, 16.
    pub l0_triggers: Vec<u32>,
    /// Cost model: compaction time per byte read or written (read, merge, compress, write).
    /// Default 4 ns.
    pub compaction_ns_per_byte: f64,
    /// Cost model: one L0 run passed by a lookup (a filter probe). Default 0.25 µs.
    pub run_probe_us: f64,
    /// Cost model: one level (L1 and below) passed by a lookup: file search, filter, index
    /// block. Default 1 µs, calibrated with `ragkv bench compaction` (at equal L0 trigger,
    /// size ratio 4 instead of 10 cost ~2-4 µs per request on the reference VM).
    pub level_probe_us: f64,
    /// Cost model: fetching a data block for a successful read. Default 1 µs (block cache).
    pub block_read_us: f64,
}

impl Default for AdaptiveOptions {
    fn default() -> Self {
        AdaptiveOptions {
            window: Duration::from_secs(60),
            interval: Duration::from_secs(5),
            hysteresis: 0.15,
            confirm: 2,
            min_ops: 1_000,
            size_ratios: vec![10],
            l0_triggers: vec![2, 4, 8, 16],
            compaction_ns_per_byte: 4.0,
            run_probe_us: 0.25,
            level_probe_us: 1.0,
            block_read_us: 1.0,
        }
    }
}

impl AdaptiveOptions {
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |why: String| {
            Err(Error::Invalid {
                what: "adaptive",
                why,
            })
        };
        if self.window.is_zero() || self.interval.is_zero() {
            return bad(format!(
                "window {:?} and interval {:?} must be > 0",
                self.window, self.interval
            ));
        }
        if self.size_ratios.is_empty() || self.size_ratios.iter().any(|t| *t < 2) {
            return bad(format!("size_ratios {:?} (each ≥ 2)", self.size_ratios));
        }
        if self.l0_triggers.is_empty() || self.l0_triggers.iter().any(|k| *k < 1 || *k > 64) {
            return bad(format!("l0_triggers {:?} (each 1..=64)", self.l0_triggers));
        }
        if !(0.0..1.0).contains(&self.hysteresis) || self.confirm == 0 {
            return bad("hysteresis must be in [0, 1) and confirm ≥ 1".into());
        }
        Ok(())
    }
}

/// LSM parameters of the index's `kv` family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// `max_bytes_for_level_multiplier`.
    pub size_ratio: u32,
    /// `level0_file_num_compaction_trigger`.
    pub l0_trigger: u32,
}

impl Tuning {
    /// RocksDB's defaults, which the store opens with.
    pub const DEFAULT: Tuning = Tuning {
        size_ratio: 10,
        l0_trigger: 4,
    };
}

/// Operation counts over a window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Mix {
    pub puts: u64,
    pub reads: u64,
    pub empty: u64,
}

impl Mix {
    pub(crate) fn total(&self) -> u64 {
        self.puts + self.reads + self.empty
    }
}

/// Sizes the cost model needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    /// Index data bytes.
    pub data_bytes: f64,
    /// Bytes per index entry.
    pub entry_bytes: f64,
    pub write_buffer_bytes: f64,
}

/// Predicted microseconds per operation of `mix` under `t`.
pub(crate) fn cost(o: &AdaptiveOptions, mix: &Mix, shape: &Shape, t: Tuning) -> f64 {
    let total = mix.total().max(1) as f64;
    let (k, ratio) = (t.l0_trigger as f64, t.size_ratio as f64);
    let base = k * shape.write_buffer_bytes;
    let lx = (shape.data_bytes / base).ln().max(0.0) / ratio.ln();
    let put = shape.entry_bytes * (4.0 + lx * (ratio + 1.0)) * o.compaction_ns_per_byte / 1e3;
    let lookup = k / 2.0 * o.run_probe_us + (1.0 + lx) * o.level_probe_us;
    (mix.puts as f64 * put
        + mix.reads as f64 * (lookup + o.block_read_us)
        + mix.empty as f64 * lookup)
        / total
}

/// The cheapest candidate for `mix` (ties keep the earlier candidate).
pub(crate) fn best(o: &AdaptiveOptions, mix: &Mix, shape: &Shape) -> (Tuning, f64) {
    let mut out = (Tuning::DEFAULT, f64::INFINITY);
    for &size_ratio in &o.size_ratios {
        for &l0_trigger in &o.l0_triggers {
            let t = Tuning {
                size_ratio,
                l0_trigger,
            };
            let c = cost(o, mix, shape, t);
            if c < out.1 {
                out = (t, c);
            }
        }
    }
    out
}

#[derive(Debug)]
struct State {
    /// (when, counter totals) samples; the window's mix is last minus first.
    samples: VecDeque<(Instant, Mix)>,
    current: Tuning,
    /// A candidate and how many evaluations in a row it won.
    pending: Option<(Tuning, u32)>,
}

/// The controller's state inside the store.
#[derive(Debug)]
pub(crate) struct Controller {
    state: Mutex<State>,
    transitions: AtomicU64,
}

impl Default for Controller {
    fn default() -> Self {
        Controller {
            state: Mutex::new(State {
                // Counters start at zero when the store opens.
                samples: VecDeque::from([(Instant::now(), Mix::default())]),
                current: Tuning::DEFAULT,
                pending: None,
            }),
            transitions: AtomicU64::new(0),
        }
    }
}

impl Controller {
    pub(crate) fn current(&self) -> Tuning {
        self.state.lock().current
    }

    /// Tunings applied since open.
    pub(crate) fn transitions(&self) -> u64 {
        self.transitions.load(Ordering::Relaxed)
    }
}

impl Controller {
    /// One evaluation (see the module documentation): `totals` are the store's operation
    /// counters now; `shape` gives the index's sizes, asked for only when the window holds
    /// enough operations; `apply` sets a new tuning on the index.
    pub(crate) fn tick(
        &self,
        o: &AdaptiveOptions,
        totals: Mix,
        shape: impl FnOnce() -> Result<Shape>,
        apply: impl FnOnce(Tuning) -> Result<()>,
    ) -> Result<()> {
        let now = Instant::now();
        let mut s = self.state.lock();
        s.samples.push_back((now, totals));
        // Keep one sample at least `window` old as the baseline.
        while s
            .samples
            .get(1)
            .is_some_and(|(t, _)| now.duration_since(*t) >= o.window)
        {
            s.samples.pop_front();
        }
        let first = s.samples.front().expect("just pushed").1;
        let mix = Mix {
            puts: totals.puts - first.puts,
            reads: totals.reads - first.reads,
            empty: totals.empty - first.empty,
        };
        if mix.total() < o.min_ops {
            s.pending = None;
            return Ok(());
        }
        let shape = shape()?;
        let (cand, cand_cost) = best(o, &mix, &shape);
        let cur_cost = cost(o, &mix, &shape, s.current);
        if cand == s.current || cand_cost > cur_cost * (1.0 - o.hysteresis) {
            s.pending = None;
            return Ok(());
        }
        let streak = match s.pending {
            Some((t, n)) if t == cand => n + 1,
            _ => 1,
        };
        if streak < o.confirm {
            s.pending = Some((cand, streak));
            return Ok(());
        }
        apply(cand)?;
        let from = s.current;
        s.current = cand;
        s.pending = None;
        self.transitions.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            ?from,
            to = ?cand,
            puts = mix.puts,
            reads = mix.reads,
            empty = mix.empty,
            predicted_us_before = cur_cost,
            predicted_us_after = cand_cost,
            "adaptive compaction: new LSM parameters"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape {
            data_bytes: 64e6,
            entry_bytes: 100.0,
            write_buffer_bytes: 2e6,
        }
    }

    /// One request of the SGLang-LSM workload at hit rate `h`: a hit is a read; a miss is an
    /// empty probe and a put.
    fn mix(h: f64) -> Mix {
        let n = 10_000.0;
        Mix {
            reads: (n * h) as u64,
            empty: (n * (1.0 - h)) as u64,
            puts: (n * (1.0 - h)) as u64,
        }
    }

    #[test]
    fn write_heavy_windows_get_more_runs_than_read_heavy_ones() {
        let o = AdaptiveOptions::default();
        let (low, _) = best(&o, &mix(0.2), &shape());
        let (high, _) = best(&o, &mix(0.9), &shape());
        assert!(low.l0_trigger > high.l0_trigger, "{low:?} vs {high:?}");
        // Pure reads: fewest runs; pure writes: fewest rewrites.
        let reads = Mix {
            reads: 1000,
            ..Mix::default()
        };
        assert!(best(&o, &reads, &shape()).0.l0_trigger <= 4);
        let puts = Mix {
            puts: 1000,
            ..Mix::default()
        };
        assert_eq!(best(&o, &puts, &shape()).0.l0_trigger, 16);
    }

    #[test]
    fn a_better_tuning_is_applied_only_after_confirmation() {
        let o = AdaptiveOptions {
            min_ops: 10,
            confirm: 2,
            hysteresis: 0.0,
            ..AdaptiveOptions::default()
        };
        let c = Controller::default();
        let applied = std::cell::RefCell::new(Vec::new());
        let tick = |puts| {
            let totals = Mix {
                puts,
                ..Mix::default()
            };
            c.tick(
                &o,
                totals,
                || Ok(shape()),
                |t| {
                    applied.borrow_mut().push(t);
                    Ok(())
                },
            )
        };
        // Too few operations: nothing evaluated.
        tick(5).unwrap();
        assert!(applied.borrow().is_empty());
        // A write-heavy window: the first win is pending, the second applies it.
        tick(10_000).unwrap();
        assert!(applied.borrow().is_empty());
        tick(20_000).unwrap();
        let want = best(
            &o,
            &Mix {
                puts: 1,
                ..Mix::default()
            },
            &shape(),
        )
        .0;
        assert_eq!(*applied.borrow(), vec![want]);
        assert_eq!((c.current(), c.transitions()), (want, 1));
        // The applied tuning is now current: no further transition for the same mix.
        tick(30_000).unwrap();
        assert_eq!(applied.borrow().len(), 1);
    }

    #[test]
    fn cost_grows_with_levels_for_puts() {
        let o = AdaptiveOptions::default();
        let puts = Mix {
            puts: 1,
            ..Mix::default()
        };
        let small = Shape {
            data_bytes: 1e6,
            ..shape()
        };
        let t = Tuning::DEFAULT;
        assert!(cost(&o, &puts, &small, t) < cost(&o, &puts, &shape(), t));
    }
}
