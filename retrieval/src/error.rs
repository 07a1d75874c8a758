//! The retrieval crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong while embedding or indexing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The ONNX Runtime shared library was not found; `searched` lists every place tried.
    #[error(
        "ONNX Runtime library not found; looked in: {}. Run scripts/setup.sh, or set \
         embedder.onnxruntime (config) or ORT_DYLIB_PATH to libonnxruntime.so",
        display_paths(searched)
    )]
    OnnxRuntimeMissing {
        /// Every place looked at.
        searched: Vec<PathBuf>,
    },
    /// The library exists but cannot be loaded or is too old for the `ort` bindings.
    #[error("ONNX Runtime at {path} is unusable: {reason}")]
    OnnxRuntimeUnusable {
        /// The library.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
    /// A model file is missing or unreadable.
    #[error("embedding model file {path}: {cause}")]
    ModelFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// fastembed (tokenizer or ONNX session) failed.
    #[error("embedding model {model}: {reason}")]
    Embed {
        /// The embedding model.
        model: String,
        /// What failed.
        reason: String,
    },
    /// A catalog model was named but this build cannot download models.
    #[error("embedding model {0:?}: catalog models need the `hub` feature and network access; use a local model directory instead")]
    HubUnavailable(String),
    /// A vector's length differs from the index's dimension.
    #[error(
        "vector dimension mismatch: the index holds {expected}-dimensional vectors, got {got}"
    )]
    Dimension {
        /// The index's dimension.
        expected: usize,
        /// The vector's.
        got: usize,
    },
    /// Bad configuration or argument.
    #[error("invalid {what}: {reason}")]
    Invalid {
        /// The setting or argument.
        what: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The embedded Qdrant Edge shard failed.
    #[error("embedded index at {path}: {op}: {reason}")]
    Edge {
        /// The shard's directory.
        path: PathBuf,
        /// The operation.
        op: &'static str,
        /// What failed.
        reason: String,
    },
    /// The remote Qdrant server failed (after retries where the call is retryable).
    #[error("Qdrant at {url}, collection {collection:?}: {op}: {reason}")]
    Remote {
        /// The server.
        url: String,
        /// The collection.
        collection: String,
        /// The operation.
        op: &'static str,
        /// What failed.
        reason: String,
    },
    /// A stored payload does not have the shape ragkv writes.
    #[error("point {id}: malformed payload: {reason}")]
    Payload {
        /// The point's id.
        id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Filesystem error outside the engines.
    #[error("{path}: {cause}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
}

fn display_paths(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "(nowhere: no candidate paths)".into();
    }
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Shorthand for this crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;
