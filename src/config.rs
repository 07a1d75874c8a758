//! The `ragkv` configuration: built-in defaults, then a TOML file (`ragkv.toml` in the working
//! directory, or `--config`), then environment variables `RAGKV__SECTION__KEY`, then
//! command-line flags. Validated at start-up; errors name the offending key.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// Everything `ragkv` can be configured with.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Root of all state: `kv/` (KV index and tensor log), `vectors/` (embedded vector index).
    pub data_dir: PathBuf,
    pub kvstore: KvStoreConfig,
    pub model: ModelConfig,
    pub embedder: retrieval::EmbedderConfig,
    pub index: retrieval::IndexConfig,
    pub ingest: ingest::IngestConfig,
    pub serve: serve::ServeConfig,
    /// The shared KV tier on object storage (off unless `write` or `read` is set).
    pub remote: remote::RemoteConfig,
}

/// What `ragkv config` prints in place of a secret.
pub const REDACTED: &str = "<redacted>";

/// `[model]`: the LLM whose KV is materialized.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// GGUF file, HF directory, or a Hugging Face reference `hf:ORG/REPO` (an HF directory)
    /// or `hf:ORG/REPO:FILE.gguf`, fetched into the model cache on first use (`HF_ENDPOINT`
    /// for a mirror, `HF_TOKEN` for gated models). Empty: SmolLM2-135M-Instruct in the model
    /// cache.
    pub path: PathBuf,
    /// Dtype stored chunk KV is kept in: f16 (default, half the bytes), bf16 or f32.
    pub kv_dtype: String,
    /// Compute device: `cpu` (default), `cuda` or `cuda:N` (needs a `--features cuda` build).
    pub device: String,
    /// GGUF weights: `quantized` (default: kept in their block types, memory near the
    /// file's size, 8-bit activations as in llama.cpp; 5-10x faster than f32 on the CPU, see
    /// docs/BENCHMARKS.md, engine) or `dequantized` (f32 at load: the reference path). The
    /// two compute slightly different KV, so they use different KV namespaces.
    pub weights: String,
    /// Which instruction sets the CPU kernels use: `auto` (default: the best this CPU has),
    /// `avx512`, `amx` (AVX-512 with AMX tile products for prompts' rows: Intel Xeon since
    /// Sapphire Rapids; opt-in, never picked by `auto`: slower than the VNNI kernels where
    /// measured, same results), `avxvnni` (AVX2 with AVX-VNNI's 256-bit integer dot products, never AVX-512:
    /// Intel's cores since Alder Lake), `avx2` (never AVX-512 or AVX-VNNI: the path of CPUs
    /// without them, measurable on one with them) or `portable` (no SIMD). Products,
    /// attention, RoPE and the KV loader all follow it.
    pub kernels: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            path: PathBuf::new(),
            kv_dtype: "f16".into(),
            device: "cpu".into(),
            weights: "quantized".into(),
            kernels: "auto".into(),
        }
    }
}

/// `[kvstore]`: the KV storage engine.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvStoreConfig {
    /// Tokens per stored block.
    pub block_tokens: usize,
    /// Segment file size at which a new one is started, MiB.
    pub segment_mib: u64,
    /// `batch` (sync every put), `interval` (every `sync_interval_ms`), or `none`.
    pub sync: String,
    pub sync_interval_ms: u64,
    /// Put batches of at least this many KiB bypass the page cache (`O_DIRECT`); 0: never.
    pub direct_write_min_kib: usize,
    /// Codec of new namespaces: none, lz4, zstd, lz4-planes, zstd-planes (lossless), q8, q4,
    /// int8 (lossy: each its own namespace). Default `q8`: half of f16's bytes, answers that
    /// agree with f16 stored KV (docs/BENCHMARKS.md, issue 37).
    pub codec: String,
    /// In-memory hot tier, MiB (0 disables).
    pub hot_tier_mib: usize,
    /// In-memory cache of index location records, MiB (91 bytes per block; 0 disables).
    pub location_cache_mib: usize,
    /// Rewrite a sealed segment once this share of it is dead.
    pub merge_dead_ratio: f64,
    /// Namespace group this process's namespaces join; the quota applies per group.
    pub group: String,
    /// Byte quota per namespace group, MiB (0: none).
    pub quota_mib: u64,
    /// KV writes fail with a clear error rather than leave less than this free on the data
    /// directory's file system, MiB (0: no reserve).
    pub min_free_mib: u64,
    /// Eviction starts above `high_water` × quota and stops at `low_water` × quota.
    pub high_water: f64,
    pub low_water: f64,
    /// Eviction policy: lru (default), lfu, ttl, cost. With no quota only `ttl` and `cost`
    /// evict anything (their sweeps); lru and lfu act at the water levels.
    pub eviction: String,
    /// `evict` (by policy, at the water levels) or `refuse` (writes beyond the quota fail).
    pub on_full: String,
    /// `ttl` policy: evict chunks not read for this long.
    pub ttl_hours: f64,
    /// `cost` policy prices: accelerator prefill speed and price, storage price.
    pub cost_prefill_tokens_per_s: f64,
    pub cost_gpu_dollars_per_hour: f64,
    pub cost_storage_dollars_per_gb_month: f64,
    /// Adaptive compaction controller for the index (workload-aware LSM parameters).
    pub adaptive: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            data_dir: PathBuf::from("ragkv-data"),
            kvstore: KvStoreConfig::default(),
            model: ModelConfig::default(),
            embedder: retrieval::EmbedderConfig::default(),
            index: retrieval::IndexConfig::default(),
            ingest: ingest::IngestConfig::recommended(),
            serve: serve::ServeConfig::default(),
            remote: remote::RemoteConfig::default(),
        }
    }
}

impl Default for KvStoreConfig {
    fn default() -> Self {
        let d = kvstore::StoreOptions::default();
        KvStoreConfig {
            block_tokens: d.block_tokens,
            segment_mib: d.segment_bytes >> 20,
            sync: "batch".into(),
            sync_interval_ms: 1000,
            direct_write_min_kib: d.direct_write_min_bytes.map_or(0, |b| b >> 10),
            codec: kvstore::Codec::Q8.name().into(),
            hot_tier_mib: d.hot_tier_bytes >> 20,
            location_cache_mib: d.location_cache_bytes >> 20,
            merge_dead_ratio: d.merge.dead_ratio,
            group: kvstore::DEFAULT_GROUP.into(),
            quota_mib: 0,
            min_free_mib: 256,
            high_water: d.capacity.high_water,
            low_water: d.capacity.low_water,
            eviction: "lru".into(),
            on_full: "evict".into(),
            ttl_hours: 24.0 * 7.0,
            cost_prefill_tokens_per_s: kvstore::CostModel::default().prefill_tokens_per_s,
            cost_gpu_dollars_per_hour: kvstore::CostModel::default().gpu_dollars_per_hour,
            cost_storage_dollars_per_gb_month: kvstore::CostModel::default()
                .storage_dollars_per_gb_month,
            adaptive: false,
        }
    }
}

/// Prefix of environment overrides: `RAGKV__KVSTORE__BLOCK_TOKENS=32`.
const ENV_PREFIX: &str = "RAGKV__";

impl Config {
    /// Loads defaults, then the file, then the environment. `explicit` is `--config`: when
    /// given the file must exist; otherwise `ragkv.toml` is read if present.
    pub fn load(explicit: Option<&Path>) -> Result<Config> {
        let file = match explicit {
            Some(p) => Some(p.to_path_buf()),
            None => Some(PathBuf::from("ragkv.toml")).filter(|p| p.exists()),
        };
        let from_file = match file {
            Some(path) => {
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading config file {}", path.display()))?;
                let value: toml::Value = toml::from_str(&text)
                    .with_context(|| format!("parsing config file {}", path.display()))?;
                Some(value)
            }
            None => None,
        };
        Config::from_layers(from_file, std::env::vars())
    }

    /// The defaults, then `file`'s values, then the `RAGKV__...` variables of `env`.
    fn from_layers(
        file: Option<toml::Value>,
        env: impl Iterator<Item = (String, String)>,
    ) -> Result<Config> {
        let mut value = toml::Value::try_from(Config::default()).context("encoding defaults")?;
        // `ingest.exact_first` named by the file or the environment; otherwise it follows
        // `ingest.context` (on where it applies), so that choosing another mode needs one key.
        let mut exact_first_named = false;
        if let Some(from_file) = file {
            exact_first_named |= from_file
                .get("ingest")
                .and_then(|i| i.get("exact_first"))
                .is_some();
            merge(&mut value, from_file);
        }
        for (k, v) in env {
            if let Some(path) = k.strip_prefix(ENV_PREFIX) {
                let keys: Vec<String> = path.split("__").map(|s| s.to_ascii_lowercase()).collect();
                exact_first_named |= keys == ["ingest", "exact_first"];
                set_path(&mut value, &keys, &v)
                    .with_context(|| format!("environment variable {k}"))?;
            }
        }
        let mut config: Config = value.try_into().context("invalid configuration")?;
        // Chunks stored under `ingest.context = "prompt..."` are prefilled after the prompt
        // the server builds: one key says what it is.
        config.ingest.system_prompt = config.serve.system_prompt.clone();
        if !exact_first_named {
            config.ingest.exact_first = config.ingest.exact_first_applies();
        }
        Ok(config)
    }

    /// Checks every value; the error names the key.
    pub fn validate(&self) -> Result<()> {
        self.store_options()?;
        self.kv_dtype()?;
        self.quantized_weights()?;
        self.kernel_path()?;
        self.device_spec()?;
        let path = self.model_path();
        let path = path.to_string_lossy();
        if model::hub::is_reference(&path) {
            path.parse::<model::hub::HubRef>().context("model.path")?;
        }
        self.embedder.validate()?;
        self.index.validate()?;
        self.ingest.validate()?;
        self.serve.validate()?;
        self.remote.validate()?;
        Ok(())
    }

    /// The configuration with its secrets (`serve.admin_token`, `index.api_key`) replaced by
    /// a marker, for printing: `ragkv config` output ends up in logs and bug reports.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        for secret in [&mut c.serve.admin_token, &mut c.index.api_key] {
            if !secret.is_empty() {
                *secret = REDACTED.into();
            }
        }
        c
    }

    /// `model.weights`: whether GGUF matrices stay quantized.
    pub fn quantized_weights(&self) -> Result<bool> {
        match self.model.weights.as_str() {
            "quantized" => Ok(true),
            "dequantized" => Ok(false),
            other => bail!("model.weights: {other:?} (quantized, dequantized)"),
        }
    }

    /// `model.kernels`, checked against this CPU.
    pub fn kernel_path(&self) -> Result<model::KernelPath> {
        let path: model::KernelPath = self.model.kernels.parse().context("model.kernels")?;
        if !path.supported() {
            bail!("model.kernels: {path:?} needs an instruction set this CPU lacks (auto, avx512, avx2, portable)", path = path.name());
        }
        Ok(path)
    }

    /// `model.kv_dtype` as a candle dtype.
    pub fn kv_dtype(&self) -> Result<model::DType> {
        match self.model.kv_dtype.as_str() {
            "f16" => Ok(model::DType::F16),
            "bf16" => Ok(model::DType::BF16),
            "f32" => Ok(model::DType::F32),
            other => bail!("model.kv_dtype: {other:?} (f16, bf16, f32)"),
        }
    }

    /// `model.device`, parsed (opened when the model loads).
    pub fn device_spec(&self) -> Result<model::DeviceSpec> {
        self.model.device.parse().context("model.device")
    }

    /// The model file, directory or `hf:` reference.
    pub fn model_path(&self) -> PathBuf {
        if self.model.path.as_os_str().is_empty() {
            model::models_dir().join(model::SMOLLM2_FILE)
        } else {
            self.model.path.clone()
        }
    }

    /// Written by a running server: how `ingest` and `delete` reach it.
    pub fn server_file(&self) -> PathBuf {
        self.data_dir.join("server.json")
    }

    pub fn vectors_dir(&self) -> PathBuf {
        self.data_dir.join("vectors")
    }

    /// The store options this configuration describes.
    pub fn store_options(&self) -> Result<kvstore::StoreOptions> {
        let k = &self.kvstore;
        let sync = match k.sync.as_str() {
            "batch" => kvstore::SyncPolicy::EveryBatch,
            "interval" => {
                kvstore::SyncPolicy::Interval(std::time::Duration::from_millis(k.sync_interval_ms))
            }
            "none" => kvstore::SyncPolicy::Never,
            other => bail!("kvstore.sync: unknown policy {other:?} (batch, interval, none)"),
        };
        let Some(codec) = kvstore::Codec::from_name(&k.codec) else {
            bail!("kvstore.codec: unknown codec {:?} (none, lz4, zstd, lz4-planes, zstd-planes, q8, q4, int8)", k.codec);
        };
        let d = kvstore::StoreOptions::default();
        let policy = match k.eviction.as_str() {
            "lru" => kvstore::EvictionPolicy::Lru,
            "lfu" => kvstore::EvictionPolicy::Lfu,
            "ttl" => {
                anyhow::ensure!(
                    k.ttl_hours > 0.0 && k.ttl_hours.is_finite(),
                    "kvstore.ttl_hours: {} (must be > 0)",
                    k.ttl_hours
                );
                kvstore::EvictionPolicy::Ttl {
                    ttl: std::time::Duration::from_secs_f64(k.ttl_hours * 3600.0),
                }
            }
            "cost" => kvstore::EvictionPolicy::CostAware(kvstore::CostModel {
                prefill_tokens_per_s: k.cost_prefill_tokens_per_s,
                gpu_dollars_per_hour: k.cost_gpu_dollars_per_hour,
                storage_dollars_per_gb_month: k.cost_storage_dollars_per_gb_month,
                ..kvstore::CostModel::default()
            }),
            other => bail!("kvstore.eviction: unknown policy {other:?} (lru, lfu, ttl, cost)"),
        };
        let on_full = match k.on_full.as_str() {
            "evict" => kvstore::OnFull::Evict,
            "refuse" => kvstore::OnFull::Refuse,
            other => bail!("kvstore.on_full: {other:?} (evict, refuse)"),
        };
        anyhow::ensure!(
            !k.group.is_empty() && k.group.len() <= 255,
            "kvstore.group: {:?} (1..=255 bytes)",
            k.group
        );
        let opts = kvstore::StoreOptions {
            capacity: kvstore::CapacityOptions {
                quota_bytes: (k.quota_mib > 0).then_some(k.quota_mib << 20),
                high_water: k.high_water,
                low_water: k.low_water,
                policy,
                on_full,
                ..d.capacity
            },
            adaptive: k.adaptive.then(kvstore::AdaptiveOptions::default),
            namespace_group: k.group.clone(),
            min_free_bytes: k.min_free_mib << 20,
            block_tokens: k.block_tokens,
            segment_bytes: k.segment_mib << 20,
            sync,
            direct_write_min_bytes: (k.direct_write_min_kib > 0)
                .then_some(k.direct_write_min_kib << 10),
            default_codec: codec,
            hot_tier_bytes: k.hot_tier_mib << 20,
            location_cache_bytes: k.location_cache_mib << 20,
            merge: kvstore::MergePolicy {
                dead_ratio: k.merge_dead_ratio,
                ..d.merge
            },
            ..d
        };
        opts.validate()
            .map_err(|e| anyhow::anyhow!("kvstore.{e}"))?;
        Ok(opts)
    }

    pub fn kv_dir(&self) -> PathBuf {
        self.data_dir.join("kv")
    }
}

fn merge(base: &mut toml::Value, over: toml::Value) {
    match (base, over) {
        (toml::Value::Table(b), toml::Value::Table(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (slot, v) => *slot = v,
    }
}

/// Sets `keys` in `value` from an environment string, typed like the default it replaces.
fn set_path(value: &mut toml::Value, keys: &[String], raw: &str) -> Result<()> {
    let (last, parents) = keys.split_last().context("empty key")?;
    let mut cur = value;
    for k in parents {
        cur = cur
            .get_mut(k.as_str())
            .with_context(|| format!("unknown section {k:?}"))?;
    }
    let table = cur.as_table_mut().context("not a section")?;
    let slot = table
        .get_mut(last.as_str())
        .with_context(|| format!("unknown key {last:?}"))?;
    *slot = match slot {
        toml::Value::Integer(_) => toml::Value::Integer(
            raw.parse()
                .with_context(|| format!("{last}: expected an integer, got {raw:?}"))?,
        ),
        toml::Value::Float(_) => toml::Value::Float(
            raw.parse()
                .with_context(|| format!("{last}: expected a number, got {raw:?}"))?,
        ),
        toml::Value::Boolean(_) => toml::Value::Boolean(
            raw.parse()
                .with_context(|| format!("{last}: expected true or false, got {raw:?}"))?,
        ),
        _ => toml::Value::String(raw.to_string()),
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_apply_in_order_and_errors_name_the_key() {
        let mut v = toml::Value::try_from(Config::default()).unwrap();
        merge(
            &mut v,
            toml::from_str("[kvstore]\nblock_tokens = 32\ncodec = \"lz4\"").unwrap(),
        );
        set_path(&mut v, &["kvstore".into(), "block_tokens".into()], "16").unwrap();
        let c: Config = v.clone().try_into().unwrap();
        assert_eq!(c.kvstore.block_tokens, 16);
        assert_eq!(c.kvstore.codec, "lz4");
        let err = set_path(&mut v, &["kvstore".into(), "block_tokens".into()], "many").unwrap_err();
        assert!(format!("{err:#}").contains("block_tokens"), "{err:#}");
        assert!(set_path(&mut v, &["kvstore".into(), "nope".into()], "1").is_err());

        let mut c = Config::default();
        c.kvstore.sync = "sometimes".into();
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("kvstore.sync"));
        let mut c = Config::default();
        c.kvstore.block_tokens = 0;
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("block_tokens"));
        let mut c = Config::default();
        c.model.kernels = "sse9".into();
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("model.kernels"));
        c.model.kernels = "portable".into();
        assert_eq!(c.kernel_path().unwrap(), model::KernelPath::Portable);
        let mut c = Config::default();
        c.serve.load_threads = 65;
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("serve.load_threads"));
        c.serve.load_threads = 8;
        assert!(c.validate().is_ok());
        let mut v = toml::Value::try_from(Config::default()).unwrap();
        set_path(&mut v, &["serve".into(), "load_threads".into()], "4").unwrap();
        assert_eq!(v.try_into::<Config>().unwrap().serve.load_threads, 4);
        assert!(Config::default().validate().is_ok());
    }

    #[test]
    fn exact_first_follows_the_materialization_unless_named() {
        let env = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>()
                .into_iter()
        };
        let file = |text: &str| Some(toml::from_str::<toml::Value>(text).unwrap());
        let c = Config::from_layers(None, env(&[])).unwrap();
        assert_eq!(c.ingest.context.to_string(), "prompt+mean:2");
        assert!(c.ingest.exact_first);
        c.validate().unwrap();
        // Another mode by one key: the copies follow it.
        for (f, e) in [
            (file("[ingest]\ncontext = \"none\""), env(&[])),
            (None, env(&[("RAGKV__INGEST__CONTEXT", "prompt")])),
        ] {
            let c = Config::from_layers(f, e).unwrap();
            assert!(!c.ingest.exact_first, "{}", c.ingest.context);
            c.validate().unwrap();
        }
        let c = Config::from_layers(
            None,
            env(&[("RAGKV__INGEST__CONTEXT", "prompt+neighbours:1")]),
        )
        .unwrap();
        assert!(c.ingest.exact_first);
        // Named, it is what was asked for, and refused where it cannot apply.
        let c = Config::from_layers(file("[ingest]\nexact_first = false"), env(&[])).unwrap();
        assert!(!c.ingest.exact_first);
        let named = env(&[
            ("RAGKV__INGEST__CONTEXT", "none"),
            ("RAGKV__INGEST__EXACT_FIRST", "true"),
        ]);
        let c = Config::from_layers(None, named).unwrap();
        let e = format!("{:#}", c.validate().unwrap_err());
        assert!(e.contains("ingest.exact_first"), "{e}");
    }

    #[test]
    fn unknown_keys_in_a_file_are_rejected() {
        let mut v = toml::Value::try_from(Config::default()).unwrap();
        merge(
            &mut v,
            toml::from_str("[kvstore]\nblok_tokens = 32").unwrap(),
        );
        let err = v.try_into::<Config>().unwrap_err();
        assert!(err.to_string().contains("blok_tokens"), "{err}");
    }
}
