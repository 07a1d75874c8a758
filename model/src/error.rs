//! The model crate's error type.

use std::path::PathBuf;

/// Errors from loading and running models.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor operation failed.
    #[error("{context}: {cause}")]
    Candle {
        /// What was being done.
        context: String,
        /// candle's error.
        cause: candle_core::Error,
    },
    /// A model file could not be read.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The model files are not where they were looked for.
    #[error("model not found: {what} (looked in {})", path.display())]
    NotFound {
        /// What is missing.
        what: String,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The model's metadata or config is missing a field or inconsistent.
    #[error("model config: {why}")]
    Config {
        /// What is missing or inconsistent.
        why: String,
    },
    /// A weight tensor is missing or has the wrong shape.
    #[error("weight {name}: {why}")]
    Weight {
        /// The tensor.
        name: String,
        /// What is wrong with it.
        why: String,
    },
    /// The architecture or a feature of it is not supported.
    #[error("unsupported: {what}")]
    Unsupported {
        /// The architecture or feature.
        what: String,
    },
    /// The tokenizer could not be built or failed.
    #[error("tokenizer: {why}")]
    Tokenizer {
        /// What failed.
        why: String,
    },
    /// A Hugging Face reference (`hf:ORG/REPO[:FILE]`) could not be resolved.
    #[error("model {reference}: {why}")]
    Hub {
        /// The reference.
        reference: String,
        /// What failed.
        why: String,
    },
    /// The chat template could not be rendered.
    #[error("chat template: {why}")]
    Template {
        /// What failed.
        why: String,
    },
    /// KV bytes or tensors do not match the model's KV layout.
    #[error("kv: {why}")]
    Kv {
        /// What does not match.
        why: String,
    },
    /// The device failed an operation on good data (memory, a copy).
    #[error("device: {what}: {why}")]
    Device {
        /// What was being done.
        what: String,
        /// The device's error.
        why: String,
    },
    /// The request does not fit the model (context length, empty prompt, ...).
    #[error("invalid input: {why}")]
    Input {
        /// What does not fit.
        why: String,
    },
}

impl Error {
    /// Whether the KV bytes or tensors themselves do not fit the model's layout (as opposed
    /// to an operation or the device failing on them): stored KV that errs so is damaged.
    pub fn is_kv_mismatch(&self) -> bool {
        matches!(self, Error::Kv { .. })
    }
}

/// Result alias for the model crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Adds context to candle errors: `.ctx("attention")?`.
pub(crate) trait Ctx<T> {
    fn ctx(self, context: &str) -> Result<T>;
}

impl<T> Ctx<T> for candle_core::Result<T> {
    fn ctx(self, context: &str) -> Result<T> {
        self.map_err(|cause| Error::Candle {
            context: context.to_string(),
            cause,
        })
    }
}
