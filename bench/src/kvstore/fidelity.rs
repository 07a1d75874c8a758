//! Codec fidelity in seconds: how far next-token distributions move when a context's stored KV
//! goes through a lossy codec, the proxy `ragkv eval qa --codec` (minutes per question) is the
//! measurement of record for.
//!
//! For each of the first documents of the dataset: the model prefills its first
//! [`CONTEXT`] tokens from position 0 (as ingestion stores a chunk), the KV is cut into the
//! store's blocks and each block encoded and decoded with the codec as the store writes it
//! (the chunk's first block knows it is first), and the next [`CONTINUATION`] tokens of the
//! document are run over the f16 KV and over the decoded KV. Reported: the mean KL(f16 ‖
//! codec) per continuation token and the share of positions whose argmax agrees.

use schema::{Codec, KvLayout};

use super::*;
use crate::model::merr;

/// Context tokens per document (a short chunk: five 64-token blocks).
const CONTEXT: usize = 320;
/// Tokens run over the context's KV.
const CONTINUATION: usize = 32;
/// Documents measured (those shorter than the two are skipped).
const DOCS: usize = 12;

/// KL(f16 ‖ codec) and agreement for `int8`, `q8` and `q4`; the `int8` codec (one scale per
/// layer and head over a block, the first lossy codec) is each line's baseline.
pub(super) fn fidelity(args: &Args) -> Result<Vec<Line>, Error> {
    let (m, l, path) = super::codecs::codec_model(args)?;
    let dec = m.decoder();
    let block = kvstore::StoreOptions::default().block_tokens;
    let codecs = [Codec::Int8, Codec::Q8, Codec::Q4];
    let (mut kl, mut agree, mut total) = ([0f64; 3], [0usize; 3], 0usize);
    let dir = crate::dataset::resolve(args.dataset.as_deref())?;
    for doc in crate::dataset::documents(&dir, DOCS)? {
        let ids = m.tokenizer().encode(&doc.text).map_err(merr)?;
        if ids.len() < CONTEXT + CONTINUATION {
            continue;
        }
        let (kv, _) = dec.prefill(&ids[..CONTEXT], 0).map_err(merr)?;
        let raw = kv.to_bytes(model::DType::F16).map_err(merr)?;
        let next = &ids[CONTEXT..CONTEXT + CONTINUATION];
        let logits = |bytes: &[u8]| -> Result<Vec<Vec<f32>>, Error> {
            let kv = model::Kv::from_bytes(bytes, &l, &model::Device::Cpu).map_err(merr)?;
            let mut cache = model::KvCache::from_kv(&kv, CONTINUATION + 1).map_err(merr)?;
            let out = dec
                .forward(&mut cache, next, model::Logits::All)
                .map_err(merr)?;
            crate::qa::rows(&out)
        };
        let reference = logits(&raw)?;
        // The f16 KV's own greedy choices are the targets.
        let targets: Vec<u32> = reference
            .iter()
            .map(|r| crate::score::argmax(r) as u32)
            .collect();
        for (i, codec) in codecs.into_iter().enumerate() {
            let got = logits(&round_trip(codec, &l, &raw, CONTEXT, block)?)?;
            let f = crate::score::forced(&reference, &got, &targets);
            kl[i] += f.kl_sum;
            agree[i] += f.agree;
        }
        total += CONTINUATION;
    }
    if total == 0 {
        return Err(Error::Check(format!(
            "no document of {CONTEXT} + {CONTINUATION} tokens"
        )));
    }
    eprintln!(
        "  fidelity: {total} continuation tokens of {}",
        path.display()
    );
    let per = |i: usize| kl[i] / total as f64;
    Ok(codecs
        .iter()
        .enumerate()
        .map(|(i, codec)| {
            Line::lower(
                &format!("kvstore.codec_kl.{codec}"),
                per(i),
                per(0),
                "nats/token",
                "KL(f16 ‖ codec) of next-token distributions; baseline: codec int8",
            )
            .detail(serde_json::json!({
                "argmax_agreement": agree[i] as f64 / total as f64,
                "tokens": total,
            }))
        })
        .collect())
}

/// `raw` (layer-major KV of `n` tokens from a chunk's start) encoded and decoded block by block
/// as the store does.
fn round_trip(
    codec: Codec,
    l: &KvLayout,
    raw: &[u8],
    n: usize,
    block: usize,
) -> Result<Vec<u8>, Error> {
    let pb = l.plane_token_bytes();
    let mut out = raw.to_vec();
    for start in (0..n).step_by(block) {
        let t = block.min(n - start);
        let mut blk = Vec::with_capacity(l.bytes_for(t));
        for p in 0..l.planes() {
            blk.extend_from_slice(&raw[(p * n + start) * pb..(p * n + start + t) * pb]);
        }
        let enc = kvstore::encode_block(codec, l, t, &blk, start)?;
        let mut back = vec![0u8; blk.len()];
        kvstore::decode_block(codec, l, t, &enc, &mut back)?;
        for p in 0..l.planes() {
            out[(p * n + start) * pb..(p * n + start + t) * pb]
                .copy_from_slice(&back[p * t * pb..(p + 1) * t * pb]);
        }
    }
    Ok(out)
}
