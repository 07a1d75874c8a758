//! Namespaces: their layout and codec (which every read and write checks), their group (which
//! quotas apply to) and lifetime, kept in memory and in the index's `meta` family.

use schema::{Codec, KvLayout, NamespaceId};

use super::inner::{now_ms, Inner, Writer};
use super::reports::NamespaceStats;
use crate::error::{Error, Result};
use crate::index::{self, Family, NamespaceInfo, NsMeta, DEFAULT_GROUP};

impl Inner {
    /// The namespace's info if it exists; an error if it exists with another layout.
    pub(super) fn check_layout(
        &self,
        ns: &NamespaceId,
        layout: &KvLayout,
    ) -> Result<Option<NamespaceInfo>> {
        match self.namespaces.read().get(ns) {
            Some(info) if info.layout != *layout => Err(Error::LayoutMismatch {
                ns: *ns,
                stored: info.layout,
                given: *layout,
            }),
            other => Ok(other.copied()),
        }
    }

    /// The namespace's info, registering it (default codec, configured group) on first use.
    pub(super) fn namespace_for_write(
        &self,
        ns: NamespaceId,
        layout: KvLayout,
    ) -> Result<NamespaceInfo> {
        if let Some(info) = self.check_layout(&ns, &layout)? {
            return Ok(info);
        }
        let _w = self.writer.lock();
        match self.check_layout(&ns, &layout)? {
            Some(info) => Ok(info),
            None => {
                let info = NamespaceInfo {
                    layout,
                    codec: self.opts.default_codec,
                };
                self.write_namespace(ns, info)?;
                Ok(info)
            }
        }
    }

    /// Writes the namespace's record (its meta as held in memory, or a new one).
    fn write_namespace(&self, ns: NamespaceId, info: NamespaceInfo) -> Result<()> {
        let meta = self.ns_meta.read().get(&ns).cloned().unwrap_or_else(|| {
            let now = now_ms();
            NsMeta {
                group: self.opts.namespace_group.clone(),
                registered_ms: now,
                active_ms: now,
            }
        });
        let v = index::encode_namespace(&info, &meta);
        self.ns_meta.write().insert(ns, meta);
        self.index.put(
            Family::Meta,
            &index::ns_meta_key(&ns),
            &v,
            "register namespace",
        )?;
        self.namespaces.write().insert(ns, info);
        Ok(())
    }

    /// See `Store::register_namespace_in`.
    pub(super) fn register_namespace(
        &self,
        ns: NamespaceId,
        layout: KvLayout,
        codec: Codec,
        group: &str,
    ) -> Result<()> {
        if group.is_empty() || group.len() > 255 {
            return Err(Error::Invalid {
                what: "namespace group",
                why: format!("{group:?} (must be 1..=255 bytes)"),
            });
        }
        let _w = self.writer.lock();
        self.check_layout(&ns, &layout)?;
        let now = now_ms();
        let registered = self
            .ns_meta
            .read()
            .get(&ns)
            .map_or(now, |m| m.registered_ms);
        self.ns_meta.write().insert(
            ns,
            NsMeta {
                group: group.to_string(),
                registered_ms: registered,
                active_ms: now,
            },
        );
        self.write_namespace(ns, NamespaceInfo { layout, codec })
    }

    /// Every namespace with its group, lifetime and bytes, oldest first.
    pub(super) fn namespace_stats(&self) -> Vec<NamespaceStats> {
        let w = self.writer.lock();
        let infos = self.namespaces.read();
        let metas = self.ns_meta.read();
        let mut out: Vec<NamespaceStats> = infos
            .iter()
            .map(|(ns, info)| {
                let m = metas.get(ns);
                NamespaceStats {
                    id: *ns,
                    layout: info.layout,
                    codec: info.codec,
                    group: m.map_or(DEFAULT_GROUP.into(), |m| m.group.clone()),
                    registered_ms: m.map_or(0, |m| m.registered_ms),
                    active_ms: m.map_or(0, |m| m.active_ms),
                    bytes: w.ns_bytes.get(ns).copied().unwrap_or(0),
                    tokens: w.ns_tokens.get(ns).copied().unwrap_or(0),
                }
            })
            .collect();
        out.sort_by_key(|n| (n.registered_ms, n.id));
        out
    }

    /// Record bytes held by the namespaces of `group`.
    pub(super) fn group_bytes(&self, w: &Writer, group: &str) -> u64 {
        let meta = self.ns_meta.read();
        w.ns_bytes
            .iter()
            .filter(|(ns, _)| meta.get(ns).is_some_and(|m| m.group == group))
            .map(|(_, b)| *b)
            .sum()
    }

    /// The group of `ns` (the configured one for a namespace not registered yet).
    pub(super) fn group_of(&self, ns: &NamespaceId) -> String {
        self.ns_meta
            .read()
            .get(ns)
            .map_or_else(|| self.opts.namespace_group.clone(), |m| m.group.clone())
    }

    /// The namespaces of `group`.
    pub(super) fn group_members(&self, group: &str) -> Vec<NamespaceId> {
        self.ns_meta
            .read()
            .iter()
            .filter(|(_, m)| m.group == group)
            .map(|(ns, _)| *ns)
            .collect()
    }
}
