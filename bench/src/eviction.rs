//! `ragkv bench eviction`: hit rate of each eviction policy at several budgets on a
//! Zipf-skewed query trace, replayed against the real store.
//!
//! `--chunks` chunks of 64-512 tokens (uniform), popularity Zipf(`--zipf`) over a random
//! permutation. Each request reads its chunk (`get_batch`); a miss re-materializes it
//! (`put_batch`), which makes room by policy when the group passes its high-water mark. The
//! quota is a share (`--budgets`) of all chunks' record bytes. Every policy at a budget
//! replays the same trace from the same (empty) state. Reported: request hit rate and token
//! hit rate (the share of requested tokens served from storage, i.e. prefill saved), each
//! policy against LRU at the same budget.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ::kvstore::{
    CapacityOptions, CostModel, DType, EvictionPolicy, KvLayout, NamespaceId, OnFull, PutItem,
    Store, StoreOptions, SyncPolicy,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::{io, Error, Line};

/// Arguments of `ragkv bench eviction`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Distinct chunks in the trace.
    #[arg(long, default_value_t = 2_000)]
    pub chunks: usize,
    /// Requests in the trace.
    #[arg(long, default_value_t = 40_000)]
    pub requests: usize,
    /// Zipf exponent of chunk popularity.
    #[arg(long, default_value_t = 0.9)]
    pub zipf: f64,
    /// Quotas as shares of the total record bytes of all chunks, comma-separated.
    #[arg(long, default_value = "0.05,0.1,0.2,0.4")]
    pub budgets: String,
    /// TTL of the `ttl` policy, ms (its sweep runs every 500 ms).
    #[arg(long, default_value_t = 2_000)]
    pub ttl_ms: u64,
    /// Seed of the trace.
    #[arg(long, default_value_t = 11)]
    pub seed: u64,
    /// Working directory (default: a fresh temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

const NS: NamespaceId = NamespaceId([0xe7; 16]);

fn layout() -> KvLayout {
    KvLayout {
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
        dtype: DType::F16,
    }
}

/// A Zipf sampler over `0..n` by inverse CDF.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut cdf = Vec::with_capacity(n);
        let mut acc = 0.0;
        for k in 1..=n {
            acc += 1.0 / (k as f64).powf(s);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    fn sample(&self, rng: &mut impl Rng) -> usize {
        let u: f64 = rng.gen();
        self.cdf.partition_point(|c| *c < u).min(self.cdf.len() - 1)
    }
}

struct Outcome {
    hits: usize,
    tokens_hit: usize,
    tokens: usize,
    evicted: u64,
    max_used: u64,
    secs: f64,
}

fn replay(
    dir: &std::path::Path,
    policy: EvictionPolicy,
    quota: u64,
    chunks: &[Vec<u32>],
    trace: &[usize],
) -> Result<Outcome, Error> {
    let store = Store::open(
        dir,
        StoreOptions {
            sync: SyncPolicy::Never,
            hot_tier_bytes: 0,
            background_merge: true,
            capacity: CapacityOptions {
                quota_bytes: Some(quota),
                policy,
                on_full: OnFull::Evict,
                flush_interval: Duration::from_millis(500),
                ..CapacityOptions::default()
            },
            ..StoreOptions::default()
        },
    )?;
    let mut buf = Vec::new();
    let mut out = Outcome {
        hits: 0,
        tokens_hit: 0,
        tokens: 0,
        evicted: 0,
        max_used: 0,
        secs: 0.0,
    };
    let t = Instant::now();
    for &c in trace {
        let tokens = &chunks[c];
        out.tokens += tokens.len();
        match store.get_batch_into(NS, tokens, tokens.len(), &mut buf) {
            Ok(_) => {
                out.hits += 1;
                out.tokens_hit += tokens.len();
            }
            Err(e) if e.is_miss() => {
                let kv = vec![(c % 251) as u8; layout().bytes_for(tokens.len())];
                store.put_batch(
                    NS,
                    layout(),
                    &[PutItem {
                        tokens,
                        kv: &kv,
                        doc: None,
                    }],
                )?;
                out.max_used = out
                    .max_used
                    .max(store.group_bytes(::kvstore::DEFAULT_GROUP));
            }
            Err(e) => return Err(e.into()),
        }
    }
    out.secs = t.elapsed().as_secs_f64();
    out.evicted = store.stats().evicted_sequences;
    if out.max_used > quota {
        return Err(Error::Check(format!(
            "{}: {} bytes used over a quota of {quota}",
            policy.name(),
            out.max_used
        )));
    }
    Ok(out)
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    let budgets: Vec<f64> = args
        .budgets
        .split(',')
        .map(|b| b.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .ok()
        .filter(|v: &Vec<f64>| !v.is_empty() && v.iter().all(|b| *b > 0.0 && *b <= 1.0))
        .ok_or_else(|| Error::Invalid {
            what: "--budgets",
            why: format!("{:?} (shares in (0, 1], comma-separated)", args.budgets),
        })?;
    if args.chunks < 2 || args.requests == 0 || args.zipf <= 0.0 {
        return Err(Error::Invalid {
            what: "--chunks/--requests/--zipf",
            why: "need at least 2 chunks, 1 request and a positive exponent".into(),
        });
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let chunks: Vec<Vec<u32>> = (0..args.chunks)
        .map(|i| {
            let n = rng.gen_range(64..=512);
            (0..n).map(|t| (i * 1000 + t) as u32).collect()
        })
        .collect();
    let mut order: Vec<usize> = (0..args.chunks).collect();
    order.shuffle(&mut rng);
    let zipf = Zipf::new(args.chunks, args.zipf);
    let trace: Vec<usize> = (0..args.requests)
        .map(|_| order[zipf.sample(&mut rng)])
        .collect();

    // Record bytes of every chunk, measured on an unbounded store.
    let work = crate::WorkDir::new(args.dir.as_deref())?;
    let root = work.path().to_path_buf();
    let total: u64 = {
        let dir = root.join("all");
        let store = Store::open(
            &dir,
            StoreOptions {
                sync: SyncPolicy::Never,
                ..StoreOptions::default()
            },
        )?;
        for (i, c) in chunks.iter().enumerate() {
            let kv = vec![(i % 251) as u8; layout().bytes_for(c.len())];
            store.put_batch(
                NS,
                layout(),
                &[PutItem {
                    tokens: c,
                    kv: &kv,
                    doc: None,
                }],
            )?;
        }
        let b = store.group_bytes(::kvstore::DEFAULT_GROUP);
        drop(store);
        std::fs::remove_dir_all(&dir).map_err(io("removing the work directory"))?;
        b
    };

    let policies = [
        EvictionPolicy::Lru,
        EvictionPolicy::Lfu,
        EvictionPolicy::Ttl {
            ttl: Duration::from_millis(args.ttl_ms),
        },
        EvictionPolicy::CostAware(CostModel::default()),
    ];
    let mut lines = Vec::new();
    for &b in &budgets {
        let quota = (total as f64 * b) as u64;
        let mut results = Vec::new();
        for p in policies {
            let dir = root.join(format!("{}-{b}", p.name()));
            let o = replay(&dir, p, quota, &chunks, &trace)?;
            std::fs::remove_dir_all(&dir).map_err(io("removing the work directory"))?;
            eprintln!(
                "budget {b}: {} hit rate {:.3} (token hit rate {:.3}, {} evicted, {:.1} s)",
                p.name(),
                o.hits as f64 / trace.len() as f64,
                o.tokens_hit as f64 / o.tokens as f64,
                o.evicted,
                o.secs
            );
            results.push((p, o));
        }
        let lru = &results[0].1;
        let rate = |o: &Outcome| o.hits as f64 / trace.len() as f64;
        let token_rate = |o: &Outcome| o.tokens_hit as f64 / o.tokens as f64;
        for (p, o) in &results[1..] {
            lines.push(Line {
                detail: Some(json!({
                    "budget_share": b, "quota_bytes": quota, "chunks": args.chunks,
                    "requests": trace.len(), "zipf": args.zipf,
                    "token_hit_rate": {"ours": token_rate(o), "lru": token_rate(lru)},
                    "evicted": {"ours": o.evicted, "lru": lru.evicted},
                    "max_used_bytes": o.max_used,
                })),
                ..Line::higher(
                    &format!("eviction.{}.budget{b}.hit_rate", p.name()),
                    rate(o),
                    rate(lru),
                    "hit rate",
                    "LRU at the same budget",
                )
            });
        }
    }
    Ok(lines)
}
