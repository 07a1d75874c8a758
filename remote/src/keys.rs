//! Where things live in the bucket, under the configured prefix:
//!
//! | key | what |
//! |---|---|
//! | `{prefix}/kv/{namespace}/{digest}` | one sequence's KV ([`crate::object`]); `digest` is [`schema::TokenDigest::of`] its tokens, hex |
//! | `{prefix}/manifests/{namespace}/{doc}/{version}` | a document version's manifest ([`crate::manifest`]) |
//! | `{prefix}/refs/{namespace}/{digest}/{doc}.{version}` | an empty object: that document version references that KV object |
//!
//! `doc` is the first 16 bytes of blake3 of the document id, hex (ids are free text; the
//! manifest keeps the id itself); `version` is the document's content hash as ingest gives
//! it (hex). Namespaces are [`NamespaceId::to_hex`].

use object_store::path::Path;
use schema::{NamespaceId, TokenDigest};

/// Lower-case hex.
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The key form of a document id.
pub fn doc_key(doc: &str) -> String {
    hex(&blake3::hash(doc.as_bytes()).as_bytes()[..16])
}

/// Key builder for one bucket prefix.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    prefix: String,
}

impl Keys {
    pub(crate) fn new(prefix: &str) -> Keys {
        Keys {
            prefix: prefix.trim_matches('/').to_string(),
        }
    }

    fn path(&self, rest: String) -> Path {
        if self.prefix.is_empty() {
            Path::from(rest)
        } else {
            Path::from(format!("{}/{rest}", self.prefix))
        }
    }

    pub(crate) fn kv(&self, ns: NamespaceId, tokens: &[u32]) -> Path {
        self.kv_digest(ns, &hex(&TokenDigest::of(tokens).0))
    }

    pub(crate) fn kv_digest(&self, ns: NamespaceId, digest: &str) -> Path {
        self.path(format!("kv/{}/{digest}", ns.to_hex()))
    }

    pub(crate) fn kv_root(&self) -> Path {
        self.path("kv".into())
    }

    pub(crate) fn manifest(&self, ns: NamespaceId, doc: &str, version: &str) -> Path {
        self.path(format!(
            "manifests/{}/{}/{version}",
            ns.to_hex(),
            doc_key(doc)
        ))
    }

    pub(crate) fn manifest_root(&self) -> Path {
        self.path("manifests".into())
    }

    pub(crate) fn doc_manifests(&self, ns: NamespaceId, doc: &str) -> Path {
        self.path(format!("manifests/{}/{}", ns.to_hex(), doc_key(doc)))
    }

    pub(crate) fn refs(&self, ns: NamespaceId, digest: &str) -> Path {
        self.path(format!("refs/{}/{digest}", ns.to_hex()))
    }

    pub(crate) fn reference(
        &self,
        ns: NamespaceId,
        digest: &str,
        doc: &str,
        version: &str,
    ) -> Path {
        self.path(format!(
            "refs/{}/{digest}/{}.{version}",
            ns.to_hex(),
            doc_key(doc)
        ))
    }

    pub(crate) fn ref_root(&self) -> Path {
        self.path("refs".into())
    }

    /// The parts of `p` after the prefix and `root` (`kv`, `manifests` or `refs`).
    pub(crate) fn parts(&self, p: &Path, root: &str) -> Option<Vec<String>> {
        let mut parts: Vec<String> = p.parts().map(|x| x.as_ref().to_string()).collect();
        let skip = if self.prefix.is_empty() {
            0
        } else {
            self.prefix.split('/').count()
        };
        if parts.len() <= skip || parts[skip] != root {
            return None;
        }
        Some(parts.split_off(skip + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_namespace_digest_and_document() {
        let ns = NamespaceId([0xab; 16]);
        let k = Keys::new("/team/ragkv/");
        let kv = k.kv(ns, &[1, 2, 3]);
        let digest = hex(&TokenDigest::of(&[1, 2, 3]).0);
        assert_eq!(
            kv.as_ref(),
            format!("team/ragkv/kv/{}/{digest}", ns.to_hex())
        );
        assert_eq!(
            k.parts(&kv, "kv").unwrap(),
            vec![ns.to_hex(), digest.clone()]
        );
        assert!(k.parts(&kv, "refs").is_none());
        let r = k.reference(ns, &digest, "doc one/α", "v1");
        let parts = k.parts(&r, "refs").unwrap();
        assert_eq!(parts[2], format!("{}.v1", doc_key("doc one/α")));
        assert_eq!(
            Keys::new("")
                .manifest(ns, "d", "v")
                .as_ref()
                .split('/')
                .count(),
            4
        );
    }
}
