//! The merger's policy: which segments to rewrite, to reclaim the space of deleted records and
//! keep the file count bounded.
//!
//! The policy is a pure function, [`choose`], over the segment accounting; the worker
//! (`store/merger.rs`) carries out its choice. Rewriting a segment copies its live records (byte for byte: a record does
//! not depend on where it lives) to the active segment, in steps of `step_bytes`. Each step
//! appends, syncs per policy, then commits the new locations in one index batch, re-checking
//! under the writer lock that each record is still the one the index points at. When a
//! segment has no live record left, its accounting is deleted in an index batch and the file is
//! retired: unlinked once the last reader holding it is done.

use std::collections::{BTreeMap, BTreeSet};

use crate::options::MergePolicy;
use crate::segment::SegmentMeta;

/// What a merger pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MergeReport {
    /// Segments whose live records were copied elsewhere.
    pub segments_rewritten: usize,
    /// Segment files retired (unlinked when their last reader is done).
    pub segments_removed: usize,
    /// Record bytes copied.
    pub bytes_copied: u64,
    /// File bytes given back.
    pub bytes_reclaimed: u64,
    /// Live records dropped because they failed verification while being copied.
    pub corrupt_dropped: usize,
}

/// Which sealed segments to rewrite: those whose dead share reaches `dead_ratio` (or that
/// hold nothing live), plus every small one once there are more than `max_small_segments`.
pub(crate) fn choose(
    metas: &BTreeMap<u64, SegmentMeta>,
    active: Option<u64>,
    policy: &MergePolicy,
    segment_bytes: u64,
) -> Vec<u64> {
    let sealed: Vec<(u64, &SegmentMeta)> = metas
        .iter()
        .filter(|(id, m)| m.sealed && Some(**id) != active)
        .map(|(id, m)| (*id, m))
        .collect();
    let mut out: BTreeSet<u64> = sealed
        .iter()
        .filter(|(_, m)| m.live_records == 0 || m.dead_ratio() >= policy.dead_ratio)
        .map(|(id, _)| *id)
        .collect();
    let small_limit = (segment_bytes as f64 * policy.small_ratio) as u64;
    let small: Vec<u64> = sealed
        .iter()
        .filter(|(id, m)| m.len < small_limit && !out.contains(id))
        .map(|(id, _)| *id)
        .collect();
    if small.len() > policy.max_small_segments {
        out.extend(small);
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(sealed: bool, len: u64, live: u64, dead: u64) -> SegmentMeta {
        SegmentMeta {
            sealed,
            len,
            live_bytes: live,
            dead_bytes: dead,
            live_records: if live > 0 { 1 } else { 0 },
        }
    }

    #[test]
    fn chooses_sparse_and_empty_sealed_segments_never_the_active_one() {
        let p = MergePolicy::default();
        let mut m = BTreeMap::new();
        m.insert(1, meta(true, 1000, 400, 600)); // 60 % dead
        m.insert(2, meta(true, 1000, 600, 400)); // 40 % dead
        m.insert(3, meta(true, 1000, 0, 1000)); // empty
        m.insert(4, meta(false, 1000, 0, 1000)); // active
        assert_eq!(choose(&m, Some(4), &p, 1000), vec![1, 3]);
    }

    #[test]
    fn packs_small_segments_once_there_are_too_many() {
        let p = MergePolicy {
            max_small_segments: 2,
            ..MergePolicy::default()
        };
        let mut m = BTreeMap::new();
        for id in 1..=2 {
            m.insert(id, meta(true, 100, 100, 0));
        }
        m.insert(9, meta(true, 900, 900, 0));
        assert!(choose(&m, None, &p, 1000).is_empty());
        m.insert(3, meta(true, 100, 100, 0));
        assert_eq!(choose(&m, None, &p, 1000), vec![1, 2, 3]);
    }
}
