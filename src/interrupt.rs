//! Ctrl-C and SIGTERM for long CLI jobs: the first asks the job to stop at its next safe point
//! (what it finished is kept, and it reports what it did), a second ends the process at once.
//! Either way nothing stored is lost: the store and index are crash-safe; stopping politely
//! only saves redoing the chunk in progress and gives the report.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};

/// A flag set by the first SIGINT or SIGTERM; the handlers are in place when this returns.
pub fn flag() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Registered here, not on the thread: a signal that comes right after this returns is
    // already caught.
    let (mut int, mut term) = runtime.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        Ok::<_, std::io::Error>((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ))
    })?;
    let s = stop.clone();
    std::thread::Builder::new()
        .name("ragkv-signal".into())
        .spawn(move || {
            runtime.block_on(async move {
                tokio::select! {
                    _ = int.recv() => {},
                    _ = term.recv() => {},
                }
                s.store(true, Ordering::Relaxed);
                eprintln!("stopping after the current chunk (again to quit at once)");
                tokio::select! {
                    _ = int.recv() => {},
                    _ = term.recv() => {},
                }
                std::process::exit(130);
            })
        })
        .context("spawning ragkv-signal")?;
    Ok(stop)
}
