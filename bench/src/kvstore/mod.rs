//! `ragkv bench kvstore`: the KV store against the ways KV caches are stored today.
//!
//! - **file-per-block** (HiCacheFile, MatKV): one file per block, named by the hash of its token
//!   prefix, in one directory. Put checks existence first (as those backends do) and writes
//!   the file; get opens and reads each block file; probe is the same binary search over
//!   `stat` calls. Same payload bytes, same fsync policy.
//! - **BlobDB**: RocksDB with `enable_blob_files`, block key → block payload; a chunk get is one
//!   `multi_get` of its blocks.
//!
//! Every system gets the same chunks (sequences of `chunk_blocks` blocks) in the same order.
//! Payload generation is outside the timed sections. The store and the file baseline are both
//! loaded before either is read; then their gets and probes run interleaved over one random
//! sample (slices of 500 samples, each slice on both systems in turn, the order alternating;
//! one untimed pass that warms the page cache for both alike, then timed passes: one for gets,
//! two for probes), so that both see the same machine: on a shared VM the tail moves by ±20 %
//! from one minute to the next. BlobDB's gets are timed on their own, after the store is closed
//! (one untimed pass, then one timed).
//! The store runs without its hot tier, so every get goes through the index and the file.
//! Its writes use its defaults: a put batch (≈540 KB here) goes to the segment with direct
//! I/O, bypassing the page cache; the file baseline writes through the page cache, as those
//! backends do (direct I/O on 4 KiB files would make each one a synchronous device write).

mod bandwidth;
mod baselines;
mod codecs;
mod fidelity;

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ::kvstore::{PutItem, Store, StoreOptions, SyncPolicy};
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use schema::{DType, KvLayout, NamespaceId};

use crate::{io, percentile, Error, Line};
use bandwidth::{bandwidth, bandwidth_realistic};
use baselines::{bench_blobdb, bench_files, file_getter, file_probe};
use codecs::codecs;
use fidelity::fidelity;

const BLOCK_TOKENS: usize = 16;
const NS: NamespaceId = NamespaceId([0x42; 16]);

/// Arguments of `ragkv bench kvstore`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Blocks written to each system.
    #[arg(long, default_value_t = 1_000_000)]
    pub blocks: usize,
    /// Bytes per block (a multiple of 64).
    #[arg(long, default_value_t = 4096)]
    pub block_bytes: usize,
    /// Blocks per chunk; a chunk get reads one chunk's adjacent blocks.
    #[arg(long, default_value_t = 8)]
    pub chunk_blocks: usize,
    /// Chunks per put batch.
    #[arg(long, default_value_t = 16)]
    pub batch_chunks: usize,
    /// fsync policy for every system: `none`, or `batch` (sync before a batch returns).
    #[arg(long, default_value = "none")]
    pub sync: String,
    /// Random chunk gets and probes timed per system.
    #[arg(long, default_value_t = 20_000)]
    pub samples: usize,
    /// Working directory (default: a fresh temporary directory); emptied afterwards.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Skip the BlobDB comparison.
    #[arg(long)]
    pub skip_blobdb: bool,
    /// Skip the file-per-block comparison.
    #[arg(long)]
    pub skip_files: bool,
    /// Bytes of SmolLM2-shaped f16 KV for the read-bandwidth comparison.
    #[arg(long, default_value_t = 4 << 30)]
    pub bw_bytes: u64,
    /// Tokens per chunk for the read-bandwidth comparison (512: 11.8 MB per chunk).
    #[arg(long, default_value_t = 512)]
    pub bw_chunk_tokens: usize,
    /// Tokens of KV for the codec report; 0 skips it.
    #[arg(long, default_value_t = 4096)]
    pub codec_tokens: usize,
    /// KV for the codec report: `real` (SmolLM2-135M prefilled over dataset documents, exported
    /// in f16) or `synthetic` (Gaussian f16 values in SmolLM2-135M's shape).
    #[arg(long, default_value = "real")]
    pub codec_kv: String,
    /// GGUF file or HF directory for `--codec-kv real` (default: the SmolLM2 file fetched by
    /// scripts/setup.sh).
    #[arg(long)]
    pub codec_model: Option<PathBuf>,
    /// LongBench-HotpotQA directory for `--codec-kv real`.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
}

/// Tokens per chunk of the real-model codec KV (each chunk prefilled alone from position 0,
/// as ingestion does).
const CODEC_CHUNK_TOKENS: usize = 512;

/// Timed passes over the probe sample (after one untimed pass).
const PROBE_PASSES: usize = 2;

fn layout(block_bytes: usize) -> KvLayout {
    // 1 layer × (K, V) × 1 head × head_dim f16 per token, 16 tokens per block.
    KvLayout {
        layers: 1,
        kv_heads: 1,
        head_dim: (block_bytes / (BLOCK_TOKENS * 2 * 2)) as u16,
        dtype: DType::F16,
    }
}

/// Tokens of chunk `c`: unique per chunk, so no block is shared.
fn chunk_tokens(c: usize, n: usize) -> Vec<u32> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(c as u64 ^ 0x5eed);
    (0..n).map(|_| rng.gen_range(0..150_000)).collect()
}

/// Drops the page cache of `path` (after syncing it, since dirty pages cannot be dropped).
pub(crate) fn drop_pages(path: &Path) -> Result<(), Error> {
    let f = File::open(path).map_err(io(format!("opening {}", path.display())))?;
    f.sync_all()
        .map_err(io(format!("syncing {}", path.display())))?;
    // SAFETY: fadvise on an owned, valid descriptor.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(Error::Io {
            what: format!("posix_fadvise {}", path.display()),
            cause: std::io::Error::from_raw_os_error(rc),
        });
    }
    Ok(())
}

struct Workload {
    layout: KvLayout,
    chunks: usize,
    chunk_tokens: usize,
    batch_chunks: usize,
    sync: bool,
    sample: Vec<usize>,
    /// Half of the probes ask for chunks that were never stored.
    probe_sample: Vec<(usize, bool)>,
}

impl Workload {
    /// Calls `f` with each batch (chunk ids, their tokens, their KV), generated outside timing.
    fn batches(
        &self,
        mut f: impl FnMut(&[usize], &[Vec<u32>], &[Vec<u8>]) -> Result<Duration, Error>,
    ) -> Result<Duration, Error> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        let mut total = Duration::ZERO;
        let mut c = 0;
        while c < self.chunks {
            let ids: Vec<usize> = (c..(c + self.batch_chunks).min(self.chunks)).collect();
            let toks: Vec<Vec<u32>> = ids
                .iter()
                .map(|&i| chunk_tokens(i, self.chunk_tokens))
                .collect();
            let kvs: Vec<Vec<u8>> = ids
                .iter()
                .map(|_| {
                    let mut kv = vec![0u8; self.layout.bytes_for(self.chunk_tokens)];
                    rng.fill_bytes(&mut kv);
                    kv
                })
                .collect();
            total += f(&ids, &toks, &kvs)?;
            c += ids.len();
        }
        Ok(total)
    }
}

struct Figures {
    put_blocks_per_s: f64,
    files: u64,
}

fn count_files(dir: &Path) -> Result<u64, Error> {
    let mut n = 0;
    for e in std::fs::read_dir(dir).map_err(io(format!("listing {}", dir.display())))? {
        let e = e.map_err(io("listing"))?;
        if e.file_type().map_err(io("stat"))?.is_dir() {
            n += count_files(&e.path())?;
        } else {
            n += 1;
        }
    }
    Ok(n)
}

fn time_samples<T>(
    items: &[T],
    mut f: impl FnMut(&T) -> Result<(), Error>,
) -> Result<Vec<f64>, Error> {
    let mut lat = Vec::with_capacity(items.len());
    for it in items {
        let t = Instant::now();
        f(it)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    Ok(lat)
}

/// The probe sample as token sequences: half stored chunks, half never-stored ones.
fn probe_tokens(w: &Workload) -> Vec<(Vec<u32>, bool)> {
    w.probe_sample
        .iter()
        .map(|&(c, stored)| {
            let c = if stored { c } else { c + 1_000_000_000 };
            (chunk_tokens(c, w.chunk_tokens), stored)
        })
        .collect()
}

/// Calls, one per system, that serve one sample.
type Systems<'a, T> = [&'a dyn Fn(&T) -> Result<(), Error>];

/// Latencies (µs) of each system over `items`, measured interleaved so that every system sees
/// the same machine: the items are cut into slices of [`SLICE`]; each slice runs on every
/// system in turn, the order rotating from slice to slice. One untimed pass first (warming
/// every system's caches alike), then `passes` timed ones; results are in item order, pass
/// after pass.
fn interleaved<T>(
    items: &[T],
    passes: usize,
    systems: &Systems<'_, T>,
) -> Result<Vec<Vec<f64>>, Error> {
    const SLICE: usize = 500;
    let n = systems.len();
    let mut lat = vec![Vec::with_capacity(items.len() * passes); n];
    for pass in 0..=passes {
        for (i, slice) in items.chunks(SLICE).enumerate() {
            for k in 0..n {
                let s = (i + pass + k) % n;
                for it in slice {
                    let t = Instant::now();
                    systems[s](it)?;
                    if pass > 0 {
                        lat[s].push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
            }
        }
    }
    // Each system's latencies went in slice by slice, so they are already in item order.
    Ok(lat)
}

/// Chunks per second from per-get latencies.
fn rate(lat: &[f64]) -> f64 {
    lat.len() as f64 / (lat.iter().sum::<f64>() / 1e6)
}

/// Splits one system's probe latencies (in [`interleaved`] order) into (stored, absent).
fn split_probes(probes: &[(Vec<u32>, bool)], lat: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let mut split = (Vec::new(), Vec::new());
    for (p, &us) in probes.iter().cycle().zip(lat) {
        if p.1 { &mut split.0 } else { &mut split.1 }.push(us);
    }
    split
}

/// p50 and p99 of all of a system's probes, and (stderr) of its stored and absent ones.
fn probe_figures(name: &str, (stored, absent): &(Vec<f64>, Vec<f64>)) -> (f64, f64) {
    let sorted = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v
    };
    for (kind, v) in [("stored", stored), ("absent", absent)] {
        let v = sorted(v);
        eprintln!(
            "  {name}: probe of {kind} chunks p50 {:.1} us, p99 {:.1} us",
            percentile(&v, 0.5),
            percentile(&v, 0.99)
        );
    }
    let all = sorted(&[stored.as_slice(), absent.as_slice()].concat());
    (percentile(&all, 0.5), percentile(&all, 0.99))
}

fn bench_ours(w: &Workload, dir: &Path) -> Result<(Figures, Store), Error> {
    let opts = StoreOptions {
        block_tokens: BLOCK_TOKENS,
        sync: if w.sync {
            SyncPolicy::EveryBatch
        } else {
            SyncPolicy::Never
        },
        hot_tier_bytes: 0,
        background_merge: false,
        // 256 MiB of index caches in all, as the file baseline's million inodes and dentries
        // stay in the kernel's caches: a location cache that holds every block's record
        // (91 MB at a million blocks), and RocksDB's block cache for the rest.
        location_cache_bytes: 192 << 20,
        index_cache_bytes: 64 << 20,
        ..StoreOptions::default()
    };
    let store = Store::open(dir, opts)?;
    let l = w.layout;
    let put_time = w.batches(|_, toks, kvs| {
        let items: Vec<PutItem<'_>> = toks
            .iter()
            .zip(kvs)
            .map(|(t, kv)| PutItem {
                tokens: t,
                kv,
                doc: None,
            })
            .collect();
        let t = Instant::now();
        store.put_batch(NS, l, &items)?;
        Ok(t.elapsed())
    })?;
    let blocks = (w.chunks * w.chunk_tokens / BLOCK_TOKENS) as f64;
    let st = store.stats();
    eprintln!(
        "  ragkv: put {:.0} blocks/s ({put_time:.1?} in put_batch; {:.0} % of {} MB with direct I/O)",
        blocks / put_time.as_secs_f64(),
        100.0 * st.bytes_written_direct as f64 / st.bytes_written.max(1) as f64,
        st.bytes_written >> 20,
    );
    // Let RocksDB finish compacting the bulk load (the file baseline's write-back is drained
    // by sync(2) before its reads in the same way).
    let settled = store.settle(Duration::from_secs(600))?;
    eprintln!("  ragkv: index settled in {settled:.1?} after the bulk load");
    eprintln!("  ragkv: {} sorted runs in the index", store.index_runs()?);

    store.sync()?;
    Ok((
        Figures {
            put_blocks_per_s: blocks / put_time.as_secs_f64(),
            files: count_files(dir)?,
        },
        store,
    ))
}

/// ragkv's probe of one sample, checked against what was stored.
fn ours_probe(store: &Store, (t, stored): &(Vec<u32>, bool)) -> Result<(), Error> {
    let n = store.probe(NS, t)?;
    if (n == t.len()) != *stored {
        return Err(Error::Check(format!("probe returned {n} of {}", t.len())));
    }
    Ok(())
}

/// Runs the benchmark; returns the compared figures.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    if args.block_bytes == 0 || !args.block_bytes.is_multiple_of(64) {
        return Err(Error::Invalid {
            what: "--block-bytes",
            why: format!("{} is not a positive multiple of 64", args.block_bytes),
        });
    }
    if args.chunk_blocks == 0
        || args.blocks < args.chunk_blocks
        || args.batch_chunks == 0
        || args.samples == 0
    {
        return Err(Error::Invalid {
            what: "--blocks/--chunk-blocks/--batch-chunks/--samples",
            why: "must be positive, and blocks ≥ chunk blocks".into(),
        });
    }
    if !matches!(args.codec_kv.as_str(), "real" | "synthetic") {
        return Err(Error::Invalid {
            what: "--codec-kv",
            why: format!("{:?} is neither `real` nor `synthetic`", args.codec_kv),
        });
    }
    let sync = match args.sync.as_str() {
        "none" => false,
        "batch" => true,
        s => {
            return Err(Error::Invalid {
                what: "--sync",
                why: format!("{s:?} (none or batch)"),
            })
        }
    };
    let work = crate::WorkDir::new(args.dir.as_deref())?;
    let root = work.path().to_path_buf();
    let chunks = args.blocks / args.chunk_blocks;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(99);
    let mut sample: Vec<usize> = (0..args.samples)
        .map(|_| rng.gen_range(0..chunks))
        .collect();
    sample.shuffle(&mut rng);
    let probe_sample = (0..args.samples)
        .map(|i| (rng.gen_range(0..chunks), i % 2 == 0))
        .collect();
    let w = Workload {
        layout: layout(args.block_bytes),
        chunks,
        chunk_tokens: args.chunk_blocks * BLOCK_TOKENS,
        batch_chunks: args.batch_chunks,
        sync,
        sample,
        probe_sample,
    };
    let blocks = chunks * args.chunk_blocks;
    let scale = format!(
        "{blocks} blocks of {} B, chunks of {}",
        args.block_bytes, args.chunk_blocks
    );
    eprintln!(
        "kvstore bench: {scale}, sync={}, in {}",
        args.sync,
        root.display()
    );

    let mut lines = Vec::new();
    let ours_dir = root.join("ragkv");
    // The first load starts clean too: nothing written before the bench is written back
    // during it.
    write_back();
    let t = Instant::now();
    let (ours, store) = bench_ours(&w, &ours_dir)?;
    eprintln!("  ragkv: done in {:.0?}", t.elapsed());
    let small_chunks: Vec<Vec<u32>> = (0..w.chunks)
        .map(|c| chunk_tokens(c, w.chunk_tokens))
        .collect();
    let small_bw = bandwidth(&store, NS, &small_chunks)?;

    // Gets and probes of the store, and of the file baseline unless skipped, interleaved
    // (the store stays open while the baseline loads).
    let sample: Vec<Vec<u32>> = w
        .sample
        .iter()
        .map(|&c| chunk_tokens(c, w.chunk_tokens))
        .collect();
    let probes = probe_tokens(&w);
    let buf = std::cell::RefCell::new(Vec::new());
    let ours_get = |t: &Vec<u32>| -> Result<(), Error> {
        let mut out = buf.borrow_mut();
        store.get_batch_into(NS, t, t.len(), &mut out)?;
        std::hint::black_box(&*out);
        Ok(())
    };
    let ours_probe = |p: &(Vec<u32>, bool)| ours_probe(&store, p);
    let ours_get_rate;
    if !args.skip_files {
        let t = Instant::now();
        let files_dir = root.join("files");
        let base = bench_files(&w, &files_dir)?;
        eprintln!("  file-per-block: loaded in {:.0?}", t.elapsed());
        let file_get = file_getter(&w, &files_dir);
        let gets = interleaved(&sample, 1, &[&ours_get, &file_get])?;
        ours_get_rate = rate(&gets[0]);
        let base_get_rate = rate(&gets[1]);
        let file_probe = |p: &(Vec<u32>, bool)| file_probe(&files_dir, p);
        let lat = interleaved(&probes, PROBE_PASSES, &[&ours_probe, &file_probe])?;
        let (ours_p50, ours_p99) = probe_figures("ragkv", &split_probes(&probes, &lat[0]));
        let (base_p50, base_p99) = probe_figures("file-per-block", &split_probes(&probes, &lat[1]));
        remove(&files_dir)?;
        let b = "file-per-block";
        lines.push(
            Line::higher(
                "kvstore.put",
                ours.put_blocks_per_s,
                base.put_blocks_per_s,
                "blocks/s",
                b,
            )
            .bar(3.0),
        );
        lines.push(
            Line::higher(
                "kvstore.chunk_get",
                ours_get_rate,
                base_get_rate,
                "chunks/s",
                b,
            )
            .bar(2.0),
        );
        lines.push(Line::lower(
            "kvstore.probe_p50",
            ours_p50,
            base_p50,
            "us",
            b,
        ));
        lines.push(Line::lower("kvstore.probe_p99", ours_p99, base_p99, "us", b).bar(1.0));
        lines.push(
            Line::lower(
                "kvstore.files",
                ours.files as f64,
                base.files as f64,
                "files",
                b,
            )
            .bar(1000.0),
        );
    } else {
        ours_get_rate = rate(&interleaved(&sample, 1, &[&ours_get])?[0]);
    }
    drop(store);
    remove(&ours_dir)?;
    if !args.skip_blobdb {
        let t = Instant::now();
        let blob_dir = root.join("blobdb");
        let (bput, bget) = bench_blobdb(&w, &blob_dir)?;
        eprintln!("  blobdb: done in {:.0?}", t.elapsed());
        remove(&blob_dir)?;
        lines.push(
            Line::higher(
                "kvstore.chunk_get_vs_blobdb",
                ours_get_rate,
                bget,
                "chunks/s",
                "rocksdb-blobdb",
            )
            .bar(1.5),
        );
        lines.push(Line::higher(
            "kvstore.put_vs_blobdb",
            ours.put_blocks_per_s,
            bput,
            "blocks/s",
            "rocksdb-blobdb",
        ));
    }
    let t = Instant::now();
    let bw = bandwidth_realistic(&root, args.bw_bytes, args.bw_chunk_tokens)?;
    eprintln!("  bandwidth: done in {:.0?}", t.elapsed());
    let plain = "plain sequential read of the same segment files";
    lines.push(
        Line::higher(
            "kvstore.read_bandwidth_cold",
            bw.ours_cold,
            bw.plain_cold,
            "GB/s",
            plain,
        )
        .bar(0.8),
    );
    lines.push(
        Line::higher(
            "kvstore.read_bandwidth_cold_announced",
            bw.ours_cold_announced,
            bw.plain_cold,
            "GB/s",
            plain,
        )
        .bar(0.8),
    );
    lines.push(Line::higher(
        "kvstore.read_bandwidth_warm",
        bw.ours_warm,
        bw.plain_warm,
        "GB/s",
        plain,
    ));
    lines.push(Line::higher(
        "kvstore.read_bandwidth_cold_32k_chunks",
        small_bw.ours_cold,
        small_bw.plain_cold,
        "GB/s",
        plain,
    ));
    lines.push(Line::higher(
        "kvstore.read_bandwidth_warm_32k_chunks",
        small_bw.ours_warm,
        small_bw.plain_warm,
        "GB/s",
        plain,
    ));
    if args.codec_tokens > 0 {
        lines.extend(codecs(&root, args)?);
        if args.codec_kv == "real" {
            lines.extend(fidelity(args)?);
        }
    }
    Ok(lines)
}

/// Removes a phase's directory and writes back every dirty page, so that no system's timed
/// section pays for another's write-back.
fn remove(dir: &Path) -> Result<(), Error> {
    std::fs::remove_dir_all(dir).map_err(io(format!("removing {}", dir.display())))?;
    write_back();
    Ok(())
}

/// Writes back every dirty page in the system (sync(2)).
fn write_back() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}
