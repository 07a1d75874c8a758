use super::*;
use proptest::prelude::*;

fn layout(dtype: DType, heads: u16, dim: u16) -> KvLayout {
    KvLayout {
        layers: 2,
        kv_heads: heads,
        head_dim: dim,
        dtype,
    }
}

/// KV with a per-channel offset and scale on key planes (as real keys have) and per-token
/// noise, deterministic in `seed`.
fn kv(l: &KvLayout, tokens: usize, seed: u64) -> Vec<u8> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let c = l.kv_heads as usize * l.head_dim as usize;
    let size = l.dtype.size();
    let mut out = vec![0u8; l.bytes_for(tokens)];
    let mut i = 0;
    for p in 0..l.planes() {
        let offset: Vec<f32> = (0..c).map(|_| rng.gen_range(-8.0..8.0)).collect();
        let scale: Vec<f32> = (0..c).map(|_| rng.gen_range(0.5..1.5)).collect();
        for _ in 0..tokens {
            for j in 0..c {
                let v = rng.gen_range(-1.0f32..1.0) * scale[j]
                    + if p % 2 == 0 { offset[j] } else { 0.0 };
                write_elem(l.dtype, v, &mut out[i * size..(i + 1) * size]);
                i += 1;
            }
        }
    }
    out
}

fn decode_all(l: &KvLayout, tokens: usize, enc: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; l.bytes_for(tokens)];
    decode_into_place(l, tokens, enc, &mut out, tokens, 0).unwrap();
    out
}

/// Each plane's mode in a payload.
fn modes(l: &KvLayout, n: usize, enc: &[u8]) -> Vec<Mode> {
    planes(l, n, enc)
        .unwrap()
        .1
        .iter()
        .map(|p| p.mode)
        .collect()
}

/// The largest step of any group of plane `p`'s body: the error bound is half of it at 8
/// bits (the group's range), one step at 4 (a fitted scale and minimum, `fit`).
fn max_step(mode: Mode, body: &[u8], n: usize, c: usize) -> f32 {
    let groups = match mode {
        Mode::Q8Token => n * c / q8_group(c),
        Mode::Q4Channel | Mode::Q8Channel | Mode::Q4ChannelWide => 0,
        Mode::Q4Token => n * c / q4_group(c),
    };
    // A mode-4 body starts with its mode-1 body, whose scales are every channel's.
    if matches!(
        mode,
        Mode::Q4Channel | Mode::Q8Channel | Mode::Q4ChannelWide
    ) {
        let mut at = 0;
        let mut m = 0f32;
        for start in (0..n).step_by(KEY_TOKEN_GROUP) {
            let t = KEY_TOKEN_GROUP.min(n - start);
            m = (0..c).map(|j| h(&body[at..], j)).fold(m, f32::max);
            at += 4 * c
                + if mode == Mode::Q8Channel {
                    t * c
                } else {
                    t * c / 2
                };
        }
        m
    } else {
        (0..groups).map(|g| h(body, g)).fold(0f32, f32::max)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn every_value_within_its_groups_bound(
        dt in 0u8..3, heads in 1u16..4, dim in prop::sample::select(vec![16u16, 32, 48, 64, 6]),
        tokens in 1usize..150, seed in any::<u64>(), bits in prop::sample::select(vec![4u8, 8]),
        first in any::<bool>(),
    ) {
        let dtype = DType::from_id(dt).unwrap();
        let l = layout(dtype, heads, dim);
        let raw = kv(&l, tokens, seed);
        let enc = encode(&l, tokens, &raw, bits, first).unwrap();
        let out = decode_all(&l, tokens, &enc);
        let c = heads as usize * dim as usize;
        let size = dtype.size();
        let (head, parts) = planes(&l, tokens, &enc).unwrap();
        // A q4 chunk's first block keeps its first token at 8 bits.
        let want = usize::from(bits == 4 && first && tokens > 1);
        prop_assert_eq!(head, want);
        for (p, plane) in parts.iter().enumerate() {
            let mode = plane.mode;
            if bits == 8 {
                prop_assert!(matches!(mode, Mode::Q8Token | Mode::Q8Channel), "{:?}", mode);
            }
            let head_bound = max_step(Mode::Q8Token, plane.head, head, c) / 2.0;
            let fitted = matches!(mode, Mode::Q4Channel | Mode::Q4Token | Mode::Q4ChannelWide);
            let rest_bound = max_step(mode, plane.body, tokens - head, c) / if fitted { 1.0 } else { 2.0 };
            for e in 0..tokens * c {
                let bound = if e < head * c { head_bound } else { rest_bound };
                let i = p * tokens * c + e;
                let a = read_elem(dtype, &raw[i * size..]);
                let b = read_elem(dtype, &out[i * size..]);
                // The output dtype's own rounding comes on top (bf16: 8 bits of mantissa).
                let tol = bound * 1.001 + b.abs() * if dtype == DType::BF16 { 1.0 / 128.0 } else { 1.0 / 1024.0 } + 1e-6;
                prop_assert!((a - b).abs() <= tol, "{dtype} {mode:?} plane {p} elem {e}: {a} vs {b} (bound {bound})");
            }
        }
    }

    #[test]
    fn simd_decoding_equals_the_portable_one(
        heads in 1u16..5, dim in prop::sample::select(vec![16u16, 32, 64, 128]),
        tokens in 1usize..140, seed in any::<u64>(), bits in prop::sample::select(vec![4u8, 8]),
        first in any::<bool>(),
    ) {
        let l = layout(DType::F16, heads, dim);
        let raw = kv(&l, tokens, seed);
        let enc = encode(&l, tokens, &raw, bits, first).unwrap();
        let c = heads as usize * dim as usize;
        let (head, parts) = planes(&l, tokens, &enc).unwrap();
        for plane in parts {
            for (mode, body, n) in [(Mode::Q8Token, plane.head, head), (plane.mode, plane.body, tokens - head)] {
                if n == 0 {
                    continue;
                }
                let mut a = vec![0u8; n * c * 2];
                let mut b = vec![0u8; n * c * 2];
                decode_plane_portable(mode, body, n, c, DType::F16, &mut a);
                // SIMD where this CPU has it (mode 4: its base, then the wide channels).
                decode_plane(mode, body, n, c, DType::F16, &mut b);
                prop_assert_eq!(&a, &b, "{:?}", mode);
            }
        }
    }

    #[test]
    fn corrupt_payloads_are_errors_not_panics(
        garbage in proptest::collection::vec(any::<u8>(), 0..400), tokens in 1usize..5,
    ) {
        let l = layout(DType::F16, 1, 16);
        let mut out = vec![0u8; l.bytes_for(tokens)];
        let _ = decode_into_place(&l, tokens, &garbage, &mut out, tokens, 0);
    }
}

/// The store bounds a record by its raw size; a quantized payload must never exceed it, even
/// for a one-token block.
#[test]
fn payloads_are_smaller_than_raw_at_every_length() {
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        let l = layout(dtype, 3, 64);
        for n in 1..=70 {
            let raw = kv(&l, n, n as u64);
            for (bits, first) in [(4, false), (4, true), (8, false)] {
                let enc = encode(&l, n, &raw, bits, first).unwrap();
                assert!(
                    enc.len() < raw.len(),
                    "{dtype} {bits} bits, {n} tokens (first {first}): {} of {}",
                    enc.len(),
                    raw.len()
                );
            }
        }
    }
}

#[test]
fn a_block_lands_in_its_layer_major_place() {
    let l = layout(DType::F16, 2, 16);
    let (total, start, n) = (10, 3, 4);
    let raw = kv(&l, n, 7);
    let enc = encode(&l, n, &raw, 4, true).unwrap();
    assert_eq!(enc[1], 1, "a head token");
    let alone = decode_all(&l, n, &enc);
    let mut out = vec![0xAAu8; l.bytes_for(total)];
    decode_into_place(&l, n, &enc, &mut out, total, start).unwrap();
    let tb = l.plane_token_bytes();
    for p in 0..l.planes() {
        let at = (p * total + start) * tb;
        assert_eq!(&out[at..at + n * tb], &alone[p * n * tb..(p + 1) * n * tb]);
        // Rows of other blocks untouched.
        assert!(out[p * total * tb..at].iter().all(|&b| b == 0xAA));
    }
}

#[test]
fn sizes_are_what_the_format_table_says() {
    // SmolLM2's shape: 3 heads × 64, one 64-token block.
    let l = layout(DType::F16, 3, 64);
    let raw = kv(&l, 64, 1);
    let q8 = encode(&l, 64, &raw, 8, true).unwrap();
    let q4 = encode(&l, 64, &raw, 4, false).unwrap();
    let q4_first = encode(&l, 64, &raw, 4, true).unwrap();
    let c = 192;
    // q4 keys: 6 wide channels per group, their 16-bit indices and high nibbles after the
    // base body (64 and 63 tokens).
    let (tail64, tail63) = (6 * 2 + 64 * 6 / 2, 6 * 2 + 63 * 6 / 2);
    // Keys per channel (their offsets measure finer so), values per token.
    assert_eq!(
        q8.len(),
        2 + 4 + 2 * (c * 4 + 64 * c) + 2 * (64 * 3 * 2 + 64 * c)
    );
    assert_eq!(
        q4.len(),
        2 + 4 + 2 * (c * 4 + 64 * c / 2 + tail64) + 2 * (64 * 2 * 4 + 64 * c / 2)
    );
    // A chunk's first block: token 0 of every plane at 8 bits (3 scales, 192 codes), the other
    // 63 in the plane's mode.
    assert_eq!(
        q4_first.len(),
        2 + 4 + 4 * (3 * 2 + c) + 2 * (c * 4 + 63 * c / 2 + tail63) + 2 * (63 * 2 * 4 + 63 * c / 2)
    );
    assert!(raw.len() as f64 / q8.len() as f64 > 1.9);
    assert!(raw.len() as f64 / q4.len() as f64 > 3.5);
}

#[test]
fn an_outlier_heavy_plane_falls_back_to_8_bits() {
    let l = layout(DType::F32, 1, 64);
    let n = 64;
    let mut raw = kv(&l, n, 3);
    // Value plane 1: one huge element per token row (a "massive activation"): per-token
    // 4-bit groups lose every other value of the row.
    for t in 0..n {
        let i = (n * 64 + t * 64) * 4;
        raw[i..i + 4].copy_from_slice(&500f32.to_le_bytes());
    }
    let enc = encode(&l, n, &raw, 4, false).unwrap();
    let modes = modes(&l, n, &enc);
    assert_eq!(
        modes,
        [
            Mode::Q4ChannelWide,
            Mode::Q8Token,
            Mode::Q4ChannelWide,
            Mode::Q4Token
        ]
    );
}

#[test]
fn non_finite_values_are_refused() {
    let l = layout(DType::F32, 1, 16);
    let mut raw = kv(&l, 2, 1);
    raw[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
    assert!(encode(&l, 2, &raw, 4, true).unwrap_err().contains("NaN"));
}

/// A constant 4-bit group is its minimum with a zero scale: exact (a symmetric 8-bit group
/// is only within half a step, which the property above covers).
#[test]
fn constant_groups_decode_exactly_at_4_bits() {
    let l = layout(DType::F16, 1, 16);
    let mut raw = vec![0u8; l.bytes_for(3)];
    for e in raw.chunks_exact_mut(2) {
        e.copy_from_slice(&f16::from_f32(1.5).to_le_bytes());
    }
    let enc = encode(&l, 3, &raw, 4, false).unwrap();
    assert_eq!(decode_all(&l, 3, &enc), raw);
    // A chunk's first block: its head token goes at 8 bits (within half a step, above), the
    // other tokens' constant groups stay exact.
    let enc = encode(&l, 3, &raw, 4, true).unwrap();
    let out = decode_all(&l, 3, &enc);
    let tb = l.plane_token_bytes();
    for p in 0..l.planes() {
        let rows = p * 3 * tb + tb..(p + 1) * 3 * tb;
        assert_eq!(out[rows.clone()], raw[rows]);
    }
}

/// Qwen2-like keys: one channel of every head carries a large offset. Per token, that channel
/// sets its head's 8-bit scale and the others keep a few codes; per channel, each keeps 255.
#[test]
fn q8_keys_with_an_offset_channel_go_per_channel_and_stay_fine() {
    use rand::{Rng, SeedableRng};
    let l = layout(DType::F16, 2, 64);
    let (n, c) = (64, 128);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
    let mut raw = vec![0u8; l.bytes_for(n)];
    for (i, e) in raw.chunks_exact_mut(2).enumerate() {
        let (plane, j) = (i / (n * c), i % c);
        let offset = if plane % 2 == 0 && j % 64 == 0 {
            300.0
        } else {
            0.0
        };
        let v: f32 = offset + rng.gen_range(-1.0..1.0);
        e.copy_from_slice(&f16::from_f32(v).to_le_bytes());
    }
    let enc = encode(&l, n, &raw, 8, true).unwrap();
    let modes = modes(&l, n, &enc);
    assert_eq!(
        modes,
        [
            Mode::Q8Channel,
            Mode::Q8Token,
            Mode::Q8Channel,
            Mode::Q8Token
        ]
    );
    let out = decode_all(&l, n, &enc);
    let worst = raw
        .chunks_exact(2)
        .zip(out.chunks_exact(2))
        .take(n * c)
        .map(|(a, b)| (read_elem(DType::F16, a) - read_elem(DType::F16, b)).abs())
        .fold(0f32, f32::max);
    // Per token the step would be 301 / 127 ≈ 2.4 (half of it: 1.2, more than the noise).
    assert!(worst < 0.25, "worst key error {worst}");
}

/// q4 keys: in every group the channels of widest range get 255 levels, so their error is
/// within half of their range / 255 while the other channels keep range / 15 steps.
#[test]
fn the_widest_key_channels_of_a_group_go_to_8_bits() {
    use rand::{Rng, SeedableRng};
    let l = layout(DType::F32, 1, 64);
    let (n, c) = (100, 64);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(9);
    // Key plane 0: channels 5 and 40 range over ±40, the others over ±1.
    let mut raw = kv(&l, n, 2);
    for t in 0..n {
        for j in [5, 40] {
            let i = (t * c + j) * 4;
            raw[i..i + 4].copy_from_slice(&rng.gen_range(-40.0f32..40.0).to_le_bytes());
        }
    }
    let enc = encode(&l, n, &raw, 4, false).unwrap();
    assert_eq!(modes(&l, n, &enc)[0], Mode::Q4ChannelWide);
    let out = decode_all(&l, n, &enc);
    let err = |t: usize, j: usize| {
        let i = (t * c + j) * 4;
        (read_elem(DType::F32, &raw[i..]) - read_elem(DType::F32, &out[i..])).abs()
    };
    // At 4 bits their bound would be 80 / 15 / 2 ≈ 2.7; at 8 bits it is 80 / 255 / 2.
    for t in 0..n {
        for j in [5, 40] {
            let e = err(t, j);
            assert!(e <= 80.0 / 255.0 / 2.0 * 1.01, "token {t} channel {j}: {e}");
        }
    }
}

/// Stores written before mode 4 (payload version 3), head tokens (version 2) or mode 3
/// (version 1) existed decode as they did; a version 1 payload naming mode 3 is refused, a
/// version 3 one naming mode 4, a wide channel outside the row or out of order, and a head as
/// long as the block.
#[test]
fn version_1_2_and_3_payloads_still_decode() {
    let l = layout(DType::F16, 3, 64);
    let n = MIN_CHANNEL_TOKENS - 1; // keys per token: a payload version 1 could hold
    let raw = kv(&l, n, 4);
    let mut enc = encode(&l, n, &raw, 8, false).unwrap();
    assert_eq!(enc[..2], [VERSION, 0]);
    let v4 = decode_all(&l, n, &enc);
    for v in [VERSION_3, VERSION_2, VERSION_1] {
        enc[0] = v;
        assert_eq!(decode_all(&l, n, &enc), v4, "version {v}");
    }
    let mut headed = encode(&l, 2, &kv(&l, 2, 4), 4, true).unwrap();
    assert_eq!(headed[1], 1);
    headed[1] = 2;
    let mut out = vec![0u8; l.bytes_for(2)];
    let e = decode_into_place(&l, 2, &headed, &mut out, 2, 0).unwrap_err();
    assert!(e.contains("head tokens"), "{e}");
    let mut wide = encode(&l, 64, &kv(&l, 64, 4), 8, false).unwrap();
    assert_eq!(wide[2], Mode::Q8Channel as u8);
    wide[0] = VERSION_1;
    let mut out = vec![0u8; l.bytes_for(64)];
    let e = decode_into_place(&l, 64, &wide, &mut out, 64, 0).unwrap_err();
    assert!(e.contains("mode 3"), "{e}");
    let mut q4 = encode(&l, 64, &kv(&l, 64, 4), 4, false).unwrap();
    assert_eq!(q4[2], Mode::Q4ChannelWide as u8);
    q4[0] = VERSION_3;
    let e = decode_into_place(&l, 64, &q4, &mut out, 64, 0).unwrap_err();
    assert!(e.contains("mode 4"), "{e}");
    // Plane 0's tail starts right after its mode-1 body: its first wide channel, made 192.
    q4[0] = VERSION;
    let at = 2 + l.planes() + body_len(Mode::Q4Channel, 64, 192);
    q4[at..at + 2].copy_from_slice(&192u16.to_le_bytes());
    let e = decode_into_place(&l, 64, &q4, &mut out, 64, 0).unwrap_err();
    assert!(e.contains("wide key channel 192"), "{e}");
    // The same channel named twice: the list must ascend.
    let second = u16::from_le_bytes([q4[at + 2], q4[at + 3]]);
    q4[at..at + 2].copy_from_slice(&second.to_le_bytes());
    let e = decode_into_place(&l, 64, &q4, &mut out, 64, 0).unwrap_err();
    assert!(
        e.contains(&format!("wide key channel {second} after channel {second}")),
        "{e}"
    );
}
