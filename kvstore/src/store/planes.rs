//! Copies between a sequence's layer-major KV and one block's: a block of `n` tokens holds, for
//! each plane (layer × K/V), its `n` tokens' bytes; the sequence holds `total` tokens per plane.

use schema::KvLayout;

/// Copies block `raw` (layer-major for `n` tokens) into `out` (layer-major for `total` tokens)
/// at token offset `start`.
pub(super) fn scatter(
    out: &mut [u8],
    total: usize,
    raw: &[u8],
    start: usize,
    n: usize,
    layout: &KvLayout,
) {
    let tb = layout.plane_token_bytes();
    for p in 0..layout.planes() {
        let dst = (p * total + start) * tb;
        let src = p * n * tb;
        out[dst..dst + n * tb].copy_from_slice(&raw[src..src + n * tb]);
    }
}

/// The inverse of [`scatter`]: the layer-major bytes of tokens `start..start + n`.
pub(super) fn gather(
    kv: &[u8],
    total: usize,
    start: usize,
    n: usize,
    layout: &KvLayout,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(layout.bytes_for(n));
    gather_into(&mut out, kv, total, start, n, layout);
    out
}

/// [`gather`], appending to `out`.
pub(super) fn gather_into(
    out: &mut Vec<u8>,
    kv: &[u8],
    total: usize,
    start: usize,
    n: usize,
    layout: &KvLayout,
) {
    let tb = layout.plane_token_bytes();
    for p in 0..layout.planes() {
        let src = (p * total + start) * tb;
        out.extend_from_slice(&kv[src..src + n * tb]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use schema::DType;

    #[test]
    fn gather_undoes_scatter() {
        let layout = KvLayout {
            layers: 2,
            kv_heads: 1,
            head_dim: 4,
            dtype: DType::F16,
        };
        let total = 10;
        let seq: Vec<u8> = (0..layout.bytes_for(total)).map(|i| i as u8).collect();
        let mut back = vec![0u8; seq.len()];
        for (start, n) in [(0, 4), (4, 4), (8, 2)] {
            let block = gather(&seq, total, start, n, &layout);
            assert_eq!(block.len(), layout.bytes_for(n));
            scatter(&mut back, total, &block, start, n, &layout);
        }
        assert_eq!(back, seq);
    }
}
