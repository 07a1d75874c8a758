//! Read bandwidth: the store's `get_batch` against a plain sequential read of its own
//! segment files, on the bench's blocks and on realistically sized KV.

use super::*;

/// Read bandwidth in GB/s: ragkv's `get_batch` and a plain read of the same segment files.
pub(super) struct Bandwidth {
    pub ours_cold: f64,
    /// Cold, each next chunk announced (`Store::prefetch`) once the one before is read, as the
    /// serving loader does before it imports a chunk.
    pub ours_cold_announced: f64,
    pub plain_cold: f64,
    pub ours_warm: f64,
    pub plain_warm: f64,
}

/// Cold and warm read bandwidth: `get_batch_into` (one reused buffer) over every stored chunk,
/// in write order (cold: also with each next chunk announced once the one before is read, as
/// the serving loader does), vs a plain sequential read of the segment files (1 MiB reads); the median of
/// three alternating runs each. Figures are KV bytes delivered per second for ours (which
/// excludes record headers, so it slightly understates ours), file bytes per second for the
/// plain read.
pub(super) fn bandwidth(
    store: &Store,
    ns: NamespaceId,
    chunks: &[Vec<u32>],
) -> Result<Bandwidth, Error> {
    let segs = store.segment_paths();
    let drop_all = || -> Result<(), Error> {
        for p in &segs {
            drop_pages(p)?;
        }
        Ok(())
    };
    let mut out = Vec::new();
    let mut ours = |announce: bool| -> Result<f64, Error> {
        let t = Instant::now();
        let mut bytes = 0usize;
        for (i, toks) in chunks.iter().enumerate() {
            store.get_batch_into(ns, toks, toks.len(), &mut out)?;
            if let Some(next) = chunks.get(i + 1).filter(|_| announce) {
                store.prefetch(ns, next)?;
            }
            bytes += out.len();
            std::hint::black_box(&out);
        }
        Ok(bytes as f64 / t.elapsed().as_secs_f64() / 1e9)
    };
    let plain = || -> Result<f64, Error> {
        let t = Instant::now();
        let mut bytes = 0usize;
        let mut buf = vec![0u8; 1 << 20];
        for p in &segs {
            let f = File::open(p).map_err(io(format!("opening {}", p.display())))?;
            let mut off = 0u64;
            loop {
                let n = f.read_at(&mut buf, off).map_err(io("reading segment"))?;
                if n == 0 {
                    break;
                }
                off += n as u64;
                bytes += n;
                std::hint::black_box(&buf);
            }
        }
        Ok(bytes as f64 / t.elapsed().as_secs_f64() / 1e9)
    };
    // The disk of a shared VM is noisy: alternate the two readers and take medians.
    const REPS: usize = 3;
    let (mut oc, mut oa, mut pc) = (Vec::new(), Vec::new(), Vec::new());
    let (mut ow, mut pw) = (Vec::new(), Vec::new());
    for _ in 0..REPS {
        drop_all()?;
        oc.push(ours(false)?);
        drop_all()?;
        oa.push(ours(true)?);
        drop_all()?;
        pc.push(plain()?);
    }
    plain()?; // warm everything
    for _ in 0..REPS {
        ow.push(ours(false)?);
        pw.push(plain()?);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    eprintln!(
        "  cold GB/s ours {oc:.2?} announced {oa:.2?} plain {pc:.2?}; warm ours {ow:.2?} plain {pw:.2?}"
    );
    Ok(Bandwidth {
        ours_cold: median(oc),
        ours_cold_announced: median(oa),
        plain_cold: median(pc),
        ours_warm: median(ow),
        plain_warm: median(pw),
    })
}

/// SmolLM2-135M's KV layout in f16: 23,040 bytes per token.
pub(super) const SMOLLM2_F16: KvLayout = KvLayout {
    layers: 30,
    kv_heads: 3,
    head_dim: 64,
    dtype: DType::F16,
};

/// A store for a throw-away measurement: no hot tier, no background merges, no fsync.
pub(super) fn scratch_store(dir: &Path) -> Result<Store, Error> {
    Ok(Store::open(
        dir,
        StoreOptions {
            hot_tier_bytes: 0,
            background_merge: false,
            sync: SyncPolicy::Never,
            ..StoreOptions::default()
        },
    )?)
}

/// Bandwidth on realistically sized KV: SmolLM2-135M's layout in f16 (23 KB per token), chunks
/// of `tokens_per_chunk` (11.8 MB at 512), 64-token blocks, `total_bytes` in all.
pub(super) fn bandwidth_realistic(
    root: &Path,
    total_bytes: u64,
    tokens_per_chunk: usize,
) -> Result<Bandwidth, Error> {
    let dir = root.join("bandwidth");
    let store = scratch_store(&dir)?;
    let l = SMOLLM2_F16;
    let n = (total_bytes / l.bytes_for(tokens_per_chunk) as u64).max(1) as usize;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
    let mut kv = vec![0u8; l.bytes_for(tokens_per_chunk)];
    let chunks: Vec<Vec<u32>> = (0..n)
        .map(|c| chunk_tokens(c + 5_000_000, tokens_per_chunk))
        .collect();
    for toks in &chunks {
        rng.fill_bytes(&mut kv);
        store.put_batch(
            NS,
            l,
            &[PutItem {
                tokens: toks,
                kv: &kv,
                doc: None,
            }],
        )?;
    }
    store.sync()?;
    let bw = bandwidth(&store, NS, &chunks)?;
    drop(store);
    remove(&dir)?;
    Ok(bw)
}
