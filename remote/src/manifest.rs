//! A document version's manifest: which KV objects it wrote, so deleting the document knows
//! what to release. JSON, one object per document version
//! ([`crate::keys`]: `manifests/{namespace}/{doc}/{version}`):
//!
//! | field | type | meaning |
//! |---|---|---|
//! | `format` | integer | manifest format, 1 |
//! | `namespace` | hex string | the model namespace its KV belongs to |
//! | `doc` | string | the document id, as given |
//! | `version` | string | the document's content hash |
//! | `objects` | array of hex strings | token digests of its KV objects, in chunk order |
//!
//! It is written after its objects and their reference markers, so a manifest that exists
//! names objects that were stored.

use schema::NamespaceId;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The manifest format this build writes and reads.
pub const FORMAT: u32 = 1;

/// One document version's KV objects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Format version of the manifest.
    pub format: u32,
    /// The KV namespace (model fingerprint), hex.
    pub namespace: String,
    /// The document id.
    pub doc: String,
    /// The document version (content hash).
    pub version: String,
    /// Keys of the chunk KV objects, in chunk order.
    pub objects: Vec<String>,
}

impl Manifest {
    /// A manifest of the current format.
    pub fn new(ns: NamespaceId, doc: &str, version: &str, objects: Vec<String>) -> Manifest {
        Manifest {
            format: FORMAT,
            namespace: ns.to_hex(),
            doc: doc.to_string(),
            version: version.to_string(),
            objects,
        }
    }

    /// JSON bytes, as stored.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a manifest serializes")
    }

    /// Parses and checks a manifest read from `key` for `ns`.
    pub fn decode(b: &[u8], ns: NamespaceId, key: &str) -> Result<Manifest> {
        let corrupt = |why: String| Error::Corrupt {
            key: key.to_string(),
            why,
        };
        let m: Manifest = serde_json::from_slice(b).map_err(|e| corrupt(e.to_string()))?;
        if m.format != FORMAT {
            return Err(corrupt(format!(
                "manifest format {}; this build reads {FORMAT}",
                m.format
            )));
        }
        if m.namespace != ns.to_hex() {
            return Err(corrupt("written under another namespace".into()));
        }
        if let Some(bad) = m
            .objects
            .iter()
            .find(|o| o.len() != 32 || !o.bytes().all(|c| c.is_ascii_hexdigit()))
        {
            return Err(corrupt(format!("object name {bad:?} is not a digest")));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_round_trip_and_refuse_what_is_not_theirs() {
        let ns = NamespaceId([7; 16]);
        let m = Manifest::new(ns, "doc/1", "abc", vec!["0".repeat(32), "f".repeat(32)]);
        assert_eq!(Manifest::decode(&m.encode(), ns, "k").unwrap(), m);
        assert!(Manifest::decode(&m.encode(), NamespaceId([8; 16]), "k").is_err());
        assert!(Manifest::decode(b"{", ns, "k").is_err());
        let mut bad = m.clone();
        bad.objects.push("../x".into());
        assert!(Manifest::decode(&bad.encode(), ns, "k").is_err());
        let mut later = m;
        later.format = 2;
        let e = Manifest::decode(&later.encode(), ns, "k").unwrap_err();
        assert!(e.to_string().contains("format 2"), "{e}");
    }
}
