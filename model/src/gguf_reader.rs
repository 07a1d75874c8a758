//! GGUF files read by ragkv itself: the header (metadata and the tensor table) is parsed here
//! rather than by candle's reader, which refuses a whole file for one tensor type it does not
//! know. Tensors of the types candle reads are handed to it unchanged; the non-linear 4-bit
//! types llama.cpp's users download (`IQ4_NL`, and `IQ4_XS`, whose tensors fall back to
//! `IQ4_NL` where a row is not a multiple of 256) are converted at load into `Q8_0` blocks
//! ([`crate::quant::iq4`]), which every kernel path of ragkv multiplies; any other type is
//! refused with its name.
//!
//! The layout (GGUF v2 and v3, little-endian; v1 with 32-bit lengths):
//!
//! | field | type |
//! |---|---|
//! | magic | `GGUF` |
//! | version | u32 (1, 2 or 3) |
//! | tensor count, metadata count | u64 each (u32 in v1) |
//! | metadata | key (string), value type (u32), value |
//! | tensor table | name (string), dims `n` (u32), `n` sizes innermost first (u64; u32 in v1), type (u32), offset (u64) |
//! | padding | to `general.alignment` (32 by default) |
//! | tensor data | each tensor at its offset from here |
//!
//! A string is its length then its UTF-8 bytes; an array is its element type (u32), its length,
//! then its elements. The caps below follow llama.cpp's (a crafted file cannot make the reader
//! allocate more than the file holds).

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};

use candle_core::quantized::gguf_file::{TensorInfo, Value};
use candle_core::quantized::{ggml_file, GgmlDType, QTensor};
use candle_core::{Device, Shape};

use crate::error::{Ctx, Error, Result};
use crate::quant::iq4;

const MAX_STRING: u64 = 1 << 30;
const MAX_ELEMENTS: u64 = 1 << 30;
const MAX_DIMS: u32 = 4;
const MAX_DEPTH: usize = 64;
const DEFAULT_ALIGNMENT: u64 = 32;

/// A tensor's type as the file names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TensorType {
    /// A type candle reads.
    Ggml(GgmlDType),
    /// `IQ4_NL`: 32 values per block, an f16 scale and a 4-bit index each into a fixed table.
    Iq4Nl,
    /// `IQ4_XS`: 256 values per block, an f16 scale, a 6-bit scale per 32 and `IQ4_NL`'s indices.
    Iq4Xs,
}

impl TensorType {
    fn of(code: u32) -> std::result::Result<TensorType, String> {
        use GgmlDType as G;
        Ok(TensorType::Ggml(match code {
            0 => G::F32,
            1 => G::F16,
            2 => G::Q4_0,
            3 => G::Q4_1,
            6 => G::Q5_0,
            7 => G::Q5_1,
            8 => G::Q8_0,
            9 => G::Q8_1,
            10 => G::Q2K,
            11 => G::Q3K,
            12 => G::Q4K,
            13 => G::Q5K,
            14 => G::Q6K,
            15 => G::Q8K,
            30 => G::BF16,
            20 => return Ok(TensorType::Iq4Nl),
            23 => return Ok(TensorType::Iq4Xs),
            other => return Err(ggml_type_name(other)),
        }))
    }

    /// (values per block, bytes per block) of the types converted here.
    fn iq_block(self) -> Option<(usize, usize)> {
        match self {
            TensorType::Iq4Nl => Some((iq4::NL_VALUES, iq4::NL_BYTES)),
            TensorType::Iq4Xs => Some((iq4::XS_VALUES, iq4::XS_BYTES)),
            TensorType::Ggml(_) => None,
        }
    }
}

/// ggml's name of a type code ragkv does not read (for the error).
fn ggml_type_name(code: u32) -> String {
    let name = match code {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        21 => "IQ3_S",
        22 => "IQ2_S",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        40 => "NVFP4",
        _ => return format!("type {code}"),
    };
    format!("{name} (type {code})")
}

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub(crate) struct TensorEntry {
    pub ty: TensorType,
    /// Sizes, outermost first (candle's order: a matrix of `n` rows of `k` is `[n, k]`).
    pub dims: Vec<usize>,
    offset: u64,
}

/// A GGUF file's header: metadata, tensor table, and where the tensor data starts.
pub(crate) struct GgufFile {
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorEntry>,
    data_offset: u64,
}

/// Reads little-endian fields, bounded by the file's size.
struct Fields<'a, R> {
    r: &'a mut R,
    size: u64,
    wide: bool,
}

impl<R: Read + Seek> Fields<'_, R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0; N];
        self.r.read_exact(&mut b)?;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// A length or count: u64, or u32 in GGUF v1.
    fn len(&mut self) -> Result<u64> {
        if self.wide {
            self.u64()
        } else {
            self.u32().map(u64::from)
        }
    }

    fn remaining(&mut self) -> Result<u64> {
        Ok(self.size.saturating_sub(self.r.stream_position()?))
    }

    fn string(&mut self) -> Result<String> {
        let n = self.len()?;
        if n > MAX_STRING || n > self.remaining()? {
            return Err(bad(format!("a string of {n} bytes")));
        }
        let mut v = vec![0; n as usize];
        self.r.read_exact(&mut v)?;
        Ok(String::from_utf8_lossy(&v).into_owned())
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        if depth > MAX_DEPTH {
            return Err(bad(format!("values nested over {MAX_DEPTH} deep")));
        }
        Ok(match ty {
            0 => Value::U8(self.bytes::<1>()?[0]),
            1 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match self.bytes::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(bad(format!("a boolean of value {b}"))),
            },
            8 => Value::String(self.string()?),
            9 => {
                let elem = self.u32()?;
                let n = self.len()?;
                // Every element takes at least a byte: no more of them than bytes left.
                if n > MAX_ELEMENTS || n > self.remaining()? {
                    return Err(bad(format!("an array of {n} elements")));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => return Err(bad(format!("metadata value type {other}"))),
        })
    }
}

fn bad(why: String) -> Error {
    Error::Config {
        why: format!("not a readable GGUF file: {why}"),
    }
}

impl GgufFile {
    /// Parses the header of the file `r` reads (from its start).
    pub fn read<R: Read + Seek>(r: &mut R) -> Result<GgufFile> {
        let size = r.seek(SeekFrom::End(0))?;
        r.seek(SeekFrom::Start(0))?;
        let mut f = Fields {
            r,
            size,
            wide: true,
        };
        let magic = f.bytes::<4>()?;
        if &magic != b"GGUF" {
            return Err(bad(format!("magic {magic:02x?}")));
        }
        f.wide = match f.u32()? {
            1 => false,
            2 | 3 => true,
            v => return Err(bad(format!("version {v}"))),
        };
        let (tensors_n, meta_n) = (f.len()?, f.len()?);
        if tensors_n > MAX_ELEMENTS
            || meta_n > MAX_ELEMENTS
            || tensors_n + meta_n > f.remaining()?
        {
            return Err(bad(format!(
                "{tensors_n} tensors and {meta_n} metadata entries"
            )));
        }
        let mut metadata = HashMap::new();
        for _ in 0..meta_n {
            let key = f.string()?;
            let ty = f.u32()?;
            let value = f.value(ty, 0).map_err(|e| bad(format!("{key}: {e}")))?;
            metadata.insert(key, value);
        }
        let mut tensors = HashMap::new();
        for _ in 0..tensors_n {
            let name = f.string()?;
            let n = f.u32()?;
            if n > MAX_DIMS {
                return Err(bad(format!("tensor {name} has {n} dimensions")));
            }
            let mut dims = (0..n)
                .map(|_| f.len().map(|d| d as usize))
                .collect::<Result<Vec<_>>>()?;
            dims.reverse();
            let ty = TensorType::of(f.u32()?).map_err(|t| Error::Unsupported {
                what: format!("GGUF tensor type {t} of {name}"),
            })?;
            let offset = f.u64()?;
            tensors.insert(name, TensorEntry { ty, dims, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            Some(Value::U32(a)) if *a > 0 => u64::from(*a),
            Some(Value::U16(a)) if *a > 0 => u64::from(*a),
            Some(Value::U8(a)) if *a > 0 => u64::from(*a),
            Some(Value::I32(a)) if *a > 0 => *a as u64,
            _ => DEFAULT_ALIGNMENT,
        };
        let at = f.r.stream_position()?;
        Ok(GgufFile {
            metadata,
            tensors,
            data_offset: at.div_ceil(alignment) * alignment,
        })
    }

    /// The tensor `name` read from `r` onto `device`: as stored, or, for the `IQ4` types, as
    /// `Q8_0` blocks of the same values.
    pub fn tensor<R: Read + Seek>(
        &self,
        r: &mut R,
        name: &str,
        device: &Device,
    ) -> Result<QTensor> {
        let e = self.tensors.get(name).ok_or_else(|| Error::Weight {
            name: name.into(),
            why: "not in the GGUF file".into(),
        })?;
        let Some((per_block, block_bytes)) = e.ty.iq_block() else {
            let TensorType::Ggml(ggml_dtype) = e.ty else {
                unreachable!("every other type is a candle one")
            };
            let info = TensorInfo {
                ggml_dtype,
                shape: Shape::from(e.dims.clone()),
                offset: e.offset,
            };
            return info
                .read(r, self.data_offset, device)
                .ctx(&format!("reading {name}"));
        };
        let weight = |why: String| Error::Weight {
            name: name.into(),
            why,
        };
        let row = e.dims.last().copied().unwrap_or(0);
        if row == 0 || !row.is_multiple_of(per_block) {
            return Err(weight(format!(
                "rows of {row} values in blocks of {per_block}"
            )));
        }
        let elems: usize = e.dims.iter().product();
        let len = (elems / per_block * block_bytes) as u64;
        let start = self.data_offset.saturating_add(e.offset);
        let size = r.seek(SeekFrom::End(0))?;
        if start.saturating_add(len) > size {
            return Err(weight(format!(
                "{len} bytes at {start} in a file of {size} bytes"
            )));
        }
        let mut raw = vec![0; len as usize];
        r.seek(SeekFrom::Start(start))?;
        r.read_exact(&mut raw)?;
        let q8 = match e.ty {
            TensorType::Iq4Nl => iq4::nl_to_q8_0(&raw),
            _ => iq4::xs_to_q8_0(&raw),
        }
        .map_err(weight)?;
        ggml_file::qtensor_from_ggml(GgmlDType::Q8_0, &q8, e.dims.clone(), device)
            .ctx(&format!("reading {name}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::iq4::LEVELS;
    use crate::synthetic_shape::{write_shaped, Shape};
    use crate::Arch;
    use half::f16;

    fn tiny() -> Shape {
        Shape {
            name: "tiny",
            arch: Arch::Qwen2,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            intermediate: 256,
            vocab: 400,
            rope_theta: 10_000.0,
            context: 512,
        }
    }

    fn open(path: &std::path::Path) -> std::io::BufReader<fs_err::File> {
        std::io::BufReader::new(fs_err::File::open(path).unwrap())
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
        let want: Vec<f32> = raw
            .data()
            .unwrap()
            .chunks_exact(18)
            .flat_map(|b| {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                let lo = b[2..]
                    .iter()
                    .map(move |&q| d * f32::from(LEVELS[usize::from(q & 15)]));
                let hi = b[2..]
                    .iter()
                    .map(move |&q| d * f32::from(LEVELS[usize::from(q >> 4)]));
                lo.chain(hi).collect::<Vec<_>>()
            })
            .collect();
        let got: Vec<f32> = t
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got, want);
        // The whole model loads and runs from it.
        let src = crate::ModelSource::from_path(&iq).unwrap();
        let model = crate::Model::load(&src, &crate::LoadOptions::default()).unwrap();
        let (_, logits) = model.decoder().prefill(&[1, 2, 3, 300], 0).unwrap();
        let v: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.is_finite()));
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
        let got: Vec<f32> = t
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // ggml's dequantize_row_iq4_xs.
        let mut want = Vec::new();
        for b in data.chunks_exact(136) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            let sh = u16::from_le_bytes([b[2], b[3]]);
            for ib in 0..8 {
                let ls = i32::from((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xf)
                    | (i32::from((sh >> (2 * ib)) & 3) << 4);
                let dl = d * (ls - 32) as f32;
                let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
                want.extend(
                    qs.iter()
                        .map(|&q| dl * f32::from(LEVELS[usize::from(q & 15)])),
                );
                want.extend(
                    qs.iter()
                        .map(|&q| dl * f32::from(LEVELS[usize::from(q >> 4)])),
                );
            }
        }
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= w.abs() / 2048.0, "{g} against {w}");
        }
    }

    #[test]
    fn other_types_and_broken_headers_are_refused_with_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.gguf");
        // An IQ2_XXS tensor: named in the error.
        fs_err::write(&path, one_tensor(16, 256, 1, &[0; 66])).unwrap();
        let e = GgufFile::read(&mut open(&path)).err().unwrap().to_string();
        assert!(e.contains("IQ2_XXS") && e.contains('w'), "{e}");
        // An IQ4_XS tensor whose rows do not divide into 256-value blocks.
        fs_err::write(&path, one_tensor(23, 128, 2, &[0; 136])).unwrap();
        let mut r = open(&path);
        let file = GgufFile::read(&mut r).unwrap();
        let e = file
            .tensor(&mut r, "w", &Device::Cpu)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("blocks of 256"), "{e}");
        // Data cut short.
        fs_err::write(&path, one_tensor(20, 64, 2, &[0; 40])).unwrap();
        let mut r = open(&path);
        let file = GgufFile::read(&mut r).unwrap();
        let e = file
            .tensor(&mut r, "w", &Device::Cpu)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("72 bytes"), "{e}");
        // Not a GGUF file; a string longer than the file.
        fs_err::write(&path, b"GGML\x03\0\0\0").unwrap();
        assert!(GgufFile::read(&mut open(&path)).is_err());
        let mut f = one_tensor(20, 32, 1, &[0; 18]);
        f[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        fs_err::write(&path, f).unwrap();
        let e = GgufFile::read(&mut open(&path)).err().unwrap().to_string();
        assert!(e.contains("string"), "{e}");
    }
}
