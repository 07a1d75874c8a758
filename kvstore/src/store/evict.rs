//! The capacity worker: carries out what `capacity.rs`'s policy chooses. Before a write it
//! makes room under the group's quota (evicting down to the low-water mark, or refusing), and
//! periodically it persists access statistics and runs the policy's sweep (TTL, cost-aware).

use std::collections::BTreeSet;

use schema::NamespaceId;

use super::inner::{bump, now_ms, Deleted, Inner, Writer};
use super::reports::DeleteReport;
use crate::capacity::{EvictReport, EvictionPolicy, OnFull};
use crate::error::{Error, Result};
use crate::index::{Batch, Family};

impl Inner {
    /// Makes room for `incoming` record bytes in the group of `ns` before a write, per the
    /// capacity options; `protect` are block keys of the write (never evicted by it). Called
    /// with the writer lock held; commits its own index batch.
    pub(super) fn make_room(
        &self,
        w: &mut Writer,
        ns: &NamespaceId,
        incoming: u64,
        protect: &[&[u8]],
    ) -> Result<()> {
        let cap = &self.opts.capacity;
        let Some(quota) = cap.quota_bytes else {
            return Ok(());
        };
        if incoming == 0 {
            return Ok(());
        }
        let group = self.group_of(ns);
        let used = self.group_bytes(w, &group);
        let high = (quota as f64 * cap.high_water) as u64;
        if cap.on_full == OnFull::Evict && used + incoming > high {
            let low = (quota as f64 * cap.low_water) as u64;
            let target = low.saturating_sub(incoming);
            let r = self.evict_locked(w, &group, target, protect, false)?;
            if r.sequences > 0 {
                tracing::debug!(group, ?r, "evicted at the high-water mark");
            }
        }
        let used = self.group_bytes(w, &group);
        if used + incoming > quota {
            return Err(Error::QuotaExceeded {
                group,
                used,
                quota,
                needed: incoming,
            });
        }
        Ok(())
    }

    /// Evicts resident sequences of `group` in policy order until it holds at most `target`
    /// bytes (or, with `sweep_only`, every sequence the policy's sweep rejects). Commits.
    pub(super) fn evict_locked(
        &self,
        w: &mut Writer,
        group: &str,
        target: u64,
        protect: &[&[u8]],
        sweep_only: bool,
    ) -> Result<EvictReport> {
        let now = now_ms();
        let members = self.group_members(group);
        let mut access = self.access.lock();
        let order = access.eviction_order(
            &self.opts.capacity.policy,
            |ns| members.contains(ns),
            sweep_only,
            now,
        );
        let before = w.clone();
        let mut batch = Batch::default();
        let mut report = EvictReport::default();
        let mut done = Deleted::default();
        let mut del = DeleteReport::default();
        for seq in order {
            if !sweep_only && self.group_bytes(w, group) <= target {
                break;
            }
            let Some(cut) = access.eviction_cut(&seq, protect) else {
                continue;
            };
            self.delete_range(w, &mut batch, &cut, &mut done, &mut del)?;
            if let Some(rec) = access.evicted(&seq) {
                batch.put(&self.index, Family::Access, &seq, &rec);
            }
            report.sequences += 1;
        }
        drop(access);
        report.blocks = del.blocks;
        report.bytes = del.bytes;
        if report.sequences > 0 {
            self.commit(w, before, batch, done.located)?;
            bump(&self.counters.evicted_sequences, report.sequences as u64);
            bump(&self.counters.evicted_bytes, report.bytes);
        }
        Ok(report)
    }

    /// Persists dirty access statistics in one batch.
    pub(super) fn flush_access(&self) -> Result<()> {
        let batch = {
            let mut a = self.access.lock();
            if a.dirty.is_empty() {
                return Ok(());
            }
            let mut batch = Batch::default();
            for k in std::mem::take(&mut a.dirty) {
                if let Some(s) = a.seqs.get(&k) {
                    batch.put(
                        &self.index,
                        Family::Access,
                        &k,
                        &crate::capacity::encode_access(s),
                    );
                }
            }
            batch
        };
        // Statistics need no sync of their own: the next synced write or flush carries them.
        self.index.write_unsynced(batch, "flush access statistics")
    }

    /// The periodic capacity work: persist statistics; run the TTL / cost sweep.
    pub(super) fn capacity_tick(&self) -> Result<()> {
        self.flush_access()?;
        let policy = self.opts.capacity.policy;
        if matches!(policy, EvictionPolicy::Lru | EvictionPolicy::Lfu) {
            return Ok(());
        }
        let groups: BTreeSet<String> = self
            .ns_meta
            .read()
            .values()
            .map(|m| m.group.clone())
            .collect();
        for g in groups {
            let mut w = self.writer.lock();
            self.check_poisoned()?;
            let r = self.evict_locked(&mut w, &g, 0, &[], true)?;
            if r.sequences > 0 {
                tracing::info!(
                    group = g,
                    policy = policy.name(),
                    ?r,
                    "sweep evicted sequences"
                );
            }
        }
        Ok(())
    }
}
