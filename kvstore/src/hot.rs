//! The hot tier: a byte-bounded LRU of recently read, decoded blocks, in front of the disk.

use std::sync::Arc;

use hashlink::LruCache;
use parking_lot::Mutex;

/// A decoded, verified block.
#[derive(Debug)]
pub(crate) struct HotBlock {
    pub digest: schema::TokenDigest,
    pub layout: schema::KvLayout,
    pub tokens: usize,
    pub bytes: Vec<u8>,
}

impl HotBlock {
    /// Whether this entry is block `b` of a sequence stored in `layout`.
    pub fn holds(&self, b: &crate::key::BlockRef, layout: &schema::KvLayout) -> bool {
        self.digest == b.digest && self.layout == *layout && self.tokens == b.tokens()
    }
}

#[derive(Debug)]
pub(crate) struct HotTier {
    capacity: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    lru: LruCache<Vec<u8>, Arc<HotBlock>>,
    bytes: usize,
}

impl HotTier {
    pub fn new(capacity: usize) -> Self {
        HotTier {
            capacity,
            inner: Mutex::new(Inner {
                lru: LruCache::new_unbounded(),
                bytes: 0,
            }),
        }
    }

    pub fn get(&self, key: &[u8]) -> Option<Arc<HotBlock>> {
        if self.capacity == 0 {
            return None;
        }
        self.inner.lock().lru.get(key).cloned()
    }

    pub fn insert(&self, key: Vec<u8>, block: Arc<HotBlock>) {
        let size = block.bytes.len() + key.len();
        if size > self.capacity {
            return;
        }
        let mut g = self.inner.lock();
        if let Some(old) = g.lru.insert(key.clone(), block) {
            g.bytes -= old.bytes.len() + key.len();
        }
        g.bytes += size;
        while g.bytes > self.capacity {
            match g.lru.remove_lru() {
                Some((k, v)) => g.bytes -= v.bytes.len() + k.len(),
                None => break,
            }
        }
    }

    pub fn remove(&self, key: &[u8]) {
        if self.capacity == 0 {
            return;
        }
        let mut g = self.inner.lock();
        if let Some(old) = g.lru.remove(key) {
            g.bytes -= old.bytes.len() + key.len();
        }
    }

    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(n: usize) -> Arc<HotBlock> {
        Arc::new(HotBlock {
            digest: schema::TokenDigest::EMPTY,
            layout: schema::KvLayout {
                layers: 1,
                kv_heads: 1,
                head_dim: 1,
                dtype: schema::DType::F32,
            },
            tokens: 1,
            bytes: vec![0; n],
        })
    }

    #[test]
    fn stays_within_its_byte_budget_and_evicts_least_recent() {
        let hot = HotTier::new(300);
        hot.insert(b"a".to_vec(), block(99));
        hot.insert(b"b".to_vec(), block(99));
        assert!(hot.get(b"a").is_some()); // a is now most recent
        hot.insert(b"c".to_vec(), block(99));
        hot.insert(b"d".to_vec(), block(99));
        assert!(hot.bytes() <= 300);
        assert!(hot.get(b"b").is_none());
        assert!(hot.get(b"a").is_some());
        hot.remove(b"a");
        assert!(hot.get(b"a").is_none());
        hot.insert(b"big".to_vec(), block(1000));
        assert!(hot.get(b"big").is_none());
    }
}
