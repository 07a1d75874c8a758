//! The GGUF reader against candle's, and the IQ4 types end to end.

use super::*;
use crate::quant::test_util::{iq4_nl_reference, iq4_xs_reference};
use crate::synthetic_shape::{tiny, write_shaped};
use half::f16;

fn open(path: &std::path::Path) -> std::io::BufReader<fs_err::File> {
    std::io::BufReader::new(fs_err::File::open(path).unwrap())
}

/// A tensor's values.
fn values(t: &QTensor) -> Vec<f32> {
    t.dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The error reading tensor `w` of the file `bytes` at `path` gives.
fn tensor_error(path: &std::path::Path, bytes: Vec<u8>) -> String {
    fs_err::write(path, bytes).unwrap();
    let mut r = open(path);
    let file = GgufFile::read(&mut r).unwrap();
    file.tensor(&mut r, "w", &Device::Cpu)
        .err()
        .unwrap()
        .to_string()
}

/// A GGUF of one tensor `w`: `ne0` values per row, `rows` rows, type `code`, `data`.
fn one_tensor(code: u32, ne0: u64, rows: u64, data: &[u8]) -> Vec<u8> {
    let mut f = b"GGUF".to_vec();
    f.extend(3u32.to_le_bytes());
    f.extend(1u64.to_le_bytes()); // tensors
    f.extend(0u64.to_le_bytes()); // metadata
    f.extend(1u64.to_le_bytes());
    f.push(b'w');
    f.extend(2u32.to_le_bytes());
    f.extend(ne0.to_le_bytes());
    f.extend(rows.to_le_bytes());
    f.extend(code.to_le_bytes());
    f.extend(0u64.to_le_bytes());
    f.resize(f.len().div_ceil(32) * 32, 0);
    f.extend(data);
    f
}

#[test]
fn reads_what_candle_reads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_shaped(&tiny(), GgmlDType::Q4_0, &path, 5).unwrap();
    let theirs = candle_core::quantized::gguf_file::Content::read(&mut open(&path)).unwrap();
    let mut r = open(&path);
    let ours = GgufFile::read(&mut r).unwrap();
    assert_eq!(ours.metadata.len(), theirs.metadata.len());
    for (k, v) in &theirs.metadata {
        assert_eq!(format!("{:?}", ours.metadata[k]), format!("{v:?}"), "{k}");
    }
    assert_eq!(ours.tensors.len(), theirs.tensor_infos.len());
    assert_eq!(ours.data_offset, theirs.tensor_data_offset);
    for (name, info) in &theirs.tensor_infos {
        let e = &ours.tensors[name];
        assert_eq!(e.ty, TensorType::Ggml(info.ggml_dtype), "{name}");
        assert_eq!(e.dims, info.shape.dims(), "{name}");
        let a = ours.tensor(&mut r, name, &Device::Cpu).unwrap();
        let b = theirs.tensor(&mut open(&path), name, &Device::Cpu).unwrap();
        assert_eq!(a.data().unwrap(), b.data().unwrap(), "{name}");
    }
}

#[test]
fn an_iq4_nl_file_loads_as_the_values_it_holds() {
    // IQ4_NL blocks are Q4_0's size: a Q4_0 file with its matrices' type codes turned to
    // IQ4_NL's (20) is an IQ4_NL file of the same bytes.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_shaped(&tiny(), GgmlDType::Q4_0, &path, 5).unwrap();
    let q4 = GgufFile::read(&mut open(&path)).unwrap();
    let mut bytes = fs_err::read(&path).unwrap();
    let mut patched = 0;
    for (name, e) in &q4.tensors {
        if e.ty != TensorType::Ggml(GgmlDType::Q4_0) {
            continue;
        }
        // The name's entry: its bytes, the dims' count and sizes, then the type code.
        let mut key = (name.len() as u64).to_le_bytes().to_vec();
        key.extend(name.as_bytes());
        let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
        let code = at + 4 + 8 * e.dims.len();
        assert_eq!(bytes[code..code + 4], 2u32.to_le_bytes());
        bytes[code..code + 4].copy_from_slice(&20u32.to_le_bytes());
        patched += 1;
    }
    assert!(patched > 10);
    let iq = dir.path().join("iq4_nl.gguf");
    fs_err::write(&iq, &bytes).unwrap();
    let mut r = open(&iq);
    let file = GgufFile::read(&mut r).unwrap();
    let name = "blk.0.ffn_down.weight";
    assert_eq!(file.tensors[name].ty, TensorType::Iq4Nl);
    let t = file.tensor(&mut r, name, &Device::Cpu).unwrap();
    assert_eq!(t.dtype(), GgmlDType::Q8_0);
    let raw = q4.tensor(&mut open(&path), name, &Device::Cpu).unwrap();
    assert_eq!(t.shape().dims(), raw.shape().dims());
    let want = iq4_nl_reference(&raw.data().unwrap());
    let got = values(&t);
    assert_eq!(got, want);
    // The whole model loads from it (its matrices kept as IQ4_NL tiles where the tile
    // kernels run, AVX2 or VNNI) and answers exactly as a Q8_0 file of the same values: both
    // products sum the same integers per block on either kernel path.
    let twin = dir.path().join("q8_0.gguf");
    let tensors: Vec<(String, QTensor)> = file
        .tensors
        .keys()
        .map(|n| (n.clone(), file.tensor(&mut r, n, &Device::Cpu).unwrap()))
        .collect();
    let meta: Vec<(&str, &Value)> = file.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = fs_err::File::create(&twin).unwrap();
    candle_core::quantized::gguf_file::write(&mut out, &meta, &refs).unwrap();
    drop(out);
    let logits = |p: &std::path::Path| -> Vec<f32> {
        let src = crate::ModelSource::from_path(p).unwrap();
        let opts = crate::LoadOptions {
            quantized: true,
            ..crate::LoadOptions::default()
        };
        let model = crate::Model::load(&src, &opts).unwrap();
        let (_, logits) = model.decoder().prefill(&[1, 2, 3, 300, 17], 0).unwrap();
        logits.flatten_all().unwrap().to_vec1().unwrap()
    };
    let (a, b) = (logits(&iq), logits(&twin));
    assert!(a.iter().all(|x| x.is_finite()));
    assert_eq!(a, b);
}

#[test]
fn iq4_xs_tensors_keep_their_shape_and_values() {
    // Two rows of 512: four blocks; block i's scale 0.01 (i + 1), group scales 0..63 in
    // turn, codes from a counter.
    let mut data = Vec::new();
    for i in 0..4u8 {
        data.extend(f16::from_f32(0.01 * f32::from(i + 1)).to_le_bytes());
        data.extend((0x9c4du16.wrapping_mul(u16::from(i) + 1)).to_le_bytes());
        data.extend([0x3a, 0xc5, 0x7e, 0x01].map(|b: u8| b.wrapping_add(i)));
        data.extend((0..128u8).map(|j| j.wrapping_mul(37).wrapping_add(i)));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("xs.gguf");
    fs_err::write(&path, one_tensor(23, 512, 2, &data)).unwrap();
    let mut r = open(&path);
    let file = GgufFile::read(&mut r).unwrap();
    assert_eq!(file.tensors["w"].ty, TensorType::Iq4Xs);
    let t = file.tensor(&mut r, "w", &Device::Cpu).unwrap();
    assert_eq!(t.shape().dims(), &[2, 512]);
    let got = values(&t);
    let want = iq4_xs_reference(&data);
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= w.abs() / 2048.0, "{g} against {w}");
    }
    // The file's own blocks, for the K-quant tiles; no such blocks of another type.
    assert_eq!(file.iq4_xs_blocks(&mut r, "w").unwrap(), Some(data));
    assert_eq!(file.iq4_xs_blocks(&mut r, "nothing").unwrap(), None);
}

#[test]
fn other_types_and_broken_headers_are_refused_with_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf");
    // An IQ2_XXS tensor: named in the error.
    fs_err::write(&path, one_tensor(16, 256, 1, &[0; 66])).unwrap();
    let e = GgufFile::open(&path).err().unwrap().to_string();
    assert!(
        e.contains("IQ2_XXS (type 16) of w in") && e.contains("x.gguf"),
        "{e}"
    );
    // An IQ4_XS tensor whose rows do not divide into 256-value blocks.
    let e = tensor_error(&path, one_tensor(23, 128, 2, &[0; 136]));
    assert!(e.contains("blocks of 256"), "{e}");
    // Data cut short.
    let e = tensor_error(&path, one_tensor(20, 64, 2, &[0; 40]));
    assert!(e.contains("72 bytes"), "{e}");
    // Not a GGUF file; a string longer than the file.
    fs_err::write(&path, b"GGML\x03\0\0\0").unwrap();
    let e = GgufFile::open(&path).err().unwrap().to_string();
    assert!(e.contains("x.gguf: not a readable GGUF file: magic"), "{e}");
    let mut f = one_tensor(20, 32, 1, &[0; 18]);
    f[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    fs_err::write(&path, f).unwrap();
    let e = GgufFile::read(&mut open(&path)).err().unwrap().to_string();
    assert!(e.contains("string"), "{e}");
}
