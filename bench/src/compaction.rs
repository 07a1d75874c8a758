//! `ragkv bench compaction`: the SGLang-LSM phased workload against the store with the
//! adaptive compaction controller on and off, in one run.
//!
//! Each request of a phase with hit rate `h` is, with probability `h`, a read of a stored
//! sequence (`get_batch`: index lookup and segment read), otherwise a miss: an empty `probe`
//! of a new sequence, then its `put_batch` (as a server re-materializing it would). Both
//! stores replay the same request sequence (same seed) from the same preloaded state, in fresh
//! directories, one after the other. Per phase and in total the bench reports index bytes read
//! and written by compaction (RocksDB statistics, the phase's delta), and mean and p99 op
//! latency. After the last phase each store settles (pending compactions run to completion)
//! and that tail counts in its total.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ::kvstore::{
    AdaptiveOptions, DType, KvLayout, NamespaceId, PutItem, Store, StoreOptions, SyncPolicy,
};
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::{io, percentile, Error, Line};

/// The paper's ten phases.
pub const PHASES: [f64; 10] = [0.2, 0.3, 0.5, 0.7, 0.5, 0.3, 0.1, 0.3, 0.5, 0.7];

/// Arguments of `ragkv bench compaction`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Requests per phase.
    #[arg(long, default_value_t = 150_000)]
    pub ops_per_phase: usize,
    /// Sequences stored before the first phase (the read set to start with).
    #[arg(long, default_value_t = 200_000)]
    pub preload: usize,
    /// Index memtable size, KiB (small, so that a short run flushes and compacts a lot).
    #[arg(long, default_value_t = 1024)]
    pub write_buffer_kib: usize,
    /// Controller window and evaluation period, ms.
    #[arg(long, default_value_t = 3000)]
    pub window_ms: u64,
    /// How often the controller evaluates, ms.
    #[arg(long, default_value_t = 500)]
    pub interval_ms: u64,
    /// Candidate size ratios and L0 run triggers of the controller, comma-separated.
    #[arg(long, default_value = "10")]
    pub size_ratios: String,
    /// Candidate L0 run triggers, comma-separated.
    #[arg(long, default_value = "2,4,8,16")]
    pub l0_triggers: String,
    /// Replay order static, adaptive, adaptive, static (ABBA: cancels drift of the machine
    /// over the run, at twice the time) instead of static, adaptive.
    #[arg(long)]
    pub abba: bool,
    /// Seed of the workload.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Working directory (default: a fresh temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

const NS: NamespaceId = NamespaceId([0xc0; 16]);

fn layout() -> KvLayout {
    KvLayout {
        layers: 1,
        kv_heads: 1,
        head_dim: 8,
        dtype: DType::F16,
    }
}

/// Tokens of sequence `i`: four tokens, one block.
fn seq(i: u64) -> [u32; 4] {
    [i as u32, (i >> 32) as u32, 0x5eed, 7]
}

#[derive(Debug, Default, Clone)]
struct Phase {
    hit_rate: f64,
    ops: usize,
    mean_us: f64,
    p99_us: f64,
    compact_read: u64,
    compact_write: u64,
    flush_write: u64,
    runs_after: u64,
    tuning: String,
}

struct Run {
    phases: Vec<Phase>,
    /// Compaction bytes (read + written) while settling after the last phase.
    tail_io: u64,
    transitions: u64,
}

fn list(what: &'static str, s: &str) -> Result<Vec<u32>, Error> {
    s.split(',')
        .map(|x| x.trim().parse::<u32>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Invalid {
            what,
            why: format!("{s:?}: {e}"),
        })
}

fn options(args: &Args, adaptive: bool) -> Result<StoreOptions, Error> {
    let size_ratios = list("--size-ratios", &args.size_ratios)?;
    let l0_triggers = list("--l0-triggers", &args.l0_triggers)?;
    Ok(StoreOptions {
        sync: SyncPolicy::Never,
        hot_tier_bytes: 0,
        background_merge: false,
        index_statistics: true,
        index_write_buffer_bytes: args.write_buffer_kib << 10,
        adaptive: adaptive.then(|| AdaptiveOptions {
            window: Duration::from_millis(args.window_ms),
            interval: Duration::from_millis(args.interval_ms),
            min_ops: 1_000,
            size_ratios,
            l0_triggers,
            ..AdaptiveOptions::default()
        }),
        ..StoreOptions::default()
    })
}

fn replay(args: &Args, dir: &Path, adaptive: bool) -> Result<Run, Error> {
    let store = Store::open(dir, options(args, adaptive)?)?;
    let kv = vec![0x3cu8; layout().bytes_for(4)];
    let put = |i: u64| -> Result<(), Error> {
        store.put_batch(
            NS,
            layout(),
            &[PutItem {
                tokens: &seq(i),
                kv: &kv,
                doc: None,
            }],
        )?;
        Ok(())
    };
    for i in 0..args.preload as u64 {
        put(i)?;
    }
    store.settle(Duration::from_secs(120))?;
    let mut next = args.preload as u64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let mut buf = Vec::new();
    let mut phases = Vec::new();
    let mut last_io = store.index_io().unwrap_or_default();
    for &h in &PHASES {
        let mut lat = Vec::with_capacity(args.ops_per_phase);
        for _ in 0..args.ops_per_phase {
            let hit = rng.gen_bool(h);
            let pick = rng.gen_range(0..next);
            let t = Instant::now();
            if hit {
                store.get_batch_into(NS, &seq(pick), 4, &mut buf)?;
            } else {
                let i = next;
                next += 1;
                if store.probe(NS, &seq(i))? != 0 {
                    return Err(Error::Check(format!("sequence {i} found before its put")));
                }
                put(i)?;
            }
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let io = store.index_io().unwrap_or_default();
        let mean = lat.iter().sum::<f64>() / lat.len().max(1) as f64;
        lat.sort_by(f64::total_cmp);
        let s = store.stats();
        phases.push(Phase {
            hit_rate: h,
            ops: lat.len(),
            mean_us: mean,
            p99_us: percentile(&lat, 0.99),
            compact_read: io.compact_read_bytes - last_io.compact_read_bytes,
            compact_write: io.compact_write_bytes - last_io.compact_write_bytes,
            flush_write: io.flush_write_bytes - last_io.flush_write_bytes,
            runs_after: store.index_runs()?,
            tuning: format!("T={} K={}", s.tuning.size_ratio, s.tuning.l0_trigger),
        });
        last_io = io;
    }
    store.settle(Duration::from_secs(300))?;
    let io = store.index_io().unwrap_or_default();
    let tail_io = io.compact_read_bytes + io.compact_write_bytes
        - last_io.compact_read_bytes
        - last_io.compact_write_bytes;
    Ok(Run {
        phases,
        tail_io,
        transitions: store.stats().tuning_transitions,
    })
}

const MB: f64 = 1e6;

/// Phase-by-phase mean of replays of one configuration (byte counts averaged too).
fn average(runs: &[Run]) -> Run {
    let n = runs.len() as f64;
    let avg = |f: &dyn Fn(&Run) -> f64| runs.iter().map(f).sum::<f64>() / n;
    let phases = (0..runs[0].phases.len())
        .map(|i| {
            let p = |f: &dyn Fn(&Phase) -> f64| avg(&|r: &Run| f(&r.phases[i]));
            Phase {
                hit_rate: runs[0].phases[i].hit_rate,
                ops: runs[0].phases[i].ops,
                mean_us: p(&|x| x.mean_us),
                p99_us: p(&|x| x.p99_us),
                compact_read: p(&|x| x.compact_read as f64) as u64,
                compact_write: p(&|x| x.compact_write as f64) as u64,
                flush_write: p(&|x| x.flush_write as f64) as u64,
                runs_after: p(&|x| x.runs_after as f64).round() as u64,
                tuning: runs
                    .iter()
                    .map(|r| r.phases[i].tuning.clone())
                    .collect::<Vec<_>>()
                    .join(" / "),
            }
        })
        .collect();
    Run {
        phases,
        tail_io: avg(&|r| r.tail_io as f64) as u64,
        transitions: runs.iter().map(|r| r.transitions).max().unwrap_or(0),
    }
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    if args.ops_per_phase == 0 || args.preload == 0 {
        return Err(Error::Invalid {
            what: "--ops-per-phase/--preload",
            why: "must be > 0".into(),
        });
    }
    let work = crate::WorkDir::new(args.dir.as_deref())?;
    let root = work.path().to_path_buf();
    let order: &[bool] = if args.abba {
        &[false, true, true, false]
    } else {
        &[false, true]
    };
    let (mut offs, mut ons) = (Vec::new(), Vec::new());
    for &adaptive in order {
        let name = if adaptive { "adaptive" } else { "static" };
        let dir = root.join(name);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io("clearing the work directory"))?;
        }
        eprintln!("compaction bench: replaying with the {name} configuration");
        let r = replay(args, &dir, adaptive)?;
        std::fs::remove_dir_all(&dir).map_err(io("removing the work directory"))?;
        if adaptive {
            ons.push(r)
        } else {
            offs.push(r)
        }
    }
    let (off, on) = (&average(&offs), &average(&ons));
    let mut lines = Vec::new();
    let mut worst: Option<(usize, f64)> = None;
    for (i, (a, b)) in on.phases.iter().zip(&off.phases).enumerate() {
        let detail = json!({
            "hit_rate": a.hit_rate, "ops": a.ops,
            "adaptive": {"compact_read_mb": a.compact_read as f64 / MB,
                         "compact_write_mb": a.compact_write as f64 / MB,
                         "flush_write_mb": a.flush_write as f64 / MB,
                         "p99_us": a.p99_us, "runs_after": a.runs_after, "tuning": a.tuning},
            "static": {"compact_read_mb": b.compact_read as f64 / MB,
                       "compact_write_mb": b.compact_write as f64 / MB,
                       "flush_write_mb": b.flush_write as f64 / MB,
                       "p99_us": b.p99_us, "runs_after": b.runs_after, "tuning": b.tuning},
        });
        let l = Line::lower(
            &format!("compaction.phase{}.h{}.latency", i + 1, a.hit_rate),
            a.mean_us,
            b.mean_us,
            "us/op",
            "static RocksDB options",
        );
        if worst.is_none_or(|(_, r)| l.ratio < r) {
            worst = Some((i, l.ratio));
        }
        lines.push(Line {
            detail: Some(detail),
            ..l
        });
        lines.push(Line::lower(
            &format!("compaction.phase{}.h{}.index_io", i + 1, a.hit_rate),
            (a.compact_read + a.compact_write) as f64 / MB,
            (b.compact_read + b.compact_write) as f64 / MB,
            "MB",
            "static RocksDB options",
        ));
    }
    let total = |r: &Run| {
        (r.phases
            .iter()
            .map(|p| p.compact_read + p.compact_write)
            .sum::<u64>()
            + r.tail_io) as f64
            / MB
    };
    let mean = |r: &Run| {
        r.phases
            .iter()
            .map(|p| p.mean_us * p.ops as f64)
            .sum::<f64>()
            / r.phases.iter().map(|p| p.ops).sum::<usize>() as f64
    };
    lines.push(Line {
        detail: Some(json!({
            "tail_mb": {"adaptive": on.tail_io as f64 / MB, "static": off.tail_io as f64 / MB},
            "transitions": on.transitions,
        })),
        ..Line::lower(
            "compaction.total_index_io",
            total(on),
            total(off),
            "MB",
            "static RocksDB options",
        )
        .bar(1.0 / 0.9)
    });
    lines.push(Line::lower(
        "compaction.total_latency",
        mean(on),
        mean(off),
        "us/op",
        "static RocksDB options",
    ));
    if let Some((i, _)) = worst {
        let (a, b) = (&on.phases[i], &off.phases[i]);
        lines.push(Line {
            detail: Some(json!({"phase": i + 1, "hit_rate": a.hit_rate,
                                "what": "the phase where the adaptive store fared worst"})),
            ..Line::lower(
                "compaction.worst_phase_latency",
                a.mean_us,
                b.mean_us,
                "us/op",
                "static RocksDB options",
            )
            .bar(1.0 / 1.05)
        });
    }
    Ok(lines)
}
