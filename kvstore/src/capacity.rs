//! Capacity: access statistics, a byte quota per namespace group, water-level eviction.
//!
//! # Unit of eviction
//! A *sequence*: the token sequence of one `put_batch` item (a chunk), named by the key of its
//! last block. Evicting a sequence drops the blocks that no other resident sequence runs
//! through, deepest first: a block is never removed while a longer sequence still uses it, so
//! suffix blocks always go before their parents and every stored sequence stays
//! prefix-closed. An evicted sequence keeps its statistics (marked not resident), so a later
//! `rematerialize --hot` knows which evicted chunks were worth keeping.
//!
//! # Access statistics
//! Kept in memory; a read updates a map entry under a short lock and marks it dirty. Dirty
//! entries are written to the `access` column family in one batch every
//! `CapacityOptions::flush_interval` (by the `kvstore-capacity` thread) and when the store
//! closes, so reads never cost a RocksDB write. A crash loses at most one interval of counts.
//!
//! | bytes   | field                                     |
//! |---------|-------------------------------------------|
//! | 0       | version, `1`                              |
//! | 1..5    | tokens, u32 LE                            |
//! | 5..13   | payload bytes of the sequence, u64 LE     |
//! | 13..21  | first stored, ms since the epoch, u64 LE  |
//! | 21..29  | last read (or stored), ms, u64 LE         |
//! | 29..33  | reads, u32 LE                             |
//! | 33      | resident, `0` or `1`                      |
//!
//! Key: the sequence key (namespace, then chained block hashes; `key.rs`).
//!
//! # Quota and water levels
//! Each namespace belongs to a group (`Store::register_namespace_in`; default `default`); the
//! quota bounds the record bytes of each group. A write that would take a group above the
//! high-water mark first evicts (policy order) down to the low-water mark, so eviction runs in
//! batches rather than once per write; a write that still does not fit under the quota is
//! refused with [`crate::Error::QuotaExceeded`]. With [`OnFull::Refuse`] nothing is evicted
//! automatically: writes beyond the quota are refused.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use schema::NamespaceId;

use crate::error::{Error, Result};
use crate::key;

/// Which sequences go first when a group must shrink.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EvictionPolicy {
    /// Least recently read (or stored) first.
    Lru,
    /// Fewest reads first; ties by recency.
    Lfu,
    /// Sequences not read for `ttl` are evicted by the periodic sweep even without pressure;
    /// under pressure, least recently used first.
    Ttl {
        /// Idle time after which a sequence goes.
        ttl: Duration,
    },
    /// Keep a sequence while the recompute its expected reuse saves is worth more than the
    /// storage it occupies (judged by the periodic sweep once a sequence is `prior_s` old);
    /// under pressure, the lowest net value per byte goes first.
    CostAware(CostModel),
}

impl EvictionPolicy {
    /// `lru`, `lfu`, `ttl` or `cost`.
    pub fn name(&self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Lfu => "lfu",
            EvictionPolicy::Ttl { .. } => "ttl",
            EvictionPolicy::CostAware(_) => "cost",
        }
    }
}

/// Prices for the cost-aware policy: MatKV's break-even ("ten-day rule") as a live policy.
///
/// A reuse of a stored chunk saves `tokens / prefill_tokens_per_s` seconds of accelerator time,
/// minus the time to load it (`bytes / load_bytes_per_s`). The expected reuse rate of a
/// sequence is `(reads + 1) / (age + prior_s)`: one imagined read over `prior_s` seconds keeps
/// new chunks from looking worthless before they had a chance to be read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Prefill throughput of the serving accelerator. Default 10,000 tokens/s (a 0.5B model
    /// on one data-centre GPU).
    pub prefill_tokens_per_s: f64,
    /// Read bandwidth of the KV store. Default 2 GB/s (one NVMe drive).
    pub load_bytes_per_s: f64,
    /// Accelerator price. Default $2 per hour.
    pub gpu_dollars_per_hour: f64,
    /// Storage price. Default $0.08 per GB-month (NVMe block storage).
    pub storage_dollars_per_gb_month: f64,
    /// Prior observation window. Default one day.
    pub prior_s: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            prefill_tokens_per_s: 10_000.0,
            load_bytes_per_s: 2e9,
            gpu_dollars_per_hour: 2.0,
            storage_dollars_per_gb_month: 0.08,
            prior_s: 86_400.0,
        }
    }
}

const MONTH_S: f64 = 30.0 * 86_400.0;

impl CostModel {
    /// Dollars one reuse of a sequence of `tokens` tokens and `bytes` bytes saves (≥ 0).
    pub fn saving_per_reuse(&self, tokens: u32, bytes: u64) -> f64 {
        let saved_s =
            tokens as f64 / self.prefill_tokens_per_s - bytes as f64 / self.load_bytes_per_s;
        saved_s.max(0.0) * self.gpu_dollars_per_hour / 3600.0
    }

    /// Dollars per second that storing `bytes` costs.
    pub fn storage_per_s(&self, bytes: u64) -> f64 {
        bytes as f64 / 1e9 * self.storage_dollars_per_gb_month / MONTH_S
    }

    /// The break-even reuse interval: storing pays while the chunk is reused at least this
    /// often (seconds between reuses).
    pub fn break_even_s(&self, tokens: u32, bytes: u64) -> f64 {
        self.saving_per_reuse(tokens, bytes) / self.storage_per_s(bytes.max(1))
    }

    /// Net dollars per second of keeping `s` at `now_ms`: expected savings minus storage.
    fn net_per_s(&self, s: &SeqStat, now_ms: u64) -> f64 {
        let age = now_ms.saturating_sub(s.created_ms) as f64 / 1e3;
        let rate = (s.reads as f64 + 1.0) / (age + self.prior_s);
        rate * self.saving_per_reuse(s.tokens, s.bytes) - self.storage_per_s(s.bytes)
    }
}

/// What a write does when its group is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFull {
    /// Evict by policy from the high-water mark down to the low-water mark.
    Evict,
    /// Refuse the write ([`crate::Error::QuotaExceeded`]); evict nothing automatically.
    Refuse,
}

/// Quota, water levels and policy; see the module documentation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapacityOptions {
    /// Record bytes each namespace group may hold. Default `None`: unbounded.
    pub quota_bytes: Option<u64>,
    /// Share of the quota at which eviction starts. Default 0.95.
    pub high_water: f64,
    /// Share of the quota eviction brings a group down to. Default 0.85: each eviction pass
    /// frees a tenth of the quota, so passes are rare.
    pub low_water: f64,
    /// What is evicted first.
    pub policy: EvictionPolicy,
    /// What a write does when eviction cannot make room.
    pub on_full: OnFull,
    /// How often access statistics are persisted and TTL / cost sweeps run. Default 5 s.
    pub flush_interval: Duration,
}

impl Default for CapacityOptions {
    fn default() -> Self {
        CapacityOptions {
            quota_bytes: None,
            high_water: 0.95,
            low_water: 0.85,
            policy: EvictionPolicy::Lru,
            on_full: OnFull::Evict,
            flush_interval: Duration::from_secs(5),
        }
    }
}

impl CapacityOptions {
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |what, why: String| Err(Error::Invalid { what, why });
        if !(0.0 < self.low_water && self.low_water <= self.high_water && self.high_water <= 1.0) {
            return bad(
                "capacity water levels",
                format!(
                    "low {} / high {} (need 0 < low ≤ high ≤ 1)",
                    self.low_water, self.high_water
                ),
            );
        }
        if self.quota_bytes == Some(0) {
            return bad(
                "capacity.quota_bytes",
                "0 (leave it unset for no quota)".into(),
            );
        }
        if self.flush_interval.is_zero() {
            return bad("capacity.flush_interval", "0".into());
        }
        match self.policy {
            EvictionPolicy::Ttl { ttl } if ttl.is_zero() => bad("capacity.ttl", "0".into()),
            EvictionPolicy::CostAware(m)
                if !(m.prefill_tokens_per_s > 0.0
                    && m.load_bytes_per_s > 0.0
                    && m.gpu_dollars_per_hour >= 0.0
                    && m.storage_dollars_per_gb_month > 0.0
                    && m.prior_s > 0.0) =>
            {
                bad(
                    "capacity cost model",
                    format!("{m:?} (rates and prices must be > 0)"),
                )
            }
            _ => Ok(()),
        }
    }
}

/// Access statistics of one stored sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccessInfo {
    /// Tokens of the sequence.
    pub tokens: u32,
    /// Payload bytes (uncompressed KV of the whole sequence).
    pub bytes: u64,
    /// Stored, ms since the epoch.
    pub created_ms: u64,
    /// Last read, hit or miss (or store).
    pub last_ms: u64,
    /// Reads asked for, hits and misses (a miss of an evicted sequence is demand too).
    pub reads: u32,
    /// False once evicted (statistics are kept).
    pub resident: bool,
}

pub(crate) type SeqStat = AccessInfo;

const ACCESS_VERSION: u8 = 1;
const ACCESS_LEN: usize = 34;

pub(crate) fn encode_access(s: &SeqStat) -> [u8; ACCESS_LEN] {
    let mut b = [0u8; ACCESS_LEN];
    b[0] = ACCESS_VERSION;
    b[1..5].copy_from_slice(&s.tokens.to_le_bytes());
    b[5..13].copy_from_slice(&s.bytes.to_le_bytes());
    b[13..21].copy_from_slice(&s.created_ms.to_le_bytes());
    b[21..29].copy_from_slice(&s.last_ms.to_le_bytes());
    b[29..33].copy_from_slice(&s.reads.to_le_bytes());
    b[33] = s.resident as u8;
    b
}

pub(crate) fn decode_access(b: &[u8]) -> Option<SeqStat> {
    if b.len() != ACCESS_LEN || b[0] != ACCESS_VERSION {
        return None;
    }
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    Some(SeqStat {
        tokens: u32::from_le_bytes(b[1..5].try_into().unwrap()),
        bytes: u64_at(5),
        created_ms: u64_at(13),
        last_ms: u64_at(21),
        reads: u32::from_le_bytes(b[29..33].try_into().unwrap()),
        resident: b[33] == 1,
    })
}

/// Reads logged since the access map was last locked, at most this many (~6 MB of keys at
/// most); a read that finds the log full applies it itself.
const READ_LOG_MAX: usize = 1 << 16;
/// How often the `kvstore-capacity` thread applies the read log.
pub(crate) const APPLY_READS_EVERY: Duration = Duration::from_millis(250);

/// The access map behind its lock, with reads logged on the side: a get appends its sequence
/// key to a flat buffer (no map search, no allocation once the buffer has grown), and the log
/// is applied, in order, whenever the map is locked: by the `kvstore-capacity` thread every
/// [`APPLY_READS_EVERY`], by anything else that needs the map, or by a read that finds the log
/// full. So every reader of the map sees every read logged before it, and gets do not pay
/// for the ordered map's search.
#[derive(Debug, Default)]
pub(crate) struct AccessLog {
    map: Mutex<Access>,
    reads: Mutex<ReadLog>,
}

#[derive(Debug, Default)]
struct ReadLog {
    keys: Vec<u8>,
    /// (key length, time) of each read, in order; the keys lie back to back in `keys`.
    reads: Vec<(u16, u64)>,
}

impl AccessLog {
    /// The access map, with every logged read applied.
    pub fn lock(&self) -> MutexGuard<'_, Access> {
        let mut map = self.map.lock();
        let log = std::mem::take(&mut *self.reads.lock());
        let mut at = 0;
        for (len, now) in log.reads {
            let key = &log.keys[at..at + len as usize];
            map.read(key, now);
            at += len as usize;
        }
        map
    }

    /// A sequence was asked for now, hit or miss: logged, applied later ([`Access::read`]).
    pub fn read(&self, key: &[u8], now: u64) {
        let Ok(len) = u16::try_from(key.len()) else {
            return self.lock().read(key, now);
        };
        let full = {
            let mut log = self.reads.lock();
            log.keys.extend_from_slice(key);
            log.reads.push((len, now));
            log.reads.len() >= READ_LOG_MAX
        };
        if full {
            drop(self.lock());
        }
    }
}

/// The in-memory access map; see the module documentation.
#[derive(Debug, Default)]
pub(crate) struct Access {
    pub seqs: BTreeMap<Vec<u8>, SeqStat>,
    pub dirty: BTreeSet<Vec<u8>>,
}

impl Access {
    /// A sequence was stored (or found stored) now.
    pub fn stored(&mut self, key: &[u8], tokens: u32, bytes: u64, now: u64) {
        let e = self.seqs.entry(key.to_vec()).or_insert(SeqStat {
            tokens,
            bytes,
            created_ms: now,
            last_ms: now,
            reads: 0,
            resident: true,
        });
        if !e.resident {
            // Re-materialized: a new residency, the read history is kept.
            e.created_ms = now;
            e.resident = true;
        }
        e.last_ms = e.last_ms.max(now);
        self.dirty.insert(key.to_vec());
    }

    /// A sequence was asked for now, hit or miss (no-op for keys never stored).
    pub fn read(&mut self, key: &[u8], now: u64) {
        if let Some(e) = self.seqs.get_mut(key) {
            e.reads = e.reads.saturating_add(1);
            e.last_ms = e.last_ms.max(now);
            if !self.dirty.contains(key) {
                self.dirty.insert(key.to_vec());
            }
        }
    }

    /// Whether some resident sequence other than `except` runs through block `anc`.
    fn needed(&self, anc: &[u8], except: &[u8]) -> bool {
        self.seqs
            .range(anc.to_vec()..)
            .take_while(|(k, _)| k.starts_with(anc))
            .any(|(k, s)| s.resident && k.as_slice() != except)
    }
}

/// Eviction order key: lower goes first.
fn order(policy: &EvictionPolicy, s: &SeqStat, now: u64) -> f64 {
    match policy {
        EvictionPolicy::Lru | EvictionPolicy::Ttl { .. } => s.last_ms as f64,
        // Reads dominate; recency breaks ties (last_ms / 1e13 < 1).
        EvictionPolicy::Lfu => s.reads as f64 + s.last_ms as f64 / 1e13,
        EvictionPolicy::CostAware(m) => m.net_per_s(s, now) / s.bytes.max(1) as f64,
    }
}

/// Whether the periodic sweep evicts `s` without pressure.
fn sweep_out(policy: &EvictionPolicy, s: &SeqStat, now: u64) -> bool {
    match policy {
        EvictionPolicy::Ttl { ttl } => now.saturating_sub(s.last_ms) >= ttl.as_millis() as u64,
        // Judged only after one prior window: a new chunk has had no chance to be read.
        EvictionPolicy::CostAware(m) => {
            now.saturating_sub(s.created_ms) as f64 >= m.prior_s * 1e3 && m.net_per_s(s, now) < 0.0
        }
        EvictionPolicy::Lru | EvictionPolicy::Lfu => false,
    }
}

/// What an eviction pass removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EvictReport {
    /// Sequences marked evicted.
    pub sequences: usize,
    /// Blocks dropped from the index.
    pub blocks: usize,
    /// Record bytes that became dead (reclaimed by the merger).
    pub bytes: u64,
}

impl Access {
    /// The resident sequences of the namespaces `in_group` accepts, in eviction order (first
    /// to go first); with `sweep_only`, only those the policy's sweep rejects.
    pub(crate) fn eviction_order(
        &self,
        policy: &EvictionPolicy,
        in_group: impl Fn(&NamespaceId) -> bool,
        sweep_only: bool,
        now: u64,
    ) -> Vec<Vec<u8>> {
        let mut cands: Vec<(f64, &Vec<u8>)> = self
            .seqs
            .iter()
            .filter(|(k, s)| {
                s.resident
                    && key::namespace_of(k).is_some_and(|ns| in_group(&ns))
                    && (!sweep_only || sweep_out(policy, s, now))
            })
            .map(|(k, s)| (order(policy, s, now), k))
            .collect();
        cands.sort_by(|a, b| a.0.total_cmp(&b.0));
        cands.into_iter().map(|(_, k)| k.clone()).collect()
    }

    /// What evicting sequence `seq` deletes: everything under its shallowest ancestor that no
    /// other resident sequence and no block of the write in progress (`protect`) runs
    /// through. `None` while it must wait: a longer resident sequence extends it (suffixes go
    /// first), or the write uses it.
    pub(crate) fn eviction_cut(&self, seq: &[u8], protect: &[&[u8]]) -> Option<Vec<u8>> {
        if protect.iter().any(|p| p.starts_with(seq)) || self.needed(seq, seq) {
            return None;
        }
        key::unneeded_ancestor(seq, |anc| {
            Ok::<bool, std::convert::Infallible>(
                self.needed(anc, seq) || protect.iter().any(|p| p.starts_with(anc)),
            )
        })
        .unwrap_or_else(|never| match never {})
    }

    /// Marks `seq` evicted (its statistics stay, not resident) and returns its record.
    pub(crate) fn evicted(&mut self, seq: &[u8]) -> Option<[u8; ACCESS_LEN]> {
        let s = self.seqs.get_mut(seq)?;
        s.resident = false;
        let rec = encode_access(s);
        self.dirty.insert(seq.to_vec());
        Some(rec)
    }
}

#[cfg(test)]
#[path = "capacity_tests.rs"]
mod tests;
