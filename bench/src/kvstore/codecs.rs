//! The codec report: stored size and warm get bandwidth of each codec on real model KV (or a
//! synthetic stand-in).

use super::bandwidth::{scratch_store, SMOLLM2_F16};
use super::*;

/// Cold reads of each codec's store, taken in turns with the other codecs'.
const COLD_PASSES: usize = 5;
/// Tokens per block of the encode and decode figures (the store's default block).
const BLOCK: usize = 64;

/// Synthetic KV shaped like SmolLM2-135M's (30 layers, 3 KV heads, head dim 64) in f16: Gaussian
/// values with a per-channel scale (keys have a few large channels, as real keys do). Used by
/// `--codec-kv synthetic`; the default report uses a real model's KV ([`model_kv`]).
pub(super) fn synthetic_kv(tokens: usize) -> (KvLayout, Vec<u8>) {
    let l = SMOLLM2_F16;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
    let per_plane = l.plane_token_bytes() / 2;
    let scales: Vec<f32> = (0..l.planes() * per_plane)
        .map(|_| {
            if rng.gen_bool(0.05) {
                8.0
            } else {
                rng.gen_range(0.3..1.5)
            }
        })
        .collect();
    let mut out = Vec::with_capacity(l.bytes_for(tokens));
    for p in 0..l.planes() {
        for _ in 0..tokens {
            for c in 0..per_plane {
                // Box-Muller.
                let (u1, u2): (f32, f32) = (rng.gen_range(1e-7..1.0), rng.gen());
                let z = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
                out.extend_from_slice(
                    &half::f16::from_f32(z * scales[p * per_plane + c]).to_le_bytes(),
                );
            }
        }
    }
    (l, out)
}

/// The model of the codec report (`--codec-model`, default SmolLM2-135M), the layout of its KV
/// in f16, and its path.
pub(super) fn codec_model(args: &Args) -> Result<(model::Model, KvLayout, PathBuf), Error> {
    use crate::model::merr;
    let path = codec_model_path(args);
    let source = model::ModelSource::from_path(&path).map_err(merr)?;
    let m = model::Model::load(&source, &model::LoadOptions::default()).map_err(merr)?;
    let layout = KvLayout {
        dtype: DType::F16,
        ..m.kv_layout().map_err(merr)?
    };
    Ok((m, layout, path))
}

/// The GGUF file or HF directory of the codec report: `--codec-model`, else SmolLM2-135M.
fn codec_model_path(args: &Args) -> PathBuf {
    args.codec_model
        .clone()
        .unwrap_or_else(|| model::models_dir().join(model::SMOLLM2_FILE))
}

/// A token sequence and its KV bytes.
pub(super) type TokensKv = (Vec<u32>, Vec<u8>);

/// KV of a real model: SmolLM2-135M (or `--codec-model`) prefilled over the dataset's
/// documents in chunks of [`CODEC_CHUNK_TOKENS`], each from position 0, exported in f16 (the
/// dtype the store is meant to hold), until `tokens` tokens. Returns the layout and, per
/// chunk, its tokens and KV bytes.
pub(super) fn model_kv(args: &Args, tokens: usize) -> Result<(KvLayout, Vec<TokensKv>), Error> {
    use crate::model::merr;
    let (m, layout, path) = codec_model(args)?;
    let dir = crate::dataset::resolve(args.dataset.as_deref())?;
    let mut chunks = Vec::new();
    let mut total = 0;
    'docs: for doc in crate::dataset::documents(&dir, usize::MAX)? {
        let ids = m.tokenizer().encode(&doc.text).map_err(merr)?;
        for c in ids.chunks(CODEC_CHUNK_TOKENS) {
            let n = c.len().min(tokens - total);
            let (kv, _) = m.decoder().prefill(&c[..n], 0).map_err(merr)?;
            let bytes = kv.to_bytes(model::DType::F16).map_err(merr)?;
            chunks.push((c[..n].to_vec(), bytes));
            total += n;
            if total == tokens {
                break 'docs;
            }
        }
    }
    eprintln!(
        "  codecs: {total} tokens of {} KV in {} chunks",
        path.display(),
        chunks.len()
    );
    Ok((layout, chunks))
}

/// Seconds the model of the report takes to prefill `items`' chunks as `ragkv ingest` does
/// (weights kept quantized, the default `model.weights`), each from position 0, the load
/// left out: the rate at which ingestion hands KV to the encoder.
fn ingest_prefill_secs(args: &Args, items: &[TokensKv]) -> Result<f64, Error> {
    use crate::model::merr;
    let source = model::ModelSource::from_path(codec_model_path(args)).map_err(merr)?;
    let options = model::LoadOptions {
        quantized: true,
        ..Default::default()
    };
    let m = model::Model::load(&source, &options).map_err(merr)?;
    let t = Instant::now();
    for (tokens, _) in items {
        m.decoder().prefill(tokens, 0).map_err(merr)?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Stored size and warm get bandwidth of each codec, through the store's public API.
pub(super) fn codecs(root: &Path, args: &Args) -> Result<Vec<Line>, Error> {
    let tokens = args.codec_tokens;
    // The model's prefill of the chunks, timed: the rate at which ingest produces KV to encode.
    let mut prefill_secs = None;
    let (l, items, base) = match args.codec_kv.as_str() {
        "real" => {
            let (l, items) = model_kv(args, tokens)?;
            prefill_secs = Some(ingest_prefill_secs(args, &items)?);
            (l, items, "codec none (real model f16 KV of dataset text)")
        }
        "synthetic" => {
            let (l, kv) = synthetic_kv(tokens);
            let toks: Vec<u32> = (0..tokens as u32).collect();
            (
                l,
                vec![(toks, kv)],
                "codec none (synthetic gaussian f16 KV)",
            )
        }
        other => {
            return Err(Error::Invalid {
                what: "--codec-kv",
                why: format!("{other:?} is neither `real` nor `synthetic`"),
            })
        }
    };
    let raw: usize = items.iter().map(|(_, kv)| kv.len()).sum();
    let puts: Vec<PutItem<'_>> = items
        .iter()
        .map(|(t, kv)| PutItem {
            tokens: t,
            kv,
            doc: None,
        })
        .collect();
    // Every codec's store first, so that the cold passes can take turns: each codec's cold
    // figure is the median of passes spread over the same minutes as the others' (this VM's
    // disk is shared, and its speed drifts).
    let mut stores = Vec::new();
    for codec in schema::Codec::ALL {
        let dir = root.join(format!("codec-{codec}"));
        let store = scratch_store(&dir)?;
        store.register_namespace(NS, l, codec)?;
        store.put_batch(NS, l, &puts)?;
        let ratio = raw as f64 / store.stats().live_bytes as f64;
        stores.push((codec, dir, store, ratio));
    }
    // Into one reused buffer, as the serving loader reads chunks (its pages touched before
    // the clock starts: a fresh buffer's page faults are no part of a read).
    let mut buf = vec![1u8; items.iter().map(|(_, kv)| kv.len()).max().unwrap_or(0)];
    let mut get_all = |codec: schema::Codec, store: &Store| -> Result<(), Error> {
        for (t, kv) in &items {
            store.get_batch_into(NS, t, t.len(), &mut buf)?;
            if buf.len() != kv.len() {
                return Err(Error::Check(format!("{codec}: short read")));
            }
            std::hint::black_box(&buf);
        }
        Ok(())
    };
    let mut colds = vec![Vec::new(); stores.len()];
    for _ in 0..COLD_PASSES {
        for ((codec, dir, store, _), cold) in stores.iter().zip(&mut colds) {
            // Cold: every segment file dropped from the page cache.
            drop_dir_pages(dir)?;
            let t = Instant::now();
            get_all(*codec, store)?;
            cold.push(raw as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    let mut figures = Vec::new();
    for ((codec, dir, store, ratio), mut cold) in stores.into_iter().zip(colds) {
        get_all(codec, &store)?; // warm
        let t = Instant::now();
        let reps = 5;
        for _ in 0..reps {
            get_all(codec, &store)?;
        }
        let gbps = (raw * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
        drop(store);
        remove(&dir)?;
        cold.sort_by(f64::total_cmp);
        figures.push((codec, ratio, gbps, cold[cold.len() / 2]));
    }
    let (_, none_ratio, none_gbps, none_cold) = figures[0];
    let mut lines = Vec::new();
    for (codec, ratio, gbps, cold) in &figures[1..] {
        lines.push(Line::higher(
            &format!("kvstore.codec_ratio.{codec}"),
            *ratio,
            none_ratio,
            "x smaller than raw",
            base,
        ));
        lines.push(Line::higher(
            &format!("kvstore.codec_get.{codec}"),
            *gbps,
            none_gbps,
            "GB/s",
            base,
        ));
        lines.push(Line::higher(
            &format!("kvstore.codec_get_cold.{codec}"),
            *cold,
            none_cold,
            "GB/s",
            "codec none, cold read (page cache dropped; median of the passes)",
        ));
    }
    for codec in [schema::Codec::Q8, schema::Codec::Q4] {
        let t = Instant::now();
        let blocks = encode_blocks(codec, &l, &items)?;
        let encode_secs = t.elapsed().as_secs_f64();
        if let Some(prefill) = prefill_secs {
            lines.push(Line::higher(
                &format!("kvstore.codec_encode.{codec}"),
                raw as f64 / encode_secs / 1e6,
                raw as f64 / prefill / 1e6,
                "MB/s of f16 KV in",
                "encode only, one thread; baseline: KV written per second by the model's \
                 prefill of the same chunks, quantized weights as ingest runs it, all threads",
            ));
        }
        lines.push(decode_speed(codec, &l, &blocks, none_gbps)?);
    }
    Ok(lines)
}

/// The chunks cut into the store's 64-token blocks, each encoded with `codec` (as `put` does):
/// per block, its number of tokens and its encoded payload.
fn encode_blocks(
    codec: schema::Codec,
    l: &KvLayout,
    items: &[TokensKv],
) -> Result<Vec<(usize, Vec<u8>)>, Error> {
    let tb = l.bytes_per_token();
    let mut blocks = Vec::new();
    for (t, kv) in items {
        for start in (0..t.len()).step_by(BLOCK) {
            let n = BLOCK.min(t.len() - start);
            // One block's layer-major bytes: each plane's rows of tokens start..start+n.
            let mut raw = Vec::with_capacity(n * tb);
            let pb = l.plane_token_bytes();
            for p in 0..l.planes() {
                let at = (p * t.len() + start) * pb;
                raw.extend_from_slice(&kv[at..at + n * pb]);
            }
            blocks.push((n, kvstore::encode_block(codec, l, n, &raw, start)?));
        }
    }
    Ok(blocks)
}

/// Decoding alone, one thread: `blocks` (from [`encode_blocks`]) decoded into f16 again and
/// again; GB/s of f16 written. Against the warm get of `none` (a copy).
fn decode_speed(
    codec: schema::Codec,
    l: &KvLayout,
    blocks: &[(usize, Vec<u8>)],
    none_gbps: f64,
) -> Result<Line, Error> {
    let mut out = vec![0u8; l.bytes_for(BLOCK)];
    let mut run = || -> Result<usize, Error> {
        let mut bytes = 0;
        for (n, enc) in blocks {
            let dst = &mut out[..l.bytes_for(*n)];
            kvstore::decode_block(codec, l, *n, enc, dst)?;
            bytes += dst.len();
        }
        std::hint::black_box(&out);
        Ok(bytes)
    };
    run()?;
    let t = Instant::now();
    let mut bytes = 0;
    while t.elapsed().as_secs_f64() < 1.0 {
        bytes += run()?;
    }
    let gbps = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
    Ok(Line::higher(
        &format!("kvstore.codec_decode.{codec}"),
        gbps,
        none_gbps,
        "GB/s",
        "decode only, one thread, f16 out; baseline: warm get of codec none",
    ))
}

/// Drops every file under `dir` from the page cache.
fn drop_dir_pages(dir: &Path) -> Result<(), Error> {
    let entries = std::fs::read_dir(dir).map_err(|cause| Error::Io {
        what: format!("listing {}", dir.display()),
        cause,
    })?;
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            drop_dir_pages(&path)?;
        } else {
            super::drop_pages(&path)?;
        }
    }
    Ok(())
}
