//! Progress display: bars on a terminal, periodic log lines otherwise.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Counters the pipeline bumps; a display thread renders them.
#[derive(Debug, Default)]
pub struct Counters {
    /// Documents read.
    pub docs_seen: AtomicU64,
    /// Documents committed (or skipped).
    pub docs_done: AtomicU64,
    /// Chunks planned.
    pub chunks_total: AtomicU64,
    /// Chunks written.
    pub chunks_done: AtomicU64,
    /// Tokens to prefill.
    pub tokens_total: AtomicU64,
    /// Tokens prefilled.
    pub tokens_done: AtomicU64,
}

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// Bars if stderr is a terminal, else log lines.
    Auto,
    /// Progress bars.
    Bars,
    /// A log line every few seconds.
    Lines,
    /// Nothing.
    Quiet,
}

/// A running display; stops when dropped.
#[derive(Debug)]
pub struct Progress {
    /// What the display shows; the pipeline bumps it.
    pub counters: Arc<Counters>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    /// Starts the display thread.
    pub fn start(mode: ProgressMode) -> Progress {
        let counters = Arc::new(Counters::default());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mode = match mode {
            ProgressMode::Auto if std::io::stderr().is_terminal() => ProgressMode::Bars,
            ProgressMode::Auto => ProgressMode::Lines,
            m => m,
        };
        let thread = (mode != ProgressMode::Quiet).then(|| {
            let c = counters.clone();
            let s = stop.clone();
            std::thread::Builder::new()
                .name("ragkv-progress".into())
                .spawn(move || match mode {
                    ProgressMode::Bars => bars(&c, &s),
                    _ => lines(&c, &s),
                })
                .expect("spawn progress thread")
        });
        Progress {
            counters,
            stop,
            thread,
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn get(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

fn bars(c: &Counters, stop: &std::sync::atomic::AtomicBool) {
    let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
    let style =
        ProgressStyle::with_template("{prefix:>9} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> ");
    let mk = |name: &str| {
        let b = multi.add(ProgressBar::new(0));
        b.set_style(style.clone());
        b.set_prefix(name.to_string());
        b
    };
    let (docs, chunks, tokens) = (mk("documents"), mk("chunks"), mk("tokens"));
    loop {
        let done = stop.load(Ordering::Relaxed);
        docs.set_length(get(&c.docs_seen));
        docs.set_position(get(&c.docs_done));
        chunks.set_length(get(&c.chunks_total));
        chunks.set_position(get(&c.chunks_done));
        tokens.set_length(get(&c.tokens_total));
        tokens.set_position(get(&c.tokens_done));
        if done {
            for b in [&docs, &chunks, &tokens] {
                b.finish();
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn lines(c: &Counters, stop: &std::sync::atomic::AtomicBool) {
    let start = Instant::now();
    let mut last = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(200));
        if last.elapsed() < Duration::from_secs(10) {
            continue;
        }
        last = Instant::now();
        let t = start.elapsed().as_secs_f64();
        let tokens = get(&c.tokens_done);
        let total = get(&c.tokens_total);
        let rate = tokens as f64 / t.max(1e-9);
        let eta = if rate > 0.0 && total > tokens {
            format!("{:.0} s", (total - tokens) as f64 / rate)
        } else {
            "?".into()
        };
        eprintln!(
            "[ingest] documents {}/{}, chunks {}/{}, tokens {}/{} ({rate:.0}/s, eta {eta} for the documents read so far)",
            get(&c.docs_done),
            get(&c.docs_seen),
            get(&c.chunks_done),
            get(&c.chunks_total),
            tokens,
            total
        );
    }
}
