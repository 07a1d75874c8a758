//! The public argument and report types of [`super::Store`].

use schema::{Codec, KvLayout, NamespaceId};

use crate::error::Error;

/// One sequence to store: KV for `tokens`, starting at position 0, in the layer-major layout.
#[derive(Debug, Clone, Copy)]
pub struct PutItem<'a> {
    /// The sequence's tokens (its key).
    pub tokens: &'a [u32],
    /// Layer-major KV of `tokens`. Empty: the sequence is already stored and is only
    /// attached to `doc` (an [`Error::Miss`] if any of its blocks is absent).
    pub kv: &'a [u8],
    /// Attach the sequence to this document, so `delete_document` can drop it later.
    /// Sequences stored without a document stay until deleted explicitly.
    pub doc: Option<&'a str>,
}

/// What a `put_batch` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PutReport {
    /// Blocks appended to the tensor log.
    pub blocks_written: usize,
    /// Blocks that were already stored and not written again.
    pub blocks_present: usize,
    /// Record bytes appended.
    pub bytes_written: u64,
}

/// KV read back from the store.
#[derive(Debug, Clone, PartialEq)]
pub struct KvData {
    /// The namespace's layout.
    pub layout: KvLayout,
    /// Tokens returned.
    pub tokens: usize,
    /// Layer-major bytes (`schema::KvLayout` docs) for `tokens` tokens.
    pub bytes: Vec<u8>,
}

/// What a delete removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeleteReport {
    /// Document sequences detached.
    pub sequences: usize,
    /// Block entries removed from the index.
    pub blocks: usize,
    /// Record bytes that became dead (reclaimed by the merger).
    pub bytes: u64,
}

/// Result of [`super::Store::verify`].
#[derive(Debug, Default)]
pub struct VerifyReport {
    /// Index entries checked.
    pub entries: u64,
    /// Of those, records that verified.
    pub ok: u64,
    /// Keys that failed, with the reason.
    pub failures: Vec<(Vec<u8>, Error)>,
}

/// A namespace as [`super::Store::namespaces`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceStats {
    /// The namespace.
    pub id: NamespaceId,
    /// Its KV layout.
    pub layout: KvLayout,
    /// Its records' codec.
    pub codec: Codec,
    /// Its quota group.
    pub group: String,
    /// First registered, ms since the epoch (0 for namespaces of format version 1).
    pub registered_ms: u64,
    /// Last registered: when a process last declared it its current namespace.
    pub active_ms: u64,
    /// Record bytes in the tensor log.
    pub bytes: u64,
    /// Tokens of KV those records hold (each block's own tokens).
    pub tokens: u64,
}

impl NamespaceStats {
    /// Stored bytes per token of KV (record overhead and codec included); 0 when empty.
    pub fn bytes_per_token(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.bytes as f64 / self.tokens as f64
        }
    }
}

/// What [`super::Store::inspect`] found.
#[derive(Debug)]
pub enum SeqState {
    /// Every block stored, and read back verified.
    Present,
    /// Not (fully) stored.
    Absent,
    /// Stored but unusable; the error says why.
    Damaged(Error),
}
