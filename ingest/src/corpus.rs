//! The corpus: the parts a stored chunk lives in (KV store, vector index, shared tier) and
//! the parts that make its KV (tokenizer, model, preamble), bound to the namespace its KV is
//! stored under. Shared by the ingest [`crate::Engine`] (which writes it) and the server
//! (which only reads it, and recomputes what is missing).

use std::sync::Arc;

use kvstore::{KvLayout, NamespaceId, Store};
use model::Model;
use remote::Remote;
use retrieval::{Embedder, VectorIndex};

use crate::config::{Context, IngestConfig};
use crate::error::{Error, Result};
use crate::source::CONTENT_HASH_LEN;

/// Identity of the chunk prefill: chunk tokens alone at positions `0..n`, no preamble. With
/// `chunk_preamble` set, the template is `chunk-preamble-v1:` and a hash of the preamble; with
/// `ingest.context = "neighbours:N"`, `+neighbours:N` follows; with `prompt`, `+prompt:` and a
/// hash of the tokens before every chunk (the prompt's start and `ingest.context_passage`),
/// then `+neighbours:N` under `prompt+neighbours:N` (`+mean:N` under `mean:N` and
/// `prompt+mean:N`).
pub const CHUNK_TEMPLATE: &str = "chunk-raw-v1";

/// KV-store document id of version `hash` of document `doc`.
pub fn kv_doc(doc: &str, hash: &str) -> String {
    format!("{doc}@{hash}")
}

/// Splits a KV-store document id into (document, hash).
pub fn split_kv_doc(kv_doc: &str) -> Option<(&str, &str)> {
    kv_doc.rsplit_once('@')
}

/// Hex key of a chunk's KV: the token digest of its tokens.
pub fn kv_key(tokens: &[u32]) -> String {
    let d = schema::TokenDigest::of(tokens);
    d.0.iter().map(|b| format!("{b:02x}")).collect()
}

/// What is stored and how to read it: the KV store, the vector index, the embedder, the model
/// whose KV is stored, and how a chunk's KV is keyed (namespace, layout, preamble). Ingest
/// writes a corpus through an [`crate::Engine`]; the server reads it (retrieval, chunk KV,
/// recompute of a missing chunk) without the writer's claims.
#[derive(Debug)]
pub struct Corpus {
    pub(crate) store: Arc<Store>,
    pub(crate) index: Arc<VectorIndex>,
    pub(crate) embedder: Arc<Embedder>,
    pub(crate) model: Arc<Model>,
    pub(crate) config: IngestConfig,
    /// The shared KV tier behind the local store, when configured ([`Corpus::with_remote`]).
    pub(crate) remote: Option<Arc<Remote>>,
    pub(crate) ns: NamespaceId,
    /// With a lossy codec: the namespace of the same model's KV stored losslessly, which
    /// re-materialization re-encodes from instead of prefilling.
    pub(crate) lossless_source: Option<NamespaceId>,
    pub(crate) layout: KvLayout,
    /// Tokens of `config.chunk_preamble`, placed before every chunk's own.
    pub(crate) preamble: Vec<u32>,
    /// Under `ingest.context = "prompt..."`: the KV of the RAG prompt's start and
    /// `ingest.context_passage` (computed once), which every chunk is prefilled after (not
    /// stored).
    pub(crate) prompt_kv: Option<model::Kv>,
    /// Under `ingest.exact_first`: the namespace of each chunk's KV after the prompt's start
    /// alone (`context = "prompt"`'s), read for the chunk a prompt places first.
    pub(crate) first_ns: Option<NamespaceId>,
    /// Under a materialization in context: the namespaces of the same model's KV of each
    /// chunk alone, read where `ns` misses ([`Corpus::plain_sources`]).
    pub(crate) plain_sources: Vec<NamespaceId>,
    pub(crate) kv_dtype: model::DType,
}

impl Corpus {
    /// Binds the parts together and registers the model's KV namespace (fingerprint of the
    /// weights, tokenizer, positions, KV layout in `kv_dtype`, chunker and chunk template).
    pub fn new(
        store: Arc<Store>,
        index: Arc<VectorIndex>,
        embedder: Arc<Embedder>,
        model: Arc<Model>,
        config: IngestConfig,
        kv_dtype: model::DType,
    ) -> Result<Corpus> {
        config.validate()?;
        if embedder.dim() != index.dim() {
            return Err(Error::Invalid {
                what: "embedder",
                why: format!(
                    "produces {}-dimensional vectors but the index holds {}",
                    embedder.dim(),
                    index.dim()
                ),
            });
        }
        let preamble = model.tokenizer().encode(&config.chunk_preamble)?;
        let template = if preamble.is_empty() {
            CHUNK_TEMPLATE.to_string()
        } else {
            let h = blake3::hash(config.chunk_preamble.as_bytes()).to_hex();
            format!("chunk-preamble-v1:{}", &h[..16])
        };
        let plain_template = template.clone();
        // Materialization in context changes every chunk's KV: a namespace of its own (what
        // goes before every chunk named by a hash of its tokens).
        let mut template = template;
        let mut prompt_kv = None;
        if config.context.prompt() {
            let mut start =
                model.prompt_tokens(&model.rag_prompt()?.prefix(&config.system_prompt))?;
            if !config.context_passage.is_empty() {
                start.extend(model.tokenizer().encode(&config.context_passage)?);
            }
            let bytes: Vec<u8> = start.iter().flat_map(|t| t.to_le_bytes()).collect();
            template = format!("{template}+prompt:{}", &blake3::hash(&bytes).to_hex()[..16]);
            prompt_kv = Some(model.decoder().prefill(&start, 0)?.0);
        }
        // Under `exact_first`, `context = "prompt"`'s namespace holds each chunk's copy for
        // the first place.
        let first_template = config.exact_first.then(|| template.clone());
        if config.context.neighbours() > 0 {
            let kind = if config.context.averaged() {
                "mean"
            } else {
                "neighbours"
            };
            template = format!("{template}+{kind}:{}", config.context.neighbours());
        }
        let mut fp = model.fingerprint(&config.chunker().id(), &template)?;
        fp.layout.dtype = model::kv_schema_dtype(kv_dtype)?;
        let layout = fp.layout;
        let codec = store.options().default_codec;
        let ns = fp.namespace_with_codec(codec);
        store.register_namespace(ns, layout, codec)?;
        // A lossy namespace can be filled from the same model's lossless KV without prefill.
        let lossless_source = (!codec.is_lossless()).then(|| fp.namespace());
        let first_ns = match first_template {
            Some(t) => {
                let mut fp = model.fingerprint(&config.chunker().id(), &t)?;
                fp.layout.dtype = layout.dtype;
                let ns = fp.namespace_with_codec(codec);
                store.register_namespace(ns, layout, codec)?;
                Some(ns)
            }
            None => None,
        };
        // Under a materialization in context, the same model's KV of each chunk alone
        // (`context = "none"`, the default before `prompt+mean:2`), in this codec and
        // losslessly: read where this corpus's own namespace misses, so a store written
        // under the earlier default serves as it did until it is re-materialized.
        let mut plain_sources = Vec::new();
        if config.context != Context::None {
            let mut fp = model.fingerprint(&config.chunker().id(), &plain_template)?;
            fp.layout.dtype = layout.dtype;
            plain_sources.push(fp.namespace_with_codec(codec));
            if !codec.is_lossless() {
                plain_sources.push(fp.namespace());
            }
        }
        Ok(Corpus {
            store,
            index,
            embedder,
            model,
            config,
            remote: None,
            ns,
            lossless_source,
            layout,
            preamble,
            prompt_kv,
            first_ns,
            plain_sources,
            kv_dtype,
        })
    }

    /// Puts the shared KV tier behind the local store: with `remote.write`, ingest stores
    /// every document's KV there too (before the document becomes searchable) and deletes
    /// release it; with `remote.read`, the server fetches what the local store misses.
    pub fn with_remote(mut self, remote: Arc<Remote>) -> Corpus {
        self.remote = Some(remote);
        self
    }

    /// The KV store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The vector index.
    pub fn index(&self) -> &Arc<VectorIndex> {
        &self.index
    }

    /// The embedding model.
    pub fn embedder(&self) -> &Arc<Embedder> {
        &self.embedder
    }

    /// The LLM whose KV is stored.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// `[ingest]` settings.
    pub fn config(&self) -> &IngestConfig {
        &self.config
    }

    /// Changes `ingest.prefill_batch_tokens` (how many tokens of short chunks one batched
    /// prefill takes; it does not change the KV, so the namespace stays).
    pub fn set_prefill_batch_tokens(&mut self, tokens: usize) -> Result<()> {
        let mut c = self.config.clone();
        c.prefill_batch_tokens = tokens;
        c.validate()?;
        self.config = c;
        Ok(())
    }

    /// The shared KV tier behind the local store, when configured.
    pub fn remote(&self) -> Option<&Arc<Remote>> {
        self.remote.as_ref()
    }

    /// The tier when ingest writes to it.
    pub(crate) fn remote_writes(&self) -> Option<&Remote> {
        self.remote.as_deref().filter(|r| r.writes())
    }

    /// The KV namespace chunks are stored under.
    pub fn namespace(&self) -> NamespaceId {
        self.ns
    }

    /// Under `ingest.exact_first`: the namespace of each chunk's KV prefilled after the
    /// prompt's start alone, which a prompt's first chunk is read from.
    pub fn first_namespace(&self) -> Option<NamespaceId> {
        self.first_ns
    }

    /// The namespaces a document's chunks are stored under: the corpus's, then, under
    /// `ingest.exact_first`, its copies' for the first place. Ingest writes both through to
    /// the shared tier, and deleting a document removes both.
    pub(crate) fn tier_namespaces(&self) -> impl Iterator<Item = NamespaceId> {
        std::iter::once(self.ns).chain(self.first_ns)
    }

    /// Whether a chunk's own stored KV is what full prefill computes for the chunk a prompt
    /// places first: `ingest.context = "prompt"` without `ingest.context_passage` (the
    /// chunk after the prompt's start alone). Under `ingest.exact_first` the copy in
    /// [`Corpus::first_namespace`] is, not the chunk's own KV.
    pub fn own_kv_exact_first(&self) -> bool {
        self.config.context == Context::Prompt && self.config.context_passage.is_empty()
    }

    /// Under `ingest.context` other than `none`: the namespaces holding the same model's KV
    /// of each chunk prefilled alone (`none`'s, the default before `prompt+mean:2`), in this
    /// corpus's codec, then losslessly. The server reads a chunk from them where this
    /// corpus's namespace (and [`Corpus::lossless_source`]) misses it: a store written under
    /// the earlier default answers as it did while ingest or `ragkv rematerialize`
    /// re-materializes it. Empty under `none`.
    pub fn plain_sources(&self) -> &[NamespaceId] {
        &self.plain_sources
    }

    /// The namespace holding this model's KV losslessly, when chunks are stored with a lossy
    /// codec (see [`schema::ModelFingerprint::namespace_with_codec`]).
    pub fn lossless_source(&self) -> Option<NamespaceId> {
        self.lossless_source
    }

    /// Layout of stored chunk KV.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Tokens of a stored chunk's text as prefilled: the preamble's, then the text's.
    pub fn chunk_tokens(&self, text: &str) -> Result<Vec<u32>> {
        let mut t = self.preamble.clone();
        t.extend(self.model.tokenizer().encode(text)?);
        Ok(t)
    }

    /// The most tokens a stored chunk has: the preamble's and `chunk_tokens`.
    pub fn max_chunk_tokens(&self) -> usize {
        self.preamble.len() + self.config.chunker().chunk_tokens
    }

    /// The KV documents (`doc@hash`) of every stored version of `doc`.
    pub(crate) fn kv_versions(&self, doc: &str) -> Result<Vec<String>> {
        let prefix = kv_doc(doc, "");
        Ok(self
            .store
            .documents_with_prefix(&prefix, prefix.len() + CONTENT_HASH_LEN)?)
    }

    /// Prefills `tokens` at positions `0..` and returns the KV bytes in the stored layout.
    pub fn prefill_bytes(&self, tokens: &[u32]) -> Result<Vec<u8>> {
        let (kv, _) = self.model.decoder().prefill(tokens, 0)?;
        Ok(kv.to_bytes(self.kv_dtype)?)
    }

    /// [`Corpus::prefill_bytes`] of each chunk, in one forward pass when there are several
    /// (each after the prompt's start under `ingest.context = "prompt"`; chunks prefilled
    /// after neighbours go through [`Corpus::chunk_kv`]).
    pub fn prefill_many_bytes(&self, chunks: &[&[u32]]) -> Result<Vec<Vec<u8>>> {
        if let Some(start) = &self.prompt_kv {
            return self.prefill_many_after_start(start, chunks);
        }
        match chunks {
            [] => Ok(Vec::new()),
            [one] => Ok(vec![self.prefill_bytes(one)?]),
            _ => self
                .model
                .decoder()
                .prefill_many(chunks)?
                .iter()
                .map(|kv| Ok(kv.to_bytes(self.kv_dtype)?))
                .collect(),
        }
    }
}
