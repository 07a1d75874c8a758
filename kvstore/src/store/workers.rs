//! The store's background threads, each named and woken on a timer until shutdown: the merger
//! (`kvstore-merger`), the capacity worker (`kvstore-capacity`: applies logged reads, rebuilds
//! the presence filter when deletes have worn it, persists statistics and sweeps), the
//! adaptive controller (`kvstore-adaptive`) and the syncer (`kvstore-syncer`, for
//! `SyncPolicy::Interval`). A panic in one of them is caught and poisons the store: writes are
//! refused from then on instead of running on possibly inconsistent state.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::inner::{get, Inner};
use crate::adaptive::{Mix, Shape};
use crate::error::Result;
use crate::options::SyncPolicy;

impl Inner {
    /// Runs `f` every `every` until shutdown; a panic poisons the store.
    fn background(&self, every: Duration, f: impl Fn(&Inner) -> Result<()>) {
        loop {
            {
                let mut stop = self.shutdown.0.lock();
                if !*stop {
                    self.shutdown.1.wait_for(&mut stop, every);
                }
                if *stop {
                    return;
                }
            }
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self))) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "background store task failed"),
                Err(_) => {
                    let why = format!(
                        "{} panicked",
                        std::thread::current().name().unwrap_or("worker")
                    );
                    tracing::error!("{why}; refusing further writes");
                    *self.poisoned.lock() = Some(why);
                    return;
                }
            }
        }
    }

    /// One evaluation of the adaptive controller (no-op without `StoreOptions::adaptive`).
    pub(super) fn adapt_tick(&self) -> Result<()> {
        let Some(o) = &self.opts.adaptive else {
            return Ok(());
        };
        let c = &self.counters;
        let totals = Mix {
            puts: get(&c.blocks_written),
            reads: get(&c.hits),
            empty: get(&c.empty_probes) + get(&c.misses),
        };
        let shape = || {
            let prop = |p: &str| self.index.kv_property(p).map(|v| v as f64);
            let keys = prop("rocksdb.estimate-num-keys")?.max(1.0);
            let data =
                prop("rocksdb.estimate-live-data-size")? + prop("rocksdb.cur-size-all-mem-tables")?;
            Ok(Shape {
                data_bytes: data.max(1.0),
                entry_bytes: (data / keys).clamp(32.0, 4096.0),
                write_buffer_bytes: self.opts.index_write_buffer_bytes as f64,
            })
        };
        self.adaptive
            .tick(o, totals, shape, |t| self.index.apply_tuning(t))
    }

    /// Stops the background threads (they finish the task in hand first).
    pub(super) fn stop_workers(&self) {
        *self.shutdown.0.lock() = true;
        self.shutdown.1.notify_all();
    }
}

/// Starts the background threads `inner`'s options ask for.
pub(super) fn spawn(inner: &Arc<Inner>) -> Result<Vec<JoinHandle<()>>> {
    let opts = &inner.opts;
    let named = |name: &str, f: Box<dyn FnOnce() + Send>| {
        std::thread::Builder::new().name(name.into()).spawn(f)
    };
    let mut workers = Vec::new();
    if opts.background_merge {
        let w = inner.clone();
        workers.push(named(
            "kvstore-merger",
            Box::new(move || w.background(w.opts.merge.interval, |s| s.merge_once().map(drop))),
        )?);
    }
    {
        // Wakes often enough to apply logged reads off the readers' threads; persists
        // statistics and sweeps every `flush_interval`.
        let w = inner.clone();
        let every = w.opts.capacity.flush_interval;
        let wake = every.min(crate::capacity::APPLY_READS_EVERY);
        let last = Mutex::new(Instant::now());
        workers.push(named(
            "kvstore-capacity",
            Box::new(move || {
                w.background(wake, |s| {
                    drop(s.access.lock());
                    if s.presence.needs_rebuild() {
                        s.rebuild_presence()?;
                    }
                    let mut last = last.lock();
                    if last.elapsed() >= every {
                        *last = Instant::now();
                        s.capacity_tick()?;
                    }
                    Ok(())
                })
            }),
        )?);
    }
    if let Some(a) = &opts.adaptive {
        let (w, every) = (inner.clone(), a.interval);
        workers.push(named(
            "kvstore-adaptive",
            Box::new(move || w.background(every, |s| s.adapt_tick())),
        )?);
    }
    if let SyncPolicy::Interval(every) = opts.sync {
        let w = inner.clone();
        workers.push(named(
            "kvstore-syncer",
            Box::new(move || w.background(every, |s| s.sync_now())),
        )?);
    }
    Ok(workers)
}
