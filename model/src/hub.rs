//! Hugging Face references: `model.path = "hf:ORG/REPO"` (an HF directory: config, tokenizer
//! and safetensors weights) or `"hf:ORG/REPO:FILE.gguf"` (one GGUF file), fetched with the
//! `hf-hub` crate into the model cache (`$RAGKV_CACHE/models/hf`, the hub's own layout:
//! `models--ORG--REPO/{blobs,snapshots,refs}`).
//!
//! A file already in the cache is used without asking the hub, so a model fetched once works
//! offline. The hub is `HF_ENDPOINT` when set (a mirror, or a stand-in in tests); a token comes
//! from `HF_TOKEN` or the hub's token file. Any failure names the reference.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::{Api, ApiBuilder, ApiRepo};
use hf_hub::{Repo, RepoType};

use crate::error::{Error, Result};
use crate::source::ModelSource;

/// The prefix of a hub reference.
pub const PREFIX: &str = "hf:";

/// A parsed `hf:ORG/REPO[:FILE]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubRef {
    /// `ORG/REPO`.
    pub repo: String,
    /// A file of the repository (a GGUF); `None`: the repository as an HF directory.
    pub file: Option<String>,
}

impl std::fmt::Display for HubRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.file {
            Some(file) => write!(f, "{PREFIX}{}:{file}", self.repo),
            None => write!(f, "{PREFIX}{}", self.repo),
        }
    }
}

impl std::str::FromStr for HubRef {
    type Err = Error;

    fn from_str(s: &str) -> Result<HubRef> {
        let bad = |why: &str| Error::Hub {
            reference: s.to_string(),
            why: format!("{why} (expected hf:ORG/REPO or hf:ORG/REPO:FILE)"),
        };
        let rest = s.strip_prefix(PREFIX).ok_or_else(|| bad("no hf: prefix"))?;
        let (repo, file) = match rest.split_once(':') {
            Some((r, f)) => (r, Some(f)),
            None => (rest, None),
        };
        let name_ok = |p: &str| {
            !p.is_empty()
                && p != "."
                && p != ".."
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        let parts: Vec<&str> = repo.split('/').collect();
        if parts.len() != 2 || !parts.iter().all(|p| name_ok(p)) {
            return Err(bad("the repository is not ORG/REPO"));
        }
        if let Some(f) = file {
            if f.is_empty() || f.split('/').any(|p| !name_ok(p)) {
                return Err(bad("the file name is not a plain relative path"));
            }
        }
        Ok(HubRef {
            repo: repo.to_string(),
            file: file.map(String::from),
        })
    }
}

/// Where to fetch from and cache to.
#[derive(Debug, Clone)]
pub struct HubOptions {
    /// The hub's address; `None`: `HF_ENDPOINT`, else the public hub.
    pub endpoint: Option<String>,
    /// Where downloads are kept.
    pub cache_dir: PathBuf,
    /// Show download progress bars.
    pub progress: bool,
}

impl Default for HubOptions {
    fn default() -> Self {
        HubOptions {
            endpoint: std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()),
            cache_dir: crate::models_dir().join("hf"),
            progress: true,
        }
    }
}

/// Whether a configured model path is a hub reference.
pub fn is_reference(path: &str) -> bool {
    path.starts_with(PREFIX)
}

/// Fetches (or finds in the cache) what `reference` names and returns it as a model source.
pub fn resolve(reference: &HubRef, opts: &HubOptions) -> Result<ModelSource> {
    let fail = |why: String| Error::Hub {
        reference: reference.to_string(),
        why,
    };
    let mut builder = ApiBuilder::new()
        .with_cache_dir(opts.cache_dir.clone())
        .with_progress(opts.progress)
        .with_retries(2);
    if let Some(e) = &opts.endpoint {
        builder = builder.with_endpoint(e.trim_end_matches('/').to_string());
    }
    if let Ok(token) = std::env::var("HF_TOKEN") {
        builder = builder.with_token(Some(token));
    }
    let api: Api = builder
        .build()
        .map_err(|e| fail(format!("hub client: {e}")))?;
    let repo = api.repo(Repo::new(reference.repo.clone(), RepoType::Model));
    let get = |file: &str| -> Result<PathBuf> {
        repo.get(file).map_err(|e| {
            fail(format!(
                "fetching {file}: {e} (offline? a model fetched once is served from {})",
                opts.cache_dir.display()
            ))
        })
    };
    if let Some(file) = &reference.file {
        let path = get(file)?;
        return Ok(ModelSource::Gguf(path));
    }
    let config = get("config.json")?;
    get("tokenizer.json")?;
    for optional in ["tokenizer_config.json", "generation_config.json"] {
        optional_get(&repo, optional);
    }
    match optional_get(&repo, "model.safetensors.index.json") {
        Some(index) => {
            for shard in shards(&index).map_err(&fail)? {
                get(&shard)?;
            }
        }
        None => {
            get("model.safetensors")?;
        }
    }
    let dir = config
        .parent()
        .ok_or_else(|| fail("cached config.json has no directory".into()))?;
    Ok(ModelSource::HfDir(dir.to_path_buf()))
}

/// A file the repository may not have.
impl ModelSource {
    /// A configured model: a hub reference (`hf:ORG/REPO[:FILE]`, fetched into the model
    /// cache, see this module) or a path ([`ModelSource::from_path`]).
    pub fn resolve(spec: &str) -> Result<ModelSource> {
        if is_reference(spec) {
            resolve(&spec.parse()?, &HubOptions::default())
        } else {
            ModelSource::from_path(spec)
        }
    }
}

fn optional_get(repo: &ApiRepo, file: &str) -> Option<PathBuf> {
    match repo.get(file) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::debug!(file, error = %e, "optional model file not fetched");
            None
        }
    }
}

/// The shard files a `model.safetensors.index.json` names.
fn shards(index: &Path) -> std::result::Result<Vec<String>, String> {
    let text = std::fs::read_to_string(index).map_err(|e| format!("reading the index: {e}"))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("parsing the index: {e}"))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or("the safetensors index has no weight_map")?;
    let mut files: Vec<String> = map
        .values()
        .filter_map(|f| f.as_str().map(String::from))
        .collect();
    files.sort();
    files.dedup();
    for f in &files {
        if f.contains("..") || f.starts_with('/') {
            return Err(format!("the safetensors index names {f:?}"));
        }
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_and_bad_ones_say_what_is_expected() {
        let r: HubRef = "hf:Qwen/Qwen3-0.6B".parse().unwrap();
        assert_eq!(
            (r.repo.as_str(), r.file.as_deref()),
            ("Qwen/Qwen3-0.6B", None)
        );
        let r: HubRef = "hf:org/repo:sub/model.Q4_K_M.gguf".parse().unwrap();
        assert_eq!(r.file.as_deref(), Some("sub/model.Q4_K_M.gguf"));
        assert_eq!(r.to_string(), "hf:org/repo:sub/model.Q4_K_M.gguf");
        for bad in [
            "hf:",
            "hf:repo",
            "hf:a/b/c",
            "hf:a/../b",
            "hf:a/b:",
            "hf:a/b:../x",
            "x:a/b",
        ] {
            let err = bad.parse::<HubRef>().unwrap_err().to_string();
            assert!(err.contains("expected hf:ORG/REPO"), "{bad}: {err}");
        }
    }
}
