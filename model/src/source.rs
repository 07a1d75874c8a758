//! Where a model comes from: a GGUF file or an HF directory (a leaf module; hub references
//! resolve to one of these in [`crate::hub`]).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Where a model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A `.gguf` file (weights, tokenizer and chat template inside).
    Gguf(PathBuf),
    /// An HF directory: `config.json`, `*.safetensors`, `tokenizer.json`, optionally
    /// `tokenizer_config.json` (chat template).
    HfDir(PathBuf),
}

impl ModelSource {
    /// The file or directory name (for messages).
    pub fn name(&self) -> String {
        let p = match self {
            ModelSource::Gguf(p) | ModelSource::HfDir(p) => p,
        };
        p.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| p.display().to_string())
    }

    /// A `.gguf` path or a directory.
    pub fn from_path(path: impl AsRef<Path>) -> Result<ModelSource> {
        let path = path.as_ref();
        if path.is_dir() {
            if !path.join("config.json").exists() {
                return Err(Error::NotFound {
                    what: "config.json".into(),
                    path: path.to_path_buf(),
                });
            }
            Ok(ModelSource::HfDir(path.to_path_buf()))
        } else if path.is_file() {
            Ok(ModelSource::Gguf(path.to_path_buf()))
        } else {
            Err(Error::NotFound {
                what: "model file or directory".into(),
                path: path.to_path_buf(),
            })
        }
    }
}
