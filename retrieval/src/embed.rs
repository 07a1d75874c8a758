//! Text embeddings with fastembed on ONNX Runtime, loaded dynamically.
//!
//! The ONNX Runtime shared library is found before fastembed touches it (fastembed would panic
//! on a missing library): the configured path, then `ORT_DYLIB_PATH`, then the project cache
//! (`$RAGKV_CACHE/onnxruntime`, default `~/.cache/ragkv/onnxruntime`, filled by
//! `scripts/setup.sh`). A missing library is [`Error::OnnxRuntimeMissing`] listing every place
//! looked at; a library that fails to load or is older than the bindings need is
//! [`Error::OnnxRuntimeUnusable`].
//!
//! Models come from a local directory (`model.onnx`, `tokenizer.json`, `config.json`,
//! `special_tokens_map.json`, `tokenizer_config.json`, optional `1_Pooling/config.json`), or,
//! with the `hub` feature, from fastembed's catalog by name.
//!
//! Truncation is set deliberately, by measurement: tokenizer files often ship with fixed
//! padding to 128 tokens (all-MiniLM-L6-v2's do), which costs compute on short texts. We pad
//! each batch to its longest member only, and truncate at `max_tokens`. On LongBench-HotpotQA,
//! answer recall@5 was 0.61 truncating at 128 word pieces and 0.55 at 512 (mean pooling over a
//! whole 512-token chunk dilutes it; MiniLM was trained on short inputs), so the default is
//! 128. Batching is off by default (`batch_size` 1): padding chunks of uneven length to the
//! longest made batches of 16 slower (7.6 chunks/s) than one chunk per call (12.0 chunks/s).
//! Both figures: docs/BENCHMARKS.md.

use std::path::{Path, PathBuf};

use fastembed::{
    InitOptionsUserDefined, Pooling, TextEmbedding, TokenizerFiles, UserDefinedEmbeddingModel,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
pub use schema::cache_dir;

/// Environment variable naming the ONNX Runtime library (the same one `ort` reads).
pub const ORT_ENV: &str = "ORT_DYLIB_PATH";
/// Directory name of the default embedding model inside the model cache.
pub const DEFAULT_MODEL_DIR: &str = "all-MiniLM-L6-v2";

/// How to build an [`Embedder`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EmbedderConfig {
    /// Local model directory. Empty: `<model cache>/all-MiniLM-L6-v2`, unless `catalog` is set.
    pub model_dir: PathBuf,
    /// fastembed catalog model name (e.g. `Xenova/all-MiniLM-L6-v2`); needs the `hub` feature
    /// and network access. Takes precedence over `model_dir` when non-empty.
    pub catalog: String,
    /// ONNX Runtime library (file, or a directory holding `libonnxruntime.so*`). Empty: search.
    pub onnxruntime: PathBuf,
    /// Tokens per text; longer texts are truncated. Capped by the model's own limit.
    pub max_tokens: usize,
    /// Texts per ONNX Runtime call.
    pub batch_size: usize,
    /// ONNX Runtime intra-op threads (0: all cores).
    pub threads: usize,
}

impl Default for EmbedderConfig {
    fn default() -> Self {
        EmbedderConfig {
            model_dir: PathBuf::new(),
            catalog: String::new(),
            onnxruntime: PathBuf::new(),
            max_tokens: 128,
            batch_size: 1,
            threads: 0,
        }
    }
}

impl EmbedderConfig {
    /// Checks ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if !(8..=8192).contains(&self.max_tokens) {
            return Err(Error::Invalid {
                what: "embedder.max_tokens",
                reason: format!("{} is outside 8..=8192", self.max_tokens),
            });
        }
        if !(1..=1024).contains(&self.batch_size) {
            return Err(Error::Invalid {
                what: "embedder.batch_size",
                reason: format!("{} is outside 1..=1024", self.batch_size),
            });
        }
        Ok(())
    }

    /// The model directory this configuration resolves to.
    pub fn resolved_model_dir(&self) -> PathBuf {
        if self.model_dir.as_os_str().is_empty() {
            cache_dir().join("models").join(DEFAULT_MODEL_DIR)
        } else {
            self.model_dir.clone()
        }
    }
}

/// Finds the ONNX Runtime library: `configured` (file or directory), then `$ORT_DYLIB_PATH`,
/// then `<cache>/onnxruntime`. Returns the first that exists, or every place looked at.
pub fn find_onnxruntime(configured: &Path) -> Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if !configured.as_os_str().is_empty() {
        candidates.push(configured.to_path_buf());
    }
    if let Some(p) = std::env::var_os(ORT_ENV).filter(|p| !p.is_empty()) {
        candidates.push(PathBuf::from(p));
    }
    candidates.push(cache_dir().join("onnxruntime"));
    first_library(candidates)
}

/// The first candidate that is a file, or a directory holding the library.
fn first_library(candidates: Vec<PathBuf>) -> Result<PathBuf> {
    let mut searched = Vec::new();
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
        if c.is_dir() {
            if let Some(lib) = library_in(&c) {
                return Ok(lib);
            }
            searched.push(c.join("libonnxruntime.so*"));
        } else {
            searched.push(c);
        }
    }
    Err(Error::OnnxRuntimeMissing { searched })
}

/// `libonnxruntime.so`, else the highest-versioned `libonnxruntime.so.X.Y.Z` in `dir`.
fn library_in(dir: &Path) -> Option<PathBuf> {
    let plain = dir.join("libonnxruntime.so");
    if plain.is_file() {
        return Some(plain);
    }
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?;
            let version: Vec<u32> = name
                .strip_prefix("libonnxruntime.so.")?
                .split('.')
                .map(|x| x.parse().ok())
                .collect::<Option<_>>()?;
            Some((version, p))
        })
        .max()
        .map(|(_, p)| p)
}

/// Loads ONNX Runtime once per process. Later calls return the first outcome's path.
fn init_onnxruntime(configured: &Path) -> Result<PathBuf> {
    static LOADED: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    static LOCK: Mutex<()> = Mutex::new(());
    let _g = LOCK.lock();
    if let Some(p) = LOADED.get() {
        return Ok(p.clone());
    }
    let path = find_onnxruntime(configured)?;
    // `init_from` loads the library and checks its version, returning errors instead of the
    // panics a lazy load inside fastembed would produce.
    ort::init_from(&path).map_err(|e| Error::OnnxRuntimeUnusable {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    tracing::info!(path = %path.display(), "loaded ONNX Runtime");
    Ok(LOADED.get_or_init(|| path).clone())
}

/// A text embedding model. `embed` is blocking CPU work: call it from a worker thread (or
/// `spawn_blocking`), never from an async task. Calls are serialized internally.
pub struct Embedder {
    model: Mutex<TextEmbedding>,
    name: String,
    dim: usize,
    batch_size: usize,
}

impl std::fmt::Debug for Embedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedder")
            .field("name", &self.name)
            .field("dim", &self.dim)
            .field("batch_size", &self.batch_size)
            .finish_non_exhaustive()
    }
}

impl Embedder {
    /// Loads ONNX Runtime and the model described by `config`.
    pub fn new(config: &EmbedderConfig) -> Result<Embedder> {
        config.validate()?;
        init_onnxruntime(&config.onnxruntime)?;
        let (model, name) = if config.catalog.is_empty() {
            let dir = config.resolved_model_dir();
            (load_local(&dir, config)?, dir.display().to_string())
        } else {
            (
                load_catalog(&config.catalog, config)?,
                config.catalog.clone(),
            )
        };
        let mut e = Embedder {
            model: Mutex::new(model),
            name,
            dim: 0,
            batch_size: config.batch_size,
        };
        e.dim = e.embed_one("dimension probe")?.len();
        Ok(e)
    }

    /// The model's name (its directory, or the catalog name).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Length of every vector this model produces.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Embeds `texts` in batches; every vector is L2-normalized (unit length).
    pub fn embed<S: AsRef<str> + Send + Sync>(&self, texts: &[S]) -> Result<Vec<Vec<f32>>> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        // One fastembed call per batch: fastembed keeps every batch's raw model output
        // (tokens × hidden floats) until the call returns, so one call over thousands of
        // texts would hold gigabytes.
        let mut out = Vec::with_capacity(texts.len());
        let mut model = self.model.lock();
        for batch in texts.chunks(self.batch_size) {
            let vectors = model
                .embed(batch, Some(self.batch_size))
                .map_err(|e| Error::Embed {
                    model: self.name.clone(),
                    reason: e.to_string(),
                })?;
            out.extend(vectors);
        }
        drop(model);
        for v in &mut out {
            normalize(v);
        }
        Ok(out)
    }

    /// Embeds one text (a question).
    pub fn embed_one(&self, text: &str) -> Result<Vec<f32>> {
        let mut v = self.embed(&[text])?;
        v.pop().ok_or_else(|| Error::Embed {
            model: self.name.clone(),
            reason: "no vector returned".into(),
        })
    }
}

/// Scales `v` to unit length (a zero vector stays zero).
pub fn normalize(v: &mut [f32]) {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if n > 0.0 {
        v.iter_mut().for_each(|x| *x /= n);
    }
}

fn read(path: PathBuf) -> Result<Vec<u8>> {
    std::fs::read(&path).map_err(|cause| Error::ModelFile { path, cause })
}

fn init_options(config: &EmbedderConfig) -> InitOptionsUserDefined {
    // ONNX Runtime's pool threads spin after each run by default: on a server whose cores the
    // model's threads own, that spinning took ~4 % of two cores under `bench peer`'s load.
    let mut o = InitOptionsUserDefined::new()
        .with_max_length(config.max_tokens)
        .with_session_config("session.intra_op.allow_spinning", "0")
        .with_session_config("session.inter_op.allow_spinning", "0");
    if config.threads > 0 {
        o = o.with_intra_threads(config.threads);
    }
    o
}

fn load_local(dir: &Path, config: &EmbedderConfig) -> Result<TextEmbedding> {
    let files = TokenizerFiles {
        tokenizer_file: read(dir.join("tokenizer.json"))?,
        config_file: read(dir.join("config.json"))?,
        special_tokens_map_file: read(dir.join("special_tokens_map.json"))?,
        tokenizer_config_file: read(dir.join("tokenizer_config.json"))?,
    };
    let onnx = read(dir.join("model.onnx"))?;
    let pooling = pooling_of(dir)?;
    let model = UserDefinedEmbeddingModel::new(onnx, files).with_pooling(pooling);
    // fastembed may panic on malformed inputs deep in ONNX Runtime; keep that an error.
    let opts = init_options(config);
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        TextEmbedding::try_new_from_user_defined(model, opts)
    }))
    .map_err(|_| Error::Embed {
        model: dir.display().to_string(),
        reason: "fastembed panicked while loading the model".into(),
    })?
    .map_err(|e| Error::Embed {
        model: dir.display().to_string(),
        reason: e.to_string(),
    })
}

/// Pooling from sentence-transformers' `1_Pooling/config.json`; mean pooling when absent.
fn pooling_of(dir: &Path) -> Result<Pooling> {
    let path = dir.join("1_Pooling").join("config.json");
    if !path.exists() {
        return Ok(Pooling::Mean);
    }
    let v: serde_json::Value =
        serde_json::from_slice(&read(path.clone())?).map_err(|e| Error::Embed {
            model: dir.display().to_string(),
            reason: format!("{}: {e}", path.display()),
        })?;
    if v["pooling_mode_cls_token"].as_bool() == Some(true) {
        Ok(Pooling::Cls)
    } else if v["pooling_mode_mean_tokens"].as_bool() == Some(true) {
        Ok(Pooling::Mean)
    } else {
        Err(Error::Embed {
            model: dir.display().to_string(),
            reason: format!(
                "{}: only CLS and mean pooling are supported",
                path.display()
            ),
        })
    }
}

#[cfg(feature = "hub")]
fn load_catalog(name: &str, config: &EmbedderConfig) -> Result<TextEmbedding> {
    use std::str::FromStr;
    let model = fastembed::EmbeddingModel::from_str(name).map_err(|e| Error::Embed {
        model: name.into(),
        reason: e.to_string(),
    })?;
    let mut o = fastembed::TextInitOptions::new(model)
        .with_max_length(config.max_tokens)
        .with_cache_dir(cache_dir().join("fastembed"))
        .with_show_download_progress(true)
        .with_session_config("session.intra_op.allow_spinning", "0")
        .with_session_config("session.inter_op.allow_spinning", "0");
    if config.threads > 0 {
        o = o.with_intra_threads(config.threads);
    }
    TextEmbedding::try_new(o).map_err(|e| Error::Embed {
        model: name.into(),
        reason: e.to_string(),
    })
}

#[cfg(not(feature = "hub"))]
fn load_catalog(name: &str, _config: &EmbedderConfig) -> Result<TextEmbedding> {
    Err(Error::HubUnavailable(name.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_gives_unit_length_and_keeps_zero() {
        let mut v = vec![3.0, 4.0];
        normalize(&mut v);
        assert!((v[0] - 0.6).abs() < 1e-6 && (v[1] - 0.8).abs() < 1e-6);
        let mut z = vec![0.0; 3];
        normalize(&mut z);
        assert_eq!(z, vec![0.0; 3]);
    }

    #[test]
    fn missing_library_lists_every_place_looked() {
        let dir = tempfile::tempdir().unwrap();
        let configured = dir.path().join("nope/libonnxruntime.so");
        let err = first_library(vec![configured.clone(), dir.path().to_path_buf()]).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::OnnxRuntimeMissing { .. }));
        assert!(msg.contains(&configured.display().to_string()), "{msg}");
        assert!(msg.contains("libonnxruntime.so*"), "{msg}");
    }

    #[test]
    fn library_lookup_prefers_plain_then_newest_version() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("libonnxruntime.so.1.9.0"), b"").unwrap();
        std::fs::write(dir.path().join("libonnxruntime.so.1.31.1"), b"").unwrap();
        assert_eq!(
            library_in(dir.path()).unwrap(),
            dir.path().join("libonnxruntime.so.1.31.1")
        );
        std::fs::write(dir.path().join("libonnxruntime.so"), b"").unwrap();
        assert_eq!(
            library_in(dir.path()).unwrap(),
            dir.path().join("libonnxruntime.so")
        );
        assert_eq!(
            find_onnxruntime(dir.path()).unwrap(),
            dir.path().join("libonnxruntime.so")
        );
    }

    #[test]
    fn config_ranges_are_checked() {
        let mut c = EmbedderConfig::default();
        assert!(c.validate().is_ok());
        c.max_tokens = 0;
        assert!(c.validate().unwrap_err().to_string().contains("max_tokens"));
    }
}
