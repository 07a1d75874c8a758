//! The baselines: file-per-block (as HiCacheFile and MatKV store KV) and RocksDB BlobDB.

use super::*;

/// Per-block names for the baselines: a hash chain over the token blocks (as file backends do).
pub(super) fn block_names(tokens: &[u32]) -> Vec<[u8; 16]> {
    let mut prev = [0u8; 16];
    let mut buf = [0u8; BLOCK_TOKENS * 4];
    tokens
        .chunks(BLOCK_TOKENS)
        .map(|b| {
            // One `update` for the block's tokens, as the store's digest does.
            let mut h = blake3::Hasher::new();
            h.update(&prev);
            for (w, t) in buf.chunks_exact_mut(4).zip(b) {
                w.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..b.len() * 4]);
            prev.copy_from_slice(&h.finalize().as_bytes()[..16]);
            prev
        })
        .collect()
}

/// Lower-case hex of a block name (one allocation).
pub(super) fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(DIGITS[(x >> 4) as usize] as char);
        s.push(DIGITS[(x & 15) as usize] as char);
    }
    s
}

/// Block `j` of layer-major `kv` (the bytes the store writes for that block).
pub(super) fn block_payload(kv: &[u8], l: &KvLayout, total: usize, j: usize, out: &mut Vec<u8>) {
    out.clear();
    let tb = l.plane_token_bytes();
    for p in 0..l.planes() {
        let s = (p * total + j * BLOCK_TOKENS) * tb;
        out.extend_from_slice(&kv[s..s + BLOCK_TOKENS * tb]);
    }
}

/// Copies a block payload into its place in a layer-major chunk buffer.
pub(super) fn place_block(out: &mut [u8], l: &KvLayout, total: usize, j: usize, payload: &[u8]) {
    let tb = l.plane_token_bytes();
    for p in 0..l.planes() {
        let d = (p * total + j * BLOCK_TOKENS) * tb;
        let s = p * BLOCK_TOKENS * tb;
        out[d..d + BLOCK_TOKENS * tb].copy_from_slice(&payload[s..s + BLOCK_TOKENS * tb]);
    }
}

pub(super) fn bench_files(w: &Workload, dir: &Path) -> Result<Figures, Error> {
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    let l = w.layout;
    let path = |name: &[u8; 16]| dir.join(hex(name));
    let mut payload = Vec::with_capacity(l.bytes_for(BLOCK_TOKENS));
    let put_time = w.batches(|_, toks, kvs| {
        let t = Instant::now();
        let mut written = Vec::new();
        for (tk, kv) in toks.iter().zip(kvs) {
            for (j, name) in block_names(tk).iter().enumerate() {
                let p = path(name);
                if p.exists() {
                    continue;
                }
                block_payload(kv, &l, tk.len(), j, &mut payload);
                let mut f = File::create(&p).map_err(io(format!("creating {}", p.display())))?;
                std::io::Write::write_all(&mut f, &payload).map_err(io("writing block file"))?;
                if w.sync {
                    written.push(f);
                }
            }
        }
        for f in &written {
            f.sync_data().map_err(io("syncing block file"))?;
        }
        if w.sync {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io("syncing directory"))?;
        }
        Ok(t.elapsed())
    })?;
    let blocks = (w.chunks * w.chunk_tokens / BLOCK_TOKENS) as f64;
    write_back();

    Ok(Figures {
        put_blocks_per_s: blocks / put_time.as_secs_f64(),
        files: count_files(dir)?,
    })
}

/// The file baseline's chunk get: open and read each block file, placing it into one buffer.
/// Like ours, it hashes the tokens into block names inside the timed call.
pub(super) fn file_getter<'a>(
    w: &Workload,
    dir: &'a Path,
) -> impl Fn(&Vec<u32>) -> Result<(), Error> + 'a {
    let l = w.layout;
    let total = w.chunk_tokens;
    let bufs = std::cell::RefCell::new((
        vec![0u8; l.bytes_for(total)],
        vec![0u8; l.bytes_for(BLOCK_TOKENS)],
    ));
    move |tokens: &Vec<u32>| {
        let mut bufs = bufs.borrow_mut();
        let (out, buf) = &mut *bufs;
        for (j, name) in block_names(tokens).iter().enumerate() {
            let mut f = File::open(dir.join(hex(name))).map_err(io("opening block file"))?;
            f.read_exact(buf).map_err(io("reading block file"))?;
            place_block(out, &l, total, j, buf);
        }
        std::hint::black_box(&*out);
        Ok(())
    }
}

/// The file baseline's probe of one sample: the same search as the store (last block, first
/// block, then a binary search), over `stat`.
pub(super) fn file_probe(dir: &Path, (tokens, stored): &(Vec<u32>, bool)) -> Result<(), Error> {
    let names = block_names(tokens);
    let exists = |i: usize| dir.join(hex(&names[i])).exists();
    let last = names.len() - 1;
    let n = if exists(last) {
        names.len()
    } else if last == 0 || !exists(0) {
        0
    } else {
        let (mut lo, mut hi) = (0, last - 1);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if exists(mid) {
                lo = mid
            } else {
                hi = mid - 1
            }
        }
        lo + 1
    };
    if (n == names.len()) != *stored {
        return Err(Error::Check(format!("file probe returned {n} blocks")));
    }
    Ok(())
}

pub(super) fn bench_blobdb(w: &Workload, dir: &Path) -> Result<(f64, f64), Error> {
    let rocks = |what| move |cause| Error::Rocks { what, cause };
    let mut opts = rocksdb::Options::default();
    opts.create_if_missing(true);
    opts.set_enable_blob_files(true);
    opts.set_min_blob_size(0);
    opts.set_blob_file_size(256 << 20);
    opts.set_max_background_jobs(2);
    let mut bb = rocksdb::BlockBasedOptions::default();
    bb.set_bloom_filter(10.0, false);
    bb.set_block_cache(&rocksdb::Cache::new_lru_cache(64 << 20));
    opts.set_block_based_table_factory(&bb);
    // Opened with the default family named, so gets use the same batched multi-get as the store.
    let db = rocksdb::DB::open_cf(&opts, dir, ["default"]).map_err(rocks("open"))?;
    let mut wo = rocksdb::WriteOptions::default();
    wo.set_sync(w.sync);
    let l = w.layout;
    let mut payload = Vec::new();
    let put_time = w.batches(|_, toks, kvs| {
        let t = Instant::now();
        let mut batch = rocksdb::WriteBatch::default();
        for (tk, kv) in toks.iter().zip(kvs) {
            for (j, name) in block_names(tk).iter().enumerate() {
                block_payload(kv, &l, tk.len(), j, &mut payload);
                batch.put(name, &payload);
            }
        }
        db.write_opt(batch, &wo).map_err(rocks("write"))?;
        Ok(t.elapsed())
    })?;
    // Settle like ours: flush, then wait for compactions to finish before timing reads.
    db.flush().map_err(rocks("flush"))?;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(600) {
        let running = db
            .property_int_value("rocksdb.num-running-compactions")
            .map_err(rocks("property"))?;
        let pending = db
            .property_int_value("rocksdb.compaction-pending")
            .map_err(rocks("property"))?;
        if running.unwrap_or(0) == 0 && pending.unwrap_or(0) == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "  blobdb: settled in {:.1?} after the bulk load",
        t.elapsed()
    );
    let blocks = (w.chunks * w.chunk_tokens / BLOCK_TOKENS) as f64;
    // Like ours, the baselines hash tokens into block names inside the timed call.
    let sample: Vec<Vec<u32>> = w
        .sample
        .iter()
        .map(|&c| chunk_tokens(c, w.chunk_tokens))
        .collect();
    let total = w.chunk_tokens;
    let out = std::cell::RefCell::new(vec![0u8; l.bytes_for(total)]);
    let get = |tokens: &Vec<u32>| -> Result<(), Error> {
        let mut out = out.borrow_mut();
        let names = block_names(tokens);
        let vals = db.batched_multi_get_cf(
            db.cf_handle("default")
                .ok_or(Error::Check("no default cf".into()))?,
            &names,
            false,
        );
        for (j, v) in vals.into_iter().enumerate() {
            let v = v
                .map_err(rocks("multi_get"))?
                .ok_or(Error::Check("blobdb lost a block".into()))?;
            place_block(&mut out, &l, total, j, &v);
        }
        std::hint::black_box(&*out);
        Ok(())
    };
    time_samples(&sample, get)?;
    let lat = time_samples(&sample, get)?;
    let get_s: f64 = lat.iter().sum::<f64>() / 1e6;
    Ok((
        blocks / put_time.as_secs_f64(),
        w.sample.len() as f64 / get_s,
    ))
}
