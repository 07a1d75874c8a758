//! A chunk's stored KV made ready for a prompt: imported into tensors on the model's device
//! in the decoding cache's dtype and placed at the chunk's prompt position (keys turned by
//! the assembly strategy), on the thread that reads it (the loader's, or the model's for a
//! chunk prefilled inline). Used by [`super::loader`], [`super::tier`] and
//! [`super::assemble`].

use ingest::Corpus;
use model::{DType, Kv};

use crate::assembly::Assembly;

/// A chunk's KV bytes (stored layout, positions `0..n`) as tensors in `dtype` on the
/// model's device (the host-to-device copy happens here, on the loader thread, overlapping
/// the decoder's work), placed for a prompt where the chunk starts at `pos`; see [`place`].
pub(crate) fn import(
    corpus: &Corpus,
    bytes: &[u8],
    assembly: Assembly,
    pos: usize,
    dtype: DType,
) -> model::Result<Kv> {
    let (model, layout) = (&corpus.model(), corpus.layout());
    if model.device().is_cpu() {
        // Each layer's keys and values placed and converted as they are imported, while
        // they are in the core's caches: one pass over the chunk instead of three.
        let each =
            &mut |l: usize, values: bool, t| place_one(model, assembly, (l, values), t, pos, dtype);
        return Kv::from_bytes_with(bytes, &layout, model.device(), each);
    }
    let kv = Kv::from_bytes(bytes, &layout, model.device())?;
    place(corpus, kv, assembly, pos, dtype)
}

/// [`place`] of one layer's keys or values (`values`), on the CPU.
fn place_one(
    model: &model::Model,
    assembly: Assembly,
    (layer, values): (usize, bool),
    t: model::Tensor,
    pos: usize,
    dtype: DType,
) -> model::Result<model::Tensor> {
    let device = model.device();
    if values {
        return Kv::tensor_to(&t, device, dtype);
    }
    if dtype == model::Q8_CACHE {
        let k = assembly.place_keys(model, layer, t, pos)?;
        return Kv::tensor_to(&k, device, dtype);
    }
    let k = Kv::tensor_to(&t, device, dtype)?;
    assembly.place_keys(model, layer, k, pos)
}

/// A chunk's imported KV (the store's dtype, positions `0..n`, on the model's device) in
/// `dtype`, placed for a prompt where the chunk starts at `pos`, and settled: any thread may
/// use the result, and `kv` itself (left unchanged) too. `dtype` is
/// [`Assembly::chunk_dtype`]'s: with the decoding cache's f16 the stored f16 values are used
/// as they are and only the keys are widened, turned and rounded (on the CPU in one pass on
/// this thread, [`model::Decoder::reposition`]), so the model thread just copies them in.
pub(super) fn place(
    corpus: &Corpus,
    kv: Kv,
    assembly: Assembly,
    pos: usize,
    dtype: DType,
) -> model::Result<Kv> {
    let model = &corpus.model();
    let kv = if dtype == model::Q8_CACHE {
        // Keys turn before they are quantized (re-positioning works on the stored floats);
        // the q8 cache then takes the rows as they are.
        assembly
            .place(model, kv, pos)
            .and_then(|kv| kv.to(model.device(), dtype))?
    } else {
        kv.to(model.device(), dtype)
            .and_then(|kv| assembly.place(model, kv, pos))?
    };
    // On a GPU the tensors go to the model thread: this thread's stream must be done.
    model.settle()?;
    Ok(kv)
}

/// Whether the KV of the chunk a prompt places first is what full prefill computes there:
/// its copy for that place (`copy`, `ingest.exact_first`), or KV of the corpus's own
/// materialization (`own`, not a store's earlier one) where that is after the prompt's
/// start alone ([`ingest::Corpus::own_kv_exact_first`]).
pub(crate) fn exact_in_first_place(corpus: &Corpus, copy: bool, own: bool) -> bool {
    copy || (own && corpus.own_kv_exact_first())
}
