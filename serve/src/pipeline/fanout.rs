//! A query's chunks loaded side by side (`serve.load_threads`): reading a chunk's stored KV
//! (the store's read and its checksums) and importing it (on a GPU: the upload and the
//! launches that place it, on the thread's own stream) are independent per chunk, and one
//! thread doing them one after the other puts their sum on the time to first token.
//!
//! The calling thread works too; the others are scoped threads named `ragkv-load-N`, spawned
//! per query (tens of microseconds against milliseconds of work each) and joined before it
//! returns. Each thread keeps its own reusable read buffer. A panicking worker's panic is
//! re-raised on the calling thread, where the loader contains and reports it like its own.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Up to `threads` threads for a query's chunks, and their read buffers (kept from query to
/// query).
#[derive(Debug)]
pub(crate) struct Fanout {
    threads: usize,
    bufs: Vec<Vec<u8>>,
}

impl Fanout {
    /// Up to `threads` threads (at least one: the caller).
    pub(crate) fn new(threads: usize) -> Fanout {
        Fanout {
            threads: threads.max(1),
            bufs: vec![Vec::new()],
        }
    }

    /// The most threads a call uses.
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Up to `threads` threads (at least one) from the next call on.
    pub(crate) fn set_threads(&mut self, threads: usize) {
        self.threads = threads.max(1);
    }

    /// [`fan_out`] over this one's threads and buffers.
    pub(crate) fn run<T, F>(&mut self, n: usize, work: F) -> Vec<T>
    where
        T: Send,
        F: Fn(usize, &mut Vec<u8>) -> T + Sync,
    {
        fan_out(n, self.threads, &mut self.bufs, work)
    }

    /// The calling thread's buffer, for work after the fan-out.
    pub(crate) fn buf(&mut self) -> &mut Vec<u8> {
        &mut self.bufs[0]
    }
}

/// Runs `work(i, buf)` for every `i < n` on up to `threads` threads (the caller one of them),
/// each thread with a buffer of its own from `bufs` (grown to the threads used, kept for the
/// next call); the results in index order.
fn fan_out<T, F>(n: usize, threads: usize, bufs: &mut Vec<Vec<u8>>, work: F) -> Vec<T>
where
    T: Send,
    F: Fn(usize, &mut Vec<u8>) -> T + Sync,
{
    let threads = threads.clamp(1, n.max(1));
    if bufs.len() < threads {
        bufs.resize_with(threads, Vec::new);
    }
    let next = AtomicUsize::new(0);
    let run = |buf: &mut Vec<u8>| {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                return done;
            }
            done.push((i, work(i, buf)));
        }
    };
    let (own, others) = bufs[..threads]
        .split_first_mut()
        .expect("at least one buffer");
    let mut results: Vec<(usize, T)> = std::thread::scope(|s| {
        let handles: Vec<_> = others
            .iter_mut()
            .enumerate()
            .filter_map(|(k, buf)| {
                let run = &run;
                // A thread that cannot be spawned leaves its share to the others.
                std::thread::Builder::new()
                    .name(format!("ragkv-load-{}", k + 1))
                    .spawn_scoped(s, move || run(buf))
                    .ok()
            })
            .collect();
        let mut all = run(own);
        for h in handles {
            match h.join() {
                Ok(mut done) => all.append(&mut done),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        all
    });
    results.sort_unstable_by_key(|&(i, _)| i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// `serve.load_threads` resolved: `configured` when set, else on a GPU as many as half the
/// CPUs (at most 8: the chunks a query reads), on the CPU one (the loader's work must not
/// take cores from the model's threads while they decode).
pub(crate) fn load_threads(configured: usize, gpu: bool) -> usize {
    match configured {
        0 if gpu => std::thread::available_parallelism()
            .map_or(1, |n| n.get() / 2)
            .clamp(1, 8),
        0 => 1,
        n => n,
    }
}

/// The threads for a query loaded while the model computes nothing (and has nothing queued):
/// with `serve.load_threads = 0` on the CPU, every CPU (at most 8), since no decoding thread
/// would lose its core and the load is all of that query's wait; otherwise
/// [`load_threads`]'s.
pub(crate) fn idle_load_threads(configured: usize, gpu: bool) -> usize {
    match configured {
        0 if !gpu => std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 8),
        n => load_threads(n, gpu),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_once_in_order_whatever_the_threads() {
        for threads in [0, 1, 2, 3, 8, 20] {
            for n in [0, 1, 2, 5, 17] {
                let mut bufs = Vec::new();
                let out = fan_out(n, threads, &mut bufs, |i, buf| {
                    buf.push(i as u8);
                    i * 10
                });
                assert_eq!(out, (0..n).map(|i| i * 10).collect::<Vec<_>>());
                // Every item went through exactly one of the threads' buffers.
                let mut seen: Vec<u8> = bufs.concat();
                seen.sort_unstable();
                assert_eq!(seen, (0..n as u8).collect::<Vec<_>>());
                assert!(bufs.len() <= threads.clamp(1, n.max(1)).max(1));
            }
        }
    }

    #[test]
    fn the_work_runs_on_several_threads() {
        let mut bufs = Vec::new();
        let barrier = std::sync::Barrier::new(2);
        // Two items that each wait for the other: finishes only if two threads run them.
        let names = fan_out(2, 2, &mut bufs, |_, _| {
            barrier.wait();
            std::thread::current().name().map(str::to_owned)
        });
        assert!(names.iter().any(|n| n.as_deref() == Some("ragkv-load-1")));
    }

    #[test]
    fn a_panicking_worker_panics_the_caller() {
        let mut bufs = Vec::new();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            fan_out(4, 2, &mut bufs, |i, _| {
                if i == 3 {
                    panic!("injected");
                }
                i
            })
        }));
        assert!(r.is_err());
    }

    #[test]
    fn a_fanout_keeps_the_callers_buffer() {
        let mut f = Fanout::new(0);
        assert_eq!(f.threads(), 1);
        assert_eq!(
            f.run(3, |i, buf| {
                buf.push(1);
                i
            }),
            vec![0, 1, 2]
        );
        assert_eq!(f.buf().len(), 3);
    }

    #[test]
    fn threads_resolve() {
        assert_eq!(load_threads(3, false), 3);
        assert_eq!(load_threads(3, true), 3);
        assert_eq!(load_threads(0, false), 1);
        assert!((1..=8).contains(&load_threads(0, true)));
        assert_eq!(idle_load_threads(3, false), 3);
        assert_eq!(idle_load_threads(0, true), load_threads(0, true));
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(idle_load_threads(0, false), cpus.clamp(1, 8));
    }
}
