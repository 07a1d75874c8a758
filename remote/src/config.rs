//! The `[remote]` section: where the shared KV tier lives and how it is used.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// When KV reaches the remote tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum WriteMode {
    /// Ingest stores each document's objects before it counts the document as done.
    Through,
    /// Objects queued to a background uploader: not built yet (refused at start-up).
    Back,
    /// Never written.
    #[default]
    Off,
}

/// Whether a local miss asks the remote tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ReadMode {
    /// A local miss is fetched from the tier (then kept locally, under the local quota).
    Through,
    /// Never read.
    #[default]
    Off,
}

/// Where the tier lives and its limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteConfig {
    /// The S3 endpoint (`http://127.0.0.1:3900` for a Garage on loopback; empty: the AWS
    /// endpoint of `region`), or `file:///a/directory` for a directory shared by the nodes.
    pub url: String,
    /// The bucket (ignored for `file://` URLs).
    pub bucket: String,
    /// Key prefix inside the bucket (several deployments can share one bucket).
    pub prefix: String,
    /// The S3 region (any name for S3-compatible servers that do not check it).
    pub region: String,
    /// `env` (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`) or the path of a file with
    /// `access_key_id = ...` and `secret_access_key = ...` lines.
    pub credentials: String,
    /// When chunk KV is written to the tier.
    pub write: WriteMode,
    /// When the tier is read.
    pub read: ReadMode,
    /// One operation, its retries included.
    pub timeout_ms: u64,
    /// Establishing one connection.
    pub connect_timeout_ms: u64,
    /// Retries of a failed request, with exponential backoff from `backoff_ms`.
    pub retries: usize,
    /// First backoff between retries (doubled each time).
    pub backoff_ms: u64,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Objects waiting for the background uploader (`write = "back"`, not built yet).
    pub upload_queue: usize,
    /// `ragkv gc` removes only what has been unreferenced this long (an ingest in flight
    /// stores objects before its manifest).
    pub gc_grace_minutes: u64,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            url: String::new(),
            bucket: String::new(),
            prefix: "ragkv".into(),
            region: "us-east-1".into(),
            credentials: "env".into(),
            write: WriteMode::Off,
            read: ReadMode::Off,
            timeout_ms: 30_000,
            connect_timeout_ms: 2_000,
            retries: 3,
            backoff_ms: 100,
            concurrency: 16,
            upload_queue: 256,
            gc_grace_minutes: 60,
        }
    }
}

/// Where the objects go, resolved from the settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    Dir(PathBuf),
    S3 {
        endpoint: Option<String>,
        bucket: String,
        region: String,
    },
}

impl RemoteConfig {
    /// Whether the tier is used at all.
    /// Whether the tier is read or written at all.
    pub fn enabled(&self) -> bool {
        self.write != WriteMode::Off || self.read != ReadMode::Off
    }

    /// `timeout_ms` as a duration.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// Checks every setting (when the tier is enabled), naming the first bad one.
    pub fn validate(&self) -> Result<()> {
        if !self.enabled() {
            return Ok(());
        }
        self.target()?;
        if self.write == WriteMode::Back {
            return Err(Error::Config {
                what: "write",
                why: "\"back\" (a background uploader) is not built yet; use \"through\"".into(),
            });
        }
        let positive = [
            ("timeout_ms", self.timeout_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("concurrency", self.concurrency as u64),
            ("upload_queue", self.upload_queue as u64),
        ];
        for (what, v) in positive {
            if v == 0 {
                return Err(Error::Config {
                    what,
                    why: "must be positive".into(),
                });
            }
        }
        if self.concurrency > 1024 || self.retries > 20 {
            return Err(Error::Config {
                what: "concurrency",
                why: format!(
                    "concurrency {} (≤ 1024) and retries {} (≤ 20)",
                    self.concurrency, self.retries
                ),
            });
        }
        if self.prefix.split('/').any(|p| p == "." || p == "..") {
            return Err(Error::Config {
                what: "prefix",
                why: format!("{:?} has a `.` or `..` part", self.prefix),
            });
        }
        Ok(())
    }

    pub(crate) fn target(&self) -> Result<Target> {
        if let Some(dir) = self.url.strip_prefix("file://") {
            if !dir.starts_with('/') {
                return Err(Error::Config {
                    what: "url",
                    why: format!("{:?}: a file:// url takes an absolute path", self.url),
                });
            }
            return Ok(Target::Dir(PathBuf::from(dir)));
        }
        if self.bucket.is_empty() {
            return Err(Error::Config {
                what: "bucket",
                why: "empty (an S3 tier needs a bucket; or set url = \"file:///dir\")".into(),
            });
        }
        let endpoint = match self.url.as_str() {
            "" => None,
            u if u.starts_with("http://") || u.starts_with("https://") => {
                Some(u.trim_end_matches('/').to_string())
            }
            u => {
                return Err(Error::Config {
                    what: "url",
                    why: format!("{u:?}: expected http(s)://host:port, file:///dir or empty"),
                })
            }
        };
        Ok(Target::S3 {
            endpoint,
            bucket: self.bucket.clone(),
            region: self.region.clone(),
        })
    }

    /// The access key pair from the configured source; `None` for `env` (the S3 client reads
    /// the environment itself).
    pub(crate) fn keys(&self) -> Result<Option<(String, String)>> {
        if self.credentials == "env" {
            return Ok(None);
        }
        let bad = |why: String| Error::Config {
            what: "credentials",
            why,
        };
        let text = std::fs::read_to_string(&self.credentials)
            .map_err(|e| bad(format!("{}: {e}", self.credentials)))?;
        let (mut id, mut secret) = (None, None);
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((k, v)) = line.split_once('=') else {
                return Err(bad(format!(
                    "{}: {line:?} is not `key = value`",
                    self.credentials
                )));
            };
            let v = v.trim().trim_matches('"').to_string();
            match k.trim() {
                "access_key_id" => id = Some(v),
                "secret_access_key" => secret = Some(v),
                other => return Err(bad(format!("{}: unknown key {other:?}", self.credentials))),
            }
        }
        match (id, secret) {
            (Some(i), Some(s)) => Ok(Some((i, s))),
            _ => Err(bad(format!(
                "{}: needs access_key_id and secret_access_key",
                self.credentials
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_and_named() {
        assert!(RemoteConfig::default().validate().is_ok(), "off by default");
        let on = RemoteConfig {
            read: ReadMode::Through,
            ..RemoteConfig::default()
        };
        let e = on.validate().unwrap_err().to_string();
        assert!(e.contains("remote.bucket"), "{e}");
        let s3 = RemoteConfig {
            url: "http://127.0.0.1:3900/".into(),
            bucket: "b".into(),
            ..on.clone()
        };
        assert!(s3.validate().is_ok());
        assert_eq!(
            s3.target().unwrap(),
            Target::S3 {
                endpoint: Some("http://127.0.0.1:3900".into()),
                bucket: "b".into(),
                region: "us-east-1".into()
            }
        );
        for bad in [
            RemoteConfig {
                url: "ftp://x".into(),
                ..s3.clone()
            },
            RemoteConfig {
                url: "file://rel/dir".into(),
                ..s3.clone()
            },
            RemoteConfig {
                concurrency: 0,
                ..s3.clone()
            },
            RemoteConfig {
                prefix: "a/../b".into(),
                ..s3.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let dir = RemoteConfig {
            url: "file:///srv/kv".into(),
            ..on
        };
        assert_eq!(dir.target().unwrap(), Target::Dir("/srv/kv".into()));
    }

    #[test]
    fn credentials_come_from_a_file_or_the_environment() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("creds");
        std::fs::write(
            &f,
            "# garage key\naccess_key_id = GK1\nsecret_access_key = \"s3cr3t\"\n",
        )
        .unwrap();
        let c = RemoteConfig {
            credentials: f.display().to_string(),
            ..RemoteConfig::default()
        };
        assert_eq!(c.keys().unwrap(), Some(("GK1".into(), "s3cr3t".into())));
        std::fs::write(&f, "access_key_id = GK1\n").unwrap();
        assert!(c
            .keys()
            .unwrap_err()
            .to_string()
            .contains("secret_access_key"));
        assert_eq!(RemoteConfig::default().keys().unwrap(), None);
    }
}
